#!/usr/bin/env python
"""The papers' WMT set-ups, one command: teacher -> sharded distillation -> AT, HRT and
Mask-Predict students on MixDistill data -> averaging -> evaluation -> benchmark -> export.

    python examples/wmt/recipe.py --setup wmt16_en_ro --work work/wmt16_en_ro [--gpus 8]
    python examples/wmt/recipe.py --setup wmt16_en_ro --work /tmp/slice --slice   # CPU, minutes
    python examples/wmt/recipe.py --setup wmt22_e12d1 --work W --print-commands   # nothing runs

Steps, in order (``--steps a,b`` runs some of them; each needs the outputs of those before it):

 download     download.py: the raw parallel text (--slice: a slice of shared/data's newstest files)
 prepare      prepare.py: joint SentencePiece BPE model, every split encoded
 binarize     fairseq-preprocess --joined-dictionary
 teacher      fairseq-train: the AT teacher on the raw data
 distill      python -m fairseq_hrt.distill, one shard per GPU (--num-shards/--shard-id)
 merge        python -m fairseq_hrt.distill --merge: the shards in source order
 distill_bin  fairseq-preprocess of the distilled targets with the raw data's dictionary
 at_student   fairseq-train: the AT student (MixDistill, --p-raw)
 hrt          fairseq-train: one HRT model per chunk size k, fine-tuned from the AT student
 mp           fairseq-train: Mask-Predict fine-tuned from the AT student (the HRT paper's set-ups)
 average      python -m fairseq_hrt.average_checkpoints: the last N interval checkpoints
 evaluate     fairseq-generate of the test set + python -m fairseq_hrt.evaluate per model
 benchmark    benchmarks/benchmark.py at batch 1, 8 and 128: words/s, speed-up vs AT greedy
 export       fairseq-hrt-export of the students (ONNX Runtime)

The settings are the papers' (setups.py cites each); ``--slice`` swaps in small models and
budgets. ``--corpus DIR`` trains on your own parallel text ({train,valid,test}.{SRC,TGT}) in
place of the download (read where it is; its two sides are checked before anything runs).
A finished step leaves WORK/markers/<step>.json: what it read (its commands, its input files,
the steps before it) and their digest (markers.py). A rerun skips it while that digest holds,
and does it again, with every step after it, when its inputs changed (it says which); what the
old run made is moved to WORK/stale/, never deleted. ``--redo STEP`` does the same on demand.
A step of several jobs (shards, one model per k) keeps one marker per job in
WORK/markers/<step>/, so a rerun does only what is missing. Logs: WORK/logs/<job>.log. At the
end WORK/results.md and WORK/results.json hold the table, written only from evaluations of the
current models.

Jobs go through submitit (WORK/submitit): ``--launcher local`` (a subprocess per job),
``debug`` (in this process) or ``slurm`` (sbatch; a training job gets ``--nodes`` x ``--gpus``
tasks, one per GPU (on CPU one per node), and fairseq's own SLURM initialisation ranks them:
examples/wmt/launch.py; a two-node cluster on this machine: examples/wmt/local_slurm.sh). Locally on
several GPUs training runs under torchrun; ``--update-freq`` reaches the paper's tokens per
update on fewer GPUs (printed: paper tokens / (GPUs x max-tokens), rounded up).
"""

import argparse
import importlib.util
import math
import os
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import cloudpickle
import submitit
import torch

SCRIPT_DIR = Path(__file__).resolve().parent
REPO = SCRIPT_DIR.parents[1]
sys.path.insert(0, str(SCRIPT_DIR))
import launch  # noqa: E402
from corpus import SPLITS, checkpoint_problem, count_lines, parallel_text_problem  # noqa: E402
from markers import Markers, digest_of, step_inputs  # noqa: E402
from results import BENCH_BATCH_SIZES, write_results  # noqa: E402
from setups import SETUPS, SLICE_SIZES, Setup, Training, slice_of  # noqa: E402

# a job's function goes to the SLURM task by value: the task's Python cannot import examples/wmt
cloudpickle.register_pickle_by_value(launch)

# the Multi30k recipe's environment for long CPU runs (docs/training.md, "On a Linux CPU")
_spec = importlib.util.spec_from_file_location("multi30k_recipe", REPO / "examples" / "multi30k" / "recipe.py")
_multi30k = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_multi30k)
GLIBC_KEEP_FREED_MEMORY = _multi30k.GLIBC_KEEP_FREED_MEMORY
log = _multi30k.log

STEPS = (
    "download prepare binarize teacher distill merge distill_bin at_student hrt mp average evaluate benchmark export"
).split()
# the steps whose outputs each step reads: one of them done again makes it run again
UPSTREAM = {
    "download": (),
    "prepare": ("download",),
    "binarize": ("prepare",),
    "teacher": ("binarize",),
    "distill": ("teacher", "prepare", "binarize"),
    "merge": ("distill",),
    "distill_bin": ("merge", "binarize", "prepare"),
    "at_student": ("distill_bin", "binarize"),
    "hrt": ("at_student", "distill_bin", "binarize"),
    "mp": ("at_student", "distill_bin", "binarize"),
    "average": ("at_student", "hrt", "mp"),
    "evaluate": ("average", "teacher", "prepare", "binarize"),
    "benchmark": ("average", "prepare", "binarize"),
    "export": ("average", "prepare", "binarize"),
}
SHARED_DATA = REPO.parent / "shared" / "data"
SLICE_SHARDS = 2  # --slice distills in two shards and merges them, as N GPUs would
DISTRIBUTED_PORT = launch.DISTRIBUTED_PORT


class StepOrderError(Exception):
    """A step whose inputs are missing: the message names the step to run first."""


@dataclass
class Job:
    label: str  # its log and marker name
    command: str  # one shell command line
    train: bool = False  # a fairseq-train: the step's nodes x GPUs, distributed
    gpu: Optional[int] = None  # a single-GPU job pinned to this GPU (distillation shards, locally)


@dataclass
class Step:
    name: str
    jobs: List[Job]
    needs: List[Tuple[Path, str]] = field(default_factory=list)  # (input, the step that makes it)
    parallel: bool = False  # jobs run at the same time (the distillation shards)
    skip_reason: str = ""  # why this set-up has no such step


def sh(words: Sequence) -> str:
    return shlex.join(str(w) for w in words)


def update_freq(training: Training, gpus: int) -> int:
    """--update-freq that reaches the paper's tokens per update on ``gpus`` devices."""
    return max(1, math.ceil(training.tokens_per_update / (max(1, gpus) * training.max_tokens)))


# runs one job's command where submitit put it (examples/wmt/launch.py)
run_job = launch.run_task


class Recipe:
    def __init__(self, args):
        self.args = args
        self.setup: Setup = slice_of(SETUPS[args.setup], args.slice_size) if args.slice else SETUPS[args.setup]
        if args.langs:  # a corpus of another pair: the set-up's recipe, the pair's own scoring
            src, tgt = args.langs.split("-")
            self.setup = replace(
                self.setup, src=src, tgt=tgt, compound_split=self.setup.compound_split and tgt == "de",
                remove_ro_diacritics=self.setup.remove_ro_diacritics and tgt == "ro",
            )  # fmt: skip
        self.work = Path(args.work)
        self.cwd = os.getcwd()
        self.gpus = args.gpus
        self.nodes = args.nodes
        self.total_gpus = self.gpus * self.nodes
        # the processes of a training job: one per GPU; on CPU one per SLURM node, or one alone
        self.ranks = max(1, self.gpus) * (self.nodes if args.launcher == "slurm" else 1)
        self.cpu = self.gpus == 0
        self.threads = args.threads
        # a CPU slice distills in two shards and merges them, as two GPUs would
        self.shards = SLICE_SHARDS if self.cpu and args.slice else max(1, self.total_gpus)
        s = self.setup
        self.data = self.work / "data"
        self.data_bin = self.work / "data-bin"
        self.corpus = Path(args.corpus) if args.corpus else None
        self.raw = self.corpus or self.work / "download" / s.download_setup / "raw"
        self.distill_out = self.work / "distill" / f"train.{s.tgt}"
        self.markers = Markers(self.work / "markers")
        self.redo = set(args.redo.split(",")) if args.redo else set()
        self.logs = self.work / "logs"

    # ------------------------------------------------------------------ paths and options

    def path(self, p) -> str:
        """A path of a command: relative to the current directory where it lies below it (the
        commands the README shows), absolute otherwise."""
        p = Path(p)
        absolute = p if p.is_absolute() else Path(self.cwd) / p
        try:
            return str(absolute.relative_to(self.cwd))
        except ValueError:
            return str(absolute)

    def model_dir(self, name: str) -> Path:
        return self.work / name

    def last(self, name: str) -> Path:
        return self.model_dir(name) / "checkpoint_last.pt"

    def averaged(self, name: str) -> Path:
        return self.model_dir(name) / "checkpoint_avg.pt"

    def students(self) -> List[str]:
        """The models averaged, evaluated and exported: AT, HRT per k, Mask-Predict."""
        names = ["at"] + [f"hrt-k{k}" for k in self.setup.hrt_chunk_sizes]
        return names + (["mp"] if self.setup.mp_student else [])

    def device_words(self) -> List[str]:
        if self.cpu:
            return ["--cpu"]
        return ["--fp16"] if self.args.fp16 else []

    def update_freq_for(self, training: Training) -> int:
        return self.args.update_freq or update_freq(training, self.ranks)

    def update_freq_note(self, training: Training) -> str:
        u = self.update_freq_for(training)
        if self.args.update_freq:
            return f"--update-freq {u} (given)"
        devices = "CPU process(es)" if self.cpu else "GPU(s)"
        source = "the slice's" if self.args.slice else "paper"
        return (
            f"--update-freq {u} = {training.tokens_per_update} tokens per update ({source}) / "
            f"({self.ranks} {devices} x {training.max_tokens} max-tokens), rounded up: "
            f"{u * self.ranks * training.max_tokens} tokens per update"
        )

    def train_launcher(self) -> List[str]:
        """The program of a training job: torchrun over the local GPUs, or fairseq-train (one per
        SLURM task, or alone)."""
        if self.args.launcher != "slurm" and self.gpus > 1:
            return ["torchrun", "--nproc-per-node", self.gpus, "-m", "fairseq_cli.train"]
        if self.args.launcher == "slurm" and self.cpu and self.nodes > 1:
            # fairseq's SLURM init counts GPUs for ranks: on CPU one rank per task (launch.py)
            return ["python", self.path(SCRIPT_DIR / "launch.py"), "fairseq-train"]
        return ["fairseq-train"]

    def train(self, name: str, training: Training, extra: Sequence) -> Job:
        s = self.setup
        words = [
            *self.train_launcher(), self.path(self.data_bin), "--user-dir", self.path(REPO / "fairseq_hrt"),
            "--task", "hrt_translation", "--source-lang", s.src, "--target-lang", s.tgt,
            "--arch", training.arch, *training.extra, "--share-all-embeddings",
            "--criterion", "hrt_loss", "--label-smoothing", s.label_smoothing,
            "--optimizer", "adam", "--adam-betas", str(training.adam_betas), "--adam-eps", training.adam_eps,
            "--clip-norm", "0.0",
            "--lr", training.lr, "--lr-scheduler", "inverse_sqrt", "--warmup-updates", training.warmup,
            "--warmup-init-lr", "1e-07", "--dropout", training.dropout, "--weight-decay", "0.0",
            "--max-tokens", training.max_tokens, "--update-freq", self.update_freq_for(training),
            "--max-update", training.max_update, "--save-dir", self.path(self.model_dir(name)),
            "--save-interval-updates", s.save_interval_updates, "--keep-interval-updates", s.average_last,
            "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", s.log_interval,
            "--seed", self.args.seed, *extra, *self.device_words(),
        ]  # fmt: skip
        if self.args.slice:
            # the slice's valid set is tiny and its numbers mean nothing: no validation passes
            words += ["--disable-validation", "--num-workers", "0"]
        words += launch.distributed_words(self.args.launcher, self.nodes, self.gpus, self.cpu)
        return Job(name, sh(words), train=True)

    def mix_distill(self) -> List:
        return ["--distill-data", self.path(self.work / "distill-bin"), "--p-raw", self.setup.p_raw]

    # ------------------------------------------------------------------ the steps

    def step(self, name: str) -> Step:
        s, p = self.setup, self.path
        dict_src = self.data_bin / f"dict.{s.src}.txt"
        if name == "download":
            if self.corpus:
                return Step(name, [], skip_reason=f"--corpus: {p(self.corpus)} is read where it is")
            if self.args.slice:
                words = ["python", p(SCRIPT_DIR / "make_slice.py"), "--setup", s.name, "--size", self.args.slice_size]
                words += ["--data", p(self.args.data)]
                words += ["--dest", p(self.work / "download")]
                words += ["--train-lines", self.args.slice_train_lines] if self.args.slice_train_lines else []
                words += ["--test-lines", self.args.slice_test_lines] if self.args.slice_test_lines else []
            else:
                words = ["python", p(SCRIPT_DIR / "download.py"), "--setup", s.download_setup]
                words += ["--dest", p(self.work / "download")]
            return Step(name, [Job(name, sh(words))])
        if name == "prepare":
            words = ["python", p(SCRIPT_DIR / "prepare.py"), "--raw", p(self.raw), "--out", p(self.data)]
            words += ["--src", s.src, "--tgt", s.tgt, "--vocab-size", s.vocab_size, "--threads", self.threads]
            words += ["--clean-max-len", s.clean_max_len, "--clean-ratio", s.clean_ratio]
            return Step(name, [Job(name, sh(words))], [(self.raw / f"train.{s.src}", "download")])
        if name == "binarize":
            spm = self.data / "spm"
            words = [
                "fairseq-preprocess", "--source-lang", s.src, "--target-lang", s.tgt, "--joined-dictionary",
                "--trainpref", p(spm / "train"), "--validpref", p(spm / "valid"), "--testpref", p(spm / "test"),
                "--destdir", p(self.data_bin), "--workers", self.threads,
            ]  # fmt: skip
            return Step(name, [Job(name, sh(words))], [(spm / f"train.{s.tgt}", "prepare")])
        if name == "teacher":
            extra = ["--hrt-mode", "at"]
            if not self.args.slice:  # validation BLEU picks the teacher, as fairseq's translation examples
                extra += [
                    "--eval-bleu", "--eval-bleu-args", '{"beam": 5, "max_len_a": 1.2, "max_len_b": 10}',
                    "--eval-bleu-remove-bpe", "sentencepiece", "--best-checkpoint-metric", "bleu",
                    "--maximize-best-checkpoint-metric",
                ]  # fmt: skip
            job = self.train("teacher", s.teacher, extra)
            return Step(name, [job], [(dict_src, "binarize")])
        if name == "distill":
            jobs = []
            for shard in range(self.shards):
                words = [
                    "python", "-m", "fairseq_hrt.distill", "--data", p(self.data_bin),
                    "--path", p(self.last("teacher")), "--src", p(self.data / "spm" / f"train.{s.src}"),
                    "--out", p(self.distill_out), "--beam", s.distill_beam, "--nbest", 1,
                    "--max-len-a", s.max_len_a, "--max-len-b", s.max_len_b, "--max-tokens", 4096 if self.cpu else 16384,
                    "--num-shards", self.shards, "--shard-id", shard, "--threads", 1 if self.cpu else 0,
                    *self.device_words(),
                ]  # fmt: skip
                gpu = shard if (not self.cpu and self.args.launcher != "slurm") else None
                jobs.append(Job(f"distill-shard-{shard}", sh(words), gpu=gpu))
            return Step(name, jobs, [(self.last("teacher"), "teacher")], parallel=True)
        if name == "merge":
            words = ["python", "-m", "fairseq_hrt.distill", "--merge", "--out", p(self.distill_out)]
            words += ["--num-shards", self.shards]
            first_shard = Path(f"{self.distill_out}.shard-0-of-{self.shards}")
            return Step(name, [Job(name, sh(words))], [(first_shard, "distill")])
        if name == "distill_bin":
            # fairseq-preprocess reads the source beside the distilled target: a link to the pieces
            link = self.work / "distill" / f"train.{s.src}"
            words = [
                "fairseq-preprocess", "--source-lang", s.src, "--target-lang", s.tgt,
                "--trainpref", p(self.work / "distill" / "train"), "--srcdict", p(dict_src),
                "--tgtdict", p(dict_src), "--destdir", p(self.work / "distill-bin"), "--workers", self.threads,
            ]  # fmt: skip
            command = f"ln -sfn ../data/spm/train.{s.src} {shlex.quote(p(link))} && {sh(words)}"
            return Step(name, [Job(name, command)], [(self.distill_out, "merge"), (dict_src, "binarize")])
        if name == "at_student":
            job = self.train("at", s.at, ["--hrt-mode", "at", *self.mix_distill()])
            return Step(name, [job], [(self.work / "distill-bin" / f"dict.{s.tgt}.txt", "distill_bin")])
        if name == "hrt":
            jobs = []
            for k in s.hrt_chunk_sizes:
                # the curriculum (p_k from 0 to 1 over --max-update) and fine-tuning from AT: [HRT] Sec. 4
                extra = ["--hrt-mode", "hrt", "--chunk-sizes", k, "--finetune-from-model", p(self.last("at"))]
                jobs.append(self.train(f"hrt-k{k}", s.hrt, extra + self.mix_distill()))
            return Step(name, jobs, [(self.last("at"), "at_student")])
        if name == "mp":
            if not s.mp_student:
                return Step(name, [], skip_reason=f"{s.name}'s paper trains no Mask-Predict student")
            extra = ["--hrt-mode", "cmlm", "--finetune-from-model", p(self.last("at")), *self.mix_distill()]
            return Step(name, [self.train("mp", s.mp, extra)], [(self.last("at"), "at_student")])
        if name == "average":
            jobs = []
            for model in self.students():
                words = [
                    "python", "-m", "fairseq_hrt.average_checkpoints", "--inputs", p(self.model_dir(model)),
                    "--num-update-checkpoints", s.average_last, "--output", p(self.averaged(model)),
                ]  # fmt: skip
                jobs.append(Job(f"average-{model}", sh(words)))
            return Step(name, jobs, [(self.last(m), self.maker(m)) for m in self.students()])
        needs = [(self.averaged(m), "average") for m in self.students()]
        if name == "evaluate":
            rows = [("teacher", self.last("teacher"), ["--beam", s.distill_beam])]
            rows.append(("at-greedy", self.averaged("at"), ["--beam", 1]))
            if s.at_beam > 1:
                rows.append((f"at-beam{s.at_beam}", self.averaged("at"), ["--beam", s.at_beam]))
            for k in s.hrt_chunk_sizes:
                rows.append((f"hrt-k{k}", self.averaged(f"hrt-k{k}"), ["--decode-chunk-size", k, "--beam", s.hrt_beam]))
                rows[-1][2].extend(["--b-nat", 1])
            if s.mp_student:
                mp = ["--iter-decode-max-iter", s.mp_iterations, "--iter-decode-with-beam", s.mp_length_beam]
                rows.append((f"mp-i{s.mp_iterations}", self.averaged("mp"), mp))
            return Step(
                name,
                [Job(f"evaluate-{row}", self.evaluate_command(row, ckpt, opts)) for row, ckpt, opts in rows],
                needs,
            )
        if name == "benchmark":
            jobs = []
            for i, k in enumerate(s.hrt_chunk_sizes):
                words = [
                    "python", p(REPO / "benchmarks" / "benchmark.py"), "--data", p(self.data_bin),
                    "--spm", p(self.data / "spm" / "spm.model"), "--src", p(self.data / "spm" / f"test.{s.src}"),
                    "--raw-src", p(self.data / "raw" / f"test.{s.src}"),
                    "--raw-ref", p(self.data / "raw" / f"test.{s.tgt}"),
                    "--at", p(self.averaged("at")), "--at-beams", "1", "--hrt", p(self.averaged(f"hrt-k{k}")),
                    "--hrt-chunk-sizes", k, "--hrt-beams", f"{s.hrt_beam}/1", "--hrt-at-mode", "no",
                    "--engines", "lean", "--ctranslate2", "no", "--int8", "no", "--lenpen", s.lenpen,
                    "--max-len-a", s.max_len_a, "--max-len-b", s.max_len_b,
                    "--batch-sizes", ",".join(map(str, BENCH_BATCH_SIZES)),
                    "--bs1-sentences", s.bench_bs1_sentences, "--max-sentences", s.bench_sentences,
                    "--threads", self.threads, "--out-dir", p(self.work / "benchmark" / f"k{k}"),
                ]  # fmt: skip
                if i == 0 and s.mp_student:  # Mask-Predict once, beside the first k
                    words += ["--mp", p(self.averaged("mp")), "--mp-iterations", s.mp_iterations]
                    words += ["--mp-length-beam", s.mp_length_beam]
                words += ["--cpu"] if self.cpu else (["--fp16"] if self.args.fp16 else [])
                jobs.append(Job(f"benchmark-k{k}", sh(words)))
            return Step(name, jobs, needs)
        assert name == "export", name
        jobs = []
        for model in self.students():
            words = ["fairseq-hrt-export", p(self.averaged(model)), p(self.work / "export" / model)]
            words += ["--data", p(self.data_bin), "--sentencepiece-model", p(self.data / "spm" / "spm.model")]
            jobs.append(Job(f"export-{model}", sh(words)))
        return Step(name, jobs, needs)

    def data_description(self) -> str:
        """What the models were trained and tested on, for results.md."""
        if self.corpus:
            counts = ", ".join(f"{split} {count_lines(self.corpus / f'{split}.{self.setup.src}')}" for split in SPLITS)
            return f"your corpus {self.path(self.corpus)} ({counts} pairs)"
        if self.args.slice:
            return self.slice_description()
        return f"download.py --setup {self.setup.download_setup}"

    def slice_description(self) -> str:
        """Which lines of shared/data the slice holds (with --slice-*-lines applied)."""
        keep = {"train": self.args.slice_train_lines, "test": self.args.slice_test_lines}
        parts = []
        for split, (source, start, stop) in self.setup.slice_splits.items():
            stop = min(stop, start + keep[split]) if keep.get(split) else stop
            parts.append(f"{split} = {source}.* lines {start + 1}-{stop}")
        return f"slice of shared/data/{self.setup.slice_data}: " + ", ".join(parts)

    def maker(self, model: str) -> str:
        return {"at": "at_student", "mp": "mp"}.get(model, "hrt")

    def evaluate_command(self, row: str, checkpoint: Path, options: List) -> str:
        """fairseq-generate of the test set, its detokenized hypotheses in source order, and
        the paper's metrics of them (python -m fairseq_hrt.evaluate)."""
        s, p = self.setup, self.path
        out = self.work / "evaluate"
        gen, hyp = p(out / f"{row}.gen"), p(out / f"{row}.{s.tgt}")
        words = [
            "fairseq-generate", p(self.data_bin), "--user-dir", p(REPO / "fairseq_hrt"), "--task", "hrt_translation",
            "--source-lang", s.src, "--target-lang", s.tgt, "--gen-subset", "test", "--path", p(checkpoint),
            *options, "--lenpen", s.lenpen, "--max-len-a", s.max_len_a, "--max-len-b", s.max_len_b,
            "--max-tokens", 4096 if self.cpu else 16384,
            "--post-process", "sentencepiece", *self.device_words(),
        ]  # fmt: skip
        evaluate = [
            "python", "-m", "fairseq_hrt.evaluate", "--hyp", hyp, "--ref", p(self.data / "raw" / f"test.{s.tgt}"),
            "--src", p(self.data / "raw" / f"test.{s.src}"), "--target-lang", s.tgt,
            *(["--compound-split"] if s.compound_split else []),
            *(["--remove-ro-diacritics"] if s.remove_ro_diacritics else []), "--json", p(out / f"{row}.json"),
        ]  # fmt: skip
        return (
            f"mkdir -p {shlex.quote(p(out))} && {sh(words)} > {shlex.quote(gen)} && "
            f"grep ^D- {shlex.quote(gen)} | sed 's/^D-//' | sort -n -k1,1 | cut -f3 > {shlex.quote(hyp)} && "
            f"{sh(evaluate)}"
        )

    # ------------------------------------------------------------------ running

    def env(self) -> launch.JobEnv:
        """The recipe's additions to a job's environment, applied inside the job, to the
        environment of the task (SLURM's variables and CUDA_VISIBLE_DEVICES reach fairseq)."""
        return launch.JobEnv(
            set=dict(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads)),
            # `python` and fairseq's console scripts of the commands: those of this interpreter
            prepend=dict(PATH=str(Path(sys.executable).parent), PYTHONPATH=str(REPO)),
            default=dict(GLIBC_KEEP_FREED_MEMORY),
        )

    def executor(self, step: Step, job: Job):
        executor = submitit.AutoExecutor(folder=str(self.work / "submitit" / step.name), cluster=self.args.launcher)
        params = dict(timeout_min=self.args.timeout_min, name=f"{self.setup.name}-{job.label}")
        if self.args.launcher == "slurm":
            params.update(launch.slurm_parameters(self.nodes, self.gpus, job.train, self.threads, self.args.partition))
        executor.update_parameters(**params)
        return executor

    def check_inputs(self, step: Step):
        """Stops in one line before any job starts when what the step reads is missing or bad."""
        if step.name == "prepare" and not self.corpus:  # a --corpus is checked before anything runs
            problem = parallel_text_problem(self.raw, self.setup.src, self.setup.tgt)
            if problem:
                raise StepOrderError(f"[recipe] step prepare: {problem}; run --steps download --redo download")
        for path, maker in step.needs:
            if not Path(path).exists():
                raise StepOrderError(
                    f"[recipe] step {step.name} needs {self.path(path)}, which step {maker} makes: "
                    f"run --steps {maker} first"
                )
            if str(path).endswith(".pt"):
                problem = checkpoint_problem(path)
                if problem:
                    raise StepOrderError(
                        f"[recipe] step {step.name}: {problem}; make it again with --steps {maker} --redo {maker}"
                    )

    # ------------------------------------------------------------------ markers

    def outputs(self, name: str) -> List[Path]:
        """What a step makes: set aside (in WORK/stale/) before the step is done again."""
        w = self.work
        made = {
            "download": [] if self.corpus else [w / "download"],
            "prepare": [self.data],
            "binarize": [self.data_bin],
            "teacher": [self.model_dir("teacher")],
            "distill": [w / "distill"],
            "merge": [self.distill_out],
            "distill_bin": [w / "distill-bin"],
            "at_student": [self.model_dir("at")],
            "hrt": [self.model_dir(f"hrt-k{k}") for k in self.setup.hrt_chunk_sizes],
            "mp": [self.model_dir("mp")],
            "average": [self.averaged(m) for m in self.students()],
            "evaluate": [w / "evaluate"],
            "benchmark": [w / "benchmark"],
            "export": [w / "export"],
        }
        return made[name]

    def inputs(self, step: Step) -> dict:
        """What ``step`` reads now, as its marker records it."""
        files = [path for path, _ in step.needs]
        if step.name == "prepare":  # the raw text: a user's corpus replaced in place counts
            files += [self.raw / f"{split}.{lang}" for split in SPLITS for lang in (self.setup.src, self.setup.tgt)]
        upstream = {name: self.markers.stamp(name) for name in UPSTREAM[step.name]}
        return step_inputs([j.command for j in step.jobs], [self.path(f) for f in files], upstream)

    def digest(self, step: Step) -> str:
        return digest_of(self.inputs(step))

    def set_aside(self, name: str, why: str):
        """Moves what a step made to WORK/stale/<step>-<time>/ (nothing is deleted) and forgets
        its markers, with results.md, which its numbers may have been part of."""
        stale = self.work / "stale" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        moved = []
        for path in [*self.outputs(name), self.work / "results.md", self.work / "results.json"]:
            if Path(path).exists():
                stale.mkdir(parents=True, exist_ok=True)
                shutil.move(str(path), str(stale / Path(path).name))
                moved.append(Path(path).name)
        self.markers.forget(name)
        where = f"; what it made is in {self.path(stale)}" if moved else ""
        log(f"step {name}: {why}: doing it again, and the steps after it{where}")

    def run_step(self, step: Step):
        tag = f"step {STEPS.index(step.name) + 1}/{len(STEPS)} {step.name}"
        if step.skip_reason:
            log(f"{tag}: none ({step.skip_reason})")
            return
        inputs = self.inputs(step)
        digest = digest_of(inputs)
        if step.name in self.redo:
            self.set_aside(step.name, "--redo")
            self.redo.discard(step.name)  # once, not again for the steps after it
        elif self.markers.stale(step.name, digest):
            self.set_aside(step.name, f"its inputs changed since it ran ({self.markers.change(step.name, inputs)})")
        if self.markers.is_done(step.name, digest):
            log(f"{tag}: skipped, done earlier ({self.path(self.markers.folder / step.name)}.json)")
            return
        self.check_inputs(step)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.markers.step_started(step.name, inputs)
        done = set(self.markers.done_jobs(step.name, digest))
        todo = [j for j in step.jobs if j.label not in done]
        if len(todo) < len(step.jobs):
            log(f"{tag}: {len(step.jobs) - len(todo)} of {len(step.jobs)} job(s) done earlier")
        for job in todo:
            if job.train:
                log(f"{tag}: {job.label}: {self.update_freq_note(self.training_of(job.label))}")
        started = time.time()
        if step.parallel:
            self.wait(step, [(job, self.submit(step, job)) for job in todo], tag, digest)
        else:
            for job in todo:
                self.wait(step, [(job, self.submit(step, job))], tag, digest)
        # results.md's time of every step, however many runs of the recipe it took to finish them
        seconds = time.time() - started
        self.markers.step_done(step.name, inputs, seconds)
        log(f"{tag}: done in {seconds:.0f} s")

    def is_current(self, name: str) -> bool:
        """Finished, with the inputs it would read now."""
        step = self.step(name)
        return not step.skip_reason and self.markers.is_done(name, self.digest(step))

    def training_of(self, label: str) -> Training:
        s = self.setup
        return {"teacher": s.teacher, "at": s.at, "mp": s.mp}.get(label, s.hrt)

    def submit(self, step: Step, job: Job):
        env = self.env()
        if job.gpu is not None:  # a shard pinned to one local GPU
            env.set["CUDA_VISIBLE_DEVICES"] = str(job.gpu)
        log_path = str((self.logs / f"{job.label}.log").resolve())
        log(f"step {step.name}: {job.label} ({self.args.launcher} launcher), log in {self.path(log_path)}")
        try:
            return self.executor(step, job).submit(run_job, job.command, log_path, self.cwd, env)
        except submitit.core.utils.FailedJobError as e:  # sbatch refused it: its own words
            reason = (str(e).strip().splitlines() or ["no reason given"])[-1]
            sys.exit(f"[recipe] step {step.name}: sbatch refused {job.label} ({reason}); run the same command again")

    def wait(self, step: Step, submitted, tag: str, digest: str):
        """Waits for the submitted jobs; each that finished gets its marker under ``digest``
        (the inputs the step started with)."""
        failed = []
        for job, handle in submitted:
            # every task of a multi-task job; a job SLURM ended without a result (a node died)
            failures = launch.wait_for_tasks(handle)
            if failures:
                log_path = self.path(self.logs / f"{job.label}.log")
                failed += [f"{job.label} (log {log_path}): {line}" for line in failures]
                continue
            self.markers.job_done(step.name, job.label, job.command, digest)
        if failed:
            sys.exit(f"[recipe] {tag} failed; run the same command again to redo what failed:\n" + "\n".join(failed))

    def selected_steps(self) -> List[str]:
        return self.args.steps.split(",") if self.args.steps else STEPS

    def print_commands(self):
        s = self.setup
        print(f"# {s.name}: {s.paper}")
        scale = "slice" if self.args.slice else "full scale"
        data = f"your corpus {self.path(self.corpus)}" if self.corpus else (s.slice_data if self.args.slice else "")
        print(f"# {scale}{' of ' + data if data else ''}; launcher {self.args.launcher}, "
              f"{self.nodes} node(s) x {self.gpus} GPU(s)")  # fmt: skip
        for name in self.selected_steps():
            step = self.step(name)
            print(f"\n# step {STEPS.index(name) + 1}/{len(STEPS)}: {name}")
            if step.skip_reason:
                print(f"# none: {step.skip_reason}")
            for job in step.jobs:
                if job.train:
                    print(f"# {self.update_freq_note(self.training_of(job.label))}")
                print(job.command)

    def step_seconds(self) -> Dict[str, float]:
        """{step: seconds it ran} of the steps done, from their markers."""
        seconds = {name: self.markers.seconds(name) for name in STEPS}
        return {name: s for name, s in seconds.items() if s is not None}

    def run(self):
        if self.args.launcher == "slurm":
            refusal = launch.check_slurm(self.args.partition)
            if refusal:
                sys.exit(refusal)
        log(f"{self.setup.name}{' (slice)' if self.args.slice else ''}: work folder {self.path(self.work)}")
        if self.corpus:  # before anything runs: a misaligned corpus stops here, not in the teacher
            problem = parallel_text_problem(self.corpus, self.setup.src, self.setup.tgt)
            if problem:
                raise StepOrderError(f"[recipe] --corpus: {problem}; fix it, then run the same command again")
        elif self.args.slice and "download" in self.selected_steps():
            folder = Path(self.args.data) / self.setup.slice_data
            if not folder.is_dir():
                raise StepOrderError(f"[recipe] --slice: {folder} not found; pass the shared data folder with --data")
        for name in self.selected_steps():
            self.run_step(self.step(name))
        # results.md only from evaluations finished on the current models
        if all(self.is_current(n) for n in ("evaluate", "benchmark")):
            print(write_results(self))
        elif (self.work / "results.md").exists() and not self.is_current("evaluate"):
            log(f"{self.path(self.work / 'results.md')} is not of the current models: run the evaluate step")


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", choices=sorted(SETUPS), required=True)
    p.add_argument("--work", required=True, help="the work folder: data, models, markers, logs, results.md")
    p.add_argument("--slice", action="store_true", help="every step on CPU on a slice of shared/data, tiny models")
    p.add_argument(
        "--slice-size",
        choices=SLICE_SIZES,
        default="learn",
        help="--slice: learn (models that learn in minutes: BLEU a user recognises) or smoke (the path "
        "only, tiny models whose BLEU is 0; the tests' size)",
    )
    p.add_argument("--steps", help=f"comma-separated steps to run (default: all): {','.join(STEPS)}")
    p.add_argument("--launcher", choices=("local", "slurm", "debug"), default="local", help="submitit's executor")
    p.add_argument("--gpus", type=int, help="GPUs per node (default: the visible ones; --print-commands: 8)")
    p.add_argument("--nodes", type=int, default=1, help="nodes of a training job (--launcher slurm)")
    p.add_argument("--fp16", action="store_true", help="fairseq's --fp16 (GPU)")
    p.add_argument("--update-freq", type=int, help="default: the paper's tokens per update / (GPUs x max-tokens)")
    p.add_argument("--print-commands", action="store_true", help="print every step's command; run nothing")
    p.add_argument(
        "--threads",
        type=int,
        help="CPU threads of a job (default: the cores; --slice: 1, faster for tiny models, docs/training.md)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--partition", help="--launcher slurm: the SLURM partition")
    p.add_argument("--timeout-min", type=int, default=3 * 24 * 60, help="a job's time limit (submitit)")
    p.add_argument(
        "--corpus",
        help="your own parallel text instead of the download: a folder of {train,valid,test}.{SRC,TGT}, one "
        "sentence a line, read where it is (never written); every step from prepare on runs on it",
    )
    p.add_argument("--langs", metavar="SRC-TGT", help="--corpus: its languages, when not the set-up's (e.g. en-fr)")
    p.add_argument("--data", default=str(SHARED_DATA), help="--slice: the shared data folder")
    p.add_argument("--slice-train-lines", type=int, default=0, help="--slice: keep the first N training pairs")
    p.add_argument("--slice-test-lines", type=int, default=0, help="--slice: keep the first N test pairs")
    p.add_argument(
        "--redo",
        help="comma-separated steps to do again although they finished: what they made is moved to "
        "WORK/stale/, and the steps after them run again too",
    )
    args = p.parse_args(argv)
    for option in ("steps", "redo"):
        unknown = [s for s in (getattr(args, option) or "").split(",") if s and s not in STEPS]
        if unknown:
            p.error(f"--{option}: unknown step(s) {', '.join(unknown)}; the steps: {','.join(STEPS)}")
    outside = sorted(set((args.redo or "").split(",")) - set((args.steps or ",".join(STEPS)).split(",")) - {""})
    if outside:
        p.error(f"--redo {','.join(outside)}: not among --steps {args.steps}")
    if args.langs and not (args.corpus and re.fullmatch(r"[A-Za-z_]+-[A-Za-z_]+", args.langs)):
        p.error(f"--langs {args.langs}: two language codes, SRC-TGT (e.g. en-fr), and only with --corpus")
    if args.corpus and (args.slice_train_lines or args.slice_test_lines):
        p.error("--slice-train-lines/--slice-test-lines cut the shared data's slice; with --corpus, cut your files")
    if args.threads is None:
        args.threads = 1 if args.slice and not args.gpus else len(os.sched_getaffinity(0))
    if args.gpus is None:
        if args.slice:
            args.gpus = 0  # the slice is sized for a CPU; --gpus N puts it on GPUs
        elif args.print_commands:
            args.gpus = 8  # the WMT'22 paper's 8 GPUs (the HRT paper names none)
        else:
            args.gpus = torch.cuda.device_count()
    elif args.gpus and args.launcher != "slurm" and not args.print_commands:
        # SLURM's GPUs are on its nodes, not on the machine that submits
        visible = torch.cuda.device_count()
        if visible < args.gpus:
            p.error(f"--gpus {args.gpus}: {visible} GPU(s) visible here; drop --gpus to run on the CPU")
    if args.fp16 and args.gpus == 0:
        p.error("--fp16 needs a GPU (--gpus N)")
    return args


def main(argv=None):
    args = parse_args(argv)
    recipe = Recipe(args)
    if args.print_commands:
        recipe.print_commands()
        return
    try:
        recipe.run()
    except StepOrderError as e:
        sys.exit(str(e))
    except KeyboardInterrupt:
        sys.exit("[recipe] interrupted; run the same command again to resume")


if __name__ == "__main__":
    main()
