"""Every strategy's engine declaration is true: Mask-Predict runs on its engine (the
generator of ``--decoder-engine onnxruntime``, the backend of the others), so the engine
checks of :func:`~fairseq_hrt.generation.strategies.check_supported` apply to it as to the
other strategies: ``--decoder-engine cuda-graph --shortlist`` is refused with the message
left-to-right and HRT decoding get."""

import pytest

from fairseq_hrt.generation import strategies
from fairseq_hrt.generation.engines import ENGINES
from fairseq_hrt.generation.mask_predict import MaskPredictDecoding
from fairseq_hrt.generation.registry import Entry, Registry
from fairseq_hrt.generation.strategies import DECODING_STRATEGIES
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample
from tests.test_shortlist import assert_same_hypotheses, shortlist_file

FLAGS = ("--iter-decode-max-iter", "3", "--iter-decode-with-beam", "2", "--max-len-b", "10")
REFUSED = r"--shortlist restricts the output layer of --decoder-engine .*; --decoder-engine cuda-graph always scores"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("engine_declarations"))
    return data_dir, {arch: build_task_and_model(data_dir, arch=arch)[1] for arch in ("cmlm_tiny", "hrt_tiny")}


def test_mask_predict_declares_every_engine_it_runs_on():
    assert DECODING_STRATEGIES["mask-predict"] is MaskPredictDecoding
    assert all(MaskPredictDecoding.uses_engine(engine) for engine in ENGINES.values())
    # what it runs of each engine: cuda-graph's backend scores the whole vocabulary; the lean
    # and fairseq engines' TorchBackend and onnxruntime's own generator take a shortlist's rows
    assert {n for n, e in ENGINES.items() if MaskPredictDecoding.engine_supports_shortlist(e)} == {
        "lean",
        "fairseq",
        "onnxruntime",
    }


def test_cuda_graph_with_shortlist_is_refused_for_mask_predict_as_for_hrt(models, tmp_path):
    data_dir, by_arch = models
    task, _ = build_generator(data_dir, by_arch["cmlm_tiny"], *FLAGS)
    path = shortlist_file(task, tmp_path / "all.pt")
    messages = []
    for arch, flags in (("cmlm_tiny", FLAGS), ("hrt_tiny", ("--decode-chunk-size", "2"))):
        with pytest.raises(ValueError, match=REFUSED) as refused:
            build_generator(data_dir, by_arch[arch], *flags, "--decoder-engine", "cuda-graph", "--shortlist", path)
        messages.append(str(refused.value))
    assert messages[0].endswith("always scores the whole vocabulary")
    assert messages[0].split(";")[1] == messages[1].split(";")[1]


@pytest.mark.parametrize("engine", ["lean", "fairseq"])
def test_mask_predict_on_its_engines_gives_the_same_tokens(models, tmp_path, engine):
    data_dir, by_arch = models
    model = by_arch["cmlm_tiny"]
    task, reference = build_generator(data_dir, model, *FLAGS)
    sample = make_sample(task, [[1, 2, 3], [4, 5], [6, 7, 8, 9], [3]])
    expected = reference.generate([model], sample)
    _, ours = build_generator(data_dir, model, *FLAGS, "--decoder-engine", engine)
    assert_same_hypotheses(expected, ours.generate([model], sample))
    # with a shortlist of every token, too
    _, listed = build_generator(
        data_dir, model, *FLAGS, "--decoder-engine", engine, "--shortlist", shortlist_file(task, tmp_path / "all.pt")
    )
    assert_same_hypotheses(expected, listed.generate([model], sample))


def test_the_registries_list_by_name_whatever_the_import_order(monkeypatch):
    assert list(DECODING_STRATEGIES) == sorted(DECODING_STRATEGIES)
    assert list(ENGINES)[1:] == sorted(list(ENGINES)[1:])  # the default engine first
    every = dict(DECODING_STRATEGIES)  # their modules imported (and registered) here first
    # a registry without a catalog: the order is the registry's, not the catalog's
    monkeypatch.setattr(strategies, "DECODING_STRATEGIES", Registry("decoding strategy", {}))
    for name in reversed(sorted(every)):  # registered in the reverse order
        strategies.register_decoding(name)(every[name])
    assert list(strategies.DECODING_STRATEGIES) == sorted(DECODING_STRATEGIES)
    assert strategies.decoding_choices() == ["auto", *sorted(DECODING_STRATEGIES)]


def test_a_catalogued_name_is_listed_without_its_module_and_keeps_the_catalogs_line():
    registry = Registry("decoder engine", {"x": Entry("no.such.module", "the catalog's line", ("x_option",))})
    assert list(registry) == ["x"] and "x" in registry  # no.such.module is not imported
    assert registry.declared("x", "summary") == "the catalog's line"
    assert registry.declared("x", "own_options") == ("x_option",)

    class Other:
        summary = "another line"

    with pytest.raises(ValueError, match="Other.summary is not the catalog's"):
        registry.register("x", Other, Other())

    class Plain:
        summary = ""

    registry.register("x", Plain, Plain())
    assert Plain.summary == "the catalog's line" and Plain.own_options == ("x_option",)
    assert isinstance(registry["x"], Plain)
