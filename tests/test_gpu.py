"""What ``--fp16`` does on a GPU: fairseq-train -> fairseq-generate -> fairseq-interactive with
half precision on CUDA, and the decoding invariants in half precision on CUDA.

Every test here is skipped without a CUDA GPU (CI has none); on a GPU machine run
``python -m pytest tests/test_gpu.py``. The CPU half-precision paths are covered by
test_training.py (fp16 on CPU) and test_generator.py (half-precision model).
"""

import math
import os
import subprocess
import sys

import pytest
import torch
from fairseq import utils
from fairseq.sequence_generator import SequenceGenerator

from fairseq_hrt.testing.tiny_runs import (
    REPO,
    SRC,
    TGT,
    USER_DIR,
    eval_bleu_finetune_args,
    make_tiny_data,
    parse_logs,
    run_cli,
    train_args,
)
from tests.hrt_fixtures import build_task_and_model, make_sample
from tests.test_generator import SENTENCES, SPECIALS, generate
from tests.tiny_data import hyp_lines

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# tiny_runs.cli_env hides the GPU from fairseq subprocesses; these runs want it back
GPU_ENV = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or "0"}
GEN = ["--user-dir", USER_DIR, "--task", "hrt_translation", "--source-lang", SRC, "--target-lang", TGT]
N_VALID = 40
UPDATES = 80


def on_gpu(args):
    return [a for a in args if a != "--cpu"]


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory):
    """An AT model, HRT fine-tuned from it, and MP fine-tuned from it, all trained with plain
    ``--fp16`` (flattened fp16 grads, fairseq's FP16Optimizer: the path that needs CUDA)."""
    root = tmp_path_factory.mktemp("gpu")
    data = make_tiny_data(root, n_train=300, n_valid=N_VALID)
    runs = {}
    at = root / "at" / "checkpoint_last.pt"
    for name, arch, extra in (
        ("at", "at_tiny", ["--hrt-mode", "at"]),
        ("hrt", "hrt_tiny", ["--chunk-sizes", "2,3", "--finetune-from-model", at]),
        ("mp", "cmlm_tiny", ["--hrt-mode", "cmlm", "--finetune-from-model", at]),
    ):
        args = train_args(data.bin_dir, root / name, "--fp16", *extra, arch=arch, max_update=UPDATES)
        runs[name] = run_cli(on_gpu(args), env=GPU_ENV).stdout
    return data, root, runs


def test_eval_bleu_validation_on_gpu(fp16_runs, tmp_path):
    """fairseq-train --eval-bleu on the GPU in float32, as the study's steps run on a lent GPU
    (examples/multi30k/gpu_handoff.py): fairseq builds the validation generator before the
    trainer moves the model to the GPU, and the search sent its tokens to the CPU ('index is on
    cpu') until the lean engine read the model's device at each use. HRT k = 2, so the
    validation runs both stages on the GPU."""
    data, root, _ = fp16_runs
    validated = ["--chunk-sizes", "2", *eval_bleu_finetune_args(root / "at" / "checkpoint_last.pt")]
    args = train_args(data.bin_dir, tmp_path / "hrt_eval", *validated, max_update=12, log_interval=4)
    out = run_cli(on_gpu([a for a in args if a != "--disable-validation"]), env=GPU_ENV).stdout
    valid = parse_logs(out, "valid")
    assert valid and all("valid_bleu" in v for v in valid), out[-3000:]
    assert "checkpoint_best.pt" in out


@pytest.mark.parametrize("name", ["at", "hrt", "mp"])
def test_fp16_training_on_gpu(fp16_runs, name):
    _, root, runs = fp16_runs
    out = runs[name]
    assert "NVIDIA" in out or "CUDA" in out, out[-3000:]  # fairseq logs the CUDA devices it trains on
    records = parse_logs(out)
    assert records, out[-3000:]
    assert all("loss_scale" in r for r in records)  # the dynamic fp16 loss scaler is on
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["num_updates"] == UPDATES
    assert records[-1]["loss"] < records[0]["loss"]
    state = torch.load(root / name / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert state["cfg"]["common"]["fp16"]
    # fairseq saves fp16-trained weights in fp32 (the FP16Optimizer's fp32 master copy)
    assert all(v.dtype == torch.float32 for v in state["model"].values() if v.is_floating_point())


def _generate(data, ckpt, *flags):
    out = run_cli(
        [
            "generate",
            data.bin_dir,
            "--path",
            ckpt,
            "--gen-subset",
            "valid",
            "--batch-size",
            "8",
            "--max-len-b",
            "40",
            *GEN,
            *flags,
        ],
        env=GPU_ENV,
    ).stdout
    hyps = hyp_lines(out)
    assert sorted(hyps) == list(range(N_VALID)), out[-3000:]
    assert "<mask>" not in out and "<s2>" not in out
    return hyps


@pytest.mark.parametrize(
    "name, flags",
    [
        ("hrt", ["--decode-chunk-size", "2", "--beam", "5", "--b-nat", "1"]),
        ("hrt", ["--decode-chunk-size", "1", "--beam", "1"]),
        ("at", ["--beam", "5"]),
        ("mp", ["--iter-decode-max-iter", "4", "--iter-decode-with-beam", "3"]),
    ],
)
def test_fp16_generate_on_gpu_agrees_with_fp32(fp16_runs, name, flags):
    """fairseq-generate --fp16 on the GPU translates every sentence, and mostly as fp32 does
    (rounding can flip a near-tie, so not necessarily every sentence)."""
    data, root, _ = fp16_runs
    ckpt = root / name / "checkpoint_last.pt"
    half = _generate(data, ckpt, "--fp16", *flags)
    full = _generate(data, ckpt, *flags)
    same = sum(half[i] == full[i] for i in range(N_VALID))
    assert same >= 0.9 * N_VALID, (same, half, full)


def test_fp16_interactive_on_gpu(fp16_runs):
    data, root, _ = fp16_runs
    lines = ["a man rides a horse .", "", " ".join(["the"] * 300), "two dogs play ."]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fairseq_cli.interactive",
            str(data.bin_dir),
            "--path",
            str(root / "hrt" / "checkpoint_last.pt"),
            "--fp16",
            "--buffer-size",
            "4",
            "--batch-size",
            "4",
            "--beam",
            "5",
            "--b-nat",
            "1",
            "--decode-chunk-size",
            "2",
            "--max-source-positions",
            "64",
            *GEN,
        ],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **GPU_ENV,
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    hyps = hyp_lines(proc.stdout)
    assert sorted(hyps) == list(range(len(lines)))
    assert hyps[1] == "" and hyps[0] and hyps[3]
    assert "truncated" in proc.stderr


# ------------------------------------------------------------- generator level, in process


@pytest.fixture(scope="module")
def cuda_half_model(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("gpu_gen"))
    task, model = build_task_and_model(data_dir)
    return data_dir, task, model


def test_at_mode_equals_sequence_generator_in_half_on_cuda(cuda_half_model):
    data_dir, task, model = cuda_half_model
    cuda_sample = utils.move_to_cuda(make_sample(task, SENTENCES))
    model.cuda().half()
    try:
        for beam in (1, 5):
            ours = generate(task, model, data_dir, cuda_sample, "--decode-chunk-size", "1", "--beam", str(beam))
            ref = SequenceGenerator(
                [model], task.target_dictionary, beam_size=beam, max_len_b=24, tokens_to_suppress=SPECIALS
            ).generate([model], cuda_sample)
            for o, r in zip(ours, ref):
                assert torch.equal(o[0]["tokens"], r[0]["tokens"])
    finally:
        model.float().cpu()


@pytest.mark.parametrize(
    "flags", [("--decode-chunk-size", "2", "--beam", "1"), ("--decode-chunk-size", "3", "--beam", "3", "--b-nat", "2")]
)
def test_hrt_in_half_on_cuda_gives_the_fp32_cpu_output(cuda_half_model, flags):
    data_dir, task, model = cuda_half_model
    sample = make_sample(task, SENTENCES)
    ref = generate(task, model, data_dir, sample, *flags)
    model.cuda().half()
    try:
        out = generate(task, model, data_dir, utils.move_to_cuda(sample), *flags)
    finally:
        model.float().cpu()
    for r, o in zip(ref, out):
        assert o[0]["tokens"].cpu().tolist() == r[0]["tokens"].tolist()
        assert float(o[0]["score"]) == pytest.approx(float(r[0]["score"]), abs=2e-2)
