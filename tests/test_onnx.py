"""--decoder-engine onnxruntime and the exported folder: token-identical to the lean engine."""

import ast
import copy
import math
import os
import re
import sys
import tomllib

import pytest
import torch

from fairseq_hrt.export import exporter
from fairseq_hrt.export.exporter import export_model
from fairseq_hrt.generation import onnx_engine
from fairseq_hrt.generation.quantize import is_quantized, prepare_for_decoding
from fairseq_hrt.passes.token_choice import argmax_block, blocked_max
from fairseq_hrt.testing.tiny_runs import run_cli
from hrt_runtime.model import LOOP_ROWS
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample, random_tiny_models
from tests.test_decoder_definitions import WEIGHT_CHANGES
from tests.test_lean import RAGGED, TINY_TRANSFORMER, assert_same_hypotheses
from tests.test_shortlist import shortlist_file
from tests.tiny_data import hyp_lines

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    return random_tiny_models(tmp_path_factory, "onnx")


@pytest.fixture(autouse=True)
def onnx_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FAIRSEQ_HRT_ONNX_CACHE", str(tmp_path_factory.getbasetemp() / "onnx-cache"))


ENGINE_CASES = [
    ("at", ("--beam", "1")),
    ("at", ("--beam", "5")),
    ("at", ("--beam", "4", "--lenpen", "0.6", "--min-len", "3", "--unkpen", "0.5", "--max-len-a", "0.5")),
    ("hrt", ("--decode-chunk-size", "1", "--beam", "1")),
    ("hrt", ("--decode-chunk-size", "1", "--beam", "5")),
    ("hrt", ("--decode-chunk-size", "2", "--beam", "1")),
    ("hrt", ("--decode-chunk-size", "3", "--beam", "4", "--b-nat", "2")),
    ("hrt", ("--decode-chunk-size", "by-length", "--beam", "2")),
]


@pytest.mark.parametrize("which,flags", ENGINE_CASES, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_onnxruntime_equals_lean(random_models, which, flags):
    data_dir, task, hrt, at = random_models
    model = hrt if which == "hrt" else at
    sample = make_sample(task, RAGGED)
    _, ref = build_generator(data_dir, model, "--max-len-b", "12", *flags, "--decoder-engine", "lean")
    _, ours = build_generator(data_dir, model, "--max-len-b", "12", *flags, "--decoder-engine", "onnxruntime")
    assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))


SHORTLIST_CASES = [
    ("at", ("--beam", "1")),
    ("at", ("--beam", "4", "--lenpen", "0.6")),
    ("hrt", ("--decode-chunk-size", "1", "--beam", "2")),
    ("hrt", ("--decode-chunk-size", "2", "--beam", "3", "--b-nat", "2")),
    # each chunk-size group decodes over its own sentences' candidates, as lean's HRTGenerator
    ("hrt", ("--decode-chunk-size", "by-length", "--beam", "1")),
]


def with_a_shortlist(random_models, tmp_path, which, flags):
    """``(task, model, lean, onnxruntime)``: generators of one model restricted to a shortlist
    that changes its output."""
    data_dir, task, hrt, at = random_models
    model = hrt if which == "hrt" else at
    path = shortlist_file(task, tmp_path / "s.pt", keep_per_source=2, always=[task.target_dictionary.index("w0")])
    _, ref = build_generator(data_dir, model, "--max-len-b", "12", *flags, "--shortlist", path)
    _, ours = build_generator(
        data_dir, model, "--max-len-b", "12", *flags, "--shortlist", path, "--decoder-engine", "onnxruntime"
    )
    return task, model, ref, ours


def record_loops(runtime) -> list:
    """The results of ``runtime.greedy_loop`` from now on (``None``: the search made its own steps)."""
    results = []
    real = runtime.greedy_loop
    runtime.greedy_loop = lambda *a: results.append(real(*a)) or results[-1]
    return results


@pytest.mark.parametrize("which,flags", SHORTLIST_CASES, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_onnxruntime_with_a_shortlist_equals_lean(random_models, tmp_path, which, flags):
    """--shortlist: ONNX Runtime scores the batch's candidate rows only, as the lean engine
    does: the same hypotheses and scores, with a shortlist that changes the output."""
    task, model, ref, ours = with_a_shortlist(random_models, tmp_path, which, flags)
    _, unrestricted = build_generator(
        random_models[0], model, "--max-len-b", "12", *flags, "--decoder-engine", "onnxruntime"
    )
    changed = 0
    for sentences in (RAGGED[:1], RAGGED[1:4], RAGGED):
        sample = make_sample(task, sentences)
        expected = ref.generate([model], sample)
        assert_same_hypotheses(expected, ours.generate([model], sample))
        changed += sum(
            e[0]["tokens"].tolist() != u[0]["tokens"].tolist()
            for e, u in zip(expected, unrestricted.generate([model], sample))
        )
    assert changed  # the shortlist restricts the output


def test_batches_without_padding_and_one_sentence(random_models):
    """The exported encoder masks padding whether or not a batch has any (fairseq's encoder
    decides in Python, which a traced graph cannot)."""
    data_dir, task, hrt, at = random_models
    for batch in ([RAGGED[1]], [RAGGED[1], RAGGED[1]], [[3, 4, 5], [6, 7, 8]]):
        sample = make_sample(task, batch)
        _, ref = build_generator(data_dir, at, "--max-len-b", "12", "--beam", "2")
        _, ours = build_generator(data_dir, at, "--max-len-b", "12", "--beam", "2", "--decoder-engine", "onnxruntime")
        assert_same_hypotheses(ref.generate([at], sample), ours.generate([at], sample))


def test_export_is_cached_by_content(random_models, tmp_path, monkeypatch):
    """A model is exported once per content: building a second generator reuses the folder;
    another model (other weights) gets its own."""
    data_dir, task, hrt, at = random_models
    monkeypatch.setenv("FAIRSEQ_HRT_ONNX_CACHE", str(tmp_path / "cache"))
    calls = []
    real = exporter.export_model
    monkeypatch.setattr(exporter, "export_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = onnx_engine.exported_folder(at, task)
    assert onnx_engine.exported_folder(at, task) == first and len(calls) == 1
    assert onnx_engine.exported_folder(hrt, task) != first and len(calls) == 2


@pytest.mark.parametrize("change", ["fairseq-adam-step", "load_state_dict"])
def test_weights_changed_between_batches_are_exported_again(random_models, change):
    """A generator built and run once, then the weights change as fairseq-train's optimizer
    step or a load changes them (a model validated with this engine while it trains): its
    next batch decodes the new weights."""
    data_dir, task, hrt, _ = random_models
    _, other = build_task_and_model(data_dir, arch="hrt_tiny", seed=9)
    model, sample = copy.deepcopy(hrt), make_sample(task, RAGGED)
    flags = ("--max-len-b", "12", "--decode-chunk-size", "2", "--beam", "2")
    _, ours = build_generator(data_dir, model, *flags, "--decoder-engine", "onnxruntime")
    before = ours.generate([model], sample)
    WEIGHT_CHANGES[change](task, model, other)
    _, ref = build_generator(data_dir, model, *flags, "--decoder-engine", "lean")
    expected = ref.generate([model], sample)
    assert [h[0]["tokens"].tolist() for h in expected] != [h[0]["tokens"].tolist() for h in before]
    assert_same_hypotheses(expected, ours.generate([model], sample))


def test_engine_refuses_what_it_cannot_do(random_models):
    data_dir, task, hrt, at = random_models
    for flags, message in (
        (("--temperature", "1.5"), "--temperature"),
        (("--decode-chunk-size", "2", "--hrt-refine-fraction", "0.2"), "--hrt-refine-fraction"),
        (("--compile",), "--compile"),
    ):
        with pytest.raises(ValueError, match=message):
            model = hrt if "--decode-chunk-size" in flags else at
            build_generator(data_dir, model, *flags, "--decoder-engine", "onnxruntime")


def test_int8_quantizes_the_exported_graphs_not_the_model(tmp_path):
    """--quantize int8 with this engine: the PyTorch model stays in float (loading skips
    PyTorch's quantization), the exported graphs are quantized by ONNX Runtime (integer matrix
    products in them), and the search decodes."""
    import onnx  # noqa: PLC0415 - optional: onnx, for exporting

    task, model = build_task_and_model(str(tmp_path), arch="hrt_tiny")
    prepare_for_decoding(model, "int8", "onnxruntime")
    assert not is_quantized(model)
    _, gen = build_generator(
        str(tmp_path),
        model,
        "--quantize",
        "int8",
        "--decoder-engine",
        "onnxruntime",
        "--decode-chunk-size",
        "2",
        "--beam",
        "1",
        "--max-len-b",
        "8",
    )
    assert gen.runtime.config["int8"] and gen.runtime.folder.endswith("-int8")
    ops = {n.op_type for n in onnx.load(gen.runtime.folder + "/step.onnx").graph.node}
    assert ops & {"MatMulInteger", "DynamicQuantizeLinear", "DynamicQuantizeMatMul"}
    hypos = gen.generate([model], make_sample(task, RAGGED[:6]))
    assert len(hypos) == 6 and all(h[0]["tokens"].numel() >= 1 for h in hypos)
    # the greedy loop's body is quantized as the step is: one sentence gives what the steps give
    loop = next(n for n in onnx.load(gen.runtime.folder + "/greedy.onnx").graph.node if n.op_type == "Loop")
    assert {n.op_type for n in loop.attribute[0].g.node} & {"MatMulInteger", "DynamicQuantizeMatMul"}
    one = make_sample(task, RAGGED[:1])
    looped = gen.generate([model], one)
    gen.runtime.loop_rows = 0
    assert_same_hypotheses(looped, gen.generate([model], one))
    with pytest.raises(ValueError, match="needs the model loaded in float"):
        prepare_for_decoding(model, "int8", "lean")
        build_generator(str(tmp_path), model, "--quantize", "int8", "--decoder-engine", "onnxruntime")


@pytest.fixture(scope="module")
def cmlm_model(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("onnx_cmlm"))
    task, model = build_task_and_model(
        data_dir, arch="cmlm_tiny", extra=("--hrt-mode", "cmlm", "--decoder-rpr-window", "4"), seed=5
    )
    return data_dir, task, model


@pytest.mark.parametrize(
    "flags",
    [
        ("--iter-decode-max-iter", "1"),
        ("--iter-decode-max-iter", "4", "--iter-decode-with-beam", "3"),
        ("--iter-decode-max-iter", "3", "--max-len-a", "0.5", "--max-len-b", "4"),
    ],
    ids=lambda f: " ".join(f),
)
def test_mask_predict_equals_the_model_decoder(cmlm_model, flags):
    data_dir, task, model = cmlm_model
    sample = make_sample(task, RAGGED)
    _, ref = build_generator(data_dir, model, "--max-len-b", "12", *flags)
    _, ours = build_generator(data_dir, model, "--max-len-b", "12", *flags, "--decoder-engine", "onnxruntime")
    assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))


def test_an_exported_folder_is_checked_against_the_checkpoint(random_models, tmp_path):
    """--onnx-model FOLDER decodes that folder (fairseq-hrt-export's) when it is the export of
    the loaded checkpoint, and refuses another checkpoint's, another precision's, another engine."""
    data_dir, task, hrt, at = random_models
    folder = str(tmp_path / "at-onnx")
    export_model(at, task, folder)
    sample = make_sample(task, RAGGED[:5])
    _, ref = build_generator(data_dir, at, "--max-len-b", "12", "--beam", "1")
    _, ours = build_generator(
        data_dir, at, "--max-len-b", "12", "--beam", "1", "--decoder-engine", "onnxruntime", "--onnx-model", folder
    )
    assert ours.runtime.folder == folder
    assert_same_hypotheses(ref.generate([at], sample), ours.generate([at], sample))
    with pytest.raises(ValueError, match="another checkpoint"):
        build_generator(data_dir, hrt, "--decoder-engine", "onnxruntime", "--onnx-model", folder)
    with pytest.raises(ValueError, match="float but --quantize is int8"):
        build_generator(data_dir, at, "--decoder-engine", "onnxruntime", "--onnx-model", folder, "--quantize", "int8")
    with pytest.raises(ValueError, match="--onnx-model"):
        build_generator(data_dir, at, "--decoder-engine", "lean", "--onnx-model", folder)


def _runtime_modules(root):
    """The modules of hrt_runtime (its folder ``root``) as paths relative to it, service/ included."""
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")
    )


def _serves(name):
    """Whether a module of hrt_runtime is hrt-serve's (serve.py, service/), which may import the serve extra."""
    return name == "serve.py" or name.startswith("service" + os.sep)


def test_the_runtime_imports_neither_torch_nor_the_plugin():
    """hrt_runtime is what a deployed model runs on: numpy, onnxruntime, sentencepiece and the
    standard library only (the fresh-venv test in test_onnx_deploy.py runs it without torch);
    hrt-serve (serve.py) also aiohttp and prometheus_client, the optional extra ``pip install ./runtime[serve]``."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime", "hrt_runtime")
    allowed = {"numpy", "onnxruntime", "sentencepiece", "hrt_runtime"} | set(sys.stdlib_module_names)
    for name in _runtime_modules(root):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(root, name)).read())
            for node in ast.walk(tree):
                modules = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module
                    else []
                )
                for module in modules:
                    assert module.split(".")[0] in allowed | (
                        {"aiohttp", "prometheus_client"} if _serves(name) else set()
                    ), f"runtime/hrt_runtime/{name} imports {module}"


def test_the_runtime_declares_what_it_imports():
    """runtime/pyproject.toml's dependencies are the third-party packages hrt_runtime imports, and
    its ``serve`` extra those only hrt-serve imports: nothing more comes with ``pip install``."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime")
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]

    def names(requirements):
        return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower().replace("-", "_") for r in requirements}

    imported = {"runtime": set(), "serve": set()}
    for name in _runtime_modules(os.path.join(root, "hrt_runtime")):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(root, "hrt_runtime", name)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found = [node.module]
                else:
                    continue
                for module in found:
                    top = module.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "hrt_runtime":
                        imported["serve" if _serves(name) else "runtime"].add(top)
    assert names(project["dependencies"]) == imported["runtime"]
    assert names(project["optional-dependencies"]["serve"]) == imported["serve"] - imported["runtime"]


@pytest.mark.parametrize("extra", [(), ("--decoder-layers", "2", "--decoder-tie-layers")], ids=["ssru", "ssru-tied"])
def test_ssru_students_equal_lean(tmp_path, extra):
    """SSRU decoders (Marian's students): the exported step carries one cell per layer."""
    task, model = build_task_and_model(str(tmp_path), arch="at_tiny_ssru", extra=("--hrt-mode", "at", *extra), seed=6)
    sample = make_sample(task, RAGGED)
    for flags in (("--beam", "1"), ("--beam", "3", "--lenpen", "0.7")):
        _, ref = build_generator(str(tmp_path), model, "--max-len-b", "12", *flags)
        _, ours = build_generator(str(tmp_path), model, "--max-len-b", "12", *flags, "--decoder-engine", "onnxruntime")
        assert ours.runtime.recurrent and "past_c0" in ours.runtime.past_names
        assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))
        for few in (RAGGED[:1], RAGGED[1:3]):  # greedy: the loop graph, carrying the cells
            assert_same_hypotheses(
                ref.generate([model], make_sample(task, few)), ours.generate([model], make_sample(task, few))
            )


@pytest.mark.parametrize(
    "variant",
    [
        ("--decoder-normalize-before", "--encoder-normalize-before"),
        (),
        ("--decoder-learned-pos", "--encoder-learned-pos", "--no-scale-embedding", "--layernorm-embedding"),
    ],
    ids=["pre-norm", "post-norm", "learned-pos"],
)
def test_fairseq_transformer_variants(tmp_path, variant):
    """fairseq's own ``transformer`` (post-norm, learned positions, embedding layer norm, two
    decoder layers): the exported encoder and step are the modules' arithmetic."""
    task, model = build_task_and_model(str(tmp_path), arch="transformer", extra=TINY_TRANSFORMER + variant, seed=5)
    sample = make_sample(task, RAGGED)
    for beam in ("1", "3"):
        _, ref = build_generator(str(tmp_path), model, "--max-len-b", "9", "--beam", beam)
        _, ours = build_generator(
            str(tmp_path), model, "--max-len-b", "9", "--beam", beam, "--decoder-engine", "onnxruntime"
        )
        assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["at_tiny", "hrt_tiny"])
def test_trained_models_and_fairseq_generate(trained, arch, tmp_path, monkeypatch):
    """Trained models end sentences at different steps; fairseq-generate prints the same
    hypotheses and scores with --decoder-engine onnxruntime as with lean."""
    monkeypatch.setenv("FAIRSEQ_HRT_ONNX_CACHE", str(tmp_path / "cache"))
    data, ckpts = trained
    common = [
        "generate",
        data.bin_dir,
        "--path",
        ckpts[arch],
        "--gen-subset",
        "valid",
        "--batch-size",
        "7",
        "--user-dir",
        "fairseq_hrt",
        "--task",
        "hrt_translation",
        "--source-lang",
        "en",
        "--target-lang",
        "de",
        "--cpu",
    ]
    decodes = [("--beam", "1"), ("--beam", "4", "--lenpen", "0.6")]
    if arch == "hrt_tiny":
        decodes = [
            ("--decode-chunk-size", "2", "--beam", "1"),
            ("--decode-chunk-size", "3", "--beam", "3", "--b-nat", "2"),
            ("--decode-chunk-size", "1", "--beam", "4"),
        ]
    for flags in decodes:
        outs = {e: run_cli(common + [*flags, "--decoder-engine", e]).stdout for e in ("lean", "onnxruntime")}
        assert hyp_lines(outs["lean"]) == hyp_lines(outs["onnxruntime"]) and len(hyp_lines(outs["lean"])) == 40
        scores = {
            e: [line.split("\t")[1] for line in out.splitlines() if line.startswith("H-")] for e, out in outs.items()
        }
        assert all(abs(float(a) - float(b)) < 1e-3 for a, b in zip(scores["lean"], scores["onnxruntime"]))
    assert any(line.startswith("H-") for line in outs["lean"].splitlines())


def test_blocked_max_is_max_with_the_first_index():
    """The greedy choice over blocks: the maximum and the first index holding it, as
    ``Tensor.max`` gives, for every block size dividing the width (ties included)."""
    torch.manual_seed(0)
    x = torch.randn(7, 60).round()  # many ties
    x[2] = 1.0  # a row of one value: index 0
    x[3, 59] = 9.0
    x[4, :] = -math.inf
    x[4, 17] = 0.0
    expected_value, expected_index = x.max(dim=-1)
    for block in (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60):
        value, index = blocked_max(x, block)
        assert torch.equal(value, expected_value) and torch.equal(index, expected_index), block
    assert argmax_block(8008) == 88 and argmax_block(60) in (6, 10) and argmax_block(53) == 1


LOOP_CASES = [
    ("at", ("--beam", "1")),
    ("at", ("--beam", "1", "--min-len", "3", "--unkpen", "0.5", "--max-len-a", "0.5")),
    ("hrt", ("--decode-chunk-size", "1", "--beam", "1")),
    ("hrt", ("--decode-chunk-size", "2", "--beam", "1")),
    ("hrt", ("--decode-chunk-size", "3", "--beam", "1")),
]


@pytest.mark.parametrize("which,flags", LOOP_CASES, ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_the_greedy_loop_equals_lean(random_models, which, flags):
    """Greedy search and HRT's Skip-AT on batches of one and two sentences run as one ONNX
    ``Loop`` (``greedy.onnx``: the rules and the end inside the graph; the HRT model's relative
    keys from the loop's step): the lean engine's hypotheses and scores. (Rows that end before
    the others: tests/test_search.py.)"""
    data_dir, task, hrt, at = random_models
    model = hrt if which == "hrt" else at
    _, ref = build_generator(data_dir, model, "--max-len-b", "12", *flags)
    _, ours = build_generator(data_dir, model, "--max-len-b", "12", *flags, "--decoder-engine", "onnxruntime")
    looped = record_loops(ours.runtime)
    for sentences in ([RAGGED[0]], [RAGGED[3]], RAGGED[1:3], RAGGED[4:6], [[]]):
        sample = make_sample(task, sentences)
        assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))
    assert looped and all(result is not None for result in looped)


@pytest.mark.parametrize(
    "which,flags",
    [("at", ("--beam", "1")), ("hrt", ("--decode-chunk-size", "2", "--beam", "1"))],
    ids=["at", "hrt k=2"],
)
def test_the_greedy_loop_over_a_shortlists_rows_equals_lean(random_models, tmp_path, which, flags):
    """greedy_restricted.onnx: the loop over a batch's candidate rows (the row chosen is mapped
    to its id inside the loop, where the next step embeds it and ``</s>`` is tested)."""
    task, model, ref, ours = with_a_shortlist(random_models, tmp_path, which, flags)
    looped = record_loops(ours.runtime)
    for sentences in ([RAGGED[0]], RAGGED[1:3], [RAGGED[5]]):
        sample = make_sample(task, sentences)
        assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))
    assert looped and all(result is not None for result in looped)


def test_the_greedy_loop_serves_few_rows_only(random_models):
    """More rows than ``LOOP_ROWS`` (the loop would decode rows that ended) or a folder
    without the loop: the search makes its own steps."""
    data_dir, task, hrt, at = random_models
    _, ours = build_generator(data_dir, at, "--max-len-b", "12", "--beam", "1", "--decoder-engine", "onnxruntime")
    runtime = ours.runtime
    calls = record_loops(runtime)
    ours.generate([at], make_sample(task, RAGGED[: LOOP_ROWS + 1]))
    assert calls == [None]
    graphs = dict(runtime.config["graphs"])
    del runtime.config["graphs"]["greedy"]
    try:
        ours.generate([at], make_sample(task, RAGGED[:1]))
    finally:
        runtime.config["graphs"] = graphs
    assert calls[-1] is None
