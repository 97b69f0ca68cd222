"""End-to-end training tests: tiny ``fairseq-train`` runs of the HRT plugin on CPU.

Every run is a real ``python -m fairseq_cli.train`` subprocess (helpers in tests/tiny_data.py)
on 300 Multi30k pairs (or a synthetic corpus when ../shared is absent; force it with
``HRT_TEST_DATA=synthetic``). Independent runs go two at a time (2 cores, one thread each).
Metrics are read from ``--log-format json`` lines.

Covered: per-kind losses fall; the curriculum p_k schedule and its continuation on resume;
MixDistill with p_raw = 1 / 0 (Python level and through fairseq-train); clear errors for bad
input; fine-tuning HRT from an AT checkpoint; fp16 refused on CPU; AMP / bfloat16 autocast /
--update-freq on CPU; a 2-rank gloo run whose ranks end with identical parameters.
"""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from fairseq import checkpoint_utils, options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.logging import metrics
from fairseq.tasks import FairseqTask
from fairseq.trainer import Trainer

from fairseq_hrt import chunking
from fairseq_hrt.cli_logging import RefusedOptions
from fairseq_hrt.criterions.hrt_loss import HRTLossCriterion, label_smoothed_token_loss, parse_kind_weights
from fairseq_hrt.passes.decoder_pass import decoder_pass
from fairseq_hrt.tasks.hrt_translation import HRTTranslationTask, parse_chunk_sizes
from fairseq_hrt.testing.tiny_runs import (
    SRC,
    TGT,
    USER_DIR,
    eval_bleu_finetune_args,
    make_tiny_data,
    parse_logs,
    preprocess_args,
    read_lines,
    run_cli,
    run_cli_many,
    start_cli,
    train_args,
    wait_cli,
    write_lines,
    write_raw_corpus,
)
from tests.tiny_data import free_port

KINDS = ("at", "cmlm", "skip_at", "skip_cmlm")
N_TRAIN = 300
N_SHORT = N_TRAIN - 10  # line count of the misaligned "distilled" set


def _load(path):
    # fairseq checkpoints pickle argparse/omegaconf objects: not weights-only
    return torch.load(path, map_location="cpu", weights_only=True)


def _by_update(records):
    return {int(r["num_updates"]): r for r in records}


def _error_lines(output, *words):
    """Output lines that contain every word (case-insensitive)."""
    return [line for line in output.splitlines() if all(w.lower() in line.lower() for w in words)]


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hrt_training")


@pytest.fixture(scope="module")
def data(work):
    return make_tiny_data(work / "main", n_train=N_TRAIN, n_valid=50)


@pytest.fixture(scope="module")
def aux(work, data):
    """Three extra binarized sets, built in parallel:

    * ``distill``: the same sources, targets = the raw German with the word order reversed
      (a stand-in for teacher output that differs from the reference), binarized with the
      raw data's dictionary into its own directory;
    * ``short``: a "distilled" set with N_SHORT lines (misaligned with the raw set);
    * ``other``: an unrelated synthetic corpus with its own (smaller) dictionary.
    """
    raw_de = read_lines(data.raw("train", TGT))
    raw_en = read_lines(data.raw("train", SRC))
    reversed_de = [" ".join(reversed(line.split())) for line in raw_de]
    assert sum(a != b for a, b in zip(raw_de, reversed_de)) > N_TRAIN // 2
    write_lines(work / "distill_raw" / f"train.{SRC}", raw_en)
    write_lines(work / "distill_raw" / f"train.{TGT}", reversed_de)
    write_lines(work / "short_raw" / f"train.{SRC}", raw_en[:N_SHORT])
    write_lines(work / "short_raw" / f"train.{TGT}", reversed_de[:N_SHORT])
    other = write_raw_corpus(work / "other_raw", n_train=40, n_valid=8, prefer="synthetic", seed=7, vocab=10)
    dirs = {"distill": work / "distill_bin", "short": work / "short_bin", "other": work / "other_bin"}
    run_cli_many(
        [
            preprocess_args(dirs["distill"], work / "distill_raw" / "train", srcdict=data.dict_path),
            preprocess_args(dirs["short"], work / "short_raw" / "train", srcdict=data.dict_path),
            preprocess_args(dirs["other"], other["train"], other["valid"]),
        ],
        log_dir=work / "logs_aux",
    )
    assert len(read_lines(dirs["other"] / "dict.en.txt")) != len(read_lines(data.dict_path))
    return dirs


# ------------------------------------------------------------------- losses per kind


def test_every_kind_loss_decreases(data, work):
    """40 updates at lr 3e-3; T = 80 so that p_k runs 0 -> ~0.5 and every log window has
    plain (AT, CMLM) and chunked (Skip-AT, Skip-CMLM) pairs."""
    out = run_cli(
        train_args(data.bin_dir, work / "ck_loss", "--curriculum-updates", 80, max_update=40, log_interval=5)
    ).stdout
    records = parse_logs(out)
    assert len(records) == 8, out[-3000:]
    first, last = records[0], records[-1]
    for kind in KINDS:
        for rec in (first, last):
            assert rec.get(f"{kind}_ntokens", 0) > 0, (kind, rec)
        assert math.isfinite(first[f"{kind}_loss"]) and math.isfinite(last[f"{kind}_loss"])
        assert last[f"{kind}_loss"] < first[f"{kind}_loss"], (kind, first, last)
    assert last["loss"] < first["loss"] - 0.5
    assert 0.4 <= last["p_k"] <= 0.5, last  # mean over updates 36..40 of T = 80


# ------------------------------------------------------------------------ curriculum

T_CURRICULUM = 20


@pytest.fixture(scope="module")
def curriculum_runs(data, work):
    """An uninterrupted run of T = 20 updates, and the same run split in two: --max-update 10
    with --curriculum-updates 20, then resumed (checkpoint_last.pt) with --max-update 20."""
    full_args = train_args(data.bin_dir, work / "ck_full", max_update=T_CURRICULUM, log_interval=1)
    part1_args = train_args(
        data.bin_dir, work / "ck_resume", "--curriculum-updates", T_CURRICULUM, max_update=10, log_interval=1
    )
    (_, full), (_, part1) = run_cli_many([full_args, part1_args], log_dir=work / "logs_curriculum")
    part2 = run_cli(train_args(data.bin_dir, work / "ck_resume", max_update=T_CURRICULUM, log_interval=1)).stdout
    return {"full": full, "part1": part1, "part2": part2}


@pytest.mark.slow
def test_curriculum_p_k_schedule(curriculum_runs):
    """p_k grows linearly (lambda = 1) by 1/T per update: ~0 at the start, ~0.5 at T/2."""
    recs = _by_update(parse_logs(curriculum_runs["full"]))
    assert sorted(recs) == list(range(1, T_CURRICULUM + 1))
    p = {u: recs[u]["p_k"] for u in recs}
    step = 1.0 / T_CURRICULUM
    assert p[1] <= step + 1e-3
    assert abs(p[T_CURRICULUM // 2] - 0.5) <= step + 1e-3
    for u in range(2, T_CURRICULUM + 1):
        assert p[u] - p[u - 1] == pytest.approx(step, abs=2e-3), (u, p)
    # the kinds follow p_k: no chunked tokens at p_k = 0, mostly chunked at the end
    if p[1] == 0:
        assert recs[1].get("skip_at_ntokens", 0) == 0
    assert recs[T_CURRICULUM]["skip_at_ntokens"] > recs[T_CURRICULUM].get("at_ntokens", 0)


@pytest.mark.slow
def test_curriculum_reaches_one_at_last_update(curriculum_runs):
    """SPEC section 2 / HRT Algorithm 1: ``for t in 1..T: p_k = (t / T) ** lambda``, so the
    update logged as num_updates = t uses p_k = t / T, and the last one p_k = 1 (all pairs
    chunked)."""
    recs = _by_update(parse_logs(curriculum_runs["full"]))
    got = {u: recs[u]["p_k"] for u in recs}
    expected = {u: u / T_CURRICULUM for u in recs}
    assert got[T_CURRICULUM] == pytest.approx(1.0, abs=1e-3), (
        f"p_k at the last update {T_CURRICULUM} of T = {T_CURRICULUM} is {got[T_CURRICULUM]}, "
        f"expected 1 (Algorithm 1 counts t = 1..T); all logged p_k: {got}"
    )
    assert got == pytest.approx(expected, abs=1e-3)


@pytest.mark.slow
def test_resume_continues_curriculum(curriculum_runs):
    part1 = _by_update(parse_logs(curriculum_runs["part1"]))
    part2 = _by_update(parse_logs(curriculum_runs["part2"]))
    full = _by_update(parse_logs(curriculum_runs["full"]))
    assert sorted(part1) == list(range(1, 11))
    assert _error_lines(curriculum_runs["part2"], "Loaded checkpoint", "@ 10 updates"), curriculum_runs["part2"][-3000:]
    assert sorted(part2) == list(range(11, T_CURRICULUM + 1))
    # the curriculum continues from update 11 of 20 instead of restarting at 0 ...
    first = part2[11]["p_k"]
    assert abs(first - 11 / T_CURRICULUM) <= 1 / T_CURRICULUM + 1e-3, first  # not ~0
    # ... and is exactly the uninterrupted run's schedule, before and after the restart
    for u in range(1, T_CURRICULUM + 1):
        rec = part1.get(u) or part2[u]
        assert rec["p_k"] == pytest.approx(full[u]["p_k"], abs=1e-6), u
    # Losses: identical up to the checkpoint. After it they are close but not bit-identical:
    # fairseq itself does not resume bit-exactly when dropout (or any torch RNG use, here
    # the CMLM masks) is on -- stock `--task translation --arch transformer` shows the same
    # drift -- while a run without any randomness (--hrt-mode at --dropout 0) resumes exactly.
    for u in range(1, 11):
        assert part1[u]["loss"] == pytest.approx(full[u]["loss"], abs=1e-6), u
    for u in range(11, T_CURRICULUM + 1):
        assert part2[u]["loss"] == pytest.approx(full[u]["loss"], abs=0.1), u


# ------------------------------------------------------------------------ MixDistill


def _setup(data_dir, *extra):
    """The task (training set loaded) and config of a training command line."""
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser,
        [
            str(data_dir),
            "--user-dir",
            USER_DIR,
            "--task",
            "hrt_translation",
            "--arch",
            "hrt_tiny",
            "--criterion",
            "hrt_loss",
            "--max-update",
            "10",
            *[str(e) for e in extra],
        ],
    )
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    return task, cfg


def _setup_task(data_dir, *extra):
    return _setup(data_dir, *extra)[0]


def _strip(row, pad):
    return [t for t in row.tolist() if t != pad]


def test_task_chunks_random_rows_of_a_length_sorted_batch(data):
    """The task draws the chunked pairs at random: in a batch sorted by length the chunked
    rows are not always the first (longest) ones, and the Skip-AT rows hold exactly the
    chosen pairs' targets."""
    task = _setup_task(data.bin_dir)
    ds = task.dataset("train")
    pad = task.target_dictionary.pad()
    order = sorted(range(32), key=lambda i: -ds.tgt_sizes[i])
    batch = ds.collater([ds[i] for i in order])
    chosen = set()
    for seed in range(10):
        torch.manual_seed(seed)
        sample = task.build_decoder_samples(dict(batch), p_k=0.25)
        n_chunked = sample["hrt"]["n_chunked"]
        assert n_chunked == 8
        rows = sample["hrt"]["ar_rows"][:n_chunked].tolist()
        chosen.add(tuple(rows))
        # Skip-AT targets are every 2nd token of the chosen rows' targets
        for skip_target, i in zip(sample["hrt"]["ar"].target[:n_chunked], rows):
            tgt = _strip(batch["target"][i], pad)
            padded = tgt + [tgt[-1]] * (len(tgt) % 2)  # extra </s> up to a multiple of k
            assert _strip(skip_target, pad) == padded[1::2]
    assert len(chosen) > 1


def test_chunked_rows_depend_on_seed_update_and_batch_only(data):
    """Training's draw: the same batch at the same update gets the same chunked pairs
    whatever the global RNG did before (dropout, other micro-batches, other ranks); another
    update draws anew."""
    task = _setup_task(data.bin_dir)
    ds = task.dataset("train")
    batch = ds.collater([ds[i] for i in range(32)])

    def rows(update, global_seed):
        torch.manual_seed(global_seed)
        gen = task.chunked_rows_generator(batch, update)
        sample = task.build_decoder_samples(dict(batch), p_k=0.5, rows_generator=gen)
        return sample["hrt"]["ar_rows"][: sample["hrt"]["n_chunked"]].tolist()

    assert rows(7, 0) == rows(7, 123)
    assert len({tuple(rows(u, 0)) for u in range(5)}) > 1


def test_mixdistill_targets_python_level(data, aux):
    """build_decoder_samples on a collated training batch: p_raw = 1 gives exactly the raw
    targets, p_raw = 0 exactly the distilled ones (aligned by sentence id), 0.5 a mix."""
    batches = {}
    for p_raw in (1.0, 0.0, 0.5):
        task = _setup_task(data.bin_dir, "--distill-data", aux["distill"], "--p-raw", p_raw)
        ds = task.dataset("train")
        pad, eos = task.target_dictionary.pad(), task.target_dictionary.eos()
        batch = ds.collater([ds[i] for i in range(0, 64, 2)])
        assert "distilled_target" in batch
        raw_rows = [_strip(r, pad) for r in batch["target"]]
        dist_rows = [_strip(r, pad) for r in batch["distilled_target"]]
        # the distilled copy is aligned by id: reversed raw words, same </s>
        for i, (r, d) in zip(batch["id"].tolist(), zip(raw_rows, dist_rows)):
            assert d[:-1] == r[:-1][::-1] and d[-1] == r[-1] == eos, i
        assert sum(r != d for r, d in zip(raw_rows, dist_rows)) > len(raw_rows) // 2
        sample = task.build_decoder_samples(dict(batch), p_k=0.5, generator=torch.Generator().manual_seed(0))
        got = [_strip(r, pad) for r in sample["target"]]
        batches[p_raw] = (got, raw_rows, dist_rows)
        # the decoder samples are built from the chosen targets
        n_chunked = sample["hrt"]["n_chunked"]
        at_target = sample["hrt"]["ar"].target[n_chunked:]
        plain_rows = sample["hrt"]["ar_rows"][n_chunked:].tolist()
        for row, i in zip(at_target, plain_rows):
            assert _strip(row, pad) == got[i]

    got, raw_rows, dist_rows = batches[1.0]
    assert got == raw_rows
    got, raw_rows, dist_rows = batches[0.0]
    assert got == dist_rows
    got, raw_rows, dist_rows = batches[0.5]
    from_raw = [g == r for g, r in zip(got, raw_rows)]
    from_dist = [g == d for g, d in zip(got, dist_rows)]
    assert all(a or b for a, b in zip(from_raw, from_dist))
    assert any(a and not b for a, b in zip(from_raw, from_dist))
    assert any(b and not a for a, b in zip(from_raw, from_dist))


@pytest.mark.slow
def test_mixdistill_p_raw_extremes_in_fairseq_train(data, aux, work):
    """Through fairseq-train: with --hrt-mode at and --dropout 0 the only randomness is
    MixDistill's draw, so p_raw = 1 must reproduce the run without --distill-data exactly,
    and p_raw = 0 (distilled targets) must not."""
    common = ("--hrt-mode", "at", "--dropout", 0)
    results = run_cli_many(
        [
            train_args(data.bin_dir, work / "ck_mix_none", *common, max_update=4),
            train_args(
                data.bin_dir, work / "ck_mix_raw", *common, "--distill-data", aux["distill"], "--p-raw", 1, max_update=4
            ),
            train_args(
                data.bin_dir,
                work / "ck_mix_dist",
                *common,
                "--distill-data",
                aux["distill"],
                "--p-raw",
                0,
                max_update=4,
            ),
        ],
        log_dir=work / "logs_mix",
    )
    none, raw, dist = ([r["loss"] for r in parse_logs(out)] for _, out in results)
    assert len(none) == len(raw) == len(dist) == 4
    assert _error_lines(results[1][1], "MixDistill")
    assert raw == none
    assert dist != none
    assert abs(dist[-1] - none[-1]) > 1e-3


def test_p_raw_chunked_gives_chunked_pairs_their_own_share(data, aux):
    """--p-raw 1 --p-raw-chunked 0: the chunked pairs (Skip-AT / Skip-CMLM samples) get the
    distilled targets, the plain pairs (AT / CMLM) the raw ones."""
    task = _setup_task(data.bin_dir, "--distill-data", aux["distill"], "--p-raw", 1, "--p-raw-chunked", 0)
    ds = task.dataset("train")
    pad = task.target_dictionary.pad()
    batch = ds.collater([ds[i] for i in range(0, 64, 2)])
    raw_rows = [_strip(r, pad) for r in batch["target"]]
    dist_rows = [_strip(r, pad) for r in batch["distilled_target"]]
    sample = task.build_decoder_samples(dict(batch), p_k=0.5, generator=torch.Generator().manual_seed(0))
    hrt = sample["hrt"]
    chunked = set(hrt["ar_rows"][: hrt["n_chunked"]].tolist())
    assert 0 < len(chunked) < len(raw_rows)
    got = [_strip(r, pad) for r in sample["target"]]
    assert [got[i] == (dist_rows[i] if i in chunked else raw_rows[i]) for i in range(len(got))] == [True] * len(got)
    # and the Skip-AT samples are built from them
    for skip_target, i in zip(hrt["ar"].target[: hrt["n_chunked"]], hrt["ar_rows"][: hrt["n_chunked"]].tolist()):
        tgt = dist_rows[i]
        padded = tgt + [tgt[-1]] * (len(tgt) % 2)
        assert _strip(skip_target, pad) == padded[1::2]


@pytest.mark.parametrize("max_sentences", [1, 3, 8, 128])
def test_no_sentence_is_dropped_outside_training(data, max_sentences):
    """fairseq 0.12 drops the last batch when its size is not a multiple of
    --required-batch-size-multiple (8): fairseq-generate --batch-size 1 translated 999 of 1000
    sentences. The task batches every set but the training set with multiple 1; the training
    set keeps fairseq's own batches."""
    task = _setup_task(data.bin_dir)
    task.load_dataset("valid")

    def batches(fn, split):
        itr = fn(
            task,
            task.dataset(split),
            max_sentences=max_sentences,
            required_batch_size_multiple=8,
            disable_iterator_cache=True,
        )
        return [b.tolist() if hasattr(b, "tolist") else list(b) for b in itr.frozen_batches]

    valid = batches(type(task).get_batch_iterator, "valid")
    assert sorted(i for b in valid for i in b) == list(range(len(task.dataset("valid"))))
    assert all(len(b) <= max_sentences for b in valid)
    assert batches(type(task).get_batch_iterator, "train") == batches(FairseqTask.get_batch_iterator, "train")


def _task_model(data_dir, *extra):
    task, cfg = _setup(data_dir, "--dropout", 0, *extra)
    torch.manual_seed(0)
    return task, task.build_model(cfg.model)


def test_skip_at_self_distillation_loss(data):
    """--skip-at-self-distill a: at every Skip-AT target y_ik of a chunked pair, the trained
    loss is (1 - a) x the label-smoothed loss + a x the cross-entropy to the model's own AT-mode
    distribution at AT slot ik - 1, teacher-forced on the full target. Recomputed here row by
    row from the model's two modes; the logged per-kind losses stay the label-smoothed ones;
    validation trains nothing and is unchanged."""
    task, model = _task_model(data.bin_dir)
    ds = task.dataset("train")
    pad, eos = task.target_dictionary.pad(), task.target_dictionary.eos()
    batch = ds.collater([ds[i] for i in range(24)])
    sample = task.build_decoder_samples(dict(batch), p_k=0.5, rows_generator=torch.Generator().manual_seed(3))
    hrt = sample["hrt"]
    n_chunked = hrt["n_chunked"]
    assert n_chunked == 12
    a = 0.3
    plain, distilled = HRTLossCriterion(task, 0.1), HRTLossCriterion(task, 0.1, skip_at_self_distill=a)
    model.train()
    loss0, size0, log0 = plain(model, sample)
    loss_a, size_a, log_a = distilled(model, sample)
    assert size0 == size_a
    assert log_a["skip_at_loss"] == pytest.approx(log0["skip_at_loss"], rel=1e-6)
    assert "skip_at_distill_loss" not in log0 and log_a["skip_at_distill_ntokens"] > 0

    # the expected difference, one chunked row at a time
    encoder_out = model.encoder(sample["net_input"]["src_tokens"], src_lengths=sample["net_input"]["src_lengths"])
    expected, n_valid = 0.0, 0
    with torch.no_grad():
        for j, row in enumerate(hrt["ar_rows"][:n_chunked].tolist()):
            k = int(hrt["chunk_sizes"][j])
            tgt = torch.tensor([_strip(sample["target"][row], pad)])
            enc = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([row]))
            model.decoder.eval()
            at = chunking.at_sample(tgt, pad, eos)
            teacher = F.softmax(model.decoder(at.tokens, encoder_out=enc, positions=at.positions, causal=True)[0], -1)
            model.decoder.train()
            skip = chunking.skip_at_sample(tgt, k, pad, eos, torch.tensor([task.chunk_start_idx[k]]))
            student = F.log_softmax(
                model.decoder(skip.tokens, encoder_out=enc, positions=skip.positions, causal=True)[0], -1
            )
            hard, _ = label_smoothed_token_loss(student, skip.target, 0.1, pad)
            n = tgt.size(1)  # y_1 .. y_N </s>
            for i in range(skip.target.size(1)):
                slot = (i + 1) * k - 1
                if slot >= n:
                    continue  # an extra </s>: no AT prediction
                assert int(at.target[0, slot]) == int(skip.target[0, i])
                soft = -(teacher[0, slot] * student[0, i]).sum()
                expected += a * float(soft - hard[0, i])
                n_valid += 1
    assert log_a["skip_at_distill_ntokens"] == n_valid
    assert float(loss_a - loss0) == pytest.approx(expected, rel=1e-3, abs=1e-3)
    loss_a.backward()  # the teacher pass is outside the graph
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())

    model.eval()
    valid = task.build_decoder_samples(dict(batch), None)
    assert float(distilled(model, valid)[0]) == pytest.approx(float(plain(model, valid)[0]))


def _one_train_step(task, model, sample):
    """``task.train_step`` on ``model``; returns the loss and the dtypes of the outputs of
    the model's linear layers during it."""
    dtypes = set()
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: dtypes.add(out.dtype))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    criterion = HRTLossCriterion(task, 0.1)
    optimizer = SimpleNamespace(backward=lambda loss: loss.backward())
    model.zero_grad()
    try:
        loss, _, _ = task.train_step(sample, model, criterion, optimizer, update_num=0)
    finally:
        for h in hooks:
            h.remove()
    return loss.detach().item(), dtypes


def test_cpu_autocast_bf16_runs_products_in_bfloat16_and_keeps_float32_weights(data):
    """--cpu-autocast-bf16: inside a training step the linear layers compute in bfloat16; the
    weights and their gradients stay float32, and the loss is float32's within bfloat16's
    rounding. Without it everything is float32. A model already in bfloat16 (or on a GPU) is
    refused with one message."""
    ds = None
    losses = {}
    for flags in ((), ("--cpu-autocast-bf16",)):
        task, model = _task_model(data.bin_dir, *flags)
        ds = ds or task.dataset("train")
        sample = ds.collater([ds[i] for i in range(16)])
        model.train()
        torch.manual_seed(1)
        loss, dtypes = _one_train_step(task, model, sample)
        assert dtypes == ({torch.bfloat16} if flags else {torch.float32}), flags
        assert all(p.dtype == torch.float32 for p in model.parameters())
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
        losses[flags] = loss
    plain, bf16 = losses.values()
    assert bf16 != plain and bf16 == pytest.approx(plain, rel=0.02)

    with pytest.raises(RefusedOptions, match="--cpu-autocast-bf16 trains a float32 model on the CPU"):
        _one_train_step(task, model.to(torch.bfloat16), sample)


@pytest.mark.parametrize(
    "mode,arch,kinds",
    [
        ("at", "hrt_tiny", {"at"}),
        ("cmlm", "cmlm_tiny", {"cmlm"}),
        ("hrt", "hrt_tiny", {"at", "cmlm", "skip_at", "skip_cmlm"}),
    ],
)
def test_logged_kinds_are_the_trained_ones(data, mode, arch, kinds):
    """--hrt-mode at / cmlm log their one kind, no Skip-AT/Skip-CMLM zeros; HRT logs all four,
    zeros included (p_k = 0 at the first update: the curve shows the kind fading in)."""
    task, model = _task_model(data.bin_dir, "--hrt-mode", mode, "--arch", arch)
    ds = task.dataset("train")
    sample = task.build_decoder_samples(ds.collater([ds[i] for i in range(8)]), p_k=0.0 if mode == "hrt" else None)
    _, _, log = HRTLossCriterion(task, 0.1)(model, sample)
    assert {key[: -len("_ntokens")] for key in log if key.endswith("_ntokens") and "length" not in key} == kinds
    if mode == "hrt":
        assert log["skip_at_ntokens"] == 0


def test_self_distillation_and_chunked_share_option_checks(data, aux):
    task = _setup_task(data.bin_dir)
    with pytest.raises(ValueError, match="skip-at-self-distill"):
        HRTLossCriterion(task, 0.1, skip_at_self_distill=1.5)
    at_task = _setup_task(data.bin_dir, "--hrt-mode", "at")
    with pytest.raises(ValueError, match="--hrt-mode at"):
        HRTLossCriterion(at_task, 0.1, skip_at_self_distill=0.5)
    with pytest.raises(ValueError, match="needs --distill-data"):
        _setup_task(data.bin_dir, "--p-raw-chunked", 0)
    with pytest.raises(ValueError, match=r"p-raw-chunked must be in \[0, 1\]"):
        _setup_task(data.bin_dir, "--distill-data", aux["distill"], "--p-raw-chunked", 2)


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "text, message",
    [
        ("1", r"--chunk-sizes '1': chunked training needs every k in 2\.\."),
        ("2,0", r"--chunk-sizes '2,0'"),
        ("two", r"--chunk-sizes must be comma-separated integers, got 'two'"),
        ("", r"--chunk-sizes is empty"),
    ],
)
def test_bad_chunk_sizes_are_rejected_by_the_task(data, text, message):
    """What fairseq-train prints for a bad --chunk-sizes: the task refuses it at set-up."""
    with pytest.raises(ValueError, match=message):
        parse_chunk_sizes(text)
    with pytest.raises(ValueError, match=message):
        _setup_task(data.bin_dir, "--chunk-sizes", text)


def test_misaligned_distilled_set_is_rejected(data, aux, work):
    proc = run_cli(
        train_args(data.bin_dir, work / "ck_bad_dist", "--distill-data", aux["short"], max_update=2), check=False
    )
    assert proc.returncode != 0
    lines = _error_lines(proc.stdout, "distill", str(N_SHORT), str(N_TRAIN))
    assert lines, proc.stdout[-3000:]


# -------------------------------------------------------------- fine-tuning from AT


def test_finetune_hrt_from_at_checkpoint(data, work):
    at_out = run_cli(
        train_args(data.bin_dir, work / "ck_at", "--hrt-mode", "at", arch="at_tiny", max_update=20, log_interval=5)
    ).stdout
    at_ckpt = work / "ck_at" / "checkpoint_last.pt"
    at_state = _load(at_ckpt)["model"]
    assert not any("relative_keys" in k for k in at_state)
    at_records = parse_logs(at_out)

    out = run_cli(
        train_args(data.bin_dir, work / "ck_ft", "--finetune-from-model", at_ckpt, max_update=6, log_interval=1)
    ).stdout
    # the model logs which weights the AT checkpoint lacked (freshly initialised)
    new_lines = _error_lines(out, "new parameter", "relative_keys")
    assert new_lines, out[-3000:]
    records = parse_logs(out)
    assert len(records) == 6
    # the AT weights were loaded: the first AT loss is that of a trained model
    assert records[0]["at_loss"] < at_records[0]["loss"] - 0.5, (records[0], at_records[0])
    hrt_state = _load(work / "ck_ft" / "checkpoint_last.pt")["model"]
    assert any("relative_keys" in k for k in hrt_state)
    assert int(hrt_state["trained_chunk_sizes"][2]) == 1
    shared = [k for k in at_state if k in hrt_state]
    assert len(shared) >= len(at_state) - 2


def test_eval_bleu_validates_an_hrt_model_with_its_chunk_size(data, work):
    """fairseq-train --eval-bleu on an HRT model fine-tuned from AT (the converged study's
    runs): the validation generator is built once the model says which chunk sizes it trains,
    so validation decodes it with HRT (k = 2) and logs BLEU every epoch instead of refusing the
    model as 'not trained with chunked samples'."""
    run_cli(train_args(data.bin_dir, work / "ck_eval_at", "--hrt-mode", "at", arch="at_tiny", max_update=10))
    validated = eval_bleu_finetune_args(work / "ck_eval_at" / "checkpoint_last.pt")
    args = train_args(data.bin_dir, work / "ck_eval_hrt", *validated, max_update=12, log_interval=4)
    out = run_cli([a for a in args if a != "--disable-validation"]).stdout
    valid = parse_logs(out, "valid")
    assert valid and all("valid_bleu" in v for v in valid), out[-3000:]
    assert "checkpoint_best.pt" in out
    # loaded with the checkpoint's own task (--eval-bleu on), as the benchmarks load it: the
    # validation generator is not built before the weights say which chunk sizes they trained
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(work / "ck_eval_hrt" / "checkpoint_best.pt")], arg_overrides={"data": str(data.bin_dir)}
    )
    assert task.cfg.eval_bleu and 2 in models[0].get_trained_chunk_sizes()


def test_fairseqs_trainer_counts_its_optimizer_steps_on_the_model(data, tmp_path):
    """fairseq-train's Trainer steps through the task's ``optimizer_step``, which counts the
    step on the model: fairseq's Adam writes the weights through ``p.data`` (no parameter's
    version counter moves), yet the decoder pass plans its fused projections again, so that an
    --eval-bleu validation decodes the weights of the moment, not those of the last one."""
    argv = [str(a) for a in train_args(data.bin_dir, tmp_path / "ck", max_update=2)[1:]]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
    task = tasks.setup_task(cfg.task)
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    trainer = Trainer(cfg, task, model, criterion)
    task.load_dataset(cfg.dataset.train_subset)
    batches = task.get_batch_iterator(task.dataset(cfg.dataset.train_subset), max_tokens=2000)
    batch = next(iter(batches.next_epoch_itr(shuffle=False)))
    the_pass = decoder_pass(model.decoder)
    plan = the_pass.plan()
    versions = [p._version for p in model.parameters()]
    trainer.train_step([batch])
    assert trainer.get_num_updates() == 1
    assert [p._version for p in model.parameters()] == versions  # what version counters alone miss
    assert the_pass.plan() is not plan


def _finished_state(path):
    state = _load(path)
    return state["optimizer_history"][-1]["num_updates"], path.read_bytes(), path.stat().st_mtime_ns


def test_a_plain_translation_run_is_fairseqs_own(data, work):
    """``--task translation`` with the plugin loaded trains as fairseq 0.12 does, also where
    fairseq has a quirk the plugin once changed for every task: run again once finished, a
    fairseq-train command trains one more update and rewrites checkpoint_last.pt
    (docs/compatibility.md says what to do instead)."""
    save_dir = work / "ck_finished_translation"
    args = train_args(data.bin_dir, save_dir, "--hrt-mode", "at", arch="at_tiny", max_update=3)
    args[args.index("hrt_translation")] = "translation"  # fairseq's own task and criterion
    args[args.index("--hrt-mode") : args.index("--hrt-mode") + 2] = []
    args[args.index("hrt_loss")] = "cross_entropy"
    run_cli(args)
    assert _finished_state(save_dir / "checkpoint_last.pt")[0] == 3
    out = run_cli(args).stdout
    assert [int(r["num_updates"]) for r in parse_logs(out)] == [4], out[-3000:]
    assert _finished_state(save_dir / "checkpoint_last.pt")[0] == 4


# --------------------------------------------------------------- precision / update-freq

# fp16 training on the CPU is refused (test_fp16_training_on_cpu_is_refused); --bf16 fails
# inside fairseq, which routes bf16 to the TPU/XLA path ("'NoneType' object has no attribute
# 'xla_device'"): on the CPU --cpu-autocast-bf16 trains in bfloat16.
PRECISION = {
    "amp": ["--amp"],
    "cpu_autocast_bf16": ["--cpu-autocast-bf16"],
    "update_freq2": ["--update-freq", 2],
}
PRECISION_UPDATES = 6


def _precision_args(data, work, name):
    # shared with the distributed test (same data, seed, batches, dropout 0)
    return train_args(
        data.bin_dir,
        work / f"ck_{name}",
        "--dropout",
        0,
        *PRECISION[name],
        max_update=PRECISION_UPDATES,
    )


@pytest.fixture(scope="module")
def precision_runs(data, work):
    names = list(PRECISION)
    results = run_cli_many(
        [_precision_args(data, work, n) for n in names], log_dir=work / "logs_precision", check=False
    )
    return dict(zip(names, results))


def _assert_trains(rc, out):
    assert rc == 0, out[-4000:]
    records = parse_logs(out)
    assert len(records) == PRECISION_UPDATES, out[-3000:]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    return records


@pytest.mark.parametrize(
    "flags, option",
    [
        (["--fp16", "--fp16-no-flatten-grads"], "--fp16"),
        (["--memory-efficient-fp16"], "--memory-efficient-fp16"),
        (["--fp16"], "--fp16"),
    ],
)
def test_fp16_training_on_cpu_is_refused(data, work, flags, option):
    """fairseq 0.12's trainer answers a gradient overflow, routine under fp16's dynamic loss
    scaler, with ``torch.tensor(0.0).cuda()``: on the CPU the task refuses fp16 training in
    one line before the first step, instead of a run that dies at its first overflow."""
    save_dir = work / f"ck_refused{'_'.join(flags)}"
    out = run_cli(train_args(data.bin_dir, save_dir, *flags, max_update=2), check=False)
    lines = [line for line in out.stdout.splitlines() if f"error: {option} trains on a GPU" in line]
    assert out.returncode != 0 and "Traceback" not in out.stdout and len(lines) == 1, out.stdout[-3000:]
    assert "fairseq 0.12's trainer needs CUDA at the first gradient overflow" in lines[0]
    assert not (save_dir / "checkpoint_last.pt").exists()


@pytest.mark.slow
def test_amp_on_cpu(precision_runs):
    """--amp runs on CPU, but fairseq's AMP is CUDA-only (torch.cuda.amp.autocast and a
    torch.cuda GradScaler, both disabled without CUDA): it trains in fp32, loss scale 1."""
    records = _assert_trains(*precision_runs["amp"])
    assert all(r.get("loss_scale") == 1 for r in records), records


@pytest.mark.slow
def test_cpu_autocast_bf16_through_fairseq_train(precision_runs):
    """The plugin's bfloat16 training on CPU: plain Adam on float32 weights (no loss scaler),
    losses within bfloat16's rounding of the otherwise identical float32 run (--amp is float32
    on CPU, test_amp_on_cpu) but not equal to them."""
    records = _assert_trains(*precision_runs["cpu_autocast_bf16"])
    fp32 = parse_logs(precision_runs["amp"][1])
    assert all("loss_scale" not in r for r in records), records
    assert [r["loss"] for r in records] != [r["loss"] for r in fp32]
    for a, b in zip(records, fp32):
        assert a["loss"] == pytest.approx(b["loss"], abs=0.05)


@pytest.mark.slow
def test_update_freq_2(precision_runs):
    records = _assert_trains(*precision_runs["update_freq2"])
    # every update has both microbatches' p_k (the same value): the schedule still steps by 1/T
    p = [r["p_k"] for r in records]
    for a, b in zip(p, p[1:]):
        assert b - a == pytest.approx(1 / PRECISION_UPDATES, abs=2e-3)


# ----------------------------------------------------------------------- distributed

# Runs fairseq-train's own cli_main and then dumps the trainer's (unwrapped) model
# parameters, so the final weights of every rank -- not only rank 0's checkpoint -- can be
# compared. argv: -c DUMP_PATH fairseq-train-args...
_RANK_WRAPPER = """
import logging, sys, torch
# fairseq_cli.train's own logging setup (its basicConfig would come too late here)
logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                    datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO, stream=sys.stdout)
dump = sys.argv[1]
sys.argv = ["fairseq-train"] + sys.argv[2:]
import fairseq.trainer as fairseq_trainer
trainers = []
_init = fairseq_trainer.Trainer.__init__
def _record(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    trainers.append(self)
fairseq_trainer.Trainer.__init__ = _record
from fairseq_cli.train import cli_main
cli_main()
model = trainers[-1].get_model()
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, dump)
"""


@pytest.mark.slow
def test_two_rank_gloo_training(data, work, precision_runs):
    """Two CPU processes, gloo, legacy_ddp. Soundness of the check:

    * both ranks end with bit-identical parameters (dumped from each rank's trainer after
      training). The ranks see different shards (fairseq shards the batch list by rank), so
      equality means their gradients were all-reduced at every update;
    * rank 0's checkpoint holds those parameters;
    * rank 0's logged, all-reduced statistics equal those of a single process with
      --update-freq 2 (the same batches: rank r of 2 gets batches r, r+2, ..., exactly the
      pairs --update-freq 2 groups): sentences, AT/Skip-AT target tokens and p_k per update.
      (Losses differ: both ranks seed the RNG alike, so CMLM masks differ from the second
      microbatch of --update-freq 2.)
    """
    port = free_port()
    save = work / "ck_ddp"
    procs = []
    for rank in range(2):
        args = _precision_args(data, work, "update_freq2")
        args = args[: args.index("--update-freq")] + args[args.index("--update-freq") + 2 :]
        args = [a if a != str(work / "ck_update_freq2") else str(save) for a in map(str, args)]
        args += [
            "--distributed-world-size",
            2,
            "--distributed-rank",
            rank,
            "--distributed-init-method",
            f"tcp://127.0.0.1:{port}",
            "--distributed-backend",
            "gloo",
            "--ddp-backend",
            "legacy_ddp",
            "--distributed-no-spawn",
            "--device-id",
            0,
        ]
        wrapper = ["-c", _RANK_WRAPPER, work / f"rank{rank}.pt", *args[1:]]
        procs.append(start_cli(wrapper, env={"OMP_NUM_THREADS": "1"}, log_path=work / f"rank{rank}.log"))
    outputs = [wait_cli(proc, cmd, timeout=300) for proc, cmd in procs]

    dumps = [torch.load(work / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert dumps[0].keys() == dumps[1].keys()
    differing = [k for k in dumps[0] if not torch.equal(dumps[0][k], dumps[1][k])]
    assert not differing, differing
    ckpt = _load(save / "checkpoint_last.pt")
    assert ckpt["optimizer_history"][-1]["num_updates"] == PRECISION_UPDATES
    for k, v in ckpt["model"].items():
        assert torch.equal(v, dumps[0][k]), k

    ddp = _by_update(parse_logs(outputs[0]))
    rc, ref_out = precision_runs["update_freq2"]
    assert rc == 0, ref_out[-3000:]
    ref = _by_update(parse_logs(ref_out))
    assert sorted(ddp) == sorted(ref) == list(range(1, PRECISION_UPDATES + 1))
    for u in ref:
        for key in ("bsz", "at_ntokens", "skip_at_ntokens", "p_k"):
            assert ddp[u].get(key, 0) == pytest.approx(ref[u].get(key, 0)), (u, key, ddp[u], ref[u])


# torchrun on CPU with the ranks on fairseq's command line (docs/compatibility.md): the WMT
# recipes' rehearsal of it runs, as its README writes it, in tests/test_docs_commands.py


def test_kind_weights_scale_the_trained_loss_of_each_kind(data):
    """--kind-weights skip_cmlm=2,at=0.5: the trained loss is the weighted sum of the per-kind
    losses (logged unweighted); validation is unweighted; bad specs are refused."""
    task, model = _task_model(data.bin_dir)
    ds = task.dataset("train")
    sample = task.build_decoder_samples(
        ds.collater([ds[i] for i in range(16)]), p_k=0.5, rows_generator=torch.Generator().manual_seed(1)
    )
    model.train()
    plain_loss, _, log = HRTLossCriterion(task, 0.1)(model, sample)
    weighted_loss, _, wlog = HRTLossCriterion(task, 0.1, kind_weights="skip_cmlm=2, at=0.5")(model, sample)
    assert {k: wlog[f"{k}_loss"] for k in KINDS} == pytest.approx({k: log[f"{k}_loss"] for k in KINDS}, rel=1e-6)
    expected = float(plain_loss) + log["skip_cmlm_loss"] - 0.5 * log["at_loss"]
    assert float(weighted_loss) == pytest.approx(expected, rel=1e-5)
    model.eval()
    valid = task.build_decoder_samples(ds.collater([ds[i] for i in range(16)]), None)
    assert float(HRTLossCriterion(task, 0.1, kind_weights="skip_cmlm=2")(model, valid)[0]) == pytest.approx(
        float(HRTLossCriterion(task, 0.1)(model, valid)[0])
    )
    assert parse_kind_weights("") == {k: 1.0 for k in KINDS}
    for bad in ("skip=2", "at", "at=x", "at=-1"):
        with pytest.raises(ValueError, match="--kind-weights"):
            parse_kind_weights(bad)


def test_a_validation_of_empty_hypotheses_has_bleu_0():
    """--eval-bleu with --best-checkpoint-metric bleu: fairseq logs no BLEU when every
    validation hypothesis is empty, and fairseq-train then dies with KeyError: 'bleu'. The task
    logs 0 there, and nothing for training batches."""
    task = object.__new__(HRTTranslationTask)
    task.cfg = SimpleNamespace(eval_bleu=True)

    class Criterion:
        @staticmethod
        def reduce_metrics(logging_outputs):
            pass

    empty = {"ntokens": 3, "nsentences": 1, "sample_size": 3, "_bleu_sys_len": 0, "_bleu_ref_len": 5}
    empty.update({f"_bleu_{kind}_{i}": 0 for kind in ("counts", "totals") for i in range(4)})
    with metrics.aggregate() as agg:
        task.reduce_metrics([empty, dict(empty)], Criterion())
    assert agg.get_smoothed_values()["bleu"] == 0.0
    with metrics.aggregate() as agg:
        task.reduce_metrics([{"ntokens": 3, "nsentences": 1, "sample_size": 3}], Criterion())
    assert "bleu" not in agg.get_smoothed_values()
