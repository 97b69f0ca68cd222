#!/usr/bin/env python
"""Convergence study of HRT against AT: chunk-size sets x training budgets, same data.

For every budget ``s x B`` (``--scales``, ``B`` = the profile's student ``--max-update``) and
every chunk-size set (``--chunk-size-sets``, e.g. ``2`` and ``2,3,4``):

* ``at``            one AT student trained for ``max(scales) x B`` updates, saved every
                    ``B`` updates: the AT model of budget ``s x B`` is its checkpoint at
                    update ``s x B``. This is exactly the model a separate run of ``s x B``
                    updates gives: the inverse-sqrt schedule does not depend on
                    ``--max-update`` and the data order depends on the seed only.
* ``hrt_c<set>_x<s>`` HRT fine-tuned from the AT model of the same budget for ``s x B``
                    updates, with the papers' curriculum over those updates (p_k = 1 at the
                    last one).
* ``quality``       ``benchmarks/hrt_quality.py`` on every model: BLEU of AT greedy, of HRT in
                    AT mode (C_d = 1) and at k = 2 with b_at = 1 and 5, the gap
                    D = BLEU(C_d = 1) - BLEU(k = 2) on the same model, outputs that hit the
                    length limit, BLEU by source length (< 10, 10-20, > 20 words) and the two
                    stage-II oracles (skeleton from the reference / from AT mode's greedy output).
* ``losses.png``    per-kind validation losses (AT, CMLM, Skip-AT, Skip-CMLM) over training.
* ``hrt_c<set>_x<s>_<name>`` (``--variants NAME=ARGS``): HRT of the first chunk-size set at the
                    largest budget, trained with extra fairseq-train options (e.g.
                    ``sd5="--skip-at-self-distill 0.5"``), measured like the others. ``{kd}`` in
                    ARGS stands for ``--distill-data`` of the study's own sequence-level KD: the
                    training set translated by the AT model of the largest budget (steps
                    ``kd_distill`` and ``kd_bin``, made once when a variant asks for it).
                    ``{tkd}`` stands for the KD set of a stronger AT teacher (``--teacher-arch``,
                    ``--teacher-args``; steps ``teacher``, ``tkd_distill``, ``tkd_bin``): trained
                    on raw data until its validation BLEU has not risen for
                    ``--teacher-patience`` epochs, its best checkpoint translates the training set
                    (beam 5, n-best picked by sentence-BLEU).

Steps reuse recipe.py's (markers, logs, resuming), so an interrupted study resumes when run
again with the same command. Output: ``OUT/study/report.{json,md}``, ``OUT/study/losses.png``.

Example (2 CPU cores, the quickstart's shape, about 1.5 hours)::

    python examples/multi30k/study.py --profile mini --scales 1,8 --chunk-size-sets 2 2,3,4
"""

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

SCRIPT_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPT_DIR))

import recipe  # noqa: E402
import study_lanes  # noqa: E402
import study_targets  # noqa: E402
from recipe import REPO, Budget, Recipe, StepError, last_num_updates, log, option_value  # noqa: E402

KINDS = ("at", "cmlm", "skip_at", "skip_cmlm")
# where studies keep their models by default: outside the checkout, so that a new clone (or a
# cleaned work/) resumes a study instead of training it again
STUDIES_ENV = "FAIRSEQ_HRT_STUDIES"
DEFAULT_STUDIES = "~/.cache/fairseq-hrt/studies"
KD_BEAM = 5  # beam and n-best of the study's own KD (--variants with {kd}) and the teacher's ({tkd})
# validation BLEU (teacher, converged students): greedy, with the benchmark's source-relative length cap, so an
# early runaway neither decides the score nor the validation's time
VALID_BLEU_ARGS = {"beam": 1, "max_len_a": 1.2, "max_len_b": 10}


def bleu_validation(patience: Optional[int]) -> List[str]:
    """fairseq-train options that keep the checkpoint of the best validation BLEU (greedy,
    detokenized sacreBLEU, once an epoch; HRT models decode with their own default, k = 2) and,
    with ``patience``, stop when it has not risen for that many validations."""
    options = [
        "--eval-bleu",
        "--eval-bleu-args",
        json.dumps(VALID_BLEU_ARGS),
        "--eval-bleu-detok",
        "space",
        "--eval-bleu-remove-bpe",
        "sentencepiece",
        "--best-checkpoint-metric",
        "bleu",
        "--maximize-best-checkpoint-metric",
    ]
    return options + (["--patience", str(patience)] if patience else [])


def parse_scales(text: str) -> List[int]:
    scales = sorted({int(x) for x in text.split(",") if x.strip()})
    if not scales or scales[0] < 1:
        raise ValueError(f"--scales must list positive integers, got {text!r}")
    return scales


def set_tag(chunk_sizes: str) -> str:
    return "c" + chunk_sizes.replace(",", "")


def parse_variants(items: List[str]) -> Dict[str, str]:
    """``NAME=ARGS`` pairs, in order: NAME in [a-z0-9_], ARGS extra fairseq-train options."""
    out = {}
    for item in items or []:
        name, sep, extra = item.partition("=")
        if not sep or not re.fullmatch(r"[a-z0-9_]+", name) or not extra.strip():
            raise ValueError(
                f"--variants {item!r}: expected NAME=ARGS, NAME of a-z, 0-9 and _, e.g. "
                "sd5='--skip-at-self-distill 0.5'"
            )
        if name in out:
            raise ValueError(f"--variants: {name} given twice")
        out[name] = extra.strip()
    return out


def parse_variant_from(items: List[str], variants: Dict[str, str], at_variants: Dict[str, str]) -> Dict[str, str]:
    """``VARIANT=AT_VARIANT`` pairs: which AT variant an HRT variant is fine-tuned from."""
    out = {}
    for item in items or []:
        name, sep, base = item.partition("=")
        if not sep or name not in variants or base not in at_variants:
            raise ValueError(
                f"--variant-from {item!r}: expected VARIANT=AT_VARIANT, VARIANT one of --variants "
                f"({', '.join(variants) or 'none'}), AT_VARIANT one of --at-variants "
                f"({', '.join(at_variants) or 'none'})"
            )
        out[name] = base
    return out


class Study(Recipe):
    def __init__(self, args):
        super().__init__(args)
        self.scales = parse_scales(args.scales)
        self.sets = args.chunk_size_sets
        self.base = self.profile.student.max_update
        self.study_dir = self.out / "study"
        self.variants = parse_variants(args.variants)
        self.at_variants = parse_variants(args.at_variants)
        self.variant_from = parse_variant_from(args.variant_from, self.variants, self.at_variants)
        self.kd_dir = self.out / "kd"
        self.tkd_dir = self.out / "tkd"

    def budget(self, scale: int) -> Budget:
        b = self.profile.student
        return Budget(max_update=scale * self.base, stop_time_hours=b.stop_time_hours * scale, lr=b.lr, warmup=b.warmup)

    def at_checkpoint(self, scale: int) -> Path:
        if scale == self.scales[-1]:
            return self.checkpoint("at")
        found = sorted((self.out / "at").glob(f"checkpoint_*_{scale * self.base}.pt"))
        if not found:
            raise StepError(f"no AT checkpoint at update {scale * self.base} in {self.out / 'at'}")
        return found[0]

    def step_at(self, i):
        p = self.profile
        longest = self.budget(self.scales[-1])
        extra = [
            "--hrt-mode",
            "at",
            *self._student_args(),
            "--save-interval-updates",
            str(self.base),
            "--keep-interval-updates",
            "-1",
        ]
        cmd = self.train_cmd("at", p.at_arch, longest, extra)
        self.run_step(i, "at", cmd, [self.checkpoint("at")], train_max_update=longest.max_update)

    def step_hrt(self, i, chunk_sizes: str, scale: int):
        name = f"hrt_{set_tag(chunk_sizes)}_x{scale}"
        budget = self.budget(scale)
        cmd = self.train_cmd(name, self.profile.hrt_arch, budget, self.hrt_args(chunk_sizes, self.at_checkpoint(scale)))
        self.run_step(i, name, cmd, [self.checkpoint(name)], train_max_update=budget.max_update)

    def variant_name(self, variant: str) -> str:
        return f"hrt_{set_tag(self.sets[0])}_x{self.scales[-1]}_{variant}"

    def at_variant_name(self, variant: str) -> str:
        return f"at_x{self.scales[-1]}_{variant}"

    def variant_args(self, variant: str, variants: Dict[str, str] = None) -> List[str]:
        kd = f"--distill-data {shlex.quote(str(self.kd_dir / 'distill-bin'))}"
        tkd = f"--distill-data {shlex.quote(str(self.tkd_dir / 'distill-bin'))}"
        return shlex.split((variants or self.variants)[variant].replace("{kd}", kd).replace("{tkd}", tkd))

    def needs_kd(self, placeholder: str = "{kd}") -> bool:
        return any(placeholder in extra for extra in [*self.variants.values(), *self.at_variants.values()])

    def needs_teacher(self) -> bool:
        return self.needs_kd("{tkd}")

    def teacher_checkpoint(self) -> Path:
        # the checkpoint of the best validation BLEU: the teacher trains until that stops rising
        return self.out / "teacher" / "checkpoint_best.pt"

    def step_teacher(self, i):
        """An AT teacher with more capacity than the students (``--teacher-arch``,
        ``--teacher-args``), trained on raw data until its validation BLEU (greedy, detokenized
        sacreBLEU, every epoch) has not risen for ``--teacher-patience`` validations, or the
        update / time cap is reached (the report says which)."""
        a = self.args
        if not a.teacher_arch:
            raise StepError("a variant uses {tkd} (the teacher's KD set): give --teacher-arch, e.g. at_small")
        budget = Budget(
            max_update=a.teacher_max_update, stop_time_hours=a.teacher_hours, lr=a.teacher_lr, warmup=a.teacher_warmup
        )
        extra = ["--hrt-mode", "at", *shlex.split(a.teacher_args), *bleu_validation(a.teacher_patience)]
        cmd = self.train_cmd("teacher", a.teacher_arch, budget, extra)
        self.run_step(i, "teacher", cmd, [self.teacher_checkpoint()], train_max_update=budget.max_update)

    def step_teacher_kd(self, i):
        """The teacher's sequence-level KD of the training set (``{tkd}``), made as the study's
        own KD; on CPU decoded with ONNX Runtime (the same n-best lists as lean, about half the
        time)."""
        engine = "onnxruntime" if self.cpu and importlib.util.find_spec("onnxruntime") else None
        self.kd_steps(i, "tkd", self.teacher_checkpoint(), self.tkd_dir, engine)

    def kd_steps(self, i, name: str, teacher: Path, kd_dir: Path, engine: Optional[str] = None):
        """Steps ``<name>_distill`` and ``<name>_bin``: ``teacher`` translates the training set
        into ``kd_dir/distill`` (beam and n-best :data:`KD_BEAM`, n-best picked by sentence-BLEU),
        binarized into ``kd_dir/distill-bin``."""
        out = kd_dir / "distill" / "train.de"
        cmd = self.distill_cmd(
            teacher, out, self.logs / f"{name}_distill.log", beam=KD_BEAM, nbest=KD_BEAM, engine=engine
        )
        self.run_step(i, f"{name}_distill", cmd, [out], own_log=True)
        dest = kd_dir / "distill-bin"
        self.run_step(
            i,
            f"{name}_bin",
            self.distill_bin_cmd(kd_dir / "distill", dest),
            [dest / "train.en-de.de.bin", dest / "train.en-de.de.idx"],
        )

    def variant_base(self, variant: str) -> Path:
        """The AT checkpoint an HRT variant is fine-tuned from: the AT of the largest budget, or
        the AT variant named by ``--variant-from`` (e.g. one with the same decoder depth)."""
        if variant in self.variant_from:
            return self.checkpoint(self.at_variant_name(self.variant_from[variant]))
        return self.at_checkpoint(self.scales[-1])

    def step_at_variant(self, i, variant: str):
        name, budget = self.at_variant_name(variant), self.budget(self.scales[-1])
        extra = ["--hrt-mode", "at", *self._student_args(), *self.variant_args(variant, self.at_variants)]
        cmd = self.train_cmd(name, self.profile.at_arch, budget, extra)
        self.run_step(i, name, cmd, [self.checkpoint(name)], train_max_update=budget.max_update)

    def step_kd(self, i):
        """The study's own sequence-level KD (no teacher in the profile): the AT model of the
        largest budget translates the training set (beam, n-best picked by sentence-BLEU)."""
        self.kd_steps(i, "kd", self.at_checkpoint(self.scales[-1]), self.kd_dir)

    def step_variant(self, i, variant: str):
        name, scale = self.variant_name(variant), self.scales[-1]
        budget = self.budget(scale)
        extra = self.hrt_args(self.sets[0], self.variant_base(variant)) + self.variant_args(variant)
        cmd = self.train_cmd(name, self.profile.hrt_arch, budget, extra)
        self.run_step(i, name, cmd, [self.checkpoint(name)], train_max_update=budget.max_update)

    def raw_hrt_sets(self) -> List[str]:
        """Chunk-size sets trained on raw data at every budget (none with ``--skip-raw-hrt``:
        a study of variants only)."""
        return [] if self.args.skip_raw_hrt else self.sets

    def models(self) -> Dict[str, dict]:
        out = {}
        for scale in self.scales:
            out[f"at_x{scale}"] = {
                "kind": "AT",
                "scale": scale,
                "updates": scale * self.base,
                "checkpoint": self.at_checkpoint(scale),
                "log": self.logs / "at.log",
            }
            for cs in self.raw_hrt_sets():
                name = f"hrt_{set_tag(cs)}_x{scale}"
                out[name] = {
                    "kind": "HRT",
                    "scale": scale,
                    "updates": scale * self.base,
                    "chunk_sizes": cs,
                    "checkpoint": self.checkpoint(name),
                    "log": self.logs / f"{name}.log",
                }
        scale = self.scales[-1]
        if self.needs_teacher():
            log_path = self.logs / "teacher.log"  # the teacher stops early: its updates are read from its log
            out["teacher"] = {
                "kind": "AT",
                "scale": scale,
                "updates": last_num_updates(log_path) if log_path.exists() else None,
                "variant": "teacher",
                "variant_args": f"--arch {self.args.teacher_arch} {self.args.teacher_args}",
                "checkpoint": self.teacher_checkpoint(),
                "log": log_path,
            }
        for variant, extra in self.at_variants.items():
            name = self.at_variant_name(variant)
            out[name] = {
                "kind": "AT",
                "scale": scale,
                "updates": scale * self.base,
                "variant": variant,
                "variant_args": extra,
                "checkpoint": self.checkpoint(name),
                "log": self.logs / f"{name}.log",
            }
        for variant, extra in self.variants.items():
            name = self.variant_name(variant)
            out[name] = {
                "kind": "HRT",
                "scale": scale,
                "updates": scale * self.base,
                "chunk_sizes": self.sets[0],
                "variant": variant,
                "variant_args": extra,
                "checkpoint": self.checkpoint(name),
                "log": self.logs / f"{name}.log",
            }
        return out

    def quality_cmd(self, checkpoint: Path, out_json: Path, hrt: bool, at_student: Optional[Path] = None) -> List[str]:
        """``benchmarks/hrt_quality.py`` of one model on test2016: for an HRT model (k = 2) AT
        mode and k = 2 at beam 1 and 5 and the stage-II oracles (``at_student``: also over that
        AT model's greedy output, splitting the gap to it); for an AT model greedy and beam 5."""
        d = self.data
        cmd = [
            sys.executable,
            str(REPO / "benchmarks" / "hrt_quality.py"),
            "--data",
            str(self.data_bin),
            "--spm",
            str(d / "spm" / "spm.model"),
            "--src",
            str(d / "spm" / "test.en"),
            "--ref-pieces",
            str(d / "spm" / "test.de"),
            "--raw-src",
            str(d / "raw" / "test.en"),
            "--raw-ref",
            str(d / "raw" / "test.de"),
            "--path",
            str(checkpoint),
            "--threads",
            str(self.threads),
            "--json",
            str(out_json),
        ]
        cmd += ["--cpu"] if self.cpu else []
        cmd += ["--fp16"] if self.args.fp16 else []
        cmd += ["--skeleton-from", str(at_student)] if at_student else []
        return cmd + (["--chunk-size", "2"] if hrt else [])

    def step_quality(self, i):
        self.study_dir.mkdir(parents=True, exist_ok=True)
        results = {}
        for name, m in self.models().items():
            out_json = self.study_dir / f"{name}.json"
            cmd = self.quality_cmd(m["checkpoint"], out_json, m["kind"] == "HRT")
            self.run_step(i, f"quality_{name}", cmd, [out_json])
            # report paths relative to the output folder: the report is read on other machines
            results[name] = {
                **json.loads(out_json.read_text()),
                **{k: (str(v.relative_to(self.out)) if isinstance(v, Path) else v) for k, v in m.items()},
                "valid_losses": valid_losses(m["log"]),
            }
        return results

    def step_prepare_all(self, i):
        """The data every training step reads: prepare.sh's output and, for profiles with a
        teacher, the teacher's distilled training set."""
        self.step_prepare(i)
        if self.profile.distill:
            self.step_teacher(i + 1)
            self.step_distill(i + 2)
            self.step_distill_bin(i + 3)

    def prepared(self) -> bool:
        """Whether ``prepare`` is done (its markers and outputs exist)."""
        needed = [self.markers / "prepare.done", self.data_bin / "dict.en.txt"]
        if self.profile.distill:
            needed += [self.markers / "distill_bin.done", self.out / "distill-bin" / "train.en-de.de.bin"]
        return all(path.exists() for path in needed)

    def require_prepared(self, step: str):
        if not self.prepared():
            raise StepError(
                f"--only {step}: the data of {self.out} is not prepared ({self.data_bin / 'dict.en.txt'} or its "
                f"marker in {self.markers} is missing): run --only prepare first, with the same --profile and --out "
                "(or run the study without --only)"
            )

    def run_only(self, names: List[str]):
        """Run the named steps only: ``prepare`` (the data, and the teacher's KD for profiles with
        one), ``kd`` (the study's own KD set) and the training steps (``at``, ``hrt_c2_x1``, ...):
        separate processes can train independent models at once, each with its own markers.
        Every step but ``prepare`` needs ``prepare`` done (earlier, or earlier in ``names``)."""
        steps = {
            "prepare": lambda: self.step_prepare_all(1),
            "at": lambda: self.step_at(5),
            "kd": lambda: self.step_kd(6),
            "teacher": lambda: self.step_teacher(6),
            "tkd": lambda: self.step_teacher_kd(6),
        }
        for variant in self.at_variants:
            steps[self.at_variant_name(variant)] = lambda v=variant: self.step_at_variant(7, v)
        for scale in self.scales:
            for cs in self.raw_hrt_sets():
                steps[f"hrt_{set_tag(cs)}_x{scale}"] = lambda cs=cs, scale=scale: self.step_hrt(6, cs, scale)
        for variant in self.variants:
            steps[self.variant_name(variant)] = lambda v=variant: self.step_variant(7, v)
        unknown = [n for n in names if n not in steps]
        if unknown:
            raise StepError(f"--only {' '.join(unknown)}: not a training step of this study ({', '.join(steps)})")
        for name in names:
            if name != "prepare":
                self.require_prepared(name)
            steps[name]()

    def run(self):
        self.out.mkdir(parents=True, exist_ok=True)
        if self.args.only:
            return self.run_only(self.args.only)
        log(
            f"study: profile {self.args.profile}, base budget {self.base} updates, scales {self.scales}, "
            f"chunk-size sets {self.sets}, output {self.out}, {self.threads} thread(s)"
        )
        start = time.time()
        self.step_prepare_all(1)
        self.step_at(5)
        for scale in self.scales:
            for cs in self.raw_hrt_sets():
                self.step_hrt(6, cs, scale)
        if self.needs_kd():
            self.step_kd(7)
        if self.needs_teacher():
            self.step_teacher(7)
            self.step_teacher_kd(7)
        for variant in self.at_variants:
            self.step_at_variant(7, variant)
        for variant in self.variants:
            self.step_variant(7, variant)
        results = self.step_quality(8)
        report = {
            "profile": self.args.profile,
            "base_updates": self.base,
            "scales": self.scales,
            "chunk_size_sets": self.sets,
            "variants": self.variants,
            "at_variants": self.at_variants,
            "variant_from": self.variant_from,
            "device": self.device_words(),
            "models": results,
            "study_seconds": round(time.time() - start, 1),
        }
        (self.study_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        md = markdown_report(report)
        (self.study_dir / "report.md").write_text(md)
        losses_plot(self.models(), self.study_dir / "losses.png")
        print(md)
        log(
            f"study done in {time.time() - start:.0f}s: {self.study_dir / 'report.md'}, {self.study_dir / 'losses.png'}"
        )


# --------------------------------------------------------------------------- converged study


# fairseq-train logs a new best checkpoint as
# "Saved checkpoint DIR/checkpoint_best.pt (epoch 12 @ 1500 updates, score 35.1) ..."
_SAVED_BEST = re.compile(r"checkpoint_best\.pt \(epoch (\d+) @ (\d+) updates, score ([-\d.]+)\)")
_WALL = re.compile(r'"wall": "([\d.]+)"')
# a run's own clock at its end: its json "wall" restarts at 0 when it resumes a checkpoint
# written on another machine (the restored stopwatch's start is that machine's clock)
_DONE_TRAINING = re.compile(r"done training in ([\d.]+) seconds")
_VALID_RECORD = re.compile(r"\|\s*valid\s*\|\s*(\{.*\})")


def best_checkpoint_update(log_path: Path) -> Optional[int]:
    """The update of the last ``checkpoint_best.pt`` a fairseq-train log reports saving."""
    found = None
    if log_path.exists():
        for m in _SAVED_BEST.finditer(log_path.read_text(errors="replace")):
            found = int(m.group(2))
    return found


def validation_bleu(log_path: Path) -> List[dict]:
    """``[{"updates", "epoch", "bleu"}]`` of every validation in a fairseq json log (``--eval-bleu``)."""
    out = []
    if not log_path.exists():
        return out
    for line in log_path.read_text(errors="replace").splitlines():
        m = _VALID_RECORD.search(line)
        if not m:
            continue
        try:
            rec = json.loads(m.group(1))
        except ValueError:
            continue
        if "valid_bleu" in rec and "valid_num_updates" in rec:
            out.append(
                {
                    "updates": int(rec["valid_num_updates"]),
                    "epoch": int(rec.get("epoch", 0)),
                    "bleu": float(rec["valid_bleu"]),
                }
            )
    return out


def best_validation(valid: List[dict]) -> Optional[dict]:
    """The best of :func:`validation_bleu`'s records: the last of equal scores, as fairseq keeps
    it (a tie is a new ``checkpoint_best.pt``)."""
    return max(valid, key=lambda v: (v["bleu"], v["updates"])) if valid else None


def parse_int_list(text: str, option: str) -> List[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise ValueError(f"{option} must list distinct positive integers, got {text!r}")
    return values


class ConvergedStudy(Study):
    """HRT against AT students where the papers' claim should hold (``--converged``): every
    model trained until its validation BLEU stops rising.

    * ``teacher``      an AT (``--teacher-arch``, default the profile's AT with the deepest
                       student decoder) on raw data, until its validation BLEU has not risen for
                       ``--patience`` epochs;
    * ``tkd``          its sequence-level KD of the training set (beam 5, n-best picked by
                       sentence-BLEU; on CPU with ONNX Runtime);
    * ``at_d<D>_s<S>`` AT students with D decoder layers, seed S, on MixDistill of that KD
                       (``--p-raw``), until their validation BLEU stops rising; kept: the best;
    * ``hrt_d<D>_s<S>`` HRT k = 2 fine-tuned from the best checkpoint of ``at_d<D>_s<S>`` (the
                       papers fine-tune HRT from a trained AT of its shape), same data: first for
                       as many updates as that AT had (the papers' curriculum over them, p_k = 1
                       at the last), then on with p_k = 1 until its validation BLEU (k = 2,
                       b_at = 1) stops rising (step ``hrt_d<D>_s<S>_more``, same folder);
    * ``hrt_d<D>_s1_from_teacher`` (``--also-from-teacher``): the same HRT fine-tuned from the
                       teacher (raw data, same shape when D is its depth): which start is better;
    * ``benchmark_s<S>`` (``--interim-benchmark``, with ``--lanes``): the benchmark and bounds of
                       the first seed's models, alone on the machine, as soon as they are trained.

    Order: seed by seed, depth by depth in ``--depths`` order, so the first answer (the deepest
    pair of seed 1) comes first; the HRT from the teacher last, after every row the targets are
    decided on. Every step resumes; a lost output folder only costs time.
    Output: ``OUT/study/converged.{json,md}`` (budgets in updates and hours, best validation
    BLEU, what stopped each run).
    """

    def __init__(self, args):
        super().__init__(args)
        self.seeds = parse_int_list(args.seeds, "--seeds")
        self.depths = parse_int_list(args.depths, "--depths")
        b = self.profile.student
        self.cap = Budget(max_update=args.max_update_cap, stop_time_hours=args.hours_cap, lr=b.lr, warmup=b.warmup)

    def needs_teacher(self) -> bool:
        return True

    def train_cmd(self, name, arch, budget, extra, seed=None):
        # every run of this study is stopped by its validation BLEU, whatever the profile says
        cmd = super().train_cmd(name, arch, budget, extra, seed=seed)
        return [word for word in cmd if word != "--disable-validation"]

    def student_args(self) -> List[str]:
        return [*shlex.split(self.args.student_args), *self.distill_args()]

    def distill_args(self) -> List[str]:
        return ["--distill-data", str(self.tkd_dir / "distill-bin"), "--p-raw", str(self.args.p_raw)]

    def at_name(self, depth: int, seed: int) -> str:
        return f"at_d{depth}_s{seed}"

    def hrt_name(self, depth: int, seed: int, start: str = "") -> str:
        return f"hrt_d{depth}_s{seed}" + (f"_from_{start}" if start else "")

    def best(self, name: str) -> Path:
        return self.out / name / "checkpoint_best.pt"

    def step_at_student(self, i, depth: int, seed: int):
        name = self.at_name(depth, seed)
        extra = [
            "--hrt-mode",
            "at",
            "--decoder-layers",
            str(depth),
            *self.student_args(),
            *bleu_validation(self.args.patience),
        ]
        cmd = self.train_cmd(name, self.profile.at_arch, self.cap, extra, seed=seed)
        self.run_step(i, name, cmd, [self.best(name)], train_max_update=self.cap.max_update)

    def hrt_steps(self, i, depth: int, seed: int, start: Path, start_log: Path, name: str):
        """HRT fine-tuned from ``start`` (a best checkpoint, whose run logged to ``start_log``)."""
        updates = best_checkpoint_update(start_log)
        if not updates:
            raise StepError(f"{name}: {start_log} reports no checkpoint_best.pt: how many updates did {start} have?")
        base = [
            "--decoder-layers",
            str(depth),
            *self.student_args(),
            "--chunk-sizes",
            "2",
            "--finetune-from-model",
            str(start),
            *bleu_validation(None),
        ]
        curriculum = Budget(
            max_update=updates, stop_time_hours=self.cap.stop_time_hours, lr=self.cap.lr, warmup=self.cap.warmup
        )
        cmd = self.train_cmd(name, self.profile.hrt_arch, curriculum, base, seed=seed)
        self.run_step(i, name, cmd, [self.checkpoint(name)], train_max_update=updates)
        # on in the same folder (fairseq resumes from checkpoint_last.pt, --finetune-from-model is
        # then ignored) with p_k = 1: fairseq's patience starts counting here, after the curriculum
        more = base + ["--curriculum-updates", str(updates), "--patience", str(self.args.patience)]
        cmd = self.train_cmd(name, self.profile.hrt_arch, self.cap, more, seed=seed)
        self.run_step(i, f"{name}_more", cmd, [self.best(name)], train_max_update=self.cap.max_update)

    def start_log(self, hrt_name: str) -> Path:
        """The log of the run an HRT model starts from (its updates are the curriculum's)."""
        if hrt_name.endswith("_from_teacher"):
            return self.logs / "teacher.log"
        return self.logs / f"{hrt_name.replace('hrt_', 'at_', 1)}.log"

    def step_hrt_student(self, i, depth: int, seed: int):
        name = self.hrt_name(depth, seed)
        self.hrt_steps(i, depth, seed, self.best(self.at_name(depth, seed)), self.start_log(name), name)

    def step_hrt_from_teacher(self, i, depth: int):
        name = self.hrt_name(depth, 1, "teacher")
        self.hrt_steps(i, depth, 1, self.teacher_checkpoint(), self.start_log(name), name)

    def teacher_depth(self) -> Optional[int]:
        depth = option_value(self.args.teacher_args, "--decoder-layers")
        return int(depth) if depth is not None else None

    def training_plan(self) -> List[tuple]:
        """``(name, run)`` of every training step, in the order the study runs them."""
        plan = [("teacher", lambda: self.step_teacher(2)), ("tkd", lambda: self.step_teacher_kd(3))]
        for seed in self.seeds:
            for depth in self.depths:
                plan.append((self.at_name(depth, seed), lambda d=depth, s=seed: self.step_at_student(4, d, s)))
                plan.append((self.hrt_name(depth, seed), lambda d=depth, s=seed: self.step_hrt_student(5, d, s)))
        if self.args.also_from_teacher:
            # last: it answers which start is better; the seed pairs decide the targets
            depth = self.teacher_depth()
            plan.append((self.hrt_name(depth, 1, "teacher"), lambda d=depth: self.step_hrt_from_teacher(6, d)))
        return plan

    def trained_models(self) -> Dict[str, dict]:
        names = ["teacher"] + [name for name, _ in self.training_plan() if name not in ("teacher", "tkd")]
        out = {}
        for name in names:
            log_path = self.logs / f"{name}.log"
            more = self.logs / f"{name}_more.log"
            logs = [log_path] + ([more] if more.exists() else [])
            valid = [v for lp in logs for v in validation_bleu(lp)]
            best = best_validation(valid)
            out[name] = {
                "kind": "HRT" if name.startswith("hrt_") else "AT",
                "checkpoint": str(self.best(name).relative_to(self.out)),
                "done": self.trained(name),
                "updates": valid[-1]["updates"] if valid else None,
                "best_updates": best["updates"] if best else None,
                "best_valid_bleu": best["bleu"] if best else None,
                "curriculum_updates": best_checkpoint_update(self.start_log(name)) if name.startswith("hrt_") else None,
                "hours": round(sum(training_seconds(lp) for lp in logs) / 3600, 2),
                "gpu_hours": round(sum(training_seconds(lp, gpu=True) for lp in logs) / 3600, 2),
                "valid_bleu": valid,
            }
        return out

    def trained(self, name: str) -> bool:
        """Whether a training step is finished: an HRT model's ends with its phase at p_k = 1."""
        return (self.markers / (f"{name}_more.done" if name.startswith("hrt_") else f"{name}.done")).exists()

    def hrt_models(self) -> List[str]:
        return [name for name, _ in self.training_plan() if name.startswith("hrt_")]

    def lane_steps(self) -> Dict[str, List[str]]:
        """``--lanes``: every training step and every HRT model's test2016 reading (its stage
        oracles, ``quality_<model>``, also with ``--train-only``), in the study's order, each
        with the steps it needs done first. A model's reading comes right after it, before the
        next training step: a few minutes of one thread give the study's answer for that model
        on test2016 (against its AT student), a small file that outlives the machine, where the
        models took hours and are lost with it."""
        needs = {}
        for name, _ in self.training_plan():
            if name == "teacher":
                needs[name] = []
            elif name == "tkd":
                needs[name] = ["teacher"]
            elif name.startswith("at_") or name.endswith("_from_teacher"):
                needs[name] = ["tkd"]
            else:
                needs[name] = [name.replace("hrt_", "at_", 1)]
            if name.startswith("hrt_"):
                needs[f"quality_{name}"] = [name]
        interim = self.interim_benchmark()
        if interim:  # right after the last step it needs, before the next seed's
            first = self.seed_models(self.seeds[0])
            wanted = first + [f"quality_{n}" for n in first if n.startswith("hrt_")]
            names = list(needs)
            at = max(names.index(n) for n in wanted) + 1
            names.insert(at, interim)
            needs = {n: wanted if n == interim else needs[n] for n in names}
        return needs

    def interim_benchmark(self) -> Optional[str]:
        """``--interim-benchmark``: the step that benchmarks the first seed's models as soon as
        they are trained (``benchmark_s<seed>``), or None."""
        return f"benchmark_s{self.seeds[0]}" if self.args.interim_benchmark else None

    def seed_models(self, seed: int) -> List[str]:
        """The AT and HRT students of one seed, in the study's order (not the HRT from the teacher)."""
        return [
            name for name, _ in self.training_plan() if name.endswith(f"_s{seed}") and name.startswith(("at_", "hrt_"))
        ]

    def lane_step_done(self, name: str) -> bool:
        if name == "tkd":
            return (self.markers / "tkd_bin.done").exists()
        if name.startswith("quality_") or name == self.interim_benchmark():
            return (self.markers / f"{name}.done").exists()
        return self.trained(name)

    def lane_at_epoch_end(self, name: str) -> bool:
        """Whether a training step has just saved ``checkpoint_last.pt`` (5 to 60 s ago: the
        save and its copies are written, the next epoch's first minute is all a restart loses)."""
        last = self.out / name / "checkpoint_last.pt"
        if name == "tkd" or name.startswith("quality_") or not last.exists():
            return False
        return 5 <= time.time() - last.stat().st_mtime <= 60

    def run_lanes(self):
        """Train the study in ``--lanes`` child processes (:mod:`study_lanes`), each one step
        (``--only <step>``) with its share of ``--threads``."""
        needs = self.lane_steps()
        lanes_dir = self.logs / "lanes"
        log(f"lanes: {self.args.lanes} lanes over {self.threads} thread(s); each lane's output in {lanes_dir}")
        script = Path(__file__).resolve()
        start = study_lanes.start_lane(
            self.args.argv, script, sys.executable, self.env, lanes_dir, recipe.die_with_parent
        )
        try:
            study_lanes.run_lanes(
                list(needs),
                needs,
                self.lane_step_done,
                start,
                self.args.lanes,
                self.threads,
                log,
                at_epoch_end=self.lane_at_epoch_end,
                exclusive={self.interim_benchmark()} - {None},
            )
        except study_lanes.LaneError as e:
            raise StepError(f"lanes: {e}") from None

    def status(self, now: Optional[float] = None) -> List[dict]:
        """``--status``: every training step's state, read from the study's markers and logs
        (nothing is locked or started, so it is safe beside a running study)."""
        now = time.time() if now is None else now
        models = self.trained_models()
        rows = []
        for name, _ in self.training_plan():
            if name == "tkd":
                logs = [self.logs / "tkd_distill.log", self.logs / "tkd_bin.log"]
            else:
                logs = [self.logs / f"{name}.log", self.logs / f"{name}_more.log"]
            rows.append(
                step_status(
                    name,
                    models.get(name),
                    self.lane_step_done(name),
                    [lp for lp in logs if lp.exists()],
                    now,
                )
            )
        interim = self.interim_benchmark()
        if interim:  # its log, or its bounds' while they run first
            first_hrt = [n for n in self.seed_models(self.seeds[0]) if n.startswith("hrt_")]
            logs = [self.logs / f"{interim}.log"] + [self.logs / f"bound_{n}.log" for n in first_hrt]
            row = step_status(interim, None, self.lane_step_done(interim), [lp for lp in logs if lp.exists()], now)
            rows.append(row | {"state": "running" if row["state"] == "training" else row["state"]})
        return rows

    def at_models(self) -> List[str]:
        return [name for name, _ in self.training_plan() if name.startswith("at_")]

    def blind_sets(self) -> List[Path]:
        folder = Path(self.args.blind_dir) if self.args.blind_dir else REPO.parent / "shared" / "blind"
        return sorted(folder.glob("*.en")) if folder.is_dir() else []

    def step_benchmark(self, i, name: str = "benchmark", at_models=None, hrt_models=None):
        """One benchmark run of every model (1 thread): the AT students and the teacher on
        lean and ONNX Runtime, float and int8, and in CTranslate2 (float, int8, +vmap), every
        HRT model at k = 2 (b_at = b_nat = 1) likewise (not in AT mode, worn down at p_k = 1: the
        stage oracles report it), batch 1, 8 and 128, at most 1.2 x source + 10 tokens; the
        blind sets translated by every system. ``name``: its step and folder; ``at_models``,
        ``hrt_models``: the students it measures (default: all of them)."""
        bench = self.out / name
        at, *at_extra = at_models or self.at_models()
        hrt, *hrt_extra = hrt_models or self.hrt_models()
        cmd = [
            sys.executable,
            str(REPO / "benchmarks" / "benchmark.py"),
            *self.test_set_args(),
            "--at",
            str(self.best(at)),
            "--at-beams",
            "1",
            "--hrt",
            str(self.best(hrt)),
            "--hrt-beams",
            "1/1",
            "--hrt-chunk-sizes",
            "2",
            # trained on with p_k = 1, their AT mode has decayed: HRT is compared with the AT students
            "--hrt-at-mode",
            "no",
            "--engines",
            "lean,onnxruntime",
            "--int8",
            "yes",
            "--shortlist",
            str(self.shortlist_file()),
            "--batch-sizes",
            "1,8,128",
            "--bs1-sentences",
            "100",
            "--max-len-a",
            "1.2",
            "--max-len-b",
            "10",
            "--threads",
            "1",
            "--out-dir",
            str(bench),
            "--log-file",
            str(self.logs / f"{name}.log"),
            "--translations-dir",
            "blind",
            "--resume",  # hours on one thread: a stopped study keeps the batch sizes measured
        ]
        for model in at_extra + ["teacher"]:
            cmd += ["--at-extra", f"{model}={self.best(model)}"]
        for model in hrt_extra:
            cmd += ["--hrt-extra", f"{model}={self.best(model)}"]
        for path in self.blind_sets():
            cmd += ["--translate", f"{path.stem}={path}"]
        self.run_step(i, name, cmd + self.device_args, [bench / "report.json"], own_log=True, redo_if_changed=True)

    def step_interim_benchmark(self, i):
        """``--interim-benchmark``: the benchmark of the first seed's students (and the teacher)
        and their HRT models' bounds, alone on the machine, into ``OUT/benchmark_s<seed>``; its
        targets (one seed) in ``OUT/study/benchmark_s<seed>_targets.{json,md}``. A machine lost
        before the second seed is trained keeps this speed front and its blind outputs."""
        name = self.interim_benchmark()
        first = self.seed_models(self.seeds[0])
        hrt = [n for n in first if n.startswith("hrt_")]
        self.step_shortlist(7)
        self.step_bounds(9, hrt)
        # its marker last: the lanes take the step as done when the benchmark's marker is there
        self.step_benchmark(8, name, [n for n in first if n.startswith("at_")], hrt)
        targets = self.targets(name, hrt)
        self.study_dir.mkdir(parents=True, exist_ok=True)
        (self.study_dir / f"{name}_targets.json").write_text(json.dumps(targets, indent=2) + "\n")
        (self.study_dir / f"{name}_targets.md").write_text(
            study_targets.targets_markdown(targets, self.interim_title())
        )

    def interim_title(self) -> str:
        return f"The targets on seed {self.seeds[0]} alone, from the interim benchmark ({self.interim_benchmark()})"

    def interim_targets(self) -> Optional[dict]:
        """The interim benchmark's verdicts, once its step is done."""
        name = self.interim_benchmark()
        path = self.study_dir / f"{name}_targets.json"
        if name and (self.markers / f"{name}.done").exists() and path.exists():
            return json.loads(path.read_text())
        return None

    def step_bounds(self, i, names=None):
        """``benchmarks/hrt_bound.py`` of every HRT model (1 thread, ONNX Runtime): its
        fixed-length bound at batch 1 and 128 beside what it delivers on test2016, against its
        AT student's greedy decoding (``--at-path``: at p_k = 1 the HRT model's AT mode decays)."""
        for name in names or self.hrt_models():
            out = self.out / "bounds" / name
            cmd = [
                sys.executable,
                str(REPO / "benchmarks" / "hrt_bound.py"),
                "--path",
                str(self.best(name)),
                "--data",
                str(self.data_bin),
                "--engines",
                "onnxruntime",
                "--batches",
                "1,128",
                "--chunk-size",
                "2",
                "--src",
                str(self.data / "spm" / "test.en"),
                "--max-len-a",
                "1.2",
                "--max-len-b",
                "10",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
            student = self.at_student_of(name)
            cmd += ["--at-path", str(self.best(student))] if student else []
            self.run_step(i, f"bound_{name}", cmd, [out / "hrt_bound.json"])

    def at_student_of(self, hrt_name: str) -> Optional[str]:
        """The AT student an HRT model is measured against: the one of its decoder depth and
        seed (also for the HRT fine-tuned from the teacher), where the study trains one."""
        m = re.match(r"hrt_d(\d+)_s(\d+)", hrt_name)
        name = m and self.at_name(int(m.group(1)), int(m.group(2)))
        return name if name in self.at_models() else None

    def step_oracles(self, i) -> Dict[str, dict]:
        """``benchmarks/hrt_quality.py`` of every HRT model's best checkpoint: where its k = 2
        output loses against its own AT mode and against its AT student (stage I, Skip-AT's
        skeleton, or stage II, the one-pass fill), read from the stage-II oracles;
        ``OUT/quality/<model>.json``."""
        return {name: self.step_oracle(i, name) for name in self.hrt_models()}

    def step_oracle(self, i, name: str) -> dict:
        """The stage oracles of one HRT model (``quality_<model>``). They time nothing, so
        ``--only quality_<model>`` may run them beside training, once the model is trained."""
        out_json = self.quality_json(name)
        out_json.parent.mkdir(parents=True, exist_ok=True)
        student = self.at_student_of(name)
        cmd = self.quality_cmd(self.best(name), out_json, True, self.best(student) if student else None)
        self.run_step(i, f"quality_{name}", cmd, [out_json])
        return stage_summary(json.loads(out_json.read_text()))

    def quality_json(self, name: str) -> Path:
        """Where ``quality_<name>`` (one HRT model's test2016 reading) writes its report."""
        return self.out / "quality" / f"{name}.json"

    def measured_oracles(self) -> Dict[str, dict]:
        """:func:`stage_summary` of every HRT model whose test2016 reading is done, without
        running any."""
        out = {}
        for name in self.hrt_models():
            path = self.quality_json(name)
            if (self.markers / f"quality_{name}.done").exists() and path.exists():
                out[name] = stage_summary(json.loads(path.read_text()))
        return out

    def targets(self, bench_name: str = "benchmark", hrt_models=None) -> dict:
        """The targets' verdicts (:mod:`study_targets`) from a benchmark's ``report.json``, its
        rows' test outputs (``hyps/``, for the quality gap's paired interval) and the HRT
        models' ``hrt_bound.json`` (default: the final benchmark, every HRT model)."""
        bench = self.out / bench_name
        report = json.loads((bench / "report.json").read_text())
        bounds = {}
        for name in hrt_models or self.hrt_models():
            path = self.out / "bounds" / name / "hrt_bound.json"
            if path.exists():
                bounds[name] = json.loads(path.read_text())
        texts = {
            s["name"]: (bench / s["hyps"]).read_text(encoding="utf-8").splitlines()
            for s in report["systems"]
            if s.get("hyps") and (bench / s["hyps"]).exists()
        }
        test = report.get("meta", {}).get("test", {})
        ref_path = bench / test["raw_ref"] if test.get("raw_ref") else None
        refs = None
        if ref_path and ref_path.exists():  # the sentences the benchmark translated: the first ones
            refs = ref_path.read_text(encoding="utf-8").splitlines()[: test["sentences"]]
        return study_targets.study_targets(report, bounds, texts, refs)

    def publish(self, dest: Path) -> List[Path]:
        """Copy what the finished study measured into ``dest`` (a folder of ``benchmarks/results``):
        the benchmark's ``report.md``/``report.json``/``pareto.png``, the blind sets' outputs
        (``blind/<set>/<system>.de``), ``converged.md``/``converged.json``, each HRT model's bound
        (``bounds/<model>.md``/``.json``) and quality (``quality/<model>.json``); with
        ``--interim-benchmark`` also the first seed's benchmark and its targets
        (``benchmark_s<seed>/``), which may be all there is yet. The files are copied as they are;
        ``SOURCES.md`` names the folder that the paths inside each are relative to. Returns the
        files written."""
        bench = self.out / "benchmark"
        interim = self.interim_benchmark()
        if not (bench / "report.json").exists() and not (interim and (self.out / interim / "report.json").exists()):
            raise StepError(f"--publish: {bench / 'report.json'} does not exist; run the study without --only first")
        copies = self.benchmark_copies(bench, dest)
        copies += [(self.study_dir / name, dest / name) for name in ("converged.md", "converged.json")]
        for name in self.hrt_models():
            for suffix in (".md", ".json"):
                copies.append((self.out / "bounds" / name / f"hrt_bound{suffix}", dest / "bounds" / f"{name}{suffix}"))
            copies.append((self.quality_json(name), dest / "quality" / f"{name}.json"))
        if interim:
            copies += self.interim_copies(dest / interim)
        written = []
        for source, target in copies:
            if source.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
                written.append(target)
        sources = [
            f"# Where these files come from ({time.strftime('%Y-%m-%d')})",
            "",
            f"Copied by `examples/multi30k/study.py --publish` from the study's folder `{self.out}`. Paths "
            "inside the files are relative to the folder each was written in:",
            "",
            f"- `report.md`, `report.json`, `pareto.png`, `blind/`: `{bench}`",
            f"- `converged.md`, `converged.json`: `{self.study_dir}`",
            f"- `bounds/<model>.*`: `{self.out / 'bounds'}/<model>`",
            f"- `quality/<model>.json`: `{self.out / 'quality'}`",
        ]
        if interim:
            sources.append(
                f"- `{interim}/` (the first seed's benchmark): `{self.out / interim}`; its `targets.*`: "
                f"`{self.study_dir}/{interim}_targets.*`"
            )
        (dest / "SOURCES.md").write_text("\n".join(sources) + "\n")
        log(f"published {len(written)} files into {dest}")
        return written + [dest / "SOURCES.md"]

    @staticmethod
    def benchmark_copies(bench: Path, dest: Path) -> List[tuple]:
        """``(source, target)`` of a benchmark's report, Pareto picture and blind outputs."""
        copies = [(bench / name, dest / name) for name in ("report.md", "report.json", "pareto.png")]
        return copies + [(f, dest / f.relative_to(bench)) for f in sorted((bench / "blind").glob("*/*.de"))]

    def interim_copies(self, dest: Path) -> List[tuple]:
        """The interim benchmark's files (:meth:`benchmark_copies`) and its targets' verdicts."""
        name = self.interim_benchmark()
        copies = self.benchmark_copies(self.out / name, dest)
        return copies + [(self.study_dir / f"{name}_targets{s}", dest / f"targets{s}") for s in (".md", ".json")]

    def run(self):
        if self.args.status:
            print(status_table(self.status()), end="")
            return
        if self.args.publish:
            self.publish(Path(self.args.publish))
            return
        self.out.mkdir(parents=True, exist_ok=True)
        log(
            f"converged study: profile {self.args.profile}, seeds {self.seeds}, decoder depths {self.depths}, "
            f"patience {self.args.patience}, output {self.out}, {self.threads} thread(s)"
        )
        self.step_prepare(1)
        plan = self.training_plan()
        wanted = self.args.only
        if self.args.lanes > 1 and not wanted:
            self.run_lanes()
        oracle_models = [n[len("quality_") :] for n in wanted or [] if n.startswith("quality_")]
        if wanted:
            steps = ["prepare", *(name for name, _ in plan), *(f"quality_{n}" for n in self.hrt_models())]
            steps += [self.interim_benchmark()] if self.interim_benchmark() else []
            unknown = [n for n in wanted if n not in steps]
            if unknown:
                raise StepError(f"--only {' '.join(unknown)}: not a step of this study ({', '.join(steps)})")
            untrained = [f"quality_{n}" for n in oracle_models if not self.trained(n)]
            if untrained:
                raise StepError(
                    f"--only {' '.join(untrained)}: the model is not trained yet (its marker "
                    f"{self.markers}/<model>_more.done is missing): train it first"
                )
            if self.interim_benchmark() in wanted:
                untrained = [n for n in self.seed_models(self.seeds[0]) if not self.trained(n)]
                if untrained:
                    raise StepError(f"--only {self.interim_benchmark()}: train {', '.join(untrained)} first")
        for name, run_step in plan:
            if not wanted or name in wanted:
                run_step()
        for name in oracle_models:
            self.step_oracle(10, name)
        if wanted and self.interim_benchmark() in wanted:
            self.step_interim_benchmark(8)
        oracles, targets = {}, None
        if not wanted and not self.args.train_only:
            self.step_shortlist(7)
            self.step_benchmark(8)
            self.step_bounds(9)
            oracles = self.step_oracles(10)
            targets = self.targets()
        else:  # the readings the lanes (or --only quality_<model>) have taken so far
            oracles = self.measured_oracles()
        self.study_dir.mkdir(parents=True, exist_ok=True)
        report = {
            "profile": self.args.profile,
            "device": self.device_words(),
            "patience": self.args.patience,
            "student_args": self.args.student_args,
            "teacher": f"--arch {self.args.teacher_arch} {self.args.teacher_args}",
            "p_raw": self.args.p_raw,
            "models": self.trained_models(),
            "stage_oracles": oracles,
            "targets": targets,
            "interim_targets": self.interim_targets(),
            "interim_title": self.interim_title() if self.interim_benchmark() else None,
        }
        (self.study_dir / "converged.json").write_text(json.dumps(report, indent=2) + "\n")
        md = converged_report(report)
        (self.study_dir / "converged.md").write_text(md)
        print(md)


GPU_RUN = "$ [gpu]"  # how a run on a lent GPU (examples/multi30k/gpu_handoff.py) starts in a step's log


def training_seconds(log_path: Path, gpu: bool = False) -> float:
    """Wall time of the runs in a fairseq json log (validation included): the last ``wall`` of
    each run (fairseq counts it from the process start), summed over the runs the log holds
    (``run_step`` writes ``$ command`` before each). ``gpu``: the runs on a lent GPU (their
    ``$ [gpu]`` line), else the others; the two are not one clock."""
    if not log_path.exists():
        return 0.0
    total, last, counted = 0.0, 0.0, True
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("$ "):  # a new run of the step (resumed): its clock starts again
            total += last if counted else 0.0
            last, counted = 0.0, line.startswith(GPU_RUN) == gpu
            continue
        m = _WALL.search(line) or _DONE_TRAINING.search(line)
        if m:
            last = max(last, float(m.group(1)))
    return total + (last if counted else 0.0)


_UPS = re.compile(r'"ups": "([\d.]+)"')
STALE_LOG_SECONDS = 600  # a training log is written every 20 updates and every validation


def step_status(name: str, model: Optional[dict], done: bool, logs: List[Path], now: float) -> dict:
    """One row of ``--status``: ``state`` is ``done``, ``training`` (its log written in the
    last ``STALE_LOG_SECONDS``), ``stopped`` (a log, then silence: the same command resumes it)
    or ``waiting`` (never started); an HRT model's ``phase`` is its curriculum or the phase at
    p_k = 1 after it (``<name>_more.log``)."""
    written = max((lp.stat().st_mtime for lp in logs), default=None)
    if done:
        state = "done"
    elif written is None:
        state = "waiting"
    else:
        state = "training" if now - written <= STALE_LOG_SECONDS else "stopped"
    row = {"step": name, "state": state, "log_age_s": None if written is None else round(now - written)}
    if name.startswith("hrt_") and logs:
        row["phase"] = "p_k = 1" if any(lp.name.endswith("_more.log") for lp in logs) else "curriculum"
    ups = [float(m.group(1)) for lp in logs for m in _UPS.finditer(lp.read_text(errors="replace"))]
    row["last_ups"] = ups[-1] if ups else None
    model = model or {}
    valid = model.get("valid_bleu") or []
    row.update(
        updates=model.get("updates"),
        last_valid=valid[-1] if valid else None,
        best_valid=best_validation(valid),
        hours=model.get("hours"),
    )
    return row


def status_table(rows: List[dict]) -> str:
    """``--status`` as a markdown table (paste-able into a report's progress section)."""
    lines = [
        "| step | state | updates | best valid BLEU (epoch) | last valid BLEU (epoch) | hours | last updates/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        state = r["state"] + (f", {r['phase']}" if r.get("phase") and r["state"] != "done" else "")
        if r["state"] == "stopped":
            state += f" {r['log_age_s'] // 60} min ago"
        best, last = (f"{v['bleu']:.2f} ({v['epoch']})" if v else "-" for v in (r["best_valid"], r["last_valid"]))
        lines.append(
            f"| {r['step']} | {state} | {r['updates'] or '-'} | {best} | {last} | "
            f"{_f(r['hours'] or None)} | {_f(r['last_ups'])} |"
        )
    return "\n".join(lines) + "\n"


def stage_summary(quality: dict) -> dict:
    """What ``hrt_quality.py`` says of an HRT model at b_at = 1: BLEU of AT mode and k = 2, their
    gap D, the stage-II oracles (over the reference's skeleton and over AT mode's), and D split
    into what stage II costs (AT mode - oracle on AT mode's skeleton) and what stage I costs
    (the rest); where it was measured against its AT student, the same split of the gap to
    that student (``*_vs_at_student``)."""
    k = quality["chunk_size"]
    s, o = quality["systems"], quality["oracles"]
    versus = quality.get("stage_losses_vs_at_student_b1")
    student = {}
    if versus:
        student = {
            "at_student": s["at_student_b1"]["bleu"],
            "gap_to_at_student": quality["gap_to_at_student_b1"],
            "oracle_at_student": o["at_student"]["bleu"],
            "stage2_loss_vs_at_student": versus["stage2"],
            "stage1_loss_vs_at_student": versus["stage1"],
        }
        paired = quality.get("paired_bootstrap_vs_at_student_b1")
        if paired:  # HRT - AT student: the gap's sign flipped, as its interval is
            student["hrt_minus_at_student_ci95"] = paired["ci95"]
    beam5 = {f"k{k}_b5": s[f"k{k}_b5"]["bleu"]} if f"k{k}_b5" in s else {}
    return {
        **student,
        **beam5,
        "chunk_size": k,
        "at_mode": s["at_mode_b1"]["bleu"],
        f"k{k}": s[f"k{k}_b1"]["bleu"],
        "gap": quality["gap"]["b1"],
        "oracle_reference": o["reference"]["bleu"],
        "oracle_at_mode": o["at_mode"]["bleu"],
        "stage2_loss": quality["stage_losses_b1"]["stage2"],
        "stage1_loss": quality["stage_losses_b1"]["stage1"],
    }


def lever_rows(report: dict) -> List[dict]:
    """What each lever tried moved, per HRT model: the phase at p_k = 1 (best validation BLEU
    after the curriculum against the best within it) and b_at = 5 against 1 on test2016 (its
    stage oracles' run), beside its test BLEU at b_at = 1 and its gap to its AT student (the AT
    student's BLEU - HRT's: positive where HRT is below)."""
    rows = []
    oracles = report.get("stage_oracles") or {}
    for name, m in report["models"].items():
        if m["kind"] != "HRT" or not m["valid_bleu"]:
            continue
        cap = m.get("curriculum_updates")
        within = [v["bleu"] for v in m["valid_bleu"] if cap is None or v["updates"] <= cap]
        o = oracles.get(name, {})
        k = o.get("chunk_size", 2)
        rows.append(
            {
                "model": name,
                "curriculum_best_valid": max(within) if within else None,
                "best_valid": m["best_valid_bleu"],
                # none until a validation after the curriculum
                "pk1_phase": round(m["best_valid_bleu"] - max(within), 2)
                if within and cap and len(within) < len(m["valid_bleu"])
                else None,
                "test_k2": o.get(f"k{k}"),
                "beam5": round(o[f"k{k}_b5"] - o[f"k{k}"], 2) if f"k{k}_b5" in o else None,
                "gap_to_at_student": o.get("gap_to_at_student"),
            }
        )
    return rows


def converged_report(report: dict) -> str:
    lines = [
        f"## Converged study ({report['profile']} profile, {report['device']})",
        "",
        f"Teacher `{report['teacher']}` on raw data; students on MixDistill of its KD (p_raw {report['p_raw']}), "
        f"`{report['student_args']}`; every run until its validation BLEU (greedy; HRT: k = 2, b_at = 1) has not "
        f"risen for {report['patience']} epochs. HRT: fine-tuned from the AT student of its depth and seed for as "
        "many updates as that AT had (the curriculum), then on with p_k = 1.",
        "",
        "| model | done | updates | best at | curriculum | best valid BLEU | hours | of them on a GPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in report["models"].items():
        lines.append(
            f"| {name} | {'yes' if m['done'] else 'no'} | {m['updates'] or '-'} | {m['best_updates'] or '-'} | "
            f"{m['curriculum_updates'] or '-'} | {_f(m['best_valid_bleu'])} | "
            f"{m['hours'] + m.get('gpu_hours', 0):.2f} | {_f(m.get('gpu_hours') or None)} |"
        )
    oracles = report.get("stage_oracles") or {}
    if oracles:
        lines += [
            "",
            "Where each HRT model loses (test2016, b_at = b_nat = 1, `benchmarks/hrt_quality.py`): D = AT mode - "
            "k = 2 on the same model; stage II = AT mode - the one-pass fill of AT mode's own skeleton; stage I = "
            "the rest of D (Skip-AT's skeleton); `oracle ref`: the fill of the reference's skeleton.",
            "",
            "| model | AT mode | k = 2 | D | stage I | stage II | oracle ref | oracle AT mode |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, o in oracles.items():
            hrt_bleu = o["k%d" % o["chunk_size"]]
            lines.append(
                f"| {name} | {_f(o['at_mode'])} | {_f(hrt_bleu)} | {_f(o['gap'])} | {_f(o['stage1_loss'])} | "
                f"{_f(o['stage2_loss'])} | {_f(o['oracle_reference'])} | {_f(o['oracle_at_mode'])} |"
            )
        against = {name: o for name, o in oracles.items() if "at_student" in o}
        if against:
            lines += [
                "",
                "The gap to the AT student of the same depth and seed (the target), split the same way: stage II = "
                "the AT student - the one-pass fill of its greedy output's skeleton; stage I = the rest. It holds "
                "where AT mode does not (trained on with p_k = 1, an HRT model's AT mode decays). `k = 2 - AT, 95 %`: "
                "the paired-bootstrap interval of k = 2's BLEU minus the AT student's over test2016's sentences "
                "(1000 resamples): how far this one test set can tell them apart.",
                "",
                "| model | AT student | k = 2 | gap | k = 2 - AT, 95 % | stage I | stage II | oracle AT student |",
                "|---|---:|---:|---:|---|---:|---:|---:|",
            ]
            for name, o in against.items():
                ci = o.get("hrt_minus_at_student_ci95")
                lines.append(
                    f"| {name} | {_f(o['at_student'])} | {_f(o['k%d' % o['chunk_size']])} | "
                    f"{_f(o['gap_to_at_student'])} | {f'{ci[0]:+.2f} to {ci[1]:+.2f}' if ci else '-'} | "
                    f"{_f(o['stage1_loss_vs_at_student'])} | {_f(o['stage2_loss_vs_at_student'])} | "
                    f"{_f(o['oracle_at_student'])} |"
                )
    levers = lever_rows(report)
    if levers:
        lines += [
            "",
            "What the levers moved, per HRT model: the phase at p_k = 1 after the curriculum (validation BLEU, "
            "k = 2, b_at = 1: its best against the curriculum's best) and b_at = 5 against b_at = 1 (test2016, "
            "the stage oracles' run). The start (AT student or teacher) and the decoder depth are read across "
            "the rows.",
            "",
            "| HRT model | curriculum's best valid | best valid | p_k = 1 phase | test k = 2 (b_at 1) | b_at 5 - 1 "
            "| its AT student - k = 2 |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in levers:
            lines.append(
                f"| {r['model']} | {_f(r['curriculum_best_valid'])} | {_f(r['best_valid'])} | "
                f"{_signed(r['pk1_phase'])} | {_f(r['test_k2'])} | {_signed(r['beam5'])} | "
                f"{_signed(r['gap_to_at_student'])} |"
            )
    if report.get("interim_targets"):
        lines += ["", study_targets.targets_markdown(report["interim_targets"], report["interim_title"]).rstrip("\n")]
    if report.get("targets"):
        lines += ["", study_targets.targets_markdown(report["targets"]).rstrip("\n")]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- reports


def _f(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def _signed(x, digits=2):
    return "-" if x is None else f"{x:+.{digits}f}"


def markdown_report(report: dict) -> str:
    models = report["models"]
    at = {m["scale"]: m for m in models.values() if m["kind"] == "AT" and not m.get("variant")}
    lines = [
        f"## HRT convergence study ({report['profile']} profile, {report['device']})",
        "",
        f"Base budget B = {report['base_updates']} updates; HRT fine-tuned from the AT model of the same budget. "
        "BLEU: sacreBLEU on test2016. D = BLEU(AT mode) - BLEU(k=2) on the same model, at the same beam "
        "(b = b_at). Oracles: stage II filling every 2nd token of the reference / of AT mode's greedy output. "
        "`limit`: outputs that ran to the length limit (greedy).",
        "",
        "| model | updates | AT greedy | AT mode b=1 | k=2 b_at=1 | D b=1 | AT mode b=5 | k=2 b_at=5 | D b=5 "
        "| k=2 - AT greedy | limit (AT mode / k=2) | oracle ref | oracle AT-mode | <10 / 10-20 / >20 words (k=2 b=1) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for scale, a in sorted(at.items()):
        ag = a["systems"]["greedy"]
        at_rows = [(f"AT x{scale}", a)] + [
            (f"AT x{scale} {m['variant']}", m)
            for _, m in sorted(models.items())
            if m["kind"] == "AT" and m.get("variant") and m["scale"] == scale
        ]
        for label, m in at_rows:
            g = m["systems"]["greedy"]
            lines.append(
                f"| {label} | {m['updates']} | {_f(g['bleu'])} | | | | | | | | {g['limit_hits']} | | | "
                + " / ".join(_f(g["bleu_by_length"][b]) for b in g["bleu_by_length"])
                + " |"
            )
        for name, m in sorted(models.items()):
            if m["kind"] != "HRT" or m["scale"] != scale:
                continue
            s = m["systems"]
            label = f"HRT k={m['chunk_sizes']} x{scale}" + (f" {m['variant']}" if m.get("variant") else "")
            row = [
                label,
                str(m["updates"]),
                "",
                _f(s["at_mode_b1"]["bleu"]),
                _f(s["k2_b1"]["bleu"]),
                _f(m["gap"]["b1"]),
                _f(s["at_mode_b5"]["bleu"]),
                _f(s["k2_b5"]["bleu"]),
                _f(m["gap"]["b5"]),
                _f(s["k2_b1"]["bleu"] - ag["bleu"]),
                f"{s['at_mode_b1']['limit_hits']} / {s['k2_b1']['limit_hits']}",
                _f(m["oracles"]["reference"]["bleu"]),
                _f(m["oracles"]["at_mode"]["bleu"]),
                " / ".join(_f(s["k2_b1"]["bleu_by_length"][b]) for b in s["k2_b1"]["bleu_by_length"]),
            ]
            lines.append("| " + " | ".join(row) + " |")
    if report.get("variants"):
        lines += [
            "",
            "Variants (extra fairseq-train options; `{kd}`: the study's sequence-level KD of the "
            "training set by the AT model of the largest budget):",
            "",
        ]
        lines += [
            f"- `{name}`: `{extra}`"
            + (
                f" (fine-tuned from AT `{report['variant_from'][name]}`)"
                if name in report.get("variant_from", {})
                else ""
            )
            for name, extra in report["variants"].items()
        ]
    if report.get("at_variants"):
        lines += ["", "AT variants (AT students of the largest budget with extra fairseq-train options):", ""]
        lines += [f"- `{name}`: `{extra}`" for name, extra in report["at_variants"].items()]
    lines += [
        "",
        "Validation losses by kind (bits per token, label-smoothed) at the end of training:",
        "",
        "| model | " + " | ".join(KINDS) + " |",
        "|---|" + "---:|" * len(KINDS),
    ]
    for name, m in sorted(models.items()):
        if m["kind"] == "HRT" and m.get("valid_losses"):
            last = m["valid_losses"][-1]
            lines.append(f"| {name} | " + " | ".join(_f(last.get(k)) for k in KINDS) + " |")
    lines += ["", f"Study wall time: {report['study_seconds']:.0f} s (steps done in earlier runs not counted)."]
    return "\n".join(lines) + "\n"


def valid_losses(log_path: Path) -> List[dict]:
    """Per-kind validation losses over training from a fairseq json log."""
    out = []
    if not log_path.exists():
        return out
    for line in log_path.read_text(errors="replace").splitlines():
        start = line.find("{")
        if start < 0 or '"valid_' not in line:
            continue
        try:
            rec = json.loads(line[start:])
        except ValueError:
            continue
        if "valid_num_updates" not in rec:
            continue
        row = {"updates": int(rec["valid_num_updates"])}
        for k in KINDS:
            if f"valid_{k}_loss" in rec:
                row[k] = float(rec[f"valid_{k}_loss"])
        out.append(row)
    return out


def losses_plot(models: Dict[str, dict], path: Path):
    import matplotlib  # noqa: PLC0415 - optional: matplotlib, for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional: matplotlib, for plots

    hrt = [(n, m) for n, m in sorted(models.items()) if m["kind"] == "HRT"]
    fig, axes = plt.subplots(1, len(hrt), figsize=(5 * len(hrt), 4), squeeze=False)
    for ax, (name, m) in zip(axes.flat, hrt):
        rows = valid_losses(m["log"])
        for k in KINDS:
            pts = [(r["updates"], r[k]) for r in rows if k in r]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=k)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("updates")
        ax.set_ylabel("valid loss (bits/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(recipe.PROFILES), default="mini")
    p.add_argument(
        "--out",
        help=f"output directory, outside the checkout so that it outlives it (default: ${STUDIES_ENV}/study-<profile>, "
        f"{STUDIES_ENV} defaulting to {DEFAULT_STUDIES})",
    )
    p.add_argument("--scales", default="1,8", help="budgets as multiples of the profile's student --max-update")
    p.add_argument("--chunk-size-sets", nargs="+", default=["2", "2,3,4"], help="HRT --chunk-sizes values to compare")
    p.add_argument("--raw-dir", help="raw Multi30k directory (default: prepare.sh's search order)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for every step (default: idle cores at start)")
    p.add_argument("--p-raw", type=float, default=0.5, help="MixDistill (profiles with a teacher)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fp16", action="store_true", help="GPU only: fairseq's --fp16 everywhere")
    p.add_argument("--cpu-bf16", action="store_true", help=recipe.CPU_BF16_HELP)
    p.add_argument(
        "--variants",
        nargs="+",
        metavar="NAME=ARGS",
        default=[],
        help="extra HRT runs (first chunk-size set, largest budget) with extra fairseq-train "
        "options, e.g. sd5='--skip-at-self-distill 0.5' kd='{kd} --p-raw 0.5'; {kd} = "
        "--distill-data of the study's own KD set",
    )
    p.add_argument(
        "--at-variants",
        nargs="+",
        metavar="NAME=ARGS",
        default=[],
        help="AT students of the largest budget trained with extra fairseq-train options, e.g. "
        "kd='{kd} --p-raw 0.5' (the same distilled data as an HRT variant) or dl2='--decoder-layers 2'",
    )
    p.add_argument(
        "--variant-from",
        nargs="+",
        metavar="VARIANT=AT_VARIANT",
        default=[],
        help="fine-tune the HRT variant from this AT variant instead of the plain AT, e.g. dl2kd=dl2 "
        "(HRT with two decoder layers from the AT with two)",
    )
    p.add_argument(
        "--teacher-arch",
        help="{tkd} in --variants / --at-variants: the KD set of this AT teacher, "
        "trained on raw data in the study (e.g. at_small: d = 256, 6 encoder layers)",
    )
    p.add_argument(
        "--teacher-args",
        help="extra fairseq-train options of the teacher (default: '--decoder-layers 3'; --converged: the deepest "
        "of --depths and --student-args)",
    )
    p.add_argument(
        "--teacher-max-update", type=int, help="the teacher's update cap (default 8000; --converged: --max-update-cap)"
    )
    p.add_argument(
        "--teacher-hours",
        type=float,
        help="the teacher's time cap (--stop-time-hours; default 2; --converged: --hours-cap)",
    )
    p.add_argument(
        "--teacher-patience",
        type=int,
        help="stop the teacher after this many validations (one per epoch) without a higher BLEU (default 3; "
        "--converged: --patience)",
    )
    p.add_argument("--teacher-lr", type=float, default=2e-3)
    p.add_argument("--teacher-warmup", type=int, default=300)
    p.add_argument(
        "--skip-raw-hrt",
        action="store_true",
        help="train no HRT on raw data (--chunk-size-sets at every budget): a study of the variants only",
    )
    p.add_argument(
        "--only",
        nargs="+",
        metavar="STEP",
        help="run only these steps: prepare (the data; with a teacher, its KD too), kd (the study's "
        "KD set, needs at), teacher, tkd (the teacher's KD set, needs teacher), at, hrt_c2_x1, ... "
        "(training steps, need prepare done), e.g. to train "
        "independent models in parallel processes; with --converged also quality_<hrt model> (its stage "
        "oracles, untimed, once it is trained); a run without --only finishes the study",
    )
    g = p.add_argument_group(
        "converged study (--converged)",
        "teacher, its KD, AT students of --depths decoder layers on MixDistill of it and HRT k = 2 fine-tuned from "
        "each, for every seed of --seeds, every model until its validation BLEU stops rising",
    )
    g.add_argument("--converged", action="store_true", help="run the converged study instead of --scales")
    g.add_argument("--seeds", default="1,2", help="seeds of the students (the teacher: --seed)")
    g.add_argument("--depths", default="2,1", help="decoder layers of the students, in the order they are trained")
    g.add_argument(
        "--patience",
        type=int,
        default=10,
        help="validations (one per epoch) without a higher BLEU before a run stops (validation BLEU moves by "
        "+-0.7 from epoch to epoch on the `small` shape; the study's teacher first beat its epoch-23 best at "
        "epoch 33)",
    )
    g.add_argument(
        "--student-args",
        default="--dropout 0.3",
        help="fairseq-train options of every model of the study (teacher included unless --teacher-args is given)",
    )
    g.add_argument("--max-update-cap", type=int, default=20000, help="update cap of every run (patience stops first)")
    g.add_argument(
        "--hours-cap",
        type=float,
        default=12.0,
        help="training-time cap of every run (--stop-time-hours, counted over restarts and over an HRT model's two "
        "phases): a safety net that a one-thread float32 lane can reach before patience (see the README); it may "
        "change between runs: an unfinished or cap-stopped run trains on under a higher one",
    )
    g.add_argument(
        "--train-only",
        action="store_true",
        help="train the models (with --lanes, each HRT model's test2016 reading, quality_<model>, follows it): "
        "no shortlist, benchmark or bounds",
    )
    g.add_argument(
        "--lanes",
        type=int,
        default=1,
        help="train independent steps this many at a time, each a child `study.py --only <step>` with an equal "
        "share of --threads (a step that is the only one able to run gets them all): two one-thread runs train "
        "1.22x the updates a second of one two-thread run on 2 cores; the HRT models' stage oracles run in a lane "
        "that training leaves idle; the benchmark comes after, on the quiet machine",
    )
    g.add_argument(
        "--blind-dir",
        help="raw sources (*.en) that every benchmarked system translates, untimed and unscored "
        "(default: ../shared/blind beside the repository, when it exists)",
    )
    g.add_argument(
        "--publish",
        metavar="DIR",
        help="train nothing: copy the finished study's reports, blind outputs, bounds and quality files into DIR "
        "(e.g. benchmarks/results/small-converged-cpu)",
    )
    g.add_argument(
        "--status",
        action="store_true",
        help="train nothing: print every training step's state (done, training, stopped, waiting), its updates, "
        "best and last validation BLEU, hours and last logged updates/s, read from the study's markers and logs "
        "(safe beside a running study)",
    )
    g.add_argument(
        "--also-from-teacher",
        action="store_true",
        help="also fine-tune HRT (seed 1, the teacher's depth) from the raw-data teacher: which start is better",
    )
    g.add_argument(
        "--interim-benchmark",
        action="store_true",
        help="with --lanes (also with --train-only): benchmark the first seed's students, the teacher and the "
        "first seed's HRT bounds as soon as they are trained, alone on the machine (training lanes stop at their "
        "epoch's end and resume after it), into OUT/benchmark_s<seed> (step benchmark_s<seed>), so that a machine "
        "lost before the last seed is trained keeps a speed front, its blind outputs and its targets (one seed)",
    )
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.lanes < 1:
        p.error(f"--lanes {args.lanes}: give 1 or more")
    if args.lanes > 1 and (args.only or args.publish or not args.converged):
        p.error("--lanes runs the whole --converged study in parallel steps: not with --only or --publish")
    if args.status and (not args.converged or args.only or args.publish):
        p.error("--status reads the --converged study's logs: it needs --converged, not --only or --publish")
    if args.publish and not args.converged:
        p.error("--publish copies the converged study's results: it needs --converged")
    if args.interim_benchmark and not args.converged:
        p.error("--interim-benchmark benchmarks the converged study's first seed: it needs --converged")
    if args.interim_benchmark and len([x for x in args.seeds.split(",") if x.strip()]) < 2:
        p.error("--interim-benchmark: with one seed in --seeds the study's own benchmark is the same one")
    if args.converged:
        depths = [x for x in args.depths.split(",") if x.strip()]
        defaults = {
            "teacher_arch": recipe.PROFILES[args.profile].at_arch,
            "teacher_args": " ".join([f"--decoder-layers {max(map(int, depths or ['1']))}", args.student_args]),
            "teacher_max_update": args.max_update_cap,
            "teacher_hours": args.hours_cap,
            "teacher_patience": args.patience,
        }
    else:
        defaults = {"teacher_args": "--decoder-layers 3", "teacher_max_update": 8000, "teacher_hours": 2.0}
        defaults["teacher_patience"] = 3
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if any("{tkd}" in item for item in [*args.variants, *args.at_variants]) and not args.teacher_arch:
        p.error("{tkd} (the teacher's KD set) needs --teacher-arch, e.g. --teacher-arch at_small")
    if not args.out:
        args.out = str(Path(os.environ.get(STUDIES_ENV) or DEFAULT_STUDIES).expanduser() / f"study-{args.profile}")
    args.comet_model, args.until, args.hrt_chunk_sizes = None, None, args.chunk_size_sets[0]
    return args


def main(argv=None):
    args = parse_args(argv)
    recipe.run_resumable(lambda: (ConvergedStudy if args.converged else Study)(args))


if __name__ == "__main__":
    main()
