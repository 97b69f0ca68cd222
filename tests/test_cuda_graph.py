"""The CUDA-graph engine (``--decoder-engine cuda-graph``): the lean engine's step replayed as
CUDA graphs gives the lean engine's hypotheses.

The differential tests run twice: on CPU with the graphs' bodies run as they are (the same
buffers, buckets, first-step spreading of a beam, row compaction and moves to graphs of fewer
sentences, without capture: ``captures = False``), and on a CUDA GPU with captured graphs
(skipped without one; CI has none). In float32 the same tokens as ``--decoder-engine lean``
(random models, and trained ones whose sentences end at different steps, so batches move to
smaller graphs mid-search); in float16 (GPU) the agreement is measured and stated. Greedy
searches of at most LOOP_ROWS sentences run as a device loop (``greedy_loop``): the tests
assert that the loop served them (``loop_runs``) and that larger batches fell back to the
search's own steps, with the same hypotheses either way.
"""

import copy

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils, utils

from fairseq_hrt.generation.cuda_graph import (
    LOOP_ROWS,
    LOOP_STEPS,
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
from fairseq_hrt.passes import weights
from fairseq_hrt.passes.attention import ATTENTION_KERNELS
from hrt_runtime.search import SearchConfig, position_cap
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


def _graph_backend(device):
    return CudaGraphBackend if device == "cuda" else EagerGraphBackend


def _eos_biases(d):
    """``(only_eos, no_eos)``: logit biases that allow ``</s>`` alone, and everything but it."""
    only_eos = np.full(len(d), -np.inf, np.float32)
    only_eos[d.eos()] = 0.0
    no_eos = np.zeros(len(d), np.float32)
    no_eos[d.eos()] = -np.inf
    return only_eos, no_eos


def _on(model, device):
    return model.to(device).float()


def _sample(task, device, sentences=RAGGED):
    sample = make_sample(task, sentences)
    return utils.move_to_cuda(sample) if device == "cuda" else sample


# the model a differential test decodes, and the chunk size whose <s_k> starts its search (None: </s>)
SKIP_AT = {"at": None, "hrt-at-mode": None, "hrt-skip-at-k2": 2, "hrt-skip-at-k3": 3}


def _lean_and_graphs(random_models, which, search, device, **config):
    """``(model, bos, lean, make_graphs)``: :data:`SKIP_AT`'s ``which`` model on ``device``, its
    start symbol, the lean generator of ``search`` (over ``config``; its temperature taken out)
    and a maker of CUDA-graph generators of the same search."""
    _, task, hrt, at = random_models
    d = task.target_dictionary
    model = _on(at if which == "at" else hrt, device)
    bos = task.chunk_start_idx[SKIP_AT[which]] if SKIP_AT[which] else None
    search = dict(search)
    temperature = search.pop("temperature", 1.0)
    config = SearchConfig(**{**config, **search})
    banned = [d.index(s) for s in ([] if which == "at" else SPECIALS)]
    lean = LeanSequenceGenerator(model, d, config, banned, temperature=temperature)
    return model, bos, lean, lambda: _graph_generator(device)(model, d, config, banned, temperature=temperature)


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
    task = random_models[1]
    model, bos, lean, make_graphs = _lean_and_graphs(random_models, which, search, device, max_len_b=9)
    graphs = make_graphs()
    sample = _sample(task, device)
    ref = lean.generate([model], sample, bos_token=bos)
    assert_same_hypotheses(ref, graphs.generate([model], sample, bos_token=bos))
    assert_same_hypotheses(ref, graphs.generate([model], sample, bos_token=bos))  # the graphs again, kept
    assert graphs.backend.graphs >= 1
    # more sentences than a greedy loop serves: the search made the steps (the loop said None)
    assert len(RAGGED) > LOOP_ROWS and graphs.backend.loop_runs == 0 and not graphs.backend._loops


# greedy searches the device loop makes: its step biases (min_len, --unkpen, the maximum length),
# temperature, and maximum lengths whose steps are fewer than a replay's, a whole number of
# replays, min_len itself, and the decoder's last position (the graph's steps at their cap)
LOOPED = {
    "usual": dict(max_len_b=9),
    "min-len,unkpen,temperature": dict(max_len_b=9, min_len=3, unk_penalty=0.5, temperature=1.3),
    "min-len=max-len": dict(max_len_b=5, min_len=5),
    "steps<replay": dict(max_len_b=LOOP_STEPS - 2),
    "steps=2-replays": dict(max_len_b=2 * LOOP_STEPS - 1),
    "position-cap": dict(max_len_b=100000),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sentences", [5, LOOP_ROWS])
@pytest.mark.parametrize("search", LOOPED.values(), ids=LOOPED.keys())
@pytest.mark.parametrize("which", SKIP_AT)
def test_greedy_loop_same_as_lean_on_random_models(random_models, which, search, sentences, device):
    """Ragged batches of at most LOOP_ROWS sentences: every greedy step on the device
    (``greedy_loop``, not ``None``), the lean engine's hypotheses (tokens and scores)."""
    task = random_models[1]
    model, bos, lean, make_graphs = _lean_and_graphs(random_models, which, search, device, beam=1)
    graphs = make_graphs()
    sample = _sample(task, device, RAGGED[:sentences])
    ref = lean.generate([model], sample, bos_token=bos)
    out = [graphs.generate([model], sample, bos_token=bos) for _ in range(2)]  # the loop graph again, kept
    if search == LOOPED["position-cap"]:
        # a thousand steps: the lean step (the cache up to the step) and the static one (the whole
        # cache, the future masked) differ in the scores' last bits, and float32 sums of
        # ~1000 of them by an ulp of 1e-4: the same tokens, and the scores of the stepped graphs
        assert [h[0]["tokens"].tolist() for h in ref] == [h[0]["tokens"].tolist() for h in out[0]]
        stepped = make_graphs()
        stepped.backend.loop_rows = 0  # the search steps
        ref = stepped.generate([model], sample, bos_token=bos)
        assert stepped.backend._graphs and stepped.backend.loop_runs == 0
    for looped in out:
        assert_same_hypotheses(ref, looped)
    backend = graphs.backend
    assert backend.loop_runs == 2 and not backend._graphs  # no step of the search's own
    (shape,) = backend._loops
    cap = position_cap(backend.max_target_positions, backend.stride_of(shape.start)) + 1
    assert shape.sentences == bucket(sentences) and shape.steps <= cap
    if search == LOOPED["position-cap"]:
        assert shape.steps == cap and max(len(h[0]["tokens"]) for h in ref) <= cap


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", ATTENTION_KERNELS, ids=lambda k: k or "written-out")
@pytest.mark.parametrize(
    "k, beam, b_nat, sentences", [(2, 1, 1, 7), (3, 1, 1, LOOP_ROWS), (2, 1, 1, len(RAGGED)), (3, 4, 2, len(RAGGED))]
)
def test_hrt_two_stages_same_as_lean(random_models, k, beam, b_nat, sentences, kernel, device):
    """Stage I greedy (b_at 1) of at most LOOP_ROWS sentences: a device loop; of more, or a
    beam: the search's steps. The graphs' attention written out or fused (``attention_kernel``),
    the lean engine's written out."""
    _, task, hrt, _ = random_models
    d = task.target_dictionary
    model = _on(hrt, device)
    config = SearchConfig(beam=beam, max_len_b=16)
    banned = [d.index(s) for s in SPECIALS]
    kwargs = dict(chunk_start=task.chunk_start_idx, mask=task.mask_idx, chunk_size=k, b_nat=b_nat)
    sample = _sample(task, device, RAGGED[:sentences])
    ref = LeanSequenceGenerator(model, d, config, banned, **kwargs).generate([model], sample)
    graphs = _graph_generator(device)(model, d, config, banned, **kwargs)
    graphs.backend.attention_kernel = kernel
    assert_same_hypotheses(ref, graphs.generate([model], sample))
    # the encoder, the steps (a loop's or the search's) and stage II each ran from graphs of their own
    backend, looped = graphs.backend, beam == 1 and sentences <= LOOP_ROWS
    assert backend._encoders and (backend._loops if looped else backend._graphs) and backend._parallel
    assert backend.loop_runs == looped and bool(backend._graphs) != looped


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beam, sentences", [(1, 7), (1, len(RAGGED)), (4, len(RAGGED))], ids=["loop", "steps", "beam"])
def test_a_decoder_of_three_layers_same_as_lean(random_models, beam, sentences, device):
    """Every layer's caches and encoder keys/values live in one buffer per graph (their layers
    along one dimension): a decoder of three layers, HRT's two stages through the device loop,
    the search's steps (whose finished sentences move the batch to smaller graphs) and a beam."""
    data_dir, task = random_models[:2]
    _, model = build_task_and_model(data_dir, arch="hrt_tiny", extra=("--decoder-layers", "3"), seed=5)
    model, d = _on(model, device), task.target_dictionary
    with torch.no_grad():  # half the sentences end at their second step, the rest later
        model.decoder.embed_tokens.weight[d.eos()] *= 4
    config, banned = SearchConfig(beam=beam, max_len_b=16), [d.index(s) for s in SPECIALS]
    kwargs = dict(chunk_start=task.chunk_start_idx, mask=task.mask_idx, chunk_size=2, b_nat=min(beam, 2))
    sample = _sample(task, device, RAGGED[:sentences])
    ref = LeanSequenceGenerator(model, d, config, banned, **kwargs).generate([model], sample)
    graphs = _graph_generator(device)(model, d, config, banned, **kwargs)
    assert_same_hypotheses(ref, graphs.generate([model], sample))
    backend = graphs.backend
    assert len(model.decoder.layers) == 3 and backend._encoders and backend._parallel
    assert backend.loop_runs == (beam == 1 and sentences <= LOOP_ROWS)
    lengths = {len(h[0]["tokens"]) for h in ref}
    assert len(lengths) > 1
    if backend._graphs:  # the steps reordered every layer's rows at once; greedy, the batch also
        # moved to graphs of fewer sentences (a beam's sentences end when all their rows have)
        assert len({shape.sentences for shape in backend._graphs}) > (beam == 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("search", [dict(beam=1), dict(beam=5, len_penalty=0.6, min_len=3)], ids=["loop", "beam"])
@pytest.mark.parametrize("which", SKIP_AT)
def test_fused_attention_same_as_lean(random_models, which, search, device):
    """The graphs' attention as one ``scaled_dot_product_attention`` (``attention_kernel``
    "fused", the benchmark's cuda-graph-fused row): the lean engine's hypotheses, its
    attention written out; greedy through the device loop, a beam through the search's steps."""
    task = random_models[1]
    model, bos, lean, make_graphs = _lean_and_graphs(random_models, which, search, device, max_len_b=9)
    graphs = make_graphs()
    graphs.backend.attention_kernel = "fused"
    sample = _sample(task, device, RAGGED[:7])
    ref = lean.generate([model], sample, bos_token=bos)
    assert_same_hypotheses(ref, graphs.generate([model], sample, bos_token=bos))
    assert graphs.backend.loop_runs == (search["beam"] == 1)


@pytest.mark.parametrize("device", DEVICES)
def test_mask_predict_same_as_lean(tmp_path_factory, device):
    """Mask-Predict's iterations run the captured non-causal pass; its length predictor reads
    the encoder output, made when first read."""
    data_dir = str(tmp_path_factory.mktemp("cuda_graph_cmlm"))
    task, model = build_task_and_model(data_dir, arch="cmlm_tiny", extra=("--hrt-mode", "cmlm"), seed=1)
    model = _on(model.eval(), device)
    d = task.target_dictionary
    sample = _sample(task, device)
    backends = (TorchBackend(model, d, mask=task.mask_idx), _graph_backend(device)(model, d, mask=task.mask_idx))
    out = [
        MaskPredictGenerator([model], backend, d, task.mask_idx, iterations=4, length_beam=3).generate([model], sample)
        for backend in backends
    ]
    assert_same_hypotheses(*out)
    assert backends[1]._parallel


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_loop_stops_after_the_replay_in_which_every_row_ended(random_models, device):
    """The backend's contract (``ExportedModel.greedy_loop``'s) called as the search calls it
    (without gradients), under biases that end every row at ``min_len``: the loop stops at the
    end of that replay (the one-element flag read between replays), not at ``max_len``."""
    _, task, _, at = random_models
    model, d = _on(at, device), task.target_dictionary
    backend = _graph_backend(device)(model, d)
    eos, min_len, max_len = d.eos(), 5, 40
    only_eos, no_eos = _eos_biases(d)
    biases, whole = (only_eos, no_eos, only_eos), backend.rows(None)
    with torch.no_grad():
        encoded = backend.encode_fairseq(_sample(task, device, RAGGED[:3])["net_input"])
        tokens, scores = backend.greedy_loop(encoded, eos, max_len, min_len, biases, whole)
        # above LOOP_ROWS sentences, or over a shortlist's rows: no loop (the search steps)
        many = backend.encode_fairseq(_sample(task, device, RAGGED[: LOOP_ROWS + 1])["net_input"])
        assert backend.greedy_loop(many, eos, max_len, min_len, biases, whole) is None
        assert backend.greedy_loop(encoded, eos, max_len, min_len, biases, backend.rows(np.arange(9))) is None
    replays = -(-(min_len + 1) // LOOP_STEPS)
    assert tokens.shape == scores.shape == (3, replays * LOOP_STEPS) and replays * LOOP_STEPS < max_len
    assert (tokens[:, :min_len] != eos).all() and (tokens[:, min_len] == eos).all()
    assert np.isfinite(scores).all() and (scores <= 0).all()
    assert backend.loop_runs == 1


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_loop_counts_a_row_ended_at_any_step_of_its_replay(random_models, device):
    """A row has ended at its first ``</s>``, whatever it decodes after (rows keep decoding):
    every row's first step is ``</s>`` (the bias before ``min_len`` 1 allows nothing else) and
    no later step is (the usual bias bans it), and the loop stops after its first replay."""
    _, task, _, at = random_models
    model, d = _on(at, device), task.target_dictionary
    backend = _graph_backend(device)(model, d)
    eos = d.eos()
    only_eos, no_eos = _eos_biases(d)
    with torch.no_grad():
        encoded = backend.encode_fairseq(_sample(task, device, RAGGED[:3])["net_input"])
        tokens, _ = backend.greedy_loop(encoded, eos, 40, 1, (no_eos, only_eos, only_eos), backend.rows(None))
    assert tokens.shape == (3, LOOP_STEPS) and (tokens[:, 0] == eos).all() and (tokens[:, 1:] != eos).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sentences", [len(RAGGED), 6], ids=["steps", "loop"])
def test_weights_loaded_later_drop_the_graphs(random_models, sentences, device):
    """The graphs read the weights' tensors (and copies of them): weights loaded into the model
    after its engine was built are decoded, not the ones the graphs were made with (the step
    graphs of a batch the search steps, the loop graph of one the device loop decodes)."""
    data_dir, task, _, at = random_models
    _, other = build_task_and_model(data_dir, arch="at_tiny", seed=9)
    model, other = _on(copy.deepcopy(at), device), _on(other, device)
    d, config = task.target_dictionary, SearchConfig(beam=1, max_len_b=9)
    sample = _sample(task, device, RAGGED[:sentences])
    graphs = _graph_generator(device)(model, d, config, [])
    # the reference decodes the same copy: the shared fixture may sit on another device
    assert_same_hypotheses(
        LeanSequenceGenerator(model, d, config, []).generate([model], sample), graphs.generate([model], sample)
    )
    assert bool(graphs.backend._loops) == (sentences <= LOOP_ROWS) != bool(graphs.backend._graphs)
    model.load_state_dict(other.state_dict())
    expected = LeanSequenceGenerator(other, d, config, []).generate([other], sample)
    assert_same_hypotheses(expected, graphs.generate([model], sample))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beam, sentences", [(2, len(RAGGED)), (1, 6)], ids=["steps", "loop"])
@pytest.mark.parametrize("change", ["fairseq-adam-step", "load_state_dict", "layer-replaced"])
def test_weights_changed_between_batches_drop_every_graph(random_models, device, change, beam, sentences):
    """HRT's two stages decoded once (the encoder, the steps -- the search's or, greedy, a
    device loop's -- and stage II from graphs), then the weights change as fairseq-train's
    optimizer step (through ``p.data``) or a load changes them: the next batch decodes the new
    weights, with nothing told to forget."""
    data_dir, task, hrt, _ = random_models
    _, other = build_task_and_model(data_dir, arch="hrt_tiny", seed=9)
    model = _on(copy.deepcopy(hrt), device)
    d, sample = task.target_dictionary, _sample(task, device, RAGGED[:sentences])
    config, banned = SearchConfig(beam=beam, max_len_b=16), [d.index(s) for s in SPECIALS]
    kwargs = dict(chunk_start=task.chunk_start_idx, mask=task.mask_idx, chunk_size=2, b_nat=1)
    graphs = _graph_generator(device)(model, d, config, banned, **kwargs)
    before = graphs.generate([model], sample)
    steps = graphs.backend._loops if beam == 1 else graphs.backend._graphs
    assert graphs.backend._encoders and steps and graphs.backend._parallel
    WEIGHT_CHANGES[change](task, model, _on(other, device))
    fresh = copy.deepcopy(model)  # a model no engine has decoded yet
    expected = LeanSequenceGenerator(fresh, d, config, banned, **kwargs).generate([fresh], sample)
    assert [h[0]["tokens"].tolist() for h in expected] != [h[0]["tokens"].tolist() for h in before]
    assert_same_hypotheses(expected, graphs.generate([model], sample))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("search", [dict(beam=1), dict(beam=5, min_len=3)], ids=["loop", "beam"])
def test_an_eager_encoders_per_layer_keys_fill_the_graphs(random_models, search, device):
    """The graphs keep every layer's caches and encoder keys/values in one buffer each, which
    the captured encoder fills as one; an encoder that is not captured (a model whose encoder
    the planned pass does not know) hands per-layer tensors, which fill the same buffers."""
    task = random_models[1]
    model, bos, lean, make_graphs = _lean_and_graphs(random_models, "hrt-skip-at-k2", search, device, max_len_b=9)
    graphs = make_graphs()
    graphs.backend._current(every_parameter=True)  # what a batch does first: drops nothing made after
    graphs.backend._modules["encoder"] = None  # the eager encoder, as for an unknown encoder
    sample = _sample(task, device, RAGGED[:7])
    expected = lean.generate([model], sample, bos_token=bos)
    assert_same_hypotheses(expected, graphs.generate([model], sample, bos_token=bos))
    assert not graphs.backend._encoders and (graphs.backend._loops or graphs.backend._graphs)


@pytest.mark.parametrize("device", DEVICES)
def test_the_captured_steps_have_the_queries_scaling_in_their_weights(random_models, device):
    """The step and loop graphs run the folded plan (the queries' scaling in their projections'
    weights, as stage II and the exported graphs: two kernels a layer fewer than the lean
    step's), the one the non-causal pass keeps, made again with the graphs."""
    task = random_models[1]
    model, bos, lean, make_graphs = _lean_and_graphs(random_models, "hrt-skip-at-k2", dict(beam=1), device, max_len_b=9)
    graphs = make_graphs()
    for sentences in (5, len(RAGGED)):  # a device loop, then the search's steps
        sample = _sample(task, device, RAGGED[:sentences])
        assert_same_hypotheses(
            lean.generate([model], sample, bos_token=bos), graphs.generate([model], sample, bos_token=bos)
        )
    backend = graphs.backend
    folded = backend._module("parallel").plan
    made = [*backend._loops.values(), *backend._graphs.values()]
    assert backend._loops and backend._graphs and all(graph.state.plan is folded for graph in made)
    assert all(layer.q_scaling is None for layer in folded.layers)
    assert all(layer.q_scaling is not None for layer in backend.decoder_pass.plan().layers)  # the lean step's


@pytest.mark.parametrize("device", DEVICES)
def test_batches_check_the_weights_without_listing_the_parameters_again(random_models, device):
    """The weights' version, checked at every batch, reads the parameters each module listed
    at the first batch: decoding registers no parameter or module, which would make every
    check walk the model's modules again (most of a check's cost)."""
    task = random_models[1]
    model, bos, lean, make_graphs = _lean_and_graphs(random_models, "hrt-skip-at-k2", dict(beam=1), device, max_len_b=9)
    generators, sample = (lean, make_graphs()), _sample(task, device)
    for generator in generators:
        generator.generate([model], sample, bos_token=bos)
    registered = weights._registered
    kept = [module.__dict__[weights._PARAMETERS] for module in (model, model.decoder)]
    for generator in generators:
        generator.generate([model], sample, bos_token=bos)
    assert weights._registered == registered
    assert all(module.__dict__[weights._PARAMETERS] is k for module, k in zip((model, model.decoder), kept))


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
    return [(c, {}) for c in searches] + [
        (SearchConfig(beam=3, max_len_b=40), dict(hrt, chunk_size=2)),
        (SearchConfig(beam=1, max_len_b=40), dict(hrt, chunk_size=3)),  # stage I a device loop
    ]


def _banned(task, arch):
    d = task.target_dictionary
    return [] if arch == "at_tiny" else [d.index(s) for s in SPECIALS]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["at_tiny", "hrt_tiny"])
def test_trained_models_same_tokens_as_lean_in_float32(trained, arch, device):
    """Trained models end sentences at different steps: rows are compacted, and batches move
    to graphs of fewer sentences mid-search (more graph shapes than batches' first steps); a
    greedy search's batches (at most LOOP_ROWS sentences) run as device loops, which stop
    after the replay in which their last sentence ended."""
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
        assert max(len(b["id"]) for b in batches) <= LOOP_ROWS
        assert graphs.backend.loop_runs == (len(batches) if config.beam == 1 else 0)
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


# ------------------------------------------------------------- the benchmarks' counts


def _observed_loops(backend):
    """``backend`` whose greedy loops' results' steps (``None``: the search stepped) are recorded."""
    made, loop = [], backend.greedy_loop

    def observed(*args):
        result = loop(*args)
        made.append(None if result is None else result[0].shape[1])
        return result

    backend.greedy_loop = observed
    return made


def test_time_split_counts_a_loops_steps_as_decoder_steps(random_models):
    """benchmarks/time_split.py on a GPU: a cuda-graph greedy loop is timed as decoder steps,
    as many as it made (here uncaptured on CPU: the same calls)."""
    from benchmarks import time_split  # noqa: PLC0415 - the benchmark's imports, for this test only

    _, task, _, at = random_models
    d = task.target_dictionary
    generator = EagerGraphGenerator(at, d, SearchConfig(beam=1, max_len_b=8), [])
    made, syncs = _observed_loops(generator.backend), []
    with time_split.backend_call_times(generator.backend, lambda: syncs.append(1)) as times:
        generator.generate([at], make_sample(task, RAGGED[:3]))
    assert made and None not in made
    assert times["hrt.step"][1] == sum(made) and times["hrt.encoder"][1] == 1
    assert len(syncs) == 2 * 2  # the encoder's call and the loop's, each synchronised around
    assert not {"encode_fairseq", "step", "greedy_loop", "parallel"} & set(vars(generator.backend))  # restored


def test_hrt_bound_fixed_length_steps_run_as_a_loop_of_exactly_their_steps(random_models):
    """benchmarks/hrt_bound.py's fixed-length parts on cuda-graph: the AT and Skip-AT steps
    each one device loop of exactly N and N / k steps (no row ends early: the replays' last
    steps before the maximum length run one by one)."""
    from benchmarks.hrt_bound import fixed_length_times  # noqa: PLC0415 - the benchmark's imports, for this test only

    _, task, hrt, _ = random_models
    backend = EagerGraphBackend(hrt, task.target_dictionary, task.chunk_start_idx, task.mask_idx)
    made = _observed_loops(backend)

    def encode(src):
        tokens = torch.from_numpy(src)
        return backend.encode_fairseq({"src_tokens": tokens, "src_lengths": torch.full((len(src),), src.shape[1])})

    tgt_len, k = 9, 2
    fixed_length_times(backend, encode, task, bsz=3, src_len=6, tgt_len=tgt_len, k=k, runs=1)
    assert sorted(set(made)) == [tgt_len // k, tgt_len] and backend.loop_runs == len(made)
