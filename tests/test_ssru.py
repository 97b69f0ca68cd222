"""SSRU decoder (``--arch *_ssru``, Marian's WNGT 2019 students): the recurrence, fairseq's
incremental decoding, the lean engine, Jacobi decoding, training, and the refusals."""

import argparse
import random

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.sequence_generator import SequenceGenerator

from benchmarks import ct2_reference
from fairseq_hrt.generation.jacobi import ParallelGreedyGenerator
from fairseq_hrt.generation.lean import LeanSequenceGenerator
from fairseq_hrt.models.ssru_transformer import SSRUDecoderLayer, SSRUTransformerModel
from fairseq_hrt.modules.ssru import SSRU, linear_recurrence
from fairseq_hrt.passes.decoder_pass import ssru_projections, ssru_step_
from fairseq_hrt.testing.tiny_runs import parse_logs, run_cli
from hrt_runtime.search import SearchConfig
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample
from tests.test_lean import assert_same_hypotheses
from tests.tiny_data import hyp_lines

random.seed(13)
RAGGED = [[random.randrange(0, 40) for _ in range(random.randint(0, 14))] for _ in range(20)]
AT = ("--hrt-mode", "at")


def sequential_recurrence(gates, inputs, initial=None):
    cell = torch.zeros_like(inputs[0]) if initial is None else initial
    cells = []
    for t in range(gates.size(0)):
        cell = gates[t] * cell + inputs[t]
        cells.append(cell)
    return torch.stack(cells)


# ------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize("steps", [1, 2, 3, 4, 7, 8, 9, 31])
def test_scan_equals_the_sequential_recurrence(steps):
    torch.manual_seed(steps)
    gates, inputs, initial = torch.rand(steps, 3, 5), torch.randn(steps, 3, 5), torch.randn(3, 5)
    for start in (None, initial):
        expected = sequential_recurrence(gates, inputs, start)
        assert torch.allclose(linear_recurrence(gates, inputs, start), expected, atol=1e-6)


def test_scan_gradients_equal_the_sequential_ones():
    torch.manual_seed(0)
    gates = torch.rand(6, 2, 4, requires_grad=True)
    inputs = torch.randn(6, 2, 4, requires_grad=True)
    weights = torch.randn(6, 2, 4)
    grads = []
    for fn in (linear_recurrence, sequential_recurrence):
        (fn(gates, inputs) * weights).sum().backward()
        grads.append((gates.grad.clone(), inputs.grad.clone()))
        gates.grad = inputs.grad = None
    for ours, ref in zip(*grads):
        assert torch.allclose(ours, ref, atol=1e-5)


def test_ssru_is_the_papers_unit():
    """h_t = ReLU(c_t), c_t = f_t c_{t-1} + (1 - f_t) W x_t, f_t = sigmoid(W_f x_t + b_f)."""
    torch.manual_seed(1)
    unit = SSRU(6)
    x = torch.randn(5, 2, 6)
    forget = torch.sigmoid(x @ unit.forget_gate.weight.t() + unit.forget_gate.bias)
    cells = sequential_recurrence(forget, (1 - forget) * (x @ unit.input_proj.weight.t()))
    assert unit.input_proj.bias is None  # W has no bias in the paper
    assert torch.allclose(unit(x), torch.relu(cells), atol=1e-6)


def test_padding_leaves_the_cell_unchanged():
    """Left-padded rows start from a zero cell at their first real token."""
    torch.manual_seed(2)
    unit = SSRU(4)
    x = torch.randn(5, 1, 4)
    padded = torch.cat([torch.randn(2, 1, 4), x])
    mask = torch.tensor([[True, True] + [False] * 5])
    assert torch.allclose(unit(padded, padding_mask=mask)[2:], unit(x), atol=1e-6)


def test_lean_step_is_the_units_step():
    """The lean engine's fused ``[-W_f; W]`` projection and in-place ``lerp`` give the cell of
    the module's incremental step."""
    torch.manual_seed(4)
    unit = SSRU(6)
    x, previous = torch.randn(3, 6), torch.randn(3, 6)
    state = {}
    unit.set_incremental_state(state, "ssru_state", {"cell": previous})
    expected = unit(x.unsqueeze(0), incremental_state=state)[0]
    cell = previous.clone()
    ssru_step_(ssru_projections(unit)(x), cell)
    assert torch.allclose(torch.relu(cell), expected, atol=1e-6)
    assert torch.allclose(cell, unit.get_incremental_state(state, "ssru_state")["cell"], atol=1e-6)


# -------------------------------------------------------------------- model, random weights


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("ssru"))
    task, one = build_task_and_model(data_dir, arch="at_tiny_ssru", extra=AT, seed=4)
    _, three = build_task_and_model(data_dir, arch="at_tiny_ssru", extra=AT + ("--decoder-layers", "3"), seed=5)
    _, tied = build_task_and_model(
        data_dir, arch="at_tiny_ssru", extra=AT + ("--decoder-layers", "3", "--decoder-tie-layers"), seed=6
    )
    return data_dir, task, {"ssru": one, "ssru-3": three, "ssru-3-tied": tied}


def test_archs_are_the_attention_twins_without_self_attention(tmp_path):
    _, ssru = build_task_and_model(str(tmp_path), arch="at_tiny_ssru", extra=AT)
    _, attention = build_task_and_model(str(tmp_path), arch="at_tiny", extra=AT)
    assert isinstance(ssru, SSRUTransformerModel) and isinstance(ssru.decoder.layers[0], SSRUDecoderLayer)
    ours, theirs = ssru.state_dict(), attention.state_dict()
    not_decoder_self_attn = {k for k in theirs if not k.startswith("decoder.layers.0.self_attn")}
    assert not_decoder_self_attn <= set(ours)
    assert all(ours[k].shape == theirs[k].shape for k in not_decoder_self_attn)
    assert set(ours) - set(theirs) == {
        "decoder.layers.0.ssru.input_proj.weight",
        "decoder.layers.0.ssru.forget_gate.weight",
        "decoder.layers.0.ssru.forget_gate.bias",
        "decoder.layers.0.ssru_layer_norm.weight",
        "decoder.layers.0.ssru_layer_norm.bias",
    }


@pytest.mark.parametrize("which", ["ssru", "ssru-3", "ssru-3-tied"])
def test_incremental_decoding_equals_the_full_forward(models, which):
    """fairseq's incremental state (one cell per layer) step by step gives the full pass's
    outputs, also after beam-style reordering of the rows."""
    _, task, by_name = models
    model = by_name[which]
    # one source for every row, as in a beam (fairseq reorders no encoder-attention cache
    # between rows of one sentence)
    sample = make_sample(task, [RAGGED[1]] * 4)
    net = sample["net_input"]
    torch.manual_seed(3)
    prev = torch.randint(4, 40, (4, 9))
    prev[:, 0] = task.target_dictionary.eos()
    with torch.no_grad():
        full, _ = model(net["src_tokens"], net["src_lengths"], prev)
        encoder_out = model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])
        state, steps = {}, []
        for t in range(prev.size(1)):
            out, _ = model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
            steps.append(out)
        assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)

        # reorder the rows after step 4 (as beam search does): the rest follows the new rows
        order = torch.tensor([2, 2, 0, 3])
        state, steps = {}, []
        for t in range(prev.size(1)):
            tokens = prev[:, : t + 1] if t < 5 else prev[order, : t + 1]
            if t == 5:
                model.decoder.reorder_incremental_state_scripting(state, order)
            out, _ = model.decoder(tokens, encoder_out=encoder_out, incremental_state=state)
            steps.append(out)
        reordered_full = full[order]
        assert torch.allclose(torch.cat(steps[5:], dim=1), reordered_full[:, 5:], atol=1e-5)


SEARCHES = [dict(beam_size=1), dict(beam_size=5), dict(beam_size=5, len_penalty=0.6, min_len=3)]


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("which", ["ssru", "ssru-3", "ssru-3-tied"])
def test_lean_equals_sequence_generator(models, which, search):
    _, task, by_name = models
    model, d = by_name[which], task.target_dictionary
    sample = make_sample(task, RAGGED)
    ref = SequenceGenerator([model], d, max_len_b=9, **search).generate([model], sample)
    options = SearchConfig(
        beam=search["beam_size"],
        max_len_b=9,
        min_len=search.get("min_len", 1),
        len_penalty=search.get("len_penalty", 1.0),
    )
    assert_same_hypotheses(ref, LeanSequenceGenerator(model, d, options).generate([model], sample))


@pytest.mark.parametrize("which", ["ssru", "ssru-3-tied"])
def test_jacobi_equals_greedy(models, which):
    """PJ/PGJ/HGJ run the recurrence over a block by a scan from the cached cell."""
    data_dir, task, by_name = models
    model = by_name[which]
    sample = make_sample(task, RAGGED)
    flags = ("--beam", "1", "--max-len-b", "9")
    _, greedy = build_generator(data_dir, model, *flags, "--decoding", "beam")
    ref = greedy.generate([model], sample)
    for method in ("pj", "pgj", "hgj"):
        for b in ("1", "3"):
            _, gen = build_generator(data_dir, model, *flags, "--decoding", method, "--jacobi-block-size", b)
            assert isinstance(gen, ParallelGreedyGenerator)
            out = gen.generate([model], sample)
            for r, o in zip(ref, out):
                assert o[0]["tokens"].tolist() == r[0]["tokens"].tolist()
                assert float(o[0]["score"]) == pytest.approx(float(r[0]["score"]), abs=1e-4)


@pytest.mark.parametrize("extra", [(), ("--decoder-layers", "2", "--decoder-tie-layers")], ids=["one", "tied"])
def test_int8_quantized_ssru_same_with_both_engines(tmp_path, extra):
    """--quantize int8 quantizes the SSRU's projections too; the lean engine then calls the
    quantized modules (no fused copy) and still equals fairseq's generator."""
    task, model = build_task_and_model(str(tmp_path), arch="at_tiny_ssru", extra=AT + extra, seed=8)
    sample = make_sample(task, RAGGED[:8])
    hypos = {}
    for engine in ("fairseq", "lean"):
        _, gen = build_generator(
            str(tmp_path), model, "--quantize", "int8", "--beam", "3", "--max-len-b", "8", "--decoder-engine", engine
        )
        hypos[engine] = gen.generate([model], sample)
    quantized = [n for n, m in model.named_modules() if "quantized" in type(m).__module__]
    assert any(".ssru.input_proj" in n for n in quantized) and any(".ssru.forget_gate" in n for n in quantized)
    assert_same_hypotheses(hypos["fairseq"], hypos["lean"])


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("mode", ["hrt", "cmlm"])
def test_ssru_with_hrt_or_mask_predict_training_is_refused(tmp_path, mode):
    with pytest.raises(ValueError, match="SSRU decoder is a left-to-right recurrence"):
        build_task_and_model(str(tmp_path), arch="at_tiny_ssru", extra=("--hrt-mode", mode))


@pytest.mark.parametrize("arch", ["hrt_tiny", "cmlm_tiny"])
def test_hrt_or_mask_predict_from_an_ssru_checkpoint_is_refused(models, tmp_path, arch):
    """``--finetune-from-model`` with an SSRU checkpoint (fairseq loads it with load_state_dict)."""
    _, _, by_name = models
    _, model = build_task_and_model(str(tmp_path), arch=arch)
    with pytest.raises(ValueError, match="SSRU decoder is a left-to-right recurrence"):
        model.load_state_dict(by_name["ssru"].state_dict())


@pytest.mark.parametrize(
    "decoding,message",
    [
        ("hrt", "HRT decoding needs an HRT model"),
        ("mask-predict", "Mask-Predict needs a model with a length predictor"),
        ("hrt-spec", "it needs an HRT model"),
    ],
)
def test_non_causal_decoding_of_an_ssru_student_is_refused(models, decoding, message):
    data_dir, _, by_name = models
    with pytest.raises(ValueError, match=message):
        build_generator(data_dir, by_name["ssru"], "--decoding", decoding, "--beam", "1")


def test_unsupported_decoder_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not support --cross-self-attention"):
        build_task_and_model(str(tmp_path), arch="at_tiny_ssru", extra=AT + ("--cross-self-attention",))


# ------------------------------------------------------------------------ trained models


@pytest.mark.slow
def test_tiny_ssru_model_learns(trained_ssru):
    _, _, logs = trained_ssru
    for name, log in logs.items():
        records = parse_logs(log)
        assert len(records) >= 30, log[-2000:]
        assert records[-1]["loss"] < records[0]["loss"] - 2.0, (name, records[0], records[-1])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["at_tiny_ssru", "at_tiny_ssru_tied"])
def test_trained_ssru_lean_and_jacobi_equal_fairseq(trained_ssru, name):
    """Trained students end sentences at different steps: ragged batches of 16."""
    data, ckpts, _ = trained_ssru
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpts[name])], arg_overrides={"data": str(data.bin_dir)}
    )
    model = models[0].eval()
    task.load_dataset("valid")
    langs = ("--source-lang", "en", "--target-lang", "de")
    batches = list(task.get_batch_iterator(task.dataset("valid"), max_sentences=16).next_epoch_itr(shuffle=False))
    lengths = set()
    for beam in ("1", "5"):
        _, ref = build_generator(str(data.bin_dir), model, *langs, "--beam", beam, "--decoder-engine", "fairseq")
        _, ours = build_generator(str(data.bin_dir), model, *langs, "--beam", beam, "--decoder-engine", "lean")
        decoders = [ours]
        if beam == "1":
            decoders += [build_generator(str(data.bin_dir), model, *langs, "--beam", "1", "--decoding", "pgj")[1]]
        for sample in batches:
            expected = ref.generate([model], sample)
            lengths |= {len(h[0]["tokens"]) for h in expected}
            for decoder in decoders:
                out = decoder.generate([model], sample)
                if beam == "1":
                    out = [hypos[:1] for hypos in out]
                assert_same_hypotheses(expected, out)
    assert len(lengths) > 2  # sentences really end at different steps


@pytest.mark.slow
def test_fairseq_generate_beam_search_with_both_engines(trained_ssru):
    data, ckpts, _ = trained_ssru
    common = [
        "generate",
        data.bin_dir,
        "--path",
        ckpts["at_tiny_ssru"],
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
    outs = {e: run_cli(common + ["--beam", "5", "--decoder-engine", e]).stdout for e in ("lean", "fairseq")}
    assert hyp_lines(outs["lean"]) == hyp_lines(outs["fairseq"]) and len(hyp_lines(outs["lean"])) == 40


def _ct2_reference():
    return ct2_reference


def test_ctranslate2_reference_gives_a_skip_reason_for_ssru_and_tied_students(tmp_path):
    ct2 = _ct2_reference()
    reasons = {}
    for name, arch, extra in (
        ("attention", "at_tiny", AT),
        ("ssru", "at_tiny_ssru", AT),
        ("tied", "at_tiny", AT + ("--decoder-layers", "2", "--decoder-tie-layers")),
    ):
        _, model = build_task_and_model(str(tmp_path), arch=arch, extra=extra)
        path = tmp_path / f"{name}.pt"
        cfg = argparse.Namespace(
            arch=arch, _name=type(model).__name__, decoder_tie_layers="--decoder-tie-layers" in extra
        )
        torch.save({"model": model.state_dict(), "cfg": {"model": cfg}}, path)
        reasons[name] = ct2.unsupported_checkpoint_reason(str(path))
    assert reasons["attention"] is None
    assert "CTranslate2 has no SSRU decoder layer" in reasons["ssru"]
    assert "--decoder-tie-layers" in reasons["tied"]
    if ct2.unavailable_reason() is None:  # with ctranslate2 installed, convert refuses clearly
        with pytest.raises(ValueError, match="CTranslate2 cannot convert"):
            ct2.convert(str(tmp_path / "ssru.pt"), str(tmp_path), str(tmp_path), "src", "tgt")
