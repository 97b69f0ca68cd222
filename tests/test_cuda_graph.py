"""The CUDA-graph engine (``--decoder-engine cuda-graph``): the lean engine's step replayed as
CUDA graphs gives the lean engine's hypotheses.

The differential tests run twice: on CPU with the graphs' bodies run as they are (the same
buffers, buckets, first-step spreading of a beam, row compaction and moves to graphs of fewer
sentences, without capture: ``captures = False``), and on a CUDA GPU with captured graphs
(skipped without one; CI has none). In float32 the same tokens as ``--decoder-engine lean``
(random models, and trained ones whose sentences end at different steps, so batches move to
smaller graphs mid-search); in float16 (GPU) the agreement is measured and stated.
"""

import copy

import pytest
import torch
from fairseq import checkpoint_utils, utils

from fairseq_hrt.generation.cuda_graph import (
    CudaGraphBackend,
    CudaGraphSequenceGenerator,
    GraphShape,
    bucket,
    cuda_graph_refusals,
    step_bucket,
)
from fairseq_hrt.generation.engines import engine_choices
from fairseq_hrt.generation.lean import LeanSequenceGenerator, TorchBackend
from fairseq_hrt.generation.mask_predict import MaskPredictGenerator
from hrt_runtime.search import SearchConfig
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample, random_tiny_models
from tests.test_decoder_definitions import WEIGHT_CHANGES
from tests.test_generator import SPECIALS
from tests.test_lean import RAGGED, assert_same_hypotheses

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ------------------------------------------------------------------- without a GPU


def test_buckets_are_powers_of_two_at_or_above():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 128)] == [1, 2, 4, 4, 8, 16, 32, 128]
    assert bucket(3, 16) == 16 and bucket(40, 16) == 64
    assert step_bucket(10, cap=1023) == 16
    assert step_bucket(40, cap=1023) == 64
    assert step_bucket(40, cap=50) == 50  # never past the decoder's positions...
    assert step_bucket(50, cap=50) == 50  # ...which the search's steps never exceed
    assert GraphShape(sentences=4, per_sentence=5, steps=16, source=16, start=2, top=10).rows == 20


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    return random_tiny_models(tmp_path_factory, "cuda_graph")


def test_registered_and_refuses_a_model_on_cpu(random_models):
    data_dir, task, hrt, _ = random_models
    assert "cuda-graph" in engine_choices()
    assert any("not on a CUDA device" in r for r in cuda_graph_refusals(hrt.cpu()))
    _, ssru = build_task_and_model(data_dir, arch="at_tiny_ssru", extra=("--hrt-mode", "at"))
    assert any("recurrent (SSRU)" in r for r in cuda_graph_refusals(ssru))
    with pytest.raises(ValueError, match="--decoder-engine cuda-graph cannot decode here: the model is on cpu"):
        build_generator(data_dir, hrt.cpu(), "--decoder-engine", "cuda-graph", "--decode-chunk-size", "2")


def test_compile_is_refused_by_name(random_models):
    data_dir, _, hrt, _ = random_models
    with pytest.raises(ValueError, match="--decoder-engine cuda-graph does not compile its step"):
        build_generator(data_dir, hrt, "--decoder-engine", "cuda-graph", "--compile")


# ------------------------------------------------------------------ differential tests


class EagerGraphBackend(CudaGraphBackend):
    captures = False  # the graphs' bodies run as they are: the bookkeeping, on any device


class EagerGraphGenerator(CudaGraphSequenceGenerator):
    backend_class = EagerGraphBackend


DEVICES = [
    pytest.param("cpu", id="cpu-uncaptured"),
    pytest.param("cuda", id="cuda-graphs", marks=needs_gpu),
]


def _graph_generator(device):
    return CudaGraphSequenceGenerator if device == "cuda" else EagerGraphGenerator


def _on(model, device):
    return model.to(device).float()


def _sample(task, device):
    sample = make_sample(task, RAGGED)
    return utils.move_to_cuda(sample) if device == "cuda" else sample


SEARCHES = [
    dict(beam=1),
    dict(beam=5),
    dict(beam=5, len_penalty=0.6, min_len=3),
    dict(beam=3, max_len_a=0.5, unk_penalty=0.5, temperature=1.3),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("which", ["at", "hrt-at-mode", "hrt-skip-at-k2"])
def test_same_hypotheses_as_lean_on_random_models(random_models, which, search, device):
    _, task, hrt, at = random_models
    d = task.target_dictionary
    model = _on(at if which == "at" else hrt, device)
    bos = task.chunk_start_idx[2] if which == "hrt-skip-at-k2" else None
    search = dict(search)
    temperature = search.pop("temperature", 1.0)
    config = SearchConfig(max_len_b=9, **search)
    banned = [d.index(s) for s in ([] if which == "at" else SPECIALS)]
    lean = LeanSequenceGenerator(model, d, config, banned, temperature=temperature)
    graphs = _graph_generator(device)(model, d, config, banned, temperature=temperature)
    sample = _sample(task, device)
    ref = lean.generate([model], sample, bos_token=bos)
    assert_same_hypotheses(ref, graphs.generate([model], sample, bos_token=bos))
    assert_same_hypotheses(ref, graphs.generate([model], sample, bos_token=bos))  # the graphs again, kept
    assert graphs.backend.graphs >= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k, beam, b_nat", [(2, 1, 1), (3, 4, 2)])
def test_hrt_two_stages_same_as_lean(random_models, k, beam, b_nat, device):
    _, task, hrt, _ = random_models
    d = task.target_dictionary
    model = _on(hrt, device)
    config = SearchConfig(beam=beam, max_len_b=16)
    banned = [d.index(s) for s in SPECIALS]
    kwargs = dict(chunk_start=task.chunk_start_idx, mask=task.mask_idx, chunk_size=k, b_nat=b_nat)
    sample = _sample(task, device)
    ref = LeanSequenceGenerator(model, d, config, banned, **kwargs).generate([model], sample)
    graphs = _graph_generator(device)(model, d, config, banned, **kwargs)
    assert_same_hypotheses(ref, graphs.generate([model], sample))
    # the encoder, the steps and stage II each ran from graphs of their own
    assert graphs.backend._encoders and graphs.backend._graphs and graphs.backend._parallel


@pytest.mark.parametrize("device", DEVICES)
def test_mask_predict_same_as_lean(tmp_path_factory, device):
    """Mask-Predict's iterations run the captured non-causal pass; its length predictor reads
    the encoder output, made when first read."""
    data_dir = str(tmp_path_factory.mktemp("cuda_graph_cmlm"))
    task, model = build_task_and_model(data_dir, arch="cmlm_tiny", extra=("--hrt-mode", "cmlm"), seed=1)
    model = _on(model.eval(), device)
    d = task.target_dictionary
    sample = _sample(task, device)
    graph_backend = CudaGraphBackend if device == "cuda" else EagerGraphBackend
    backends = (TorchBackend(model, d, mask=task.mask_idx), graph_backend(model, d, mask=task.mask_idx))
    out = [
        MaskPredictGenerator([model], backend, d, task.mask_idx, iterations=4, length_beam=3).generate([model], sample)
        for backend in backends
    ]
    assert_same_hypotheses(*out)
    assert backends[1]._parallel


@pytest.mark.parametrize("device", DEVICES)
def test_weights_loaded_later_drop_the_graphs(random_models, device):
    """The graphs read the weights' tensors (and copies of them): weights loaded into the model
    after its engine was built are decoded, not the ones the graphs were made with."""
    data_dir, task, _, at = random_models
    _, other = build_task_and_model(data_dir, arch="at_tiny", seed=9)
    model, other = _on(copy.deepcopy(at), device), _on(other, device)
    d, config, sample = task.target_dictionary, SearchConfig(beam=1, max_len_b=9), _sample(task, device)
    graphs = _graph_generator(device)(model, d, config, [])
    # the reference decodes the same copy: the shared fixture may sit on another device
    assert_same_hypotheses(
        LeanSequenceGenerator(model, d, config, []).generate([model], sample), graphs.generate([model], sample)
    )
    model.load_state_dict(other.state_dict())
    expected = LeanSequenceGenerator(other, d, config, []).generate([other], sample)
    assert_same_hypotheses(expected, graphs.generate([model], sample))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", ["fairseq-adam-step", "load_state_dict"])
def test_weights_changed_between_batches_drop_every_graph(random_models, device, change):
    """HRT's two stages decoded once (the encoder, the steps and stage II from graphs), then
    the weights change as fairseq-train's optimizer step (through ``p.data``) or a load changes
    them: the next batch decodes the new weights, with nothing told to forget."""
    data_dir, task, hrt, _ = random_models
    _, other = build_task_and_model(data_dir, arch="hrt_tiny", seed=9)
    model = _on(copy.deepcopy(hrt), device)
    d, sample = task.target_dictionary, _sample(task, device)
    config, banned = SearchConfig(beam=2, max_len_b=16), [d.index(s) for s in SPECIALS]
    kwargs = dict(chunk_start=task.chunk_start_idx, mask=task.mask_idx, chunk_size=2, b_nat=1)
    graphs = _graph_generator(device)(model, d, config, banned, **kwargs)
    before = graphs.generate([model], sample)
    assert graphs.backend._encoders and graphs.backend._graphs and graphs.backend._parallel
    WEIGHT_CHANGES[change](task, model, _on(other, device))
    fresh = copy.deepcopy(model)  # a model no engine has decoded yet
    expected = LeanSequenceGenerator(fresh, d, config, banned, **kwargs).generate([fresh], sample)
    assert [h[0]["tokens"].tolist() for h in expected] != [h[0]["tokens"].tolist() for h in before]
    assert_same_hypotheses(expected, graphs.generate([model], sample))


@needs_gpu
@pytest.mark.parametrize("flags", [("--decode-chunk-size", "2", "--beam", "1"), ("--decode-chunk-size", "by-length")])
def test_fairseq_generate_engine_option_builds_the_graph_engine(random_models, flags):
    data_dir, task, hrt, _ = random_models
    hrt.cuda().float()
    sample = utils.move_to_cuda(make_sample(task, RAGGED))
    _, ref = build_generator(data_dir, hrt, "--max-len-b", "16", *flags, "--decoder-engine", "lean")
    _, ours = build_generator(data_dir, hrt, "--max-len-b", "16", *flags, "--decoder-engine", "cuda-graph")
    assert_same_hypotheses(ref.generate([hrt], sample), ours.generate([hrt], sample))


def _trained(trained, arch, device):
    data, ckpts = trained
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpts[arch])], arg_overrides={"data": str(data.bin_dir)}
    )
    task.load_dataset("valid")
    itr = task.get_batch_iterator(task.dataset("valid"), max_sentences=16).next_epoch_itr(shuffle=False)
    batches = [utils.move_to_cuda(s) if device == "cuda" else s for s in itr]
    return task, models[0].eval().to(device), batches


def _decodes(task, arch):
    """``(config, generator keyword arguments)`` of the searches a trained model is decoded with."""
    searches = [SearchConfig(beam=1, max_len_b=40), SearchConfig(beam=5, len_penalty=0.6, max_len_b=40)]
    if arch == "at_tiny":
        return [(c, {}) for c in searches]
    hrt = dict(chunk_start=task.chunk_start_idx, mask=task.mask_idx)
    return [(c, {}) for c in searches] + [(SearchConfig(beam=3, max_len_b=40), dict(hrt, chunk_size=2))]


def _banned(task, arch):
    d = task.target_dictionary
    return [] if arch == "at_tiny" else [d.index(s) for s in SPECIALS]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["at_tiny", "hrt_tiny"])
def test_trained_models_same_tokens_as_lean_in_float32(trained, arch, device):
    """Trained models end sentences at different steps: rows are compacted, and batches move
    to graphs of fewer sentences mid-search (more graph shapes than batches' first steps)."""
    task, model, batches = _trained(trained, arch, device)
    d, banned = task.target_dictionary, _banned(task, arch)
    lengths, moved = set(), False
    for config, kwargs in _decodes(task, arch):
        lean = LeanSequenceGenerator(model, d, config, banned, **kwargs)
        graphs = _graph_generator(device)(model, d, config, banned, **kwargs)
        for sample in batches:
            out = graphs.generate([model], sample)
            assert_same_hypotheses(lean.generate([model], sample), out)
            lengths |= {len(h[0]["tokens"]) for h in out}
        moved |= len({shape.sentences for shape in graphs.backend._graphs}) > 1
    assert len(lengths) > 2  # sentences really end at different steps
    assert moved  # and batches moved to graphs of fewer sentences


@needs_gpu
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["at_tiny", "hrt_tiny"])
def test_trained_models_in_float16_mostly_agree_with_lean(trained, arch, capsys):
    """In half precision the graph's static step (the whole cache, the future masked) and the
    lean step (the cache up to the step) sum in other orders: a near-tie can flip. The agreement
    is printed (pytest -s) and must stay high."""
    task, model, batches = _trained(trained, arch, "cuda")
    model.half()
    d, banned = task.target_dictionary, _banned(task, arch)
    same = total = graphs_made = 0
    seconds = 0.0
    for config, kwargs in _decodes(task, arch):
        lean = LeanSequenceGenerator(model, d, config, banned, **kwargs)
        graphs = CudaGraphSequenceGenerator(model, d, config, banned, **kwargs)
        for sample in batches:
            for r, o in zip(lean.generate([model], sample), graphs.generate([model], sample)):
                same += r[0]["tokens"].tolist() == o[0]["tokens"].tolist()
                total += 1
        graphs_made += graphs.backend.graphs
        seconds += graphs.backend.capture_seconds
    with capsys.disabled():
        print(
            f"\n[cuda-graph fp16] {arch}: {same}/{total} best hypotheses identical to the lean engine's; "
            f"{graphs_made} graphs made in {seconds:.2f} s"
        )
    assert same >= 0.9 * total
