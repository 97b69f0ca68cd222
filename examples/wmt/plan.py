"""What one run of examples/wmt/recipe.py is: its set-up, its devices and where everything lies.

Computed once from the command line; the steps' commands (steps.py) and the running (recipe.py)
read it and never change it.
"""

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import List

from corpus import SPLITS, count_lines
from setups import SETUPS, Setup, Training, slice_of

SLICE_SHARDS = 2  # --slice distills in two shards and merges them, as N GPUs would


def update_freq(training: Training, gpus: int) -> int:
    """--update-freq that reaches the paper's tokens per update on ``gpus`` devices."""
    return max(1, math.ceil(training.tokens_per_update / (max(1, gpus) * training.max_tokens)))


class Plan:
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
        self.logs = self.work / "logs"

    # ------------------------------------------------------------------ places

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

    def maker(self, model: str) -> str:
        """The step that trains ``model``."""
        return {"at": "at_student", "mp": "mp"}.get(model, "hrt")

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

    # ------------------------------------------------------------------ devices and training

    def device_words(self) -> List[str]:
        if self.cpu:
            return ["--cpu"]
        return ["--fp16"] if self.args.fp16 else []

    def training_of(self, label: str) -> Training:
        s = self.setup
        return {"teacher": s.teacher, "at": s.at, "mp": s.mp}.get(label, s.hrt)

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

    # ------------------------------------------------------------------ for results.md

    def data_description(self) -> str:
        """What the models were trained and tested on."""
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
