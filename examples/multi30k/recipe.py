#!/usr/bin/env python
"""Multi30k En->De: AT teacher -> distillation -> AT, HRT and Mask-Predict students -> benchmark.

The commands of the top-level README, one after the other:

 1. prepare      prepare.sh: SentencePiece + fairseq-preprocess (joined dictionary)
 2. teacher      AT teacher (more decoder layers than the students), raw data
 3. distill      sequence-level knowledge distillation (KD) of the training set by the teacher
                 (python -m fairseq_hrt.distill, the n-best hypothesis closest to the reference)
 4. distill_bin  the distilled targets binarized with the raw data's dictionary
 5. at           AT student (deep encoder, one decoder layer), MixDistill
 6. hrt          HRT fine-tuned from the AT student, MixDistill, k = 2 (--hrt-chunk-sizes)
 7. mp           Mask-Predict fine-tuned from the AT student, MixDistill
 8. ssru         --ssru-students only: the AT student with an SSRU decoder (one layer)
 9. ssru_tied    --ssru-students only: the same with two tied SSRU layers
10. shortlist    a lexical shortlist of the training set (fairseq-hrt-shortlist)
11. benchmark    benchmarks/benchmark.py: BLEU, speed at batch 1..128, ratios to AT greedy

MixDistill: each training pair uses its raw target with probability --p-raw, the distilled
one otherwise. The students share one budget (--max-update, the same on every machine) and
are compared at their last checkpoint. A finished step leaves OUT/markers/<step>.done (its
command) and is skipped when the recipe runs again, so the same command resumes an
interrupted run (a training step from its checkpoint_last.pt). Logs: OUT/logs/<step>.log.
"""

import argparse
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch

SCRIPT_DIR = Path(__file__).resolve().parent
REPO = SCRIPT_DIR.parents[1]
USER_DIR = REPO / "fairseq_hrt"
GLIBC_KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
    "MALLOC_TOP_PAD_": str(512 << 20),
}


@dataclass
class Profile:
    vocab_size: int
    subset: Optional[int]  # training pairs kept by prepare.sh (None = all 29k)
    max_tokens: int
    lr: float
    warmup: int
    teacher_arch: Optional[str]  # None: no teacher, the students train on raw data
    teacher_updates: int
    at_arch: str
    hrt_arch: str
    mp_arch: str
    student_updates: int
    distill_beam: int
    validate: bool  # off where an epoch is a few updates long
    log_interval: int
    bench_sentences: int  # test sentences benchmarked (0 = all 1,000)
    bench_bs1_sentences: int
    bench_batch_sizes: str = "1,8,32,128"
    # every benchmarked decoder stops at a x source length + b tokens: 1.2 x + 10 lies above
    # every Multi30k reference, and an under-trained model repeating itself stops there
    bench_max_len_a: float = 1.2
    bench_max_len_b: int = 10
    bench_parallel: str = ""  # benchmark.py --parallel: Jacobi decoding and hrt-spec rows
    teacher_decoder_layers: int = 2

    @property
    def distill(self) -> bool:
        return self.teacher_arch is not None


TINY = dict(at_arch="at_tiny", hrt_arch="hrt_tiny", mp_arch="cmlm_tiny", teacher_arch="at_tiny")
SMALL = dict(at_arch="at_small", hrt_arch="hrt_small", mp_arch="cmlm_small", teacher_arch="at_small")
# fmt: off
PROFILES = {
    # the smallest run of every step, for tests of the recipe: its numbers mean nothing
    "tiny": Profile(
        **TINY, vocab_size=200, subset=300, max_tokens=1024, lr=3e-3, warmup=10, teacher_updates=30,
        student_updates=60, distill_beam=2, validate=False, log_interval=1, bench_sentences=10,
        bench_bs1_sentences=2, bench_batch_sizes="1,8", bench_max_len_a=0.0, bench_max_len_b=40
    ),
    # a smoke run of the whole recipe on 2,000 pairs, minutes on a CPU
    "quick": Profile(
        **TINY, vocab_size=1000, subset=2000, max_tokens=2048, lr=3e-3, warmup=100, teacher_updates=800,
        student_updates=500, distill_beam=2, validate=False, log_interval=10, bench_sentences=100,
        bench_bs1_sentences=20
    ),
    # the quickstart's shape (d = 128, 3 encoder layers, 1 decoder layer) on raw data, no teacher
    "mini": Profile(
        at_arch="at_mini", hrt_arch="hrt_mini", mp_arch="cmlm_mini", teacher_arch=None, teacher_updates=0,
        vocab_size=4000, subset=None, max_tokens=4096, lr=4e-3, warmup=150, student_updates=300, distill_beam=0,
        validate=True, log_interval=20, bench_sentences=0, bench_bs1_sentences=100
    ),
    # d = 256 students (6 encoder layers, 1 decoder layer) and a 6-3 teacher on all 29k pairs
    "full": Profile(
        **SMALL, vocab_size=8000, subset=None, max_tokens=4096, lr=2e-3, warmup=300, teacher_updates=1200,
        student_updates=800, distill_beam=5, validate=True, log_interval=20, bench_sentences=0,
        bench_bs1_sentences=100, bench_parallel="pj,pgj,hgj,hrt-spec", teacher_decoder_layers=3
    ),
    # the full shapes with 4x the batch and longer budgets, for one GPU (with --fp16)
    "gpu": Profile(
        **SMALL, vocab_size=8000, subset=None, max_tokens=16384, lr=2e-3, warmup=500, teacher_updates=2000,
        student_updates=1500, distill_beam=5, validate=True, log_interval=50, bench_sentences=0,
        bench_bs1_sentences=100, bench_parallel="pj,pgj,hgj,hrt-spec", teacher_decoder_layers=3
    ),
}
# fmt: on
STEPS = "prepare teacher distill distill_bin at hrt mp ssru ssru_tied shortlist benchmark".split()
# Marian's students: step -> options beside the SSRU twin of the AT student's arch
SSRU_STUDENTS = {"ssru": [], "ssru_tied": ["--decoder-layers", "2", "--decoder-tie-layers"]}


def log(msg: str):
    print(f"[recipe] {msg}", file=sys.stderr, flush=True)


class Recipe:
    def __init__(self, args):
        self.args = args
        self.profile = PROFILES[args.profile]
        self.out = Path(args.out).resolve()
        self.data = self.out / "data"
        self.data_bin = self.data / "data-bin"
        self.markers = self.out / "markers"
        self.logs = self.out / "logs"
        self.threads = args.threads
        self.device_args = ["--cpu"] if args.cpu else (["--fp16"] if args.fp16 else [])
        self.env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        # prepare.sh calls `python` and fairseq's console scripts: those of this interpreter
        self.env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), self.env.get("PATH", "")))
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p)
        # glibc keeps freed big tensors in the heap rather than faulting them in again every step
        # (docs/training.md, "On a Linux CPU"); values set by the user win
        for name, value in GLIBC_KEEP_FREED_MEMORY.items():
            self.env.setdefault(name, value)

    def checkpoint(self, name: str) -> Path:
        # the end of the budget: best-by-validation-loss would compare different amounts of
        # training, and for HRT pick a model from earlier in the curriculum
        return self.out / name / "checkpoint_last.pt"

    def run_step(self, name: str, cmd: List[str]):
        marker = self.markers / f"{name}.done"
        tag = f"step {STEPS.index(name) + 1}/{len(STEPS)} {name}"
        if marker.exists():
            log(f"{tag}: skipped, done earlier ({marker})")
            return
        self.markers.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{name}.log"
        log(f"{tag}: running, log in {log_path}")
        cmd_str = shlex.join(str(c) for c in cmd)
        with open(log_path, "a") as log_file:
            log_file.write(f"$ {cmd_str}\n")
            log_file.flush()
            rc = subprocess.run(cmd, env=self.env, stdout=log_file, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
            sys.exit(f"[recipe] {tag} failed (exit {rc}); the end of {log_path}:\n{tail}")
        marker.write_text(cmd_str + "\n")

    def train_cmd(self, name: str, arch: str, max_update: int, extra: List[str]) -> List[str]:
        """fairseq-train of a model saved in OUT/name."""
        p = self.profile
        cmd = [
            sys.executable, "-m", "fairseq_cli.train", str(self.data_bin), "--user-dir", str(USER_DIR),
            "--task", "hrt_translation", "--source-lang", "en", "--target-lang", "de",
            "--arch", arch, "--share-all-embeddings", "--criterion", "hrt_loss", "--label-smoothing", "0.1",
            "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "1.0",
            "--lr", str(p.lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(p.warmup),
            "--warmup-init-lr", "1e-07", "--max-tokens", str(p.max_tokens), "--max-update", str(max_update),
            "--save-dir", str(self.out / name), "--no-epoch-checkpoints", "--log-format", "simple",
            "--log-interval", str(p.log_interval), "--seed", str(self.args.seed), "--num-workers", "0",
        ]  # fmt: skip
        if not p.validate:
            cmd.append("--disable-validation")
        return cmd + self.device_args + extra

    def student_data_args(self) -> List[str]:
        if not self.profile.distill:
            return []
        return ["--distill-data", str(self.out / "distill-bin"), "--p-raw", str(self.args.p_raw)]

    def hrt_args(self, chunk_sizes: str, at_checkpoint: Path) -> List[str]:
        """HRT fine-tuned from the AT student through the papers' curriculum (p_k = 1 at the
        last update)."""
        return ["--chunk-sizes", chunk_sizes, "--finetune-from-model", str(at_checkpoint), *self.student_data_args()]

    def ssru_cmd(self, name: str) -> List[str]:
        """An SSRU student: the AT student's command with the SSRU twin of its arch."""
        p = self.profile
        extra = ["--hrt-mode", "at", *SSRU_STUDENTS[name], *self.student_data_args()]
        return self.train_cmd(name, f"{p.at_arch}_ssru", p.student_updates, extra)

    def ssru_extra_rows(self) -> List[str]:
        """benchmark.py --at-extra rows of the SSRU students this run trained."""
        rows = []
        for name in SSRU_STUDENTS:
            if (self.markers / f"{name}.done").exists():
                rows += ["--at-extra", f"{name.replace('_', '-')}={self.checkpoint(name)}"]
        return rows

    def commands(self, name: str) -> List[str]:
        """The command of step ``name`` (the steps before it done)."""
        p, data, out = self.profile, self.data, self.out
        shortlist = out / "shortlist" / "shortlist.pt"
        if name == "prepare":
            cmd = ["bash", str(SCRIPT_DIR / "prepare.sh"), "--out", str(data), "--vocab-size", str(p.vocab_size)]
            cmd += ["--subset", str(p.subset)] if p.subset else []
            return cmd + (["--raw-dir", str(Path(self.args.raw_dir).resolve())] if self.args.raw_dir else [])
        if name == "teacher":
            extra = ["--hrt-mode", "at", "--decoder-layers", str(p.teacher_decoder_layers)]
            return self.train_cmd("teacher", p.teacher_arch, p.teacher_updates, extra)
        if name == "distill":
            return [
                sys.executable, "-m", "fairseq_hrt.distill", "--data", str(self.data_bin),
                "--path", str(self.checkpoint("teacher")), "--src", str(data / "spm" / "train.en"),
                "--out", str(out / "distill" / "train.de"), "--beam", str(p.distill_beam),
                "--nbest", str(p.distill_beam), "--select-by-bleu", str(data / "raw" / "train.de"),
                "--post-process", "sentencepiece", "--max-len-a", "1.5", "--max-len-b", "10",
                "--threads", str(self.threads), *self.device_args,
            ]  # fmt: skip
        if name == "distill_bin":
            dictionary = str(self.data_bin / "dict.en.txt")
            return [
                sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "en", "--target-lang", "de",
                "--trainpref", str(out / "distill" / "train"), "--srcdict", dictionary, "--tgtdict", dictionary,
                "--destdir", str(out / "distill-bin"), "--workers", str(self.threads),
            ]  # fmt: skip
        if name == "at":
            return self.train_cmd("at", p.at_arch, p.student_updates, ["--hrt-mode", "at", *self.student_data_args()])
        if name == "hrt":
            extra = self.hrt_args(self.args.hrt_chunk_sizes, self.checkpoint("at"))
            return self.train_cmd("hrt", p.hrt_arch, p.student_updates, extra)
        if name == "mp":
            extra = ["--hrt-mode", "cmlm", "--finetune-from-model", str(self.checkpoint("at"))]
            return self.train_cmd("mp", p.mp_arch, p.student_updates, extra + self.student_data_args())
        if name in SSRU_STUDENTS:
            return self.ssru_cmd(name)
        if name == "shortlist":
            return [
                sys.executable, "-m", "fairseq_hrt.shortlist", str(self.data_bin), "--output", str(shortlist),
                "--per-source", "7", "--frequent", "50",
            ]  # fmt: skip
        assert name == "benchmark", name
        cmd = [
            sys.executable, str(REPO / "benchmarks" / "benchmark.py"), "--data", str(self.data_bin),
            "--spm", str(data / "spm" / "spm.model"), "--src", str(data / "spm" / "test.en"),
            "--raw-src", str(data / "raw" / "test.en"), "--raw-ref", str(data / "raw" / "test.de"),
            "--at", str(self.checkpoint("at")), "--hrt", str(self.checkpoint("hrt")),
            "--hrt-chunk-sizes", self.args.hrt_chunk_sizes, "--mp", str(self.checkpoint("mp")),
            "--shortlist", str(shortlist), "--batch-sizes", p.bench_batch_sizes,
            "--bs1-sentences", str(p.bench_bs1_sentences), "--max-sentences", str(p.bench_sentences),
            "--max-len-b", str(p.bench_max_len_b), "--threads", str(self.threads),
            "--out-dir", str(out / "benchmark"), *self.ssru_extra_rows(), *self.device_args,
        ]  # fmt: skip
        cmd += ["--max-len-a", str(p.bench_max_len_a)] if p.bench_max_len_a else []
        cmd += ["--parallel", p.bench_parallel] if p.bench_parallel else []
        return cmd + (["--comet-model", str(Path(self.args.comet_model).resolve())] if self.args.comet_model else [])

    def run(self):
        log(f"profile {self.args.profile}, output {self.out}, {self.threads} CPU thread(s)")
        for name in STEPS:
            if name in ("teacher", "distill", "distill_bin") and not self.profile.distill:
                continue  # the students train on raw data
            if name in SSRU_STUDENTS and not self.args.ssru_students:
                continue
            if name == "distill_bin" and not (self.out / "distill" / "train.en").exists():
                # fairseq-preprocess wants the source side beside the distilled target
                (self.out / "distill" / "train.en").unlink(missing_ok=True)  # a dangling link of a killed run
                (self.out / "distill" / "train.en").symlink_to(self.data / "spm" / "train.en")
            self.run_step(name, self.commands(name))
            if name == self.args.until:
                return
        print((self.out / "benchmark" / "report.md").read_text())


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PROFILES), default="quick", help="model shapes and budgets (PROFILES)")
    p.add_argument("--out", help="output directory (default: work/recipe-<profile> under the repository root)")
    p.add_argument("--raw-dir", help="raw Multi30k directory (default: prepare.sh's search order)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads of every step")
    p.add_argument("--p-raw", type=float, default=0.5, help="MixDistill: probability of a pair's raw target")
    p.add_argument(
        "--hrt-chunk-sizes",
        default="2",
        help="chunk sizes k the HRT student trains and the benchmark decodes: 2 as the papers (one model per k); "
        "2,3,4 trains one model for several k, each of which then sees a third of the chunked pairs",
    )
    p.add_argument("--ssru-students", action="store_true", help="also train SSRU students (one layer, two tied)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fp16", action="store_true", help="GPU only: fairseq's --fp16 for every step")
    p.add_argument("--comet-model", help="a local COMET model folder for the benchmark")
    p.add_argument("--until", choices=STEPS, help="stop after this step")
    args = p.parse_args(argv)
    args.out = args.out or str(REPO / "work" / f"recipe-{args.profile}")
    args.cpu = not torch.cuda.is_available()
    if args.fp16 and args.cpu:
        p.error("--fp16 needs a GPU")
    return args


if __name__ == "__main__":
    try:
        Recipe(parse_args()).run()
    except KeyboardInterrupt:
        sys.exit("[recipe] interrupted; run the same command again to resume")
