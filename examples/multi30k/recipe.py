#!/usr/bin/env python
"""Multi30k En->De benchmark recipe: teacher -> distillation -> AT / HRT / MP students -> benchmark.

Steps (each one is skipped when its marker ``OUT/markers/<step>.done`` exists; an interrupted
training resumes from its ``checkpoint_last.pt``; every step logs to ``OUT/logs/<step>.log``):

1. ``prepare``      examples/multi30k/prepare.sh: SentencePiece + fairseq-preprocess (joined dict)
2. ``teacher``      AT teacher (deeper decoder than the students), raw data
3. ``distill``      sequence-level KD of the training set with the teacher
                    (``python -m fairseq_hrt.distill``; n-best selection by sentence-BLEU)
4. ``distill_bin``  binarize the distilled targets with the raw data's dictionary
5. ``at``           AT student: deep encoder, 1 decoder layer, MixDistill
6. ``hrt``          HRT fine-tuned from the AT student, MixDistill, chunk size 2 (``--hrt-chunk-sizes``)
7. ``mp``           Mask-Predict (CMLM) fine-tuned from the AT student, MixDistill
8. ``ssru``         with ``--ssru-students`` only: Marian's SSRU student (``<at arch>_ssru``: the AT
                    student's shape, an SSRU in place of decoder self-attention), same data and budget
9. ``ssru_tied``    with ``--ssru-students`` only: the same with 2 tied SSRU decoder layers
                    (``--decoder-layers 2 --decoder-tie-layers``, the paper's tied student)
10. ``shortlist``   a lexical shortlist of the training set (``fairseq-hrt-shortlist``, IBM
                    Model 1, 7 targets per source token + the 50 most frequent: tuned on the
                    validation set of the ``mini`` models)
11. ``benchmark``   benchmarks/benchmark.py: BLEU, COMET (if a local model is given),
                    words/s at batch 1, 8, 32, 128, ratios to AT greedy, Pareto plot; the SSRU
                    students as extra AT rows (``--at-extra``); a "+shortlist" row per system
                    (CTranslate2: a "+vmap" row, its vocabulary map of the shortlist)

The three students get the same training budget (``--max-update`` and ``--stop-time-hours``)
and the same data (MixDistill with ``--p-raw 0.5``); HRT and MP start from the AT student, as
the HRT paper fine-tunes from AT (SPEC section 2). Profiles: ``quick`` (a smoke run, minutes)
and ``full`` (CPU-sized shapes, about 2 hours on 2 cores); see examples/multi30k/README.md.
"""

import argparse
import ctypes
import fcntl
import importlib.metadata
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from tqdm import tqdm

SCRIPT_DIR = Path(__file__).resolve().parent
REPO = SCRIPT_DIR.parents[1]
USER_DIR = REPO / "fairseq_hrt"


# glibc's malloc hands every tensor over its (adaptive, at most 32 MB) mmap threshold back to the
# kernel when it is freed, and the next step's tensor of that size is faulted in and zeroed
# again page by page: training `at_small` on one thread spent 22 % of its CPU time in the kernel
# (8.1 M page faults in 40 updates). Keeping freed memory in the heap instead took that to 3 %
# (0.9 M) and 0.36 to 0.48 updates/s. glibc reads these at process start, so they go to the
# children's environment; a value the user set wins; other C libraries ignore them.
GLIBC_MALLOC_KEEP = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
    "MALLOC_TOP_PAD_": str(512 << 20),
}
# Kept in the heap, glibc's freed tensors fragment it as the hours go by: `at_small` (2 decoder
# layers, bfloat16 autocast, 2 threads) grew to 11.7 GB of RSS in its first hour, spent 14 % of
# its samples in glibc's _int_malloc (10 % when fresh, the other thread waiting meanwhile) and
# slowed from 1.2-1.36 updates/s to 0.93, back to 1.2-1.3 when restarted. Under mimalloc (the
# cmeel-mimalloc wheel of requirements.txt, preloaded into the CPU training commands) the same
# run held 1.9 GB and trained 9 % more updates in its first 6 minutes. FAIRSEQ_HRT_TRAIN_MALLOC=glibc
# keeps glibc (with GLIBC_MALLOC_KEEP).
TRAIN_MALLOC_ENV = "FAIRSEQ_HRT_TRAIN_MALLOC"


def mimalloc_library() -> Optional[str]:
    """The path of the cmeel-mimalloc wheel's ``libmimalloc.so``, or None where it is not installed."""
    try:
        files = importlib.metadata.files("cmeel-mimalloc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "libmimalloc.so" and Path(f.locate()).exists():
            return str(f.locate())
    return None


def training_env(env: Dict[str, str]) -> Dict[str, str]:
    """``env`` for a CPU training command: mimalloc preloaded (before any library the user
    preloads) unless ``FAIRSEQ_HRT_TRAIN_MALLOC=glibc`` or the wheel is missing."""
    choice = env.get(TRAIN_MALLOC_ENV, "mimalloc")
    if choice not in ("mimalloc", "glibc"):
        raise StepError(f"{TRAIN_MALLOC_ENV}={choice}: give mimalloc or glibc")
    library = mimalloc_library() if choice == "mimalloc" else None
    if not library:
        return env
    # mimalloc hands freed memory back to the kernel after 10 ms by default, and the next step
    # faults it in again: 16 % of the teacher's samples were the kernel zeroing pages
    # (clear_page_erms). Never purging keeps them, as GLIBC_MALLOC_KEEP does for glibc; a value
    # the user set wins
    return {
        "MIMALLOC_PURGE_DELAY": "-1",
        **env,
        "LD_PRELOAD": " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p),
    }


@dataclass
class Budget:
    max_update: int
    stop_time_hours: float
    lr: float
    warmup: int


@dataclass
class Profile:
    """Everything that differs between ``quick`` and ``full``."""

    vocab_size: int
    subset: Optional[int]  # training pairs kept by prepare.sh (None = all 29k)
    max_tokens: int
    teacher_arch: Optional[str]  # None: no teacher, no distillation (students train on raw data)
    teacher_args: List[str]  # makes the teacher bigger than the students
    teacher: Optional[Budget]
    at_arch: str
    hrt_arch: str
    mp_arch: str
    student: Budget  # budget shared by the AT, HRT and MP students
    distill_beam: int
    distill_nbest: int
    validate: bool  # quick skips validation: its epochs are a few updates long
    log_interval: int
    bench_sentences: int  # test sentences benchmarked (0 = all 1000)
    bench_bs1_sentences: int
    bench_batch_sizes: str = "1,8,32,128"
    # L of every benchmarked decoder; the tiny profile's untrained models run every greedy
    # output to it, so it keeps L small
    bench_max_len_b: int = 10
    # every benchmarked system (AT, HRT, MP, CTranslate2) outputs at most a x source length + b
    # tokens: 1.2 x + 10 lies above every Multi30k reference (target/source piece ratio ~1.1),
    # while a runaway output (an under-trained decoder repeating itself) stops there instead of
    # at 200 tokens, where it would decide BLEU and its batch's time
    bench_max_len_a: float = 1.2
    # the lexical shortlist of the benchmark's "+shortlist" rows: targets per source token and
    # frequent targets (7/50: the fastest setting within 0.3 BLEU on the mini models' valid set)
    shortlist_per_source: int = 7
    shortlist_frequent: int = 50
    # the exact parallel forms of greedy search benchmarked (benchmark.py --parallel): Jacobi
    # of the AT student and hrt-spec of the HRT student; empty for the smoke profiles
    bench_parallel: str = ""

    @property
    def distill(self) -> bool:
        return self.teacher_arch is not None


PROFILES: Dict[str, Profile] = {
    # Smoke run: tiny shapes on a 2000-pair subset; the numbers mean nothing, the report's
    # structure is what tests/test_benchmark_smoke.py checks.
    "quick": Profile(
        vocab_size=1000,
        subset=2000,
        max_tokens=2048,
        teacher_arch="at_tiny",
        teacher_args=["--decoder-layers", "2"],
        teacher=Budget(max_update=800, stop_time_hours=0.03, lr=3e-3, warmup=100),
        at_arch="at_tiny",
        hrt_arch="hrt_tiny",
        mp_arch="cmlm_tiny",
        student=Budget(max_update=500, stop_time_hours=0.02, lr=3e-3, warmup=100),
        distill_beam=2,
        distill_nbest=2,
        validate=False,
        log_interval=10,
        bench_sentences=100,
        bench_bs1_sentences=20,
    ),
    # CPU-sized: d = 256 students (6 encoder layers, 1 decoder layer) and a 6-3 teacher of the
    # same width, vocabulary 8000, all 29k pairs. Budgets from short speed probes with 2
    # threads on 2 cores (--max-tokens 4096, about 106 updates per epoch; the fastest intervals
    # of a machine shared with other jobs): 6-3 teacher ~0.6 updates/s,
    # AT and MP students ~0.8/s, HRT ~0.5/s (two decoder samples per pair). So the teacher
    # takes ~33 min, the students ~17 + 27 + 17 min, distillation (beam 5) ~10 min and the
    # benchmark ~15 min: about 2 hours. The updates are the budget (HRT's curriculum is
    # scheduled over --max-update); the time caps only stop a run on a much slower machine.
    "full": Profile(
        vocab_size=8000,
        subset=None,
        max_tokens=4096,
        teacher_arch="at_small",
        teacher_args=["--decoder-layers", "3"],
        teacher=Budget(max_update=1200, stop_time_hours=0.6, lr=2e-3, warmup=300),
        at_arch="at_small",
        hrt_arch="hrt_small",
        mp_arch="cmlm_small",
        student=Budget(max_update=800, stop_time_hours=0.5, lr=2e-3, warmup=300),
        distill_beam=5,
        distill_nbest=5,
        validate=True,
        log_interval=20,
        bench_sentences=0,
        bench_bs1_sentences=100,
        bench_parallel="pj,pgj,hgj,hrt-spec",
    ),
    # GPU-sized (--fp16, one H100-class device): the `full` shapes with 4x larger batches and
    # budgets meant to converge on Multi30k (~23 updates per epoch at 16k tokens: teacher ~85
    # epochs, students ~65, i.e. 2.5x the tokens the `mini` AT needed to reach 33 BLEU).
    # Estimated from the `full --fp16` run on an H100 (AT 800 updates in 105 s at 4k tokens;
    # small models are latency-bound there, so 4x tokens cost well under 4x time): teacher
    # ~6 min, distill ~2, AT, HRT and MP ~4-5 each, benchmark ~7: about 30 minutes, resumable
    # across 10-minute commands (markers, checkpoint_last.pt).
    "gpu": Profile(
        vocab_size=8000,
        subset=None,
        max_tokens=16384,
        teacher_arch="at_small",
        teacher_args=["--decoder-layers", "3"],
        teacher=Budget(max_update=2000, stop_time_hours=0.2, lr=2e-3, warmup=500),
        at_arch="at_small",
        hrt_arch="hrt_small",
        mp_arch="cmlm_small",
        student=Budget(max_update=1500, stop_time_hours=0.15, lr=2e-3, warmup=500),
        distill_beam=5,
        distill_nbest=5,
        validate=True,
        log_interval=50,
        bench_sentences=0,
        bench_bs1_sentences=100,
        bench_parallel="pj,pgj,hgj,hrt-spec",
    ),
    # The converged study of the `full` shapes (examples/multi30k/study.py --profile small
    # --converged): d = 256, 6 encoder layers, vocabulary 8000, all 29k pairs, no fixed-budget
    # teacher (the study's teacher and students train until their validation BLEU stops
    # rising). The student budget is the cap of such a run and the base of --scales studies.
    "small": Profile(
        vocab_size=8000,
        subset=None,
        max_tokens=4096,
        teacher_arch=None,
        teacher_args=[],
        teacher=None,
        at_arch="at_small",
        hrt_arch="hrt_small",
        mp_arch="cmlm_small",
        student=Budget(max_update=800, stop_time_hours=0.5, lr=2e-3, warmup=300),
        distill_beam=0,
        distill_nbest=0,
        validate=True,
        log_interval=20,
        bench_sentences=0,
        bench_bs1_sentences=100,
    ),
    # The smallest run of every step (300 pairs, tens of updates, 10 test sentences): for
    # tests of the recipe itself (killed at any step and re-run, benchmarks/fault_table.py);
    # its numbers mean nothing.
    "tiny": Profile(
        vocab_size=200,
        subset=300,
        max_tokens=1024,
        teacher_arch="at_tiny",
        teacher_args=["--decoder-layers", "2"],
        teacher=Budget(max_update=30, stop_time_hours=0.05, lr=3e-3, warmup=10),
        at_arch="at_tiny",
        hrt_arch="hrt_tiny",
        mp_arch="cmlm_tiny",
        student=Budget(max_update=60, stop_time_hours=0.05, lr=3e-3, warmup=10),
        distill_beam=2,
        distill_nbest=2,
        validate=False,
        log_interval=1,
        bench_sentences=10,
        bench_bs1_sentences=2,
        bench_batch_sizes="1,8",
        bench_max_len_b=40,
        bench_max_len_a=0.0,
    ),
    # The quickstart's shape (at_mini / hrt_mini: d = 128, 3-1, vocabulary 4000) on raw
    # data, no teacher: the base budget of the convergence study on 2 CPU cores
    # (examples/multi30k/study.py), about 0.35 s per AT and 0.55 s per HRT update.
    "mini": Profile(
        vocab_size=4000,
        subset=None,
        max_tokens=4096,
        teacher_arch=None,
        teacher_args=[],
        teacher=None,
        at_arch="at_mini",
        hrt_arch="hrt_mini",
        mp_arch="cmlm_mini",
        student=Budget(max_update=300, stop_time_hours=0.5, lr=4e-3, warmup=150),
        distill_beam=0,
        distill_nbest=0,
        validate=True,
        log_interval=20,
        bench_sentences=0,
        bench_bs1_sentences=100,
    ),
}

STEPS = [
    "prepare",
    "teacher",
    "distill",
    "distill_bin",
    "at",
    "hrt",
    "mp",
    "ssru",
    "ssru_tied",
    "shortlist",
    "benchmark",
]
DISTILL_STEPS = ("teacher", "distill", "distill_bin")
SSRU_STEPS = ("ssru", "ssru_tied")
# Marian's WNGT 2019 students (README, "Marian-style students"): name -> options beside the
# SSRU twin of the AT student's arch
SSRU_STUDENTS = {"ssru": [], "ssru_tied": ["--decoder-layers", "2", "--decoder-tie-layers"]}


CPU_BF16_HELP = (
    "CPU only: train every model under bfloat16 autocast (the task's --cpu-autocast-bf16); distillation and "
    "the benchmark stay in float32. Measure before using it: about 2x float32's updates a second on an AMD EPYC "
    "with AVX512-BF16, but 0.6x on an Intel Xeon with AVX512-BF16 and no AMX; refused on a CPU with neither "
    "(it would emulate bfloat16, many times slower than float32)"
)


def log(msg: str):
    print(f"[recipe] {msg}", file=sys.stderr, flush=True)


class StepError(RuntimeError):
    pass


class Recipe:
    def __init__(self, args):
        self.args = args
        self.profile = PROFILES[args.profile]
        self.out = Path(args.out).resolve()
        self.data = self.out / "data"
        self.data_bin = self.data / "data-bin"
        self.markers = self.out / "markers"
        self.logs = self.out / "logs"
        self.threads = args.threads or idle_cores()
        self.cpu = not cuda_available()
        if args.fp16 and self.cpu:
            raise StepError("--fp16 needs a GPU: half-precision matmuls on CPU are slower, not faster")
        # the device flags of every fairseq command (--fp16 implies a GPU, checked above)
        self.device_args = ["--cpu"] if self.cpu else (["--fp16"] if args.fp16 else [])
        if args.cpu_bf16 and not self.cpu:
            raise StepError("--cpu-bf16 is for training on the CPU; on a GPU use --fp16")
        if args.cpu_bf16 and not cpu_has_native_bf16():
            # measured on a 2-core AMD EPYC without AVX512: the small teacher trained fewer than
            # 20 updates in 15 minutes under autocast, 0.38-0.54 updates/s in float32
            raise StepError(
                "--cpu-bf16: this CPU has no native bfloat16 (AVX512-BF16 or AMX), so autocast would "
                "emulate every bfloat16 product, many times slower than float32. Leave --cpu-bf16 out "
                "(with another --out for a run begun under it: its precision is part of its settings)"
            )
        # training only: distillation, validation and the benchmark run in float32 whatever this is
        self.train_precision_args = ["--cpu-autocast-bf16"] if args.cpu_bf16 else []
        self.env = dict(os.environ)
        self.env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        for name, value in GLIBC_MALLOC_KEEP.items():
            self.env.setdefault(name, value)
        # prepare.sh calls `python` and fairseq's console scripts: those of this interpreter
        self.env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), self.env.get("PATH", "")))
        # the plugin importable from the children, wherever they start
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH", "")) if p)
        self.train_env = training_env(self.env) if self.cpu else self.env

    # ------------------------------------------------------------------ helpers

    def device_words(self) -> str:
        """Where and in what precision the models are trained, for the reports."""
        if not self.cpu:
            return "GPU" + (" fp16" if self.args.fp16 else "")
        return f"CPU, {self.threads} thread(s)" + (", trained under bfloat16 autocast" if self.args.cpu_bf16 else "")

    def checkpoint(self, name: str) -> Path:
        # The model at the end of the budget: the students are compared after the same
        # amount of training (best-by-valid-loss would compare different amounts, and for HRT
        # pick a model from earlier in the chunk curriculum).
        return self.out / name / "checkpoint_last.pt"

    def run_step(
        self,
        index: int,
        name: str,
        cmd: List[str],
        outputs: List[Path],
        train_max_update: int = 0,
        own_log: bool = False,
        redo_if_changed: bool = False,
    ):
        """Run ``cmd`` unless the step's marker says it is done with this very command.

        A marker of another command is an error (outputs of different settings must not be
        mixed), except for steps with ``redo_if_changed``, which only read other steps'
        outputs (the benchmark: e.g. MP became available after a first run without it).
        """
        tag = f"step {index}/{len(STEPS)} {name}"
        marker = self.markers / f"{name}.done"
        cmd_file = self.markers / f"{name}.cmd"
        cmd_str = shlex.join(str(c) for c in cmd)
        if marker.exists() and redo_if_changed and not same_command(marker.read_text(), cmd_str):
            log(f"{tag}: its command changed since it was done, running it again")
            marker.unlink()
            cmd_file.unlink(missing_ok=True)
        log_path = self.logs / f"{name}.log"
        if marker.exists():
            done_cmd = marker.read_text()
            if same_command(done_cmd, cmd_str):
                log(f"{tag}: skipped, done earlier ({marker})")
                return
            if not (train_max_update and same_command(done_cmd, cmd_str, ignore=(TIME_CAP_OPTION,))):
                raise StepError(
                    f"{tag}: {marker} was made by another command than this run's (another profile "
                    f"or version of the recipe?). Delete {self.out} or use another --out.\n"
                    f"  done:  {done_cmd.strip()}\n  now:   {cmd_str}"
                )
            if not self.train_on_under_another_cap(tag, done_cmd, cmd_str, log_path, train_max_update):
                return
            marker.unlink()
        self.markers.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        # one process per step: two processes on one step would write the same checkpoints
        with step_lock(self.markers / f"{name}.lock", tag):
            if marker.exists():  # done by another process while this one reached the step
                log(f"{tag}: skipped, done meanwhile ({marker})")
                return
            before = cmd_file.read_text() if cmd_file.exists() else cmd_str
            if not same_command(before, cmd_str):
                if not (train_max_update and same_command(before, cmd_str, ignore=(TIME_CAP_OPTION,))):
                    raise StepError(
                        f"{tag}: an interrupted run of another command is in {self.out} (see {cmd_file}). "
                        f"Delete {self.out} or use another --out."
                    )
                # fairseq counts --stop-time-hours over restarts (the checkpoint keeps the time
                # trained), so an unfinished run resumed under another cap goes on to that one
                log(
                    f"{tag}: its time cap is now {option_value(cmd_str, TIME_CAP_OPTION)} h "
                    f"(its last run had {option_value(before, TIME_CAP_OPTION)} h)"
                )
            write_atomic(cmd_file, cmd_str + "\n")
            resumed = train_max_update and (self.out / name / "checkpoint_last.pt").exists()
            log(f"{tag}: {'resuming' if resumed else 'running'}, log in {log_path}")
            start = time.time()
            with open(log_path, "a") as log_file:
                log_file.write(f"$ {cmd_str}\n")
                log_file.flush()
                if train_max_update:
                    rc = run_with_update_bar(cmd, self.train_env, log_file, log_path, train_max_update, name)
                elif own_log:
                    # the command logs to the file itself (--log-file) and draws its progress bar
                    # on the terminal (stderr); what it prints (the benchmark's table) is logged too
                    rc = subprocess.run(cmd, env=self.env, stdout=log_file, preexec_fn=die_with_parent).returncode
                else:
                    rc = subprocess.run(
                        cmd, env=self.env, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
                    ).returncode
            if rc != 0:
                raise StepError(f"{tag}: failed (exit {rc}); see {log_path}:\n{tail(log_path)}")
            missing = [str(p) for p in outputs if not p.exists()]
            if missing:
                raise StepError(f"{tag}: finished but did not produce {', '.join(missing)}; see {log_path}")
            note = ""
            if train_max_update:
                done = last_num_updates(log_path)
                if done is not None and done < train_max_update:
                    cause = "patience" if stopped_early(log_path) else "the time cap"
                    note = f" (stopped by {cause} after {done} of {train_max_update} updates)"
            write_atomic(marker, cmd_str + "\n")
            log(f"{tag}: done in {time.time() - start:.0f}s{note} -> {', '.join(str(p) for p in outputs)}")

    def train_on_under_another_cap(
        self, tag: str, done_cmd: str, cmd_str: str, log_path: Path, max_update: int
    ) -> bool:
        """A training step done under another ``--stop-time-hours`` than this run's, all else equal:
        True to train it on (its cap stopped it and this one is higher: fairseq resumes from its
        last checkpoint and counts the time trained before), False where its outputs stand, with
        the marker of the command that made them (the cap did not stop it, this one is no lower).
        A lower cap might have stopped it elsewhere: refused."""
        before, now = (float(option_value(c, TIME_CAP_OPTION) or 0) for c in (done_cmd, cmd_str))
        by_cap = log_path.exists() and stopped_by_time_cap(log_path, max_update)
        if by_cap and now > before:
            log(f"{tag}: stopped by its {before:g} h time cap, training on up to {now:g} h")
            return True
        if not by_cap and now >= before:
            log(f"{tag}: done earlier under a {before:g} h time cap, which did not stop it; it stands under {now:g} h")
            return False
        raise StepError(
            f"{tag}: it was trained under a {before:g} h time cap"
            + (", which stopped it" if by_cap else "")
            + f"; this run's {now:g} h would have stopped it elsewhere. Pass {before:g} h again "
            f"(or a higher cap), or use another --out.\n  done:  {done_cmd.strip()}\n  now:   {cmd_str}"
        )

    def train_cmd(
        self, name: str, arch: str, budget: Budget, extra: List[str], seed: Optional[int] = None
    ) -> List[str]:
        """The fairseq-train command of a model saved in ``OUT/name``; ``seed``: default ``--seed``."""
        p = self.profile
        cmd = [
            sys.executable,
            "-m",
            "fairseq_cli.train",
            str(self.data_bin),
            "--user-dir",
            str(USER_DIR),
            "--task",
            "hrt_translation",
            "--source-lang",
            "en",
            "--target-lang",
            "de",
            "--arch",
            arch,
            "--share-all-embeddings",
            "--criterion",
            "hrt_loss",
            "--label-smoothing",
            "0.1",
            "--optimizer",
            "adam",
            "--adam-betas",
            "(0.9, 0.98)",
            "--clip-norm",
            "1.0",
            "--lr",
            str(budget.lr),
            "--lr-scheduler",
            "inverse_sqrt",
            "--warmup-updates",
            str(budget.warmup),
            "--warmup-init-lr",
            "1e-07",
            "--max-tokens",
            str(p.max_tokens),
            "--max-update",
            str(budget.max_update),
            "--stop-time-hours",
            str(budget.stop_time_hours),
            "--save-dir",
            str(self.out / name),
            "--no-epoch-checkpoints",
            "--log-format",
            "json",
            "--log-interval",
            str(p.log_interval),
            "--seed",
            str(self.args.seed if seed is None else seed),
            "--num-workers",
            "0",
        ]
        if not p.validate:
            cmd.append("--disable-validation")
        return cmd + self.device_args + self.train_precision_args + extra

    # ------------------------------------------------------------------ steps

    def step_prepare(self, i):
        p = self.profile
        cmd = ["bash", str(SCRIPT_DIR / "prepare.sh"), "--out", str(self.data), "--vocab-size", str(p.vocab_size)]
        if p.subset:
            cmd += ["--subset", str(p.subset)]
        if self.args.raw_dir:
            cmd += ["--raw-dir", str(Path(self.args.raw_dir).resolve())]
        self.run_step(i, "prepare", cmd, [self.data_bin / "dict.en.txt", self.data / "spm" / "spm.model"])

    def step_teacher(self, i):
        p = self.profile
        cmd = self.train_cmd("teacher", p.teacher_arch, p.teacher, ["--hrt-mode", "at", *p.teacher_args])
        self.run_step(i, "teacher", cmd, [self.checkpoint("teacher")], train_max_update=p.teacher.max_update)

    def step_distill(self, i):
        out = self.out / "distill" / "train.de"
        self.run_step(
            i,
            "distill",
            self.distill_cmd(self.checkpoint("teacher"), out, self.logs / "distill.log"),
            [out],
            own_log=True,
        )

    def distill_cmd(
        self, teacher: Path, out: Path, log_file: Path, beam: int = 0, nbest: int = 0, engine: Optional[str] = None
    ) -> List[str]:
        """Sequence-level KD of the training set by ``teacher`` into ``out`` (pieces); beam and
        n-best default to the profile's; ``engine``: ``--decoder-engine`` (default lean)."""
        p = self.profile
        cmd = [
            sys.executable,
            "-m",
            "fairseq_hrt.distill",
            "--data",
            str(self.data_bin),
            "--path",
            str(teacher),
            "--src",
            str(self.data / "spm" / "train.en"),
            "--out",
            str(out),
            "--beam",
            str(beam or p.distill_beam),
            "--nbest",
            str(nbest or p.distill_nbest),
            "--select-by-bleu",
            str(self.data / "raw" / "train.de"),
            "--post-process",
            "sentencepiece",
            # an under-trained teacher can loop until the 200-token limit: cap the length
            # well above any real Multi30k translation (target/source piece ratio ~1.1)
            "--max-len-a",
            "1.5",
            "--max-len-b",
            "10",
            "--threads",
            str(self.threads),
            "--log-file",
            str(log_file),
        ]
        if engine:
            cmd += ["--decoder-engine", engine]
        return cmd + self.device_args

    def step_distill_bin(self, i):
        dest = self.out / "distill-bin"
        cmd = self.distill_bin_cmd(self.out / "distill", dest)
        self.run_step(i, "distill_bin", cmd, [dest / "train.en-de.de.bin", dest / "train.en-de.de.idx"])

    def distill_bin_cmd(self, distill: Path, dest: Path) -> List[str]:
        """fairseq-preprocess of a distilled training set with the data's dictionary."""
        # fairseq-preprocess needs the source side next to the distilled target
        src = distill / "train.en"
        if not src.exists():
            src.unlink(missing_ok=True)  # a dangling link left by a run killed between two steps
            src.parent.mkdir(parents=True, exist_ok=True)
            src.symlink_to(self.data / "spm" / "train.en")
        dict_path = self.data_bin / "dict.en.txt"
        return [
            sys.executable,
            "-m",
            "fairseq_cli.preprocess",
            "--source-lang",
            "en",
            "--target-lang",
            "de",
            "--trainpref",
            str(distill / "train"),
            "--srcdict",
            str(dict_path),
            "--tgtdict",
            str(dict_path),
            "--destdir",
            str(dest),
            "--workers",
            str(self.threads),
        ]

    def _student_args(self) -> List[str]:
        if not self.profile.distill:
            return []
        return ["--distill-data", str(self.out / "distill-bin"), "--p-raw", str(self.args.p_raw)]

    def hrt_args(self, chunk_sizes: str, at_checkpoint: Path) -> List[str]:
        """HRT fine-tuned from an AT student with the papers' curriculum (p_k = 1 at the last
        update). Several chunk sizes share the chunked pairs of a batch (see --hrt-chunk-sizes)."""
        return ["--chunk-sizes", chunk_sizes, "--finetune-from-model", str(at_checkpoint), *self._student_args()]

    def step_at(self, i):
        p = self.profile
        cmd = self.train_cmd("at", p.at_arch, p.student, ["--hrt-mode", "at", *self._student_args()])
        self.run_step(i, "at", cmd, [self.checkpoint("at")], train_max_update=p.student.max_update)

    def step_hrt(self, i):
        p = self.profile
        cmd = self.train_cmd(
            "hrt", p.hrt_arch, p.student, self.hrt_args(self.args.hrt_chunk_sizes, self.checkpoint("at"))
        )
        self.run_step(i, "hrt", cmd, [self.checkpoint("hrt")], train_max_update=p.student.max_update)

    def step_mp(self, i):
        p = self.profile
        if not arch_registered(p.mp_arch, self.env):
            log(
                f"step {i}/{len(STEPS)} mp: SKIPPED: --arch {p.mp_arch} is not registered by this version of "
                "fairseq_hrt (Mask-Predict baseline not available); the benchmark runs without MP"
            )
            return
        cmd = self.train_cmd(
            "mp",
            p.mp_arch,
            p.student,
            ["--hrt-mode", "cmlm", "--finetune-from-model", str(self.checkpoint("at")), *self._student_args()],
        )
        self.run_step(i, "mp", cmd, [self.checkpoint("mp")], train_max_update=p.student.max_update)

    def ssru_cmd(self, name: str) -> List[str]:
        """An SSRU student: the AT student's command with the SSRU twin of its arch."""
        p = self.profile
        return self.train_cmd(
            name, f"{p.at_arch}_ssru", p.student, ["--hrt-mode", "at", *SSRU_STUDENTS[name], *self._student_args()]
        )

    def step_ssru(self, i):
        self.run_step(
            i,
            "ssru",
            self.ssru_cmd("ssru"),
            [self.checkpoint("ssru")],
            train_max_update=self.profile.student.max_update,
        )

    def step_ssru_tied(self, i):
        self.run_step(
            i,
            "ssru_tied",
            self.ssru_cmd("ssru_tied"),
            [self.checkpoint("ssru_tied")],
            train_max_update=self.profile.student.max_update,
        )

    def ssru_extra_rows(self) -> List[str]:
        """``--at-extra`` rows of the SSRU students this run trained."""
        out = []
        for name in SSRU_STUDENTS:
            if self.checkpoint(name).exists() and (self.markers / f"{name}.done").exists():
                out += ["--at-extra", f"{name.replace('_', '-')}={self.checkpoint(name)}"]
        return out

    def shortlist_file(self) -> Path:
        return self.out / "shortlist" / "shortlist.pt"

    def step_shortlist(self, i):
        p = self.profile
        cmd = [
            sys.executable,
            "-m",
            "fairseq_hrt.shortlist",
            str(self.data_bin),
            "--output",
            str(self.shortlist_file()),
            "--per-source",
            str(p.shortlist_per_source),
            "--frequent",
            str(p.shortlist_frequent),
        ]
        self.run_step(i, "shortlist", cmd, [self.shortlist_file()])

    def test_set_args(self) -> List[str]:
        """The measuring scripts' test-data flags (``benchmarks.measure.add_data_arguments``):
        the dictionaries, the SentencePiece model, test2016 in pieces and raw, its references."""
        return [
            "--data",
            str(self.data_bin),
            "--spm",
            str(self.data / "spm" / "spm.model"),
            "--src",
            str(self.data / "spm" / "test.en"),
            "--raw-src",
            str(self.data / "raw" / "test.en"),
            "--raw-ref",
            str(self.data / "raw" / "test.de"),
        ]

    def step_benchmark(self, i):
        p = self.profile
        bench = self.out / "benchmark"
        cmd = [
            sys.executable,
            str(REPO / "benchmarks" / "benchmark.py"),
            *self.test_set_args(),
            "--at",
            str(self.checkpoint("at")),
            "--hrt",
            str(self.checkpoint("hrt")),
            "--hrt-chunk-sizes",
            self.args.hrt_chunk_sizes,
            "--batch-sizes",
            p.bench_batch_sizes,
            "--bs1-sentences",
            str(p.bench_bs1_sentences),
            "--max-sentences",
            str(p.bench_sentences),
            "--threads",
            str(self.threads),
            "--out-dir",
            str(bench),
            "--log-file",
            str(self.logs / "benchmark.log"),
        ]
        cmd += ["--max-len-b", str(p.bench_max_len_b)]
        if p.bench_max_len_a:
            cmd += ["--max-len-a", str(p.bench_max_len_a)]
        if p.bench_parallel:
            cmd += ["--parallel", p.bench_parallel]
        if self.checkpoint("mp").exists() and (self.markers / "mp.done").exists():
            cmd += ["--mp", str(self.checkpoint("mp"))]
        if self.args.ssru_students:
            cmd += self.ssru_extra_rows()
        if self.shortlist_file().exists() and (self.markers / "shortlist.done").exists():
            cmd += ["--shortlist", str(self.shortlist_file())]
        if self.args.comet_model:
            cmd += ["--comet-model", str(Path(self.args.comet_model).resolve())]
        self.run_step(
            i,
            "benchmark",
            cmd + self.device_args,
            [bench / "report.json", bench / "report.md", bench / "pareto.png"],
            own_log=True,
            redo_if_changed=True,
        )

    def run(self):
        self.out.mkdir(parents=True, exist_ok=True)
        settings = self.out / "recipe.json"
        mine = {"profile": self.args.profile, "seed": self.args.seed, "p_raw": self.args.p_raw}
        if self.args.hrt_chunk_sizes != "2,3,4":  # runs made before single-k training still match
            mine["hrt_chunk_sizes"] = self.args.hrt_chunk_sizes
        if self.args.fp16:  # only when set, so that runs made before the option still match
            mine["fp16"] = True
        if self.args.cpu_bf16:
            mine["cpu_bf16"] = True
        if settings.exists() and json.loads(settings.read_text()) != mine:
            raise StepError(
                f"{self.out} holds a run with settings {settings.read_text().strip()}, now asked for {mine}. "
                "Use another --out or delete it."
            )
        write_atomic(settings, json.dumps(mine) + "\n")
        log(f"profile {self.args.profile}, output {self.out}, {self.threads} CPU thread(s), {self.device_words()}")
        start = time.time()
        for i, name in enumerate(STEPS, 1):
            if self.args.until and STEPS.index(name) > STEPS.index(self.args.until):
                break
            if name in DISTILL_STEPS and not self.profile.distill:
                log(f"step {i}/{len(STEPS)} {name}: not in profile {self.args.profile} (students train on raw data)")
                continue
            if name in SSRU_STEPS and not self.args.ssru_students:
                log(f"step {i}/{len(STEPS)} {name}: not requested (--ssru-students)")
                continue
            getattr(self, f"step_{name}")(i)
        log(f"all steps done in {time.time() - start:.0f}s")
        report = self.out / "benchmark" / "report.md"
        if report.exists() and not self.args.until:
            print(report.read_text())


# --------------------------------------------------------------------------- utilities


# options that only set parallelism, from --threads, whose default (idle cores at start) may
# change from one run of the recipe to the next
_PARALLELISM_OPTIONS = ("--threads", "--workers")


# fairseq-train's time cap: a training step may change it (see Recipe.run_step)
TIME_CAP_OPTION = "--stop-time-hours"


def same_command(a: str, b: str, ignore: tuple = ()) -> bool:
    """Whether two step commands make the same outputs: equal but for parallelism options (and
    for the options in ``ignore``, each with its value)."""
    skip = (*_PARALLELISM_OPTIONS, *ignore)

    def key(cmd: str) -> List[str]:
        words = shlex.split(cmd)
        return [w for i, w in enumerate(words) if w not in skip and (i == 0 or words[i - 1] not in skip)]

    return key(a) == key(b)


def option_value(cmd: str, option: str) -> Optional[str]:
    """The value of ``option`` in a command line (its last occurrence), or None."""
    words = shlex.split(cmd)
    found = None
    for i, w in enumerate(words[:-1]):
        if w == option:
            found = words[i + 1]
    return found


@contextmanager
def step_lock(path: Path, tag: str):
    """Hold an exclusive lock on ``path`` while a step runs: a second process that reaches the
    same step (two lanes given overlapping ``--only`` lists, or a full run started beside a
    lane) stops with a message instead of training into the same folder. The lock goes with
    the process, however it ends."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise StepError(
            f"{tag}: {owner} is running this step now ({path}). Give each process its own steps "
            "(--only), and run the study without --only once they are done."
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()} (since {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        handle.flush()
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def write_atomic(path: Path, text: str):
    """Write through ``path.part`` and a rename: a marker or command file is complete or absent,
    so a run killed while writing one is not mistaken, on re-run, for a run of another command."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def die_with_parent():
    """In a step's child process (``preexec_fn``): be killed when the recipe dies.

    Why: a recipe killed with SIGKILL (the OOM killer, ``kill -9``) cannot stop its running
    step, which went on as an orphan, still writing checkpoints or the distilled corpus while
    the re-run started the same step in the same folder. Linux's parent-death signal ends the
    child with the recipe; elsewhere this does nothing.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the recipe died before prctl: do not start as an orphan
            os._exit(1)
    except (OSError, AttributeError):
        pass


def _cpu_times() -> List[int]:
    with open("/proc/stat") as f:  # cpu user nice system idle iowait irq softirq steal
        return [int(x) for x in f.readline().split()[1:9]]


def idle_cores() -> int:
    """Cores idle at start, at least 1: on a busy 2-core machine two OpenMP threads wait on
    each other and run slower than one (see examples/multi30k/README.md). Measured over one
    second from /proc/stat, not with the 1-minute load average, which right after
    ``pip install`` still counts the finished install."""
    n = os.cpu_count() or 1
    try:
        before = _cpu_times()
        time.sleep(1.0)
        after = _cpu_times()
    except (OSError, ValueError):
        return n
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta)
    busy = n * (total - delta[3] - delta[4]) / total if total > 0 else 0.0
    return max(1, min(n, int(n - busy + 0.5)))


def cuda_available() -> bool:
    import torch  # noqa: PLC0415 - optional: PyTorch (the recipe runs its stages as commands)

    return torch.cuda.is_available()


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bfloat16 natively here (AVX512-BF16 or AMX), as the task checks."""
    import torch  # noqa: PLC0415 - optional, as in cuda_available

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def arch_registered(arch: str, env) -> bool:
    """Whether the plugin registers ``--arch arch`` (asked in a child: importing fairseq here
    would set up its logging in the driver)."""
    code = (
        "import sys, fairseq_hrt; from fairseq.models import ARCH_MODEL_REGISTRY; "
        f"sys.exit(0 if {arch!r} in ARCH_MODEL_REGISTRY else 3)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if proc.returncode not in (0, 3):
        raise StepError(f"could not import fairseq_hrt to look up --arch {arch}:\n{proc.stderr.decode()[-3000:]}")
    return proc.returncode == 0


_NUM_UPDATES = re.compile(r'"(?:train_)?num_updates":\s*"?(\d+)')


def stopped_early(log_path: Path) -> bool:
    """Whether the last run in a fairseq-train log was stopped by ``--patience``."""
    text = log_path.read_text(errors="replace")
    return "early stop since valid performance hasn't improved" in text[text.rfind("\n$ ") + 1 :]


def stopped_by_time_cap(log_path: Path, max_update: int) -> bool:
    """Whether the last run in a fairseq-train log ended short of ``max_update`` without patience
    stopping it: ``--stop-time-hours`` did."""
    done = last_num_updates(log_path)
    return done is not None and done < max_update and not stopped_early(log_path)


def last_num_updates(log_path: Path) -> Optional[int]:
    found = None
    with open(log_path, errors="replace") as f:
        for line in f:
            m = _NUM_UPDATES.search(line)
            if m:
                found = int(m.group(1))
    return found


def run_with_update_bar(cmd, env, log_file, log_path: Path, max_update: int, desc: str) -> int:
    """Run a fairseq-train command with its output in ``log_file`` and a progress bar of its
    updates (read back from the json log lines) on the terminal."""
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    bar = tqdm(total=max_update, desc=desc, unit="upd", disable=None)
    stop = threading.Event()

    def follow():
        while not stop.wait(2.0):
            done = last_num_updates(log_path)
            if done is not None and done > bar.n:
                bar.update(done - bar.n)

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (see main): stop the training too
        proc.terminate()
        proc.wait()
        raise
    finally:
        stop.set()
        watcher.join()
        bar.close()
    return rc


def tail(path: Path, n: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="quick",
        help="quick: tiny models on 2000 pairs, minutes (a smoke run); full: CPU-sized models, about 2 h on 2 cores; "
        "gpu: the full shapes with converging budgets, --fp16 on one GPU, about 30 min; mini: the quickstart's "
        "shape on raw data (no teacher), the base budget of examples/multi30k/study.py",
    )
    p.add_argument("--out", help="output directory (default: work/recipe-<profile> under the repository root)")
    p.add_argument("--raw-dir", help="raw Multi30k directory (default: prepare.sh's search order)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for every step (default: idle cores at start)")
    p.add_argument("--p-raw", type=float, default=0.5, help="MixDistill: probability of the raw target (students)")
    p.add_argument(
        "--hrt-chunk-sizes",
        default="2",
        help="chunk sizes k the HRT student trains (and the benchmark decodes). Default 2, as the papers "
        "(one model per k). A list such as 2,3,4 trains one model for several k, at a cost: the chunked "
        "pairs of a batch are shared among the k, so each k sees 1/len of them (measured on the "
        "quickstart shape: 2,3,4 scored 4.7 BLEU below k=2 alone at k=2 greedy; see README)",
    )
    p.add_argument(
        "--ssru-students",
        action="store_true",
        help="also train Marian's SSRU students (an SSRU in place of decoder self-attention; one "
        "layer, and two tied layers) on the AT student's data and budget, benchmarked as extra "
        "AT rows (README: 'Marian-style students')",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--fp16",
        action="store_true",
        help="GPU only: train, distill and benchmark in half precision (fairseq's --fp16)",
    )
    p.add_argument("--cpu-bf16", action="store_true", help=CPU_BF16_HELP)
    p.add_argument("--comet-model", help="local COMET model for the benchmark (default: $COMET_MODEL, else none)")
    p.add_argument("--until", choices=STEPS, help="stop after this step")
    args = p.parse_args(argv)
    if not args.out:
        args.out = str(REPO / "work" / f"recipe-{args.profile}")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run_resumable(make_runner):
    """Build a recipe-like object and ``run()`` it as a command: step errors and
    interruptions end it with a message and an exit code; the same command resumes it."""
    # SIGTERM like Ctrl-C, so that the running step's child process is stopped as well
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        make_runner().run()
    except StepError as e:
        log(f"ERROR: {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        log("interrupted; run the same command again to resume")
        sys.exit(130)


def main(argv=None):
    args = parse_args(argv)
    run_resumable(lambda: Recipe(args))


if __name__ == "__main__":
    main()
