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
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List

import cloudpickle
import submitit
import torch

SCRIPT_DIR = Path(__file__).resolve().parent
REPO = SCRIPT_DIR.parents[1]
sys.path.insert(0, str(SCRIPT_DIR))
import launch  # noqa: E402
from corpus import SPLITS, checkpoint_problem, parallel_text_problem  # noqa: E402
from markers import Markers, digest_of, step_inputs  # noqa: E402
from plan import Plan  # noqa: E402
from results import write_results  # noqa: E402
from setups import SETUPS, SLICE_SIZES  # noqa: E402
from steps import STEPS, UPSTREAM, Job, Step, build_step  # noqa: E402

# a job's function goes to the SLURM task by value: the task's Python cannot import examples/wmt
cloudpickle.register_pickle_by_value(launch)

# the Multi30k recipe's environment for long CPU runs (docs/training.md, "On a Linux CPU")
_spec = importlib.util.spec_from_file_location("multi30k_recipe", REPO / "examples" / "multi30k" / "recipe.py")
_multi30k = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_multi30k)
GLIBC_KEEP_FREED_MEMORY = _multi30k.GLIBC_KEEP_FREED_MEMORY
log = _multi30k.log

SHARED_DATA = REPO.parent / "shared" / "data"
DISTRIBUTED_PORT = launch.DISTRIBUTED_PORT


class StepOrderError(Exception):
    """A step whose inputs are missing: the message names the step to run first."""


# runs one job's command where submitit put it (examples/wmt/launch.py)
run_job = launch.run_task


class Recipe(Plan):
    """Runs a :class:`plan.Plan`'s steps: each step's jobs submitted through submitit, waited
    for, and marked done with the digest of what they read (markers.py)."""

    def __init__(self, args):
        super().__init__(args)
        self.markers = Markers(self.work / "markers")
        self.redo = set(args.redo.split(",")) if args.redo else set()

    def step(self, name: str) -> Step:
        return build_step(self, name)

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
