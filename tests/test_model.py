"""The HRT model built through fairseq's own machinery (options parser, task, build_model).

SPEC section 1: one decoder with two modes sharing every parameter, key-only relative
positions over ORIGINAL positions (window w), parameter count = fairseq's transformer + the
relative key embeddings, incremental decoding for AT and Skip-AT, the task's special symbols,
and initialisation from an AT checkpoint.
"""

import logging
import math
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from fairseq import options, tasks
from fairseq.data import Dictionary
from fairseq.modules import MultiheadAttention
from fairseq.sequence_generator import SequenceGenerator

import fairseq_hrt  # noqa: F401  (registers the task, model and archs)
from fairseq_hrt.models.hrt_transformer import HRTDecoder, refuse_unsupported_options
from fairseq_hrt.modules.relative_attention import RelativeSelfAttention, relative_bucket
from fairseq_hrt.symbols import MASK_SYMBOL, MAX_CHUNK_SIZE, add_hrt_symbols, chunk_start_symbol

USER_DIR = str(Path(fairseq_hrt.__file__).resolve().parent)
N_WORDS = 20
HRT_SYMBOLS = [MASK_SYMBOL] + [chunk_start_symbol(k) for k in range(2, MAX_CHUNK_SIZE + 1)]


# ------------------------------------------------------------------------------- helpers


def _write_dicts(path: Path, n_words: int):
    d = Dictionary()
    for i in range(n_words):
        d.add_symbol(f"w{i}", n=100 - i)
    path.mkdir(parents=True, exist_ok=True)
    d.save(str(path / "dict.en.txt"))
    d.save(str(path / "dict.de.txt"))
    return path


def _args(data_dir, arch, *extra):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(
        parser,
        [
            str(data_dir),
            "--task",
            "hrt_translation",
            "--arch",
            arch,
            "-s",
            "en",
            "-t",
            "de",
            "--user-dir",
            USER_DIR,
            "--max-update",
            "100",
            "--seed",
            "1",
            *extra,
        ],
    )


def build(data_dir, arch="hrt_tiny", *extra, seed=0):
    args = _args(data_dir, arch, *extra)
    task = tasks.setup_task(args)
    torch.manual_seed(seed)
    model = task.build_model(args)
    model.eval()
    return task, model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread avoids oversubscription on a loaded machine
    (several x faster here); restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return _write_dicts(tmp_path_factory.mktemp("hrt_data"), N_WORDS)


@pytest.fixture(scope="module")
def other_data_dir(tmp_path_factory):
    return _write_dicts(tmp_path_factory.mktemp("hrt_data_big"), N_WORDS + 5)


@pytest.fixture(scope="module")
def hrt1(data_dir):
    """hrt_tiny: 2 encoder layers, 1 decoder layer, w = 16."""
    return build(data_dir, "hrt_tiny", seed=1)


@pytest.fixture(scope="module")
def hrt2(data_dir):
    """hrt_tiny with 2 decoder layers and a small window (w = 3) so clipping matters."""
    return build(data_dir, "hrt_tiny", "--decoder-layers", "2", "--decoder-rpr-window", "3", seed=2)


def words(task, *ids):
    return [task.target_dictionary.index(f"w{i}") for i in ids]


def encode(task, model, rows):
    """Encode source rows of word ids (``</s>`` appended, right padded)."""
    d = task.source_dictionary
    seqs = [torch.tensor([d.index(f"w{i}") for i in r] + [d.eos()]) for r in rows]
    width = max(len(s) for s in seqs)
    src = torch.full((len(seqs), width), d.pad(), dtype=torch.long)
    for i, s in enumerate(seqs):
        src[i, : len(s)] = s
    lengths = torch.tensor([len(s) for s in seqs])
    return src, lengths, model.encoder(src, src_lengths=lengths)


def lprobs(model, tokens, enc, **kw):
    out, _ = model.decoder(tokens, encoder_out=enc, **kw)
    return F.log_softmax(out.float(), dim=-1)


# --------------------------------------------------------------------- relative positions


def test_relative_bucket_clips_at_window():
    q = torch.tensor([[0, 1, 5]])
    k = torch.tensor([[0, 1, 2, 9, 30]])
    w = 3
    got = relative_bucket(q, k, w)
    assert got.shape == (1, 3, 5)
    expected = [[min(max(kj - qi, -w), w) + w for kj in k[0].tolist()] for qi in q[0].tolist()]
    assert got[0].tolist() == expected
    assert got[0].tolist() == [[3, 4, 5, 6, 6], [2, 3, 4, 6, 6], [0, 0, 0, 6, 6]]
    assert got.min() >= 0 and got.max() <= 2 * w
    # window 0: every distance maps to the single bucket 0
    assert relative_bucket(q, k, 0).eq(0).all()


def _reference_rpr_attention(attn, x, positions, causal):
    """O_i = softmax(Q_i (K^T + R_i) / sqrt(d)) V, R_i[j] = E[clip(p_j - p_i, -w, w)]."""
    T, B, C = x.shape
    H, d = attn.num_heads, attn.head_dim
    q = attn.q_proj(x).view(T, B, H, d).permute(1, 2, 0, 3)
    k = attn.k_proj(x).view(T, B, H, d).permute(1, 2, 0, 3)
    v = attn.v_proj(x).view(T, B, H, d).permute(1, 2, 0, 3)
    out = torch.zeros(B, H, T, d)
    for b in range(B):
        for i in range(T):
            keys = k[b, :, :, :].clone()  # (H, T, d)
            if attn.relative_keys is not None:
                for j in range(T):
                    dist = int(positions[b, j] - positions[b, i])
                    dist = max(-attn.window, min(attn.window, dist))
                    keys[:, j] = keys[:, j] + attn.relative_keys.weight[dist + attn.window]
            scores = torch.einsum("hd,htd->ht", q[b, :, i], keys) / math.sqrt(d)
            if causal:
                scores[:, i + 1 :] = float("-inf")
            out[b, :, i] = torch.einsum("ht,htd->hd", scores.softmax(-1), v[b])
    return attn.out_proj(out.permute(2, 0, 1, 3).reshape(T, B, C))


@pytest.mark.parametrize("causal", [True, False])
def test_relative_attention_matches_shaw_formula(causal):
    torch.manual_seed(0)
    attn = RelativeSelfAttention(16, 2, window=2).eval()
    x = torch.randn(5, 2, 16)
    positions = torch.tensor([[0, 2, 4, 6, 8], [0, 1, 2, 3, 4]])
    got = attn(x, positions, causal=causal)
    ref = _reference_rpr_attention(attn, x, positions, causal)
    assert torch.allclose(got, ref, atol=1e-5)


def test_relative_attention_uses_original_positions():
    torch.manual_seed(0)
    attn = RelativeSelfAttention(16, 2, window=4).eval()
    x = torch.randn(3, 1, 16)
    skip = attn(x, torch.tensor([[0, 2, 4]]))
    dense = attn(x, torch.tensor([[0, 1, 2]]))
    assert not torch.allclose(skip, dense, atol=1e-4)  # distances 2 apart differ from 1 apart
    # only distances matter: shifting every position changes nothing
    shifted = attn(x, torch.tensor([[7, 9, 11]]))
    assert torch.allclose(skip, shifted, atol=1e-6)
    # distances beyond the window are clipped: 10 apart and 50 apart look the same (w = 4)
    far = attn(x, torch.tensor([[0, 10, 20]]))
    farther = attn(x, torch.tensor([[0, 50, 100]]))
    assert torch.allclose(far, farther, atol=1e-6)
    assert not torch.allclose(far, skip, atol=1e-4)


def test_relative_attention_window0_is_fairseq_attention():
    torch.manual_seed(0)
    rel = RelativeSelfAttention(16, 2, window=0).eval()
    assert rel.relative_keys is None
    plain = MultiheadAttention(16, 2, self_attention=True).eval()
    plain.load_state_dict(rel.state_dict(), strict=True)
    x = torch.randn(4, 2, 16)
    skip = rel(x, torch.tensor([[0, 2, 4, 6], [0, 2, 4, 6]]))
    dense = rel(x, torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]))
    assert torch.allclose(skip, dense, atol=1e-6)  # no position information at all
    future = torch.triu(torch.full((4, 4), float("-inf")), 1)
    ref, _ = plain(x, x, x, attn_mask=future, need_weights=False)
    assert torch.allclose(dense, ref, atol=1e-5)
    bidir = rel(x, torch.tensor([[1, 2, 3, 4]] * 2), causal=False)
    ref, _ = plain(x, x, x, need_weights=False)
    assert torch.allclose(bidir, ref, atol=1e-5)


def test_decoder_rpr_sees_original_positions(hrt2):
    """Skip-AT inputs at 0,2,4 differ from the same tokens at 0,1,2 only through positions;
    with explicit positions the decoder's default (from <s2>) is 0,2,4."""
    task, model = hrt2
    _, _, enc = encode(task, model, [[1, 2, 3, 4]])
    s2 = task.target_dictionary.index("<s2>")
    tokens = torch.tensor([[s2] + words(task, 5, 6)])
    default = lprobs(model, tokens, enc)
    explicit = lprobs(model, tokens, enc, positions=torch.tensor([[0, 2, 4]]))
    dense = lprobs(model, tokens, enc, positions=torch.tensor([[0, 1, 2]]))
    assert torch.allclose(default, explicit, atol=1e-6)
    assert not torch.allclose(default, dense, atol=1e-4)


def test_default_positions_follow_the_start_symbol(hrt1):
    task, model = hrt1
    d = task.target_dictionary
    dec = model.decoder
    rest = words(task, 1, 2, 3)
    assert dec.default_positions(torch.tensor([[d.eos()] + rest]), causal=True).tolist() == [[0, 1, 2, 3]]
    for k in range(2, MAX_CHUNK_SIZE + 1):
        tokens = torch.tensor([[d.index(chunk_start_symbol(k))] + rest])
        assert dec.default_positions(tokens, causal=True).tolist() == [[0, k, 2 * k, 3 * k]]
        assert dec.default_positions(tokens, causal=False).tolist() == [[1, 2, 3, 4]]
    mixed = torch.tensor([[d.eos()] + rest, [d.index("<s3>")] + rest])
    assert dec.default_positions(mixed, causal=True).tolist() == [[0, 1, 2, 3], [0, 3, 6, 9]]


# ---------------------------------------------------------------------- causal vs non-causal


def test_modes_share_every_parameter(hrt1):
    task, model = hrt1
    _, _, enc = encode(task, model, [[1, 2, 3]])
    tokens = torch.tensor([[task.target_dictionary.eos()] + words(task, 4, 5, 6)])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = [n for n, _ in model.named_parameters()]
    causal = lprobs(model, tokens, enc, causal=True, positions=torch.tensor([[1, 2, 3, 4]]))
    bidir = lprobs(model, tokens, enc, causal=False, positions=torch.tensor([[1, 2, 3, 4]]))
    # one decoder, no mode-specific module or parameter
    assert isinstance(model.decoder, HRTDecoder)
    assert [n for n, _ in model.named_parameters()] == names
    assert not any("cmlm" in n or "nat" in n or "bidir" in n for n in names)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    # with a single decoder layer, the last query sees every key in both modes: only the
    # mask differs, so the last position agrees and the others do not
    assert len(model.decoder.layers) == 1
    assert torch.allclose(causal[:, -1], bidir[:, -1], atol=1e-5)
    assert not torch.allclose(causal[:, :-1], bidir[:, :-1], atol=1e-4)


@pytest.mark.parametrize("fixture", ["hrt1", "hrt2"])
def test_causal_ignores_future_non_causal_does_not(fixture, request):
    task, model = request.getfixturevalue(fixture)
    _, _, enc = encode(task, model, [[1, 2, 3]])
    eos = task.target_dictionary.eos()
    a = torch.tensor([[eos] + words(task, 4, 5, 6, 7)])
    b = a.clone()
    b[0, 3] = words(task, 9)[0]  # change the token at position 3 only
    ca, cb = lprobs(model, a, enc), lprobs(model, b, enc)
    assert torch.allclose(ca[:, :3], cb[:, :3], atol=1e-6)  # past of position 3 unchanged
    assert not torch.allclose(ca[:, 3:], cb[:, 3:], atol=1e-4)
    na, nb = lprobs(model, a, enc, causal=False), lprobs(model, b, enc, causal=False)
    assert not torch.allclose(na[:, :3], nb[:, :3], atol=1e-4)  # everything sees position 3


def test_non_causal_right_padding_does_not_leak(hrt2):
    task, model = hrt2
    d = task.target_dictionary
    _, _, enc = encode(task, model, [[1, 2, 3], [1, 2, 3]])
    mask = d.index(MASK_SYMBOL)
    row = [mask, words(task, 4)[0], mask, d.eos()]
    padded = torch.tensor([row + [d.pad(), d.pad()], row + [mask, mask]])
    out = lprobs(model, padded, enc, causal=False)
    _, _, enc1 = encode(task, model, [[1, 2, 3]])
    alone = lprobs(model, torch.tensor([row]), enc1, causal=False)
    assert torch.allclose(out[0, :4], alone[0], atol=1e-5)


# ------------------------------------------------------------------------ parameter count


def _n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("layers,window", [(1, 16), (2, 3), (3, 16), (2, 0)])
def test_parameter_count_is_transformer_plus_relative_keys(data_dir, layers, window):
    extra = ("--decoder-layers", str(layers), "--decoder-rpr-window", str(window))
    _, hrt = build(data_dir, "hrt_tiny", *extra)
    _, at = build(data_dir, "at_tiny", "--decoder-layers", str(layers))
    assert type(at).__name__ == "TransformerModel"
    head_dim = 32 // 2
    relative = layers * (2 * window + 1) * head_dim if window > 0 else 0  # w = 0: RPR off
    assert _n_params(hrt) == _n_params(at) + relative
    # the same tensors under the same names, plus the relative keys only
    hrt_names = {n: p.shape for n, p in hrt.named_parameters()}
    at_names = {n: p.shape for n, p in at.named_parameters()}
    new = set(hrt_names) - set(at_names)
    assert set(at_names) <= set(hrt_names)
    assert all(at_names[n] == hrt_names[n] for n in at_names)
    if window:
        assert new == {f"decoder.layers.{i}.self_attn.relative_keys.weight" for i in range(layers)}
    else:
        assert not new


# ------------------------------------------------------------------- incremental decoding


def _step_by_step(model, tokens, enc, reorder_at=None, new_order=None):
    """Feed growing prefixes with an incremental state, as fairseq's SequenceGenerator does;
    optionally reorder the state (beam reordering) after ``reorder_at`` steps."""
    state = {}
    outs = []
    for t in range(1, tokens.size(1) + 1):
        if reorder_at is not None and t == reorder_at + 1:
            model.decoder.reorder_incremental_state_scripting(state, new_order)
            enc = model.encoder.reorder_encoder_out(enc, new_order)
            outs = [o.index_select(0, new_order) for o in outs]
            tokens = torch.cat([tokens[:, :reorder_at].index_select(0, new_order), tokens[:, reorder_at:]], 1)
        out = lprobs(model, tokens[:, :t], enc, incremental_state=state)
        assert out.size(1) == 1
        outs.append(out[:, 0])
    return torch.stack(outs, dim=1), tokens, enc


@pytest.mark.parametrize("start", ["</s>", "<s2>", "<s3>"])
@pytest.mark.parametrize("fixture", ["hrt1", "hrt2"])
def test_incremental_equals_full_causal_forward(fixture, start, request):
    task, model = request.getfixturevalue(fixture)
    d = task.target_dictionary
    _, _, enc = encode(task, model, [[1, 2, 3, 4], [5, 6], [7, 8, 9]])
    s = d.index(start)
    tokens = torch.tensor(
        [[s] + words(task, 1, 2, 3, 4, 5, 6), [s] + words(task, 6, 5, 4, 3, 2, 1), [s] + words(task, 9, 9, 8, 8, 7, 7)]
    )
    full = lprobs(model, tokens, enc)
    step, _, _ = _step_by_step(model, tokens, enc)
    assert torch.allclose(step, full, atol=1e-5)
    if start != "</s>":
        k = int(start[2])
        explicit = lprobs(model, tokens, enc, positions=torch.arange(7).mul(k).expand(3, 7))
        assert torch.allclose(full, explicit, atol=1e-6)
    else:
        explicit = lprobs(model, tokens, enc, positions=torch.arange(7).expand(3, 7))
        assert torch.allclose(full, explicit, atol=1e-6)


@pytest.mark.parametrize("start", ["</s>", "<s2>"])
def test_incremental_after_beam_reordering(hrt2, start):
    """Two sentences x beam 2, reordered within each sentence as fairseq's beam search does
    (fairseq's encoder-attention cache is deliberately not reordered: it is the same for all
    beams of a sentence)."""
    task, model = hrt2
    d = task.target_dictionary
    src, lengths, enc = encode(task, model, [[1, 2, 3, 4], [1, 2, 3, 4], [7, 8, 9], [7, 8, 9]])
    s = d.index(start)
    tokens = torch.tensor(
        [
            [s] + words(task, 1, 2, 3, 4, 5, 6),
            [s] + words(task, 6, 5, 4, 3, 2, 1),
            [s] + words(task, 9, 9, 8, 8, 7, 7),
            [s] + words(task, 3, 1, 4, 1, 5, 9),
        ]
    )
    new_order = torch.tensor([1, 1, 3, 2])  # beams swapped / duplicated within a sentence
    step, final_tokens, _ = _step_by_step(model, tokens, enc, reorder_at=3, new_order=new_order)
    # the reference: one full causal pass over the final (reordered) hypotheses
    enc_ref = model.encoder(src.index_select(0, new_order), src_lengths=lengths.index_select(0, new_order))
    full = lprobs(model, final_tokens, enc_ref)
    assert torch.allclose(step, full, atol=1e-5)
    # rows 0 and 1 continue the same (duplicated) prefix: same scores up to the reorder
    assert torch.equal(final_tokens[0, :3], final_tokens[1, :3])
    assert torch.allclose(step[0, :3], step[1, :3], atol=1e-6)
    assert not torch.allclose(step[0, 3:], step[1, 3:], atol=1e-4)


def test_incremental_is_causal_only(hrt1):
    task, model = hrt1
    _, _, enc = encode(task, model, [[1, 2]])
    with pytest.raises(ValueError, match="causal"):
        model.decoder(
            torch.tensor([[task.target_dictionary.eos()]]), encoder_out=enc, incremental_state={}, causal=False
        )


# ---------------------------------------------------------------------------- dictionaries


def test_task_dictionaries_have_hrt_symbols(hrt1, data_dir):
    task, _ = hrt1
    src, tgt = task.source_dictionary, task.target_dictionary
    base = Dictionary.load(str(Path(data_dir) / "dict.de.txt"))
    assert len(src) == len(tgt) == len(base) + len(HRT_SYMBOLS)
    for offset, sym in enumerate(HRT_SYMBOLS):
        assert sym in src.indices and sym in tgt.indices
        assert src.index(sym) == tgt.index(sym) == len(base) + offset  # appended in a fixed order
        assert src.index(sym) != src.unk()
    assert task.mask_idx == tgt.index("<mask>")
    assert task.chunk_start_idx == {k: tgt.index(f"<s{k}>") for k in range(2, 9)}
    # adding them again is idempotent
    before = list(tgt.symbols)
    add_hrt_symbols(tgt)
    add_hrt_symbols(tgt)
    assert list(tgt.symbols) == before
    # and so is loading the same dict.txt again (training and inference agree)
    again = type(task).load_dictionary(str(Path(data_dir) / "dict.en.txt"))
    assert list(again.symbols) == list(src.symbols)


def test_dictionary_that_already_has_the_symbols(tmp_path):
    d = Dictionary()
    for i in range(5):
        d.add_symbol(f"w{i}")
    d.add_symbol("<s3>")
    d.add_symbol("<mask>")
    d.save(str(tmp_path / "dict.de.txt"))
    loaded = tasks.get_task("hrt_translation").load_dictionary(str(tmp_path / "dict.de.txt"))
    assert all(sym in loaded.indices for sym in HRT_SYMBOLS)
    assert len(loaded) == len(Dictionary.load(str(tmp_path / "dict.de.txt"))) + len(HRT_SYMBOLS) - 2


# ----------------------------------------------------------------- AT checkpoint loading


def _copy_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_load_at_state_dict(data_dir, caplog):
    _, hrt = build(data_dir, "hrt_tiny", "--decoder-layers", "2", seed=3)
    task, at = build(data_dir, "at_tiny", "--decoder-layers", "2", seed=4)
    hrt_before = _copy_state(hrt)
    at_state = _copy_state(at)
    with caplog.at_level(logging.WARNING):
        hrt.load_state_dict(dict(at_state), strict=True)
    rel = {f"decoder.layers.{i}.self_attn.relative_keys.weight" for i in range(2)}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "relative" in r.getMessage()]
    assert warnings, caplog.text
    for key in rel:
        assert key in warnings[0].getMessage()
    after = hrt.state_dict()
    assert set(after) - set(at_state) == rel | {"trained_chunk_sizes"}
    for key, value in at_state.items():
        assert torch.equal(after[key], value), key
    for key in rel:  # the only new weights start at zero (fresh ones are random)
        assert not torch.equal(hrt_before[key], torch.zeros_like(hrt_before[key]))
        assert torch.equal(after[key], torch.zeros_like(after[key]))
    _, _, enc_h = encode(task, hrt, [[1, 2, 3]])
    _, _, enc_a = encode(task, at, [[1, 2, 3]])
    for a, b in zip(enc_h["encoder_out"], enc_a["encoder_out"]):
        assert torch.allclose(a, b, atol=1e-6)  # identical encoders


def test_hrt_loaded_from_at_starts_as_the_at_model(data_dir):
    """Fine-tuning from AT starts from the AT model: with the default relative-position
    window (w = 16), the HRT model loaded from an AT checkpoint gives the AT model's
    decoder outputs (teacher-forced, ragged batch) and its greedy translations."""
    _, hrt = build(data_dir, "hrt_tiny", "--decoder-layers", "2", seed=11)
    task, at = build(data_dir, "at_tiny", "--decoder-layers", "2", seed=12)
    hrt.load_state_dict(_copy_state(at), strict=True)
    src, lengths, _ = encode(task, at, [[1, 2, 3, 4, 7, 8], [5, 6], [9, 3, 1]])
    d = task.target_dictionary
    rows = [words(task, 1, 2, 3, 4, 5), words(task, 4, 5), words(task, 6, 7, 8)]
    width = 1 + max(len(r) for r in rows)
    prev = torch.full((len(rows), width), d.pad(), dtype=torch.long)
    for i, r in enumerate(rows):
        prev[i, : 1 + len(r)] = torch.tensor([d.eos()] + r)
    ours, _ = hrt(src, lengths, prev)
    theirs, _ = at(src, lengths, prev)
    real = prev.ne(d.pad())
    assert torch.allclose(ours[real], theirs[real], atol=1e-5)

    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    hyps = [SequenceGenerator([m], d, beam_size=1, max_len_b=12).generate([m], sample) for m in (hrt, at)]
    for h, a in zip(*hyps):
        assert torch.equal(h[0]["tokens"], a[0]["tokens"])


def test_hrt_without_rpr_loaded_from_at_equals_at(data_dir):
    """w = 0: after loading, HRT in AT mode computes exactly fairseq's transformer."""
    _, hrt = build(data_dir, "hrt_tiny", "--decoder-layers", "2", "--decoder-rpr-window", "0", seed=5)
    task, at = build(data_dir, "at_tiny", "--decoder-layers", "2", seed=6)
    hrt.load_state_dict(_copy_state(at), strict=True)
    src, lengths, _ = encode(task, at, [[1, 2, 3, 4], [5, 6]])
    d = task.target_dictionary
    prev = torch.tensor([[d.eos()] + words(task, 1, 2, 3), [d.eos()] + words(task, 4, 5, 6)])
    ours, _ = hrt(src, lengths, prev)
    theirs, _ = at(src, lengths, prev)
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_load_hrt_state_dict_roundtrip(hrt2, data_dir):
    _, model = hrt2
    _, fresh = build(data_dir, "hrt_tiny", "--decoder-layers", "2", "--decoder-rpr-window", "3", seed=9)
    fresh.load_state_dict(_copy_state(model), strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_partial_hrt_state_dict_fails_strict_loading(data_dir):
    _, hrt = build(data_dir, "hrt_tiny", "--decoder-layers", "2", seed=7)
    state = _copy_state(hrt)
    del state["decoder.layers.1.self_attn.relative_keys.weight"]
    with pytest.raises(RuntimeError, match="relative_keys"):
        hrt.load_state_dict(state, strict=True)


def test_state_dict_with_another_dictionary_raises(data_dir, other_data_dir):
    _, hrt = build(data_dir, "hrt_tiny", "--decoder-layers", "2")
    _, at_big = build(other_data_dir, "at_tiny", "--decoder-layers", "2")
    # what fairseq-train --finetune-from-model / --restore-file and fairseq-generate print
    other_size = at_big.encoder.embed_tokens.weight.size(0)
    own_size = hrt.encoder.embed_tokens.weight.size(0)
    with pytest.raises(
        ValueError,
        match=rf"another dictionary: its encoder.embed_tokens.weight has {other_size} "
        rf"entries, the task's dictionary has {own_size}",
    ):
        hrt.load_state_dict(_copy_state(at_big), strict=True)


# (arch, encoder layers, decoder layers) of the named Transformer-base shapes (SPEC section 5)
NAMED_SHAPES = [
    ("at_e6d1", 6, 1),
    ("at_e12d1", 12, 1),
    ("at_e20d1", 20, 1),
    ("hrt_e6d1", 6, 1),
    ("hrt_e12d1", 12, 1),
    ("hrt_e20d1", 20, 1),
    ("hrt_base", 6, 6),
    ("cmlm_base", 6, 6),
]


@pytest.mark.parametrize("arch,enc,dec", NAMED_SHAPES)
def test_named_archs_have_the_stated_shape_and_pre_norm(data_dir, arch, enc, dec):
    """d = 512, FFN 2048, 8 heads, pre-norm on both sides, the stated layer counts; a flag
    given on the command line still wins over the arch default."""
    args = _args(data_dir, arch)
    assert (args.encoder_layers, args.decoder_layers) == (enc, dec)
    for side in ("encoder", "decoder"):
        assert getattr(args, f"{side}_embed_dim") == 512
        assert getattr(args, f"{side}_ffn_embed_dim") == 2048
        assert getattr(args, f"{side}_attention_heads") == 8
        assert getattr(args, f"{side}_normalize_before") is True
    assert _args(data_dir, arch, "--encoder-layers", "3").encoder_layers == 3


def test_small_shapes_match_across_families(data_dir):
    """at_small / hrt_small / cmlm_small (and the tiny ones) share one shape, so an AT
    checkpoint of a size initialises the HRT and Mask-Predict models of that size."""
    keys = [
        f"{side}_{opt}"
        for side in ("encoder", "decoder")
        for opt in ("embed_dim", "ffn_embed_dim", "attention_heads", "layers")
    ]
    for size in ("small", "mini", "tiny"):
        shapes = {
            fam: tuple(getattr(_args(data_dir, f"{fam}_{size}"), k) for k in keys) for fam in ("at", "hrt", "cmlm")
        }
        assert len(set(shapes.values())) == 1, shapes


# ------------------------------------------------------- fairseq's model building, HRT decoder


def test_unsupported_transformer_options_are_refused_together(data_dir):
    with pytest.raises(ValueError) as err:
        build(data_dir, "hrt_tiny", "--cross-self-attention", "--adaptive-softmax-cutoff", "5,10")
    assert "--cross-self-attention" in str(err.value) and "--adaptive-softmax-cutoff" in str(err.value)
    with pytest.raises(ValueError, match="--scale-attn, --scale-fc"):
        refuse_unsupported_options(Namespace(scale_attn=True, scale_fc=True, scale_heads=False))
    refuse_unsupported_options(Namespace(cross_self_attention=False, adaptive_softmax_cutoff=None))


@pytest.mark.parametrize("arch", ["hrt_tiny", "cmlm_tiny"])
def test_fairseq_options_of_model_building_apply_to_hrt(data_dir, arch):
    """The model is built by fairseq's TransformerModel with only the decoder overridden, so
    fairseq's options work: --checkpoint-activations wraps the HRT decoder layers (same
    outputs and gradients, recomputed in the backward pass) and shared embeddings stay one
    tensor."""
    outputs = {}
    for extra in ((), ("--checkpoint-activations",)):
        task, model = build(data_dir, arch, "--share-all-embeddings", "--dropout", "0", *extra, seed=3)
        assert model.encoder.embed_tokens.weight is model.decoder.embed_tokens.weight
        assert model.decoder.output_projection.weight is model.decoder.embed_tokens.weight
        wrapped = [getattr(layer, "precheckpoint_forward", None) is not None for layer in model.decoder.layers]
        assert wrapped == [bool(extra)] * len(model.decoder.layers)
        model.train()
        src = torch.randint(4, 20, (3, 5))
        prev = torch.randint(4, 20, (3, 4))
        out = model(src, torch.full((3,), 5), prev, causal=False)[0]
        out.float().pow(2).mean().backward()
        outputs[extra] = (out.detach(), model.decoder.layers[0].fc1.weight.grad.clone())
    (a, ga), (b, gb) = outputs.values()
    assert torch.allclose(a, b, atol=1e-6) and torch.allclose(ga, gb, atol=1e-6)
