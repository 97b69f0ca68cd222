#!/usr/bin/env python
"""Train steps of a CPU study on a lent GPU for the minutes a lease allows, and carry their
trainer state back so that the study resumes them on the CPU (docs/gpu.md).

A lent GPU gives minutes (15 a session), a converged `small` student needs hours of one CPU
thread (0.6 updates/s) or some ten minutes of an H200 (12-13 updates/s with two students side
by side), and a call hands back at most 64 MiB: a ``checkpoint_last.pt`` with Adam's state in
float32 (94-107 MB for the ``small`` students) does not fit. So the GPU trains the first part
of a step with the study's own command (the same data, batch, schedule and seed; fp32 on the
GPU instead of bf16 autocast on the CPU), fairseq's ``--stop-time-hours`` ends it with a
validation and a checkpoint, and the state travels with Adam's moments in bfloat16 (their
first three digits; the weights stay float32), xz-compressed, in parts of at most 15 MiB.
Back here the moments are widened again and the checkpoint is put where the study resumes
it, beside the step's command file, so ``study.py`` carries on as after any interruption.

    # here: the steps' commands (their markers/<step>.cmd), data and start checkpoints, for the GPU
    python examples/multi30k/gpu_handoff.py prepare STUDY_DIR at_d2_s2 at_d1_s2 --minutes 7
    # on the GPU machine (carry .gpustudy): train them side by side, pack the first into $OUT
    bash .gpustudy/run.sh train $OUT
    # ... and the next one into $OUT of a second call, if the first call's 64 MiB were used
    bash .gpustudy/run.sh send $OUT at_d2_s2
    # here: rebuild checkpoint_last.pt (and checkpoint_best.pt) in STUDY_DIR/<step>/
    python examples/multi30k/gpu_handoff.py receive STUDY_DIR FILES_AT_FOLDER
"""

import argparse
import io
import lzma
import shlex
import shutil
import sys
from pathlib import Path
from typing import List

import torch

REPO = Path(__file__).resolve().parents[2]
PART_BYTES = 15 * 2**20
GPU_RUN = "$ [gpu]"  # study.py's mark of a GPU run in a step's log (its hours are counted apart)
MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# options of the CPU run that have no meaning on the GPU
CPU_ONLY = {"--cpu", "--cpu-autocast-bf16"}


def gpu_command(cmd: List[str], study: Path, minutes: float, save_dir: str) -> List[str]:
    """The study's training command as the GPU runs it: the same options, minus the CPU's,
    its folders moved under ``$G`` (the carried folder) and a stop time that ends the run
    with a validation and a checkpoint before the lease does."""
    if "-m" not in cmd or cmd[cmd.index("-m") + 1] != "fairseq_cli.train":
        raise SystemExit(f"not a fairseq-train command: {shlex.join(cmd[:4])} ...")
    out = ["python3", "-m", "fairseq_cli.train"]
    args = cmd[cmd.index("-m") + 2 :]
    moved = {"--stop-time-hours": f"{minutes / 60:.4f}", "--save-dir": save_dir, "--user-dir": "$REPO/fairseq_hrt"}
    i = 0
    while i < len(args):
        a = args[i]
        if a in CPU_ONLY:
            i += 1
            continue
        if a in moved and i + 1 < len(args):
            out += [a, moved[a]]
            i += 2
            continue
        out.append(a.replace(str(study), "$G/study") if a.startswith(str(study)) else a)
        i += 1
    return out


def study_inputs(cmd: List[str], study: Path) -> List[Path]:
    """What a command reads from the study folder and must travel: binarised data folders and
    files (an HRT step's ``--finetune-from-model`` AT checkpoint)."""
    found = []
    for i, a in enumerate(cmd):
        if a.startswith(str(study)) and (i == 0 or cmd[i - 1] != "--save-dir"):
            p = Path(a)
            if p.exists() and p not in found:
                found.append(p)
    return found


def cast_moments(checkpoint: dict, dtype: torch.dtype):
    """Adam's moments of a fairseq checkpoint to ``dtype`` (bfloat16 to travel, float32 back)."""
    for state in checkpoint["last_optimizer_state"]["state"].values():
        for key in MOMENTS:
            if key in state:
                state[key] = state[key].to(dtype)


def slim_start(src: Path, dst: Path):
    """A checkpoint to fine-tune from, small enough to travel: its weights in float32 without
    the optimizer's state, tied embeddings saved once (a checkpoint saved on a GPU holds them
    once per use: fairseq copies each tensor to the CPU on its own)."""
    state = torch.load(src, map_location="cpu", weights_only=False)
    state.pop("last_optimizer_state", None)
    kept: List[torch.Tensor] = []
    for name, tensor in state["model"].items():
        same = next((t for t in kept if t.shape == tensor.shape and torch.equal(t, tensor)), None)
        if same is None:
            kept.append(tensor)
        else:
            state["model"][name] = same
    torch.save(state, dst)


def prepare(args):
    study = Path(args.study).resolve()
    dest, site = Path(args.dest), Path(args.site)
    if not site.exists():
        raise SystemExit(f"{site} is missing: `bash benchmarks/gpu_run.sh prepare ...` packs fairseq for the GPU image")
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "study").mkdir(parents=True)
    shutil.copy(site, dest / "site.tar.xz")
    lines = []
    for step in args.steps:
        cmd_file = study / "markers" / f"{step}.cmd"
        if not cmd_file.exists():
            raise SystemExit(f"{cmd_file} is missing: let the study reach {step} once (it writes the command first)")
        if (study / "markers" / f"{step}.done").exists() or (study / step / "checkpoint_last.pt").exists():
            raise SystemExit(f"{step} is done or under way here ({study / step}); the GPU starts steps from scratch")
        cmd = shlex.split(cmd_file.read_text())
        for path in study_inputs(cmd, study):
            target = dest / "study" / path.relative_to(study)
            if target.exists():
                continue
            if path.is_dir():
                shutil.copytree(path, target, ignore=shutil.ignore_patterns("test.*", "*.log"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                slim_start(path, target)
        gpu = gpu_command(cmd, study, args.minutes, f"$W/{step}")
        # $G, $REPO and $W are the device side's folders; everything else is quoted
        text = " ".join(a if a.startswith(("$G/", "$REPO/", "$W/")) else shlex.quote(a) for a in gpu)
        # the log's first line marks the run as the GPU's (study.py counts its hours apart)
        mark = shlex.quote(f"{GPU_RUN} {text}")
        log = f'"$W/{step}.log"'
        lines.append(f"    ( printf '%s\\n' {mark} > {log}; {text} >> {log} 2>&1; echo \"exit $?\" >> {log} ) &")
    steps = " ".join(args.steps)
    script = RUN_SH.format(trainings="\n".join(lines), steps=steps)
    (dest / "run.sh").write_text(script)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    if size > 56 * 2**20:  # the call's working tree (checkout and carried folders) holds 64 MiB
        raise SystemExit(f"{dest} holds {size / 2**20:.1f} MiB: too much to travel with the checkout (64 MiB)")
    print(f"{dest} ({size / 2**20:.1f} MiB): {steps}, {args.minutes} minutes each, side by side")
    print("on the GPU machine, carrying .gpustudy:  bash .gpustudy/run.sh train $OUT")


RUN_SH = """#!/usr/bin/env bash
# Made by examples/multi30k/gpu_handoff.py prepare: the study steps {steps}, on the GPU.
#   bash .gpustudy/run.sh train OUT        train them side by side, pack each, the first into OUT
#   bash .gpustudy/run.sh send OUT STEP    STEP's parts into OUT (a later call: 64 MiB a call)
set -u
G="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$G")"
W="$REPO/.gpustudy-work"  # outside the carried folder: a later call that carries nothing keeps it
mkdir -p "$W"
if python3 -c "import fairseq" 2>/dev/null; then  # a machine with fairseq installed
    export PYTHONPATH="$REPO${{PYTHONPATH:+:$PYTHONPATH}}"
else  # the GPU image: fairseq and its needs from the carried archive
    mkdir -p /tmp/gpu-site
    [ -d /tmp/gpu-site/site ] || tar xJf "$G/site.tar.xz" -C /tmp/gpu-site || exit 1
    export PYTHONPATH="/tmp/gpu-site/site:$REPO${{PYTHONPATH:+:$PYTHONPATH}}"
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export OMP_NUM_THREADS=4
cd "$REPO" || exit 1
case "${{1:-}}" in
train)
    nvidia-smi -L
{trainings}
    wait
    for s in {steps}; do
        tail -n 4 "$W/$s.log"
        python3 examples/multi30k/gpu_handoff.py pack "$W" "$s" "$W/packed/$s" &
    done
    wait
    first=$(echo {steps} | cut -d' ' -f1)
    cp "$W/packed/$first"/* "$2"/
    ;;
send) cp "$W/packed/$3"/* "$2"/ ;;
*) sed -n 2,4p "$0"; exit 2 ;;
esac
"""


def pack(args):
    """On the GPU machine: one step's checkpoint_last.pt (and checkpoint_best.pt where it is
    another update) and log, as parts that fit what a call hands back."""
    work, step, out = Path(args.work), args.step, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    last = torch.load(work / step / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    cast_moments(last, torch.bfloat16)
    bundle = {"last": last, "best_model": None}
    best_path = work / step / "checkpoint_best.pt"
    if best_path.exists():
        best = torch.load(best_path, map_location="cpu", weights_only=False)
        if best["optimizer_history"][-1]["num_updates"] != last["optimizer_history"][-1]["num_updates"]:
            bundle["best_model"] = best  # rare half-way (BLEU still rising): its weights, and no moments
            best.pop("last_optimizer_state", None)
    buffer = io.BytesIO()
    torch.save(bundle, buffer)
    data = lzma.compress(buffer.getvalue(), preset=1)
    parts = [data[i : i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    for i, part in enumerate(parts):
        (out / f"{step}.state.{i:02d}").write_bytes(part)
    shutil.copy(work / f"{step}.log", out / f"{step}.log")
    updates = last["optimizer_history"][-1]["num_updates"]
    print(f"{step}: {len(parts)} parts, {len(data) / 2**20:.1f} MiB, update {updates}")


def receive(args):
    """Here: rebuild the steps' checkpoints in the study folder from the parts a call brought
    back and append the GPU's log to the step's log: the step's command file (the study's
    own, which ``prepare`` read) is still in place, so the study resumes the step."""
    study, got = Path(args.study).resolve(), Path(args.files)
    steps = sorted({p.name.split(".state.")[0] for p in got.glob("*.state.*")})
    if not steps:
        raise SystemExit(f"no *.state.NN parts in {got}")
    for step in steps:
        parts = sorted(got.glob(f"{step}.state.*"))
        bundle = torch.load(io.BytesIO(lzma.decompress(b"".join(p.read_bytes() for p in parts))), weights_only=False)
        last = bundle["last"]
        cast_moments(last, torch.float32)
        target = study / step
        if (target / "checkpoint_last.pt").exists() and not args.force:
            raise SystemExit(
                f"{target / 'checkpoint_last.pt'} exists: this study has trained {step} meanwhile (--force replaces it)"
            )
        target.mkdir(parents=True, exist_ok=True)
        torch.save(last, target / "checkpoint_last.pt")
        if bundle["best_model"] is not None:
            torch.save(bundle["best_model"], target / "checkpoint_best.pt")
        else:
            shutil.copy(target / "checkpoint_last.pt", target / "checkpoint_best.pt")
        log = study / "logs" / f"{step}.log"
        text = (got / f"{step}.log").read_text()
        with open(log, "a") as f:
            f.write(text if text.startswith(GPU_RUN) else f"{GPU_RUN} (a run on a lent GPU)\n{text}")
        print(f"{step}: update {last['optimizer_history'][-1]['num_updates']} -> {target}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    a = sub.add_parser("prepare", help="here: the steps' commands and data into .gpustudy/")
    a.add_argument("study", help="the study folder (e.g. ~/.cache/fairseq-hrt/studies/study-small)")
    a.add_argument("steps", nargs="+", help="steps whose markers/<step>.cmd exist and that have not started")
    a.add_argument("--minutes", type=float, default=7.0, help="training minutes per step (fairseq --stop-time-hours)")
    a.add_argument(
        "--dest",
        default=str(REPO / ".gpustudy"),
        help="the folder to carry: ignored by git, directly in the checkout (run.sh takes its parent for it)",
    )
    a.add_argument(
        "--site",
        default=str(REPO / ".gpu" / "site.tar.xz"),
        help="fairseq and its needs packed for the GPU image (benchmarks/gpu_run.sh prepare makes it)",
    )
    a = sub.add_parser("pack", help="on the GPU: one step's trainer state into parts")
    a.add_argument("work")
    a.add_argument("step")
    a.add_argument("out")
    a = sub.add_parser("receive", help="here: rebuild the checkpoints in the study folder")
    a.add_argument("study")
    a.add_argument("files", help="the folder the parts came back in")
    a.add_argument("--force", action="store_true", help="replace a checkpoint_last.pt the study has made meanwhile")
    args = p.parse_args(argv)
    {"prepare": prepare, "pack": pack, "receive": receive}[args.verb](args)


if __name__ == "__main__":
    sys.exit(main())
