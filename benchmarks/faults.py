"""The reliability scenarios of the fault table (benchmarks/fault_table.py runs and reports
them; tests/test_reliability.py runs compact versions): a fairseq-train launcher with kill
points, the tiny-data setting, and one function per case that runs it and returns what
happened (a dict). No reporting here.

``python -m benchmarks.faults --child SPEC -- TRAIN ARGS`` is the kill-point launcher
(:func:`launch` starts it).
"""

import functools
import http.client
import io
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.serve_load import drain_row
from fairseq_hrt.testing.tiny_runs import (
    REPO,
    SRC,
    TGT,
    cli_env,
    make_tiny_data,
    make_tiny_spm_data,
    parse_logs,
    preprocess_args,
    read_lines,
    run_cli,
    run_cli_many,
    train_args,
    write_lines,
    write_raw_corpus,
)
from hrt_runtime import Translator

SAVE_INTERVAL = 5
MAX_UPDATE = 30
N_TRAIN = 300

# ----------------------------------------------------------------------------- launcher
# ``python -m benchmarks.faults --child SPEC -- TRAIN ARGS`` runs fairseq-train in this process after
# installing a kill point. SPEC: ``write:N`` = the N-th checkpoint write stops half-way,
# ``copy:N`` = the N-th checkpoint copy stops half-way; ``,stock-copy`` = undo the plugin's
# atomic copy (fairseq 0.12 alone). At the kill point the process writes what it was writing
# up to half, records it in $FAULT_INFO (JSON) and sends itself SIGKILL.


def _die(info: dict):
    path = os.environ.get("FAULT_INFO")
    if path:
        with open(path, "w") as f:
            json.dump(info, f)
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_point(spec: str):
    import torch  # noqa: PLC0415 - optional: PyTorch and fairseq (the fault table's own process runs without them)
    from fairseq import checkpoint_utils  # noqa: PLC0415 - optional: PyTorch and fairseq (the fault table's own process runs without them)

    import fairseq_hrt  # noqa: F401,PLC0415 - optional: the plugin, as --user-dir loads it (the fault table's own process runs without it)

    parts = spec.split(",")
    if "stock-copy" in parts:
        checkpoint_utils.PathManager = getattr(
            checkpoint_utils.PathManager, "_path_manager", checkpoint_utils.PathManager
        )
    for part in parts:
        if ":" not in part:
            continue
        what, n = part.split(":")
        n = int(n)
        if what == "write":
            original = checkpoint_utils._torch_persistent_save
            calls = {"n": 0}

            def half_write(obj, f, original=original, calls=calls, n=n):
                calls["n"] += 1
                if calls["n"] < n:
                    return original(obj, f)
                buf = io.BytesIO()
                torch.save(obj, buf)
                data = buf.getvalue()
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
                _die({"kill": "write", "file": getattr(f, "name", "?"), "bytes": len(data) // 2, "of": len(data)})

            checkpoint_utils._torch_persistent_save = half_write
        elif what == "copy":
            original_copy = shutil.copyfile
            calls = {"n": 0}

            def half_copy(src, dst, *args, original=original_copy, calls=calls, n=n, **kwargs):
                if not str(src).endswith(".pt"):
                    return original(src, dst, *args, **kwargs)
                calls["n"] += 1
                if calls["n"] < n:
                    return original(src, dst, *args, **kwargs)
                data = Path(src).read_bytes()
                with open(dst, "wb") as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                _die({"kill": "copy", "src": str(src), "file": str(dst), "bytes": len(data) // 2, "of": len(data)})

            shutil.copyfile = half_copy
        else:
            raise SystemExit(f"unknown kill point {part!r}")


def child_main(spec: str, train_argv: List[str]):
    install_kill_point(spec)
    from fairseq_cli.train import cli_main  # noqa: PLC0415 - optional: PyTorch and fairseq (the fault table's own process runs without them)

    sys.argv = ["fairseq-train", *train_argv]
    cli_main()


# ----------------------------------------------------------------------------- helpers

LOADED = re.compile(r"Loaded checkpoint (\S+) \(epoch (\d+) @ (\d+) updates\)")


def checkpoint_updates(path: Path) -> Optional[int]:
    """The update count stored in a checkpoint, None when it is not a complete archive."""
    import torch  # noqa: PLC0415 - optional: PyTorch and fairseq (the fault table's own process runs without them)

    from fairseq_hrt import compat  # noqa: PLC0415 - as torch

    if not path.is_file() or not zipfile.is_zipfile(path):
        return None
    compat.register_checkpoint_types()
    state = torch.load(path, map_location="cpu", weights_only=True)
    return int(state["optimizer_history"][-1]["num_updates"])


def dir_state(save: Path) -> Dict[str, object]:
    """``{file: updates}`` of the complete checkpoints, ``{file: 'incomplete'}`` otherwise."""
    out = {}
    for p in sorted(save.glob("*.pt*")):
        n = checkpoint_updates(p) if p.suffix == ".pt" else None
        out[p.name] = n if n is not None else f"incomplete ({p.stat().st_size} bytes)"
    return out


def resumed_from(output: str) -> int:
    m = LOADED.search(output)
    return int(m.group(3)) if m else 0


def updates_logged(output: str) -> Dict[int, dict]:
    return {int(r["num_updates"]): r for r in parse_logs(output) if "num_updates" in r}


def error_line(output: str, *needles: str) -> str:
    """The last output line holding every needle (the message a user sees)."""
    lines = [line for line in output.splitlines() if all(n in line for n in needles)]
    return lines[-1].strip() if lines else ""


def log_message(line: str) -> str:
    """A log line without its time stamp, level and logger name."""
    return re.split(r"(?:\| WARNING \| [\w.]+ \| |WARNING:[\w.]+:)", line)[-1].strip()


_REPORT_ROOT = ""  # the output folder, resolved: report paths are made relative to it


def relative(text: str) -> str:
    return text.replace(_REPORT_ROOT, ".") if _REPORT_ROOT else text


def short(text: str, n: int = 220) -> str:
    # relative before cutting: a path cut in the middle could no longer be made relative
    text = relative(" ".join(text.split()))
    return text if len(text) <= n else text[: n - 1] + "…"


# ----------------------------------------------------------------------------- setting

KINDS = {
    "AT": {"arch": "at_tiny", "args": ["--hrt-mode", "at"]},
    "HRT": {"arch": "hrt_tiny", "args": ["--chunk-sizes", "2", "--distill-data", "{distill}", "--p-raw", "0.5"]},
    "MP": {"arch": "cmlm_tiny", "args": ["--hrt-mode", "cmlm", "--distill-data", "{distill}", "--p-raw", "0.5"]},
}
KIND_NAMES = {"AT": "AT", "HRT": "HRT (k=2 curriculum, MixDistill)", "MP": "Mask-Predict (MixDistill)"}


class Setting:
    """Tiny data: the raw set, a distilled stand-in (targets reversed, same dictionary), a
    distilled set 10 lines short, another corpus with its own dictionary and the raw set
    binarized with the same dictionary in another order."""

    def __init__(self, root: Path):
        self.root = root
        self.data = make_tiny_data(root / "main", n_train=N_TRAIN, n_valid=20)
        raw_en = read_lines(self.data.raw("train", SRC))
        raw_de = read_lines(self.data.raw("train", TGT))
        reversed_de = [" ".join(reversed(line.split())) for line in raw_de]
        write_lines(root / "distill_raw" / f"train.{SRC}", raw_en)
        write_lines(root / "distill_raw" / f"train.{TGT}", reversed_de)
        write_lines(root / "short_raw" / f"train.{SRC}", raw_en[:-10])
        write_lines(root / "short_raw" / f"train.{TGT}", reversed_de[:-10])
        other = write_raw_corpus(root / "other_raw", n_train=40, n_valid=8, prefer="synthetic", seed=7, vocab=10)
        # the same symbols in another order: a dictionary of the same size that means something else
        symbols = read_lines(self.data.dict_path)
        shuffled = symbols[:]
        random.Random(3).shuffle(shuffled)
        write_lines(root / "shuffled.dict.txt", shuffled)
        self.distill, self.short, self.other, self.shuffled = (
            root / d for d in ("distill_bin", "short_bin", "other_bin", "shuffled_bin")
        )
        run_cli_many(
            [
                preprocess_args(self.distill, root / "distill_raw" / "train", srcdict=self.data.dict_path),
                preprocess_args(self.short, root / "short_raw" / "train", srcdict=self.data.dict_path),
                preprocess_args(self.other, other["train"], other["valid"]),
                preprocess_args(
                    self.shuffled,
                    self.data.raw_dir / "train",
                    self.data.raw_dir / "valid",
                    srcdict=root / "shuffled.dict.txt",
                ),
            ],
            log_dir=root / "logs_preprocess",
        )

    def train(self, kind: str, save: Path, *extra, max_update: int = MAX_UPDATE, data_dir=None) -> List[str]:
        k = KINDS[kind]
        args = [a.format(distill=self.distill) for a in k["args"]]
        return train_args(
            data_dir or self.data.bin_dir,
            save,
            *args,
            "--save-interval-updates",
            SAVE_INTERVAL,
            "--source-lang",
            SRC,
            "--target-lang",
            TGT,
            *extra,
            arch=k["arch"],
            max_update=max_update,
        )


def launch(args: List[str], log_path: Path, kill_point: Optional[str] = None, info: Optional[Path] = None):
    """Start fairseq-train (through the kill-point launcher when ``kill_point``)."""
    args = [str(a) for a in args]
    assert args[0] == "train"
    if kill_point:
        cmd = [sys.executable, "-m", "benchmarks.faults", "--child", kill_point, "--", *args[1:]]
    else:
        cmd = [sys.executable, "-m", "fairseq_cli.train", *args[1:]]
    env = cli_env({"FAULT_INFO": str(info)} if info else None)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT)
    proc._fault_log = log  # noqa: SLF001
    return proc


def finish(proc, log_path: Path, timeout: float = 600) -> str:
    try:
        proc.wait(timeout=timeout)
    finally:
        proc._fault_log.close()  # noqa: SLF001
    return log_path.read_text(errors="replace")


def run_logged(args, log_path: Path, kill_point=None, info=None):
    proc = launch(args, log_path, kill_point, info)
    out = finish(proc, log_path)
    return proc.returncode, out


# ----------------------------------------------------------------------------- training


def reference_runs(s: Setting, work: Path, kinds: List[str]) -> Dict[str, Dict[int, dict]]:
    results = run_cli_many([s.train(k, work / f"ref_{k}") for k in kinds], log_dir=work / "logs_ref")
    return {k: updates_logged(out) for k, (_, out) in zip(kinds, results)}


def compare_to_reference(logged: Dict[int, dict], ref: Dict[int, dict]) -> Dict[str, float]:
    """Largest differences of p_k (the curriculum position) and of the loss, per update."""
    dp = max((abs(r["p_k"] - ref[u]["p_k"]) for u, r in logged.items() if "p_k" in r), default=0.0)
    dl = max((abs(r["loss"] - ref[u]["loss"]) for u, r in logged.items() if u in ref), default=0.0)
    return {"max_p_k_difference": dp, "max_loss_difference": dl}


def random_kills(s: Setting, work: Path, kind: str, ref: Dict[int, dict], kills: int, rng: random.Random) -> dict:
    """``kills`` SIGKILLs at random moments of training, each followed by the same command."""
    save = work / f"random_{kind}"
    events, logged = [], {}
    for attempt in range(kills + 1):
        log_path = work / f"random_{kind}_{attempt}.log"
        proc = launch(s.train(kind, save), log_path)
        event = {"attempt": attempt}
        if attempt < kills:
            # wait for the first logged update of this attempt, then a random part of the run
            start = time.time()
            while proc.poll() is None and '"num_updates"' not in log_path.read_text(errors="replace"):
                if time.time() - start > 300:
                    break
                time.sleep(0.05)
            delay = rng.uniform(0.0, 2.5)
            time.sleep(delay)
            event["delay_after_first_update_s"] = round(delay, 2)
            event["tmp_files_at_kill"] = sorted(p.name for p in save.glob("*.tmp"))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        out = finish(proc, log_path)
        this = updates_logged(out)
        logged.update(this)
        event.update(
            returncode=proc.returncode,
            resumed_from=resumed_from(out),
            last_update=max(this) if this else resumed_from(out),
        )
        events.append(event)
    lost = [max(0, events[i]["last_update"] - events[i + 1]["resumed_from"]) for i in range(kills)]
    final_ok = events[-1]["returncode"] == 0 and events[-1]["last_update"] == MAX_UPDATE
    cmp = compare_to_reference(logged, ref)
    killed = sum(e["returncode"] == -signal.SIGKILL for e in events)
    # every update of the reference was trained (some twice, after a resume)
    complete = sorted(logged) == sorted(ref)
    ok = final_ok and complete and all(x <= SAVE_INTERVAL for x in lost) and cmp["max_p_k_difference"] < 1e-6
    return {"events": events, "lost_updates": lost, "killed": killed, "complete": complete, "ok": ok, **cmp}


def kill_while_writing(s: Setting, work: Path, kind: str, ref: Dict[int, dict], nth: int = 3) -> dict:
    save = work / f"write_{kind}"
    info = work / f"write_{kind}.json"
    rc, out = run_logged(s.train(kind, save), work / f"write_{kind}_0.log", kill_point=f"write:{nth}", info=info)
    kill = json.loads(info.read_text()) if info.exists() else {}
    done = updates_logged(out)
    state = dir_state(save)
    rc2, out2 = run_logged(s.train(kind, save), work / f"write_{kind}_1.log")
    logged = {**done, **updates_logged(out2)}
    back = resumed_from(out2)
    lost = (max(done) if done else 0) - back
    cmp = compare_to_reference(logged, ref)
    ok = (
        rc == -signal.SIGKILL
        and rc2 == 0
        and max(logged) == MAX_UPDATE
        and 0 <= lost <= SAVE_INTERVAL
        and cmp["max_p_k_difference"] < 1e-6
        and all(isinstance(v, int) for k, v in state.items() if k.endswith(".pt"))
    )
    return {
        "kill": kill,
        "files_after_kill": state,
        "resumed_from": back,
        "last_update_before_kill": max(done) if done else 0,
        "lost_updates": lost,
        "returncodes": [rc, rc2],
        "ok": ok,
        **cmp,
    }


def kill_while_copying(s: Setting, work: Path, ref: Dict[int, dict], stock: bool) -> dict:
    """SIGKILL during the copy of checkpoint_E_U.pt to checkpoint_last.pt (the first
    interval save), with the plugin's atomic copy or fairseq's own."""
    name = "copy_stock" if stock else "copy_plugin"
    save = work / name
    info = work / f"{name}.json"
    rc, out = run_logged(
        s.train("HRT", save), work / f"{name}_0.log", kill_point="copy:1" + (",stock-copy" if stock else ""), info=info
    )
    kill = json.loads(info.read_text()) if info.exists() else {}
    state = dir_state(save)
    rc2, out2 = run_logged(s.train("HRT", save), work / f"{name}_1.log")
    result = {"kill": kill, "files_after_kill": state, "returncodes": [rc, rc2]}
    done = updates_logged(out)
    if rc2 == 0:
        logged = {**done, **updates_logged(out2)}
        result.update(
            resumed_from=resumed_from(out2),
            lost_updates=max(done) - resumed_from(out2),
            **compare_to_reference(logged, ref),
        )
        return result
    message = error_line(out2, "cannot read the checkpoint") or error_line(out2, "Error")
    suggested = re.search(r"--restore-file (\S+)", out2)
    result["message"] = message
    result["advice"] = error_line(out2, "What to do")
    if suggested:
        rc3, out3 = run_logged(s.train("HRT", save, "--restore-file", suggested.group(1)), work / f"{name}_2.log")
        logged = {**done, **updates_logged(out3)}
        result.update(
            followed_advice=suggested.group(1),
            returncodes=[rc, rc2, rc3],
            resumed_from=resumed_from(out3),
            lost_updates=max(done) - resumed_from(out3),
            **compare_to_reference(logged, ref),
            completed=rc3 == 0 and max(logged) == MAX_UPDATE,
        )
    return result


def truncated_checkpoint(s: Setting, work: Path) -> dict:
    """A finished AT run whose checkpoint_last.pt is cut to half its bytes: resume and decode."""
    save = work / "truncated"
    run_cli(s.train("AT", save, max_update=10))
    last = save / "checkpoint_last.pt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    train = run_cli(s.train("AT", save, max_update=15), check=False)
    gen = run_cli(
        [
            "generate",
            s.data.bin_dir,
            "--path",
            last,
            "--user-dir",
            str(REPO / "fairseq_hrt"),
            "--task",
            "hrt_translation",
            "--gen-subset",
            "valid",
            "--cpu",
            "--source-lang",
            SRC,
            "--target-lang",
            TGT,
        ],
        check=False,
    )
    suggested = re.search(r"--restore-file (\S+)", train.stdout)
    follow = (
        run_cli(s.train("AT", save, "--restore-file", suggested.group(1), max_update=15), check=False)
        if suggested
        else None
    )
    return {
        "train_returncode": train.returncode,
        "train_message": error_line(train.stdout, "cannot read the checkpoint"),
        "advice": error_line(train.stdout, "What to do"),
        "generate_returncode": gen.returncode,
        "generate_message": error_line(gen.stdout, "cannot read the checkpoint"),
        "followed_advice_returncode": follow.returncode if follow else None,
        "followed_advice_resumed_from": resumed_from(follow.stdout) if follow else None,
    }


def full_disk(s: Setting, work: Path, checkpoint_bytes: int) -> dict:
    """fairseq-train saving into a tmpfs of 1.5 checkpoints (the second save cannot fit next to
    the first), then the same command after the file system is made larger."""
    if not shutil.which("unshare"):
        return {"skipped": "unshare is not available"}
    save = work / "fulldisk"
    save.mkdir(parents=True, exist_ok=True)
    size_kb = int(checkpoint_bytes * 1.5 / 1024)
    train = [str(a) for a in s.train("AT", save, max_update=12)]
    py = [sys.executable, "-m", "fairseq_cli.train", *train[1:]]
    q = shlex.join(py)
    script = f"""
set -u
mount -t tmpfs -o size={size_kb}k tmpfs {save} || {{ echo MOUNT_FAILED; exit 9; }}
{q} > {work}/fulldisk_0.log 2>&1; echo "rc0=$?"
ls -l {save} | tail -n +2 | awk '{{print "file", $5, $9}}'
mount -o remount,size=64m {save}
{q} > {work}/fulldisk_1.log 2>&1; echo "rc1=$?"
ls -l {save} | tail -n +2 | awk '{{print "after", $5, $9}}'
"""
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", script],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=str(REPO),
        timeout=900,
    )
    if "MOUNT_FAILED" in proc.stdout or proc.returncode == 9:
        return {"skipped": f"could not mount a tmpfs in a user namespace: {short(proc.stderr)}"}
    out0 = (work / "fulldisk_0.log").read_text(errors="replace")
    out1 = (work / "fulldisk_1.log").read_text(errors="replace")
    rcs = dict(re.findall(r"^(rc\d)=(\d+)", proc.stdout, re.M))
    done = updates_logged(out0)
    return {
        "tmpfs_kb": size_kb,
        "checkpoint_bytes": checkpoint_bytes,
        "returncodes": [int(rcs.get("rc0", -1)), int(rcs.get("rc1", -1))],
        "message": error_line(out0, "could not write the checkpoint") or error_line(out0, "Error"),
        "files_after_failure": re.findall(r"^file (\d+) (\S+)", proc.stdout, re.M),
        "last_update_before_failure": max(done) if done else 0,
        "resumed_from": resumed_from(out1),
        "final_update": max(updates_logged(out1) or {0: None}),
    }


def other_dictionary(s: Setting, work: Path) -> dict:
    """Resume a run (checkpoint_last.pt) with a data directory of another dictionary."""
    out = {}
    for kind in ("AT", "HRT"):
        save = work / f"dict_{kind}"
        run_cli(s.train(kind, save, max_update=5))
        for name, data_dir in (("other size", s.other), ("same size, other order", s.shuffled)):
            proc = run_cli(s.train(kind, save, max_update=10, data_dir=data_dir), check=False)
            msg = (
                error_line(proc.stdout, "another dictionary")
                or error_line(proc.stdout, "size mismatch")
                or error_line(proc.stdout, "Error")
            )
            out[f"{kind}, {name}"] = {
                "returncode": proc.returncode,
                "message": msg,
                "trained_updates": sorted(updates_logged(proc.stdout)),
            }
    return out


def short_distilled_set(s: Setting, work: Path) -> dict:
    proc = run_cli(train_args(s.data.bin_dir, work / "short", "--distill-data", s.short, max_update=2), check=False)
    return {"returncode": proc.returncode, "message": error_line(proc.stdout, "distilled set not aligned")}


# ----------------------------------------------------------------------------- bad input


def _interactive_bad_input(work: Path, data, ckpt_dir: Path) -> dict:
    """Bad lines through fairseq-interactive with the plugin: every line translated, a warning
    naming each bad one."""
    lines = [
        b"a man rides a horse .",
        b"hello \xff\xfe world",
        b"nul\x00here and a \x07bell \x1b[31m",
        b"      ",
        ("a horse " * 12_500).encode(),
        "Ein Mann 👨‍👩‍👧 läuft — 東京 Москва مرحبا".encode(),
        b"two dogs play .",
    ]
    cmd = [
        sys.executable,
        "-m",
        "fairseq_cli.interactive",
        str(data.bin_dir),
        "--path",
        str(ckpt_dir / "checkpoint_last.pt"),
        "--user-dir",
        str(REPO / "fairseq_hrt"),
        "--task",
        "hrt_translation",
        "--source-lang",
        SRC,
        "--target-lang",
        TGT,
        "--cpu",
        "--bpe",
        "sentencepiece",
        "--sentencepiece-model",
        str(work / "spm" / "spm" / "spm.model"),
        "--max-source-positions",
        "64",
        "--buffer-size",
        "2",
        "--batch-size",
        "2",
    ]
    proc = subprocess.run(
        cmd, input=b"\n".join(lines) + b"\n", capture_output=True, env=cli_env(), cwd=str(REPO), timeout=600
    )
    out = proc.stdout.decode("utf-8", "replace") + proc.stderr.decode("utf-8", "replace")
    hyps = sorted(int(m) for m in re.findall(r"^H-(\d+)\t", out, re.M))
    interactive = {
        "returncode": proc.returncode,
        "input_lines": len(lines),
        "translated_lines": hyps,
        "warnings": [
            short(log_message(line), 200) for line in out.splitlines() if "<stdin>, line" in line or "truncated" in line
        ],
        "traceback": "Traceback" in out,
    }
    return interactive


def _distill_bad_input(work: Path, data, ckpt_dir: Path) -> dict:
    """Bad bytes in distill's --src: every line distilled, a warning naming each bad one."""
    src = work / "distill_src.en"
    pieces = (data.bin_dir.parent / "spm" / "valid.en").read_bytes().splitlines()[:3]
    src.write_bytes(b"\n".join([pieces[0], pieces[1] + b" \xff", pieces[2] + b"\x00"]) + b"\n")
    dist = run_cli(
        [
            "fairseq_hrt.distill",
            "--data",
            data.bin_dir,
            "--path",
            ckpt_dir / "checkpoint_last.pt",
            "--src",
            src,
            "--out",
            work / "distill_out.de",
            "--beam",
            "1",
            "--cpu",
            "--threads",
            "1",
            "--no-progress-bar",
            "--max-len-b",
            "10",
        ],
        check=False,
    )
    out_lines = (work / "distill_out.de").read_text().splitlines() if (work / "distill_out.de").exists() else []
    distill = {
        "returncode": dist.returncode,
        "output_lines": len(out_lines),
        "input_lines": 3,
        "warnings": [short(log_message(line), 200) for line in dist.stdout.splitlines() if f"{src}, line" in line],
    }
    return distill


def bad_input(work: Path) -> dict:
    data = make_tiny_spm_data(work / "spm")
    ckpt_dir = work / "spm" / "ck"
    run_cli(train_args(data.bin_dir, ckpt_dir, "--hrt-mode", "at", arch="at_tiny", max_update=3))
    interactive = _interactive_bad_input(work, data, ckpt_dir)
    return {"interactive": interactive, "distill": _distill_bad_input(work, data, ckpt_dir)}


def set_report_root(path: str):
    """Paths under ``path`` are written relative to it (``.``) by :func:`relative` and :func:`short`."""
    global _REPORT_ROOT
    _REPORT_ROOT = str(Path(path).resolve()) if path else ""


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] != ["--child"] or "--" not in argv:
        raise SystemExit("usage: python -m benchmarks.faults --child SPEC -- TRAIN ARGS")
    child_main(argv[1], argv[argv.index("--") + 1 :])


# ------------------------------------------------------------- the deployed runtime and service

BAD_LINES = [
    b"a man rides a horse .",
    b"hello \xff\xfe world",
    b"nul\x00here and a \x07bell \x1b[31m",
    b"      ",
    ("a horse " * 12_500).encode(),
    "Ein Mann 👨‍👩‍👧 läuft — 東京 Москва مرحبا".encode(),
    b"two dogs play .",
]

# the exporter SIGKILLed right after the file named argv[1] moved into the output folder (files
# move in one by one, config.json last): the files moved so far are printed first
_KILLED_EXPORT = """
import os, signal, sys
real = os.replace
def replace(src, dst):
    real(src, dst)
    print("moved", os.path.basename(dst), flush=True)
    if os.path.basename(dst) == sys.argv[1]:
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
from fairseq_hrt.export.exporter import cli_main
cli_main(sys.argv[2:])
"""


def _runtime_error(folder: Path) -> str:
    """hrt-translate's last line on ``folder`` (one line of input), after its exit status."""
    r = _cli_result(folder, "--beam", "1", "--max-len-b", "5")
    return f"exit {r['returncode']}: {r['last_line']}"


def _request_bytes(body: bytes, *headers: str) -> bytes:
    """A POST /translate as it goes on the wire (for clients that hang up or send part of it)."""
    head = "".join(h + "\r\n" for h in ("Content-Type: application/json", f"Content-Length: {len(body)}", *headers))
    return b"POST /translate HTTP/1.1\r\nHost: x\r\n" + head.encode() + b"\r\n" + body


def _send_and_leave(port: int, body: dict, seconds: float):
    """A whole request whose client goes away ``seconds`` later, without reading the answer."""
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(_request_bytes(json.dumps(body).encode()))
    time.sleep(seconds)
    c.close()


def _post(port: int, body: dict, timeout: float = 300):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("POST", "/translate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def _bad_input_rows(folder: Path) -> dict:
    """The bad lines through hrt-translate, as fairseq-interactive's row."""
    proc = subprocess.run(
        [sys.executable, "-m", "hrt_runtime", str(folder), "--beam", "2", "--max-len-b", "10"],
        input=b"\n".join(BAD_LINES) + b"\n",
        capture_output=True,
        env=cli_env(),
        cwd=str(REPO),
        timeout=600,
    )
    err = proc.stderr.decode("utf-8", "replace")
    return {
        "returncode": proc.returncode,
        "input_lines": len(BAD_LINES),
        "output_lines": proc.stdout.count(b"\n"),
        "traceback": "Traceback" in err,
        "warnings": [short(line.split(" | ")[-1], 200) for line in err.splitlines() if "<stdin>, line" in line],
    }


def _damaged_copies(work: Path, folder: Path) -> Dict[str, Path]:
    """Copies of ``folder`` with a damaged weights.bin or a config.json edited by hand."""
    damaged = {}
    size = (folder / "weights.bin").stat().st_size
    for name in ("truncated", "zeroed", "swapped", "no_file_list", "positions_edited"):
        copy = work / "rt" / f"onnx-{name}"
        shutil.copytree(folder, copy)
        if name in ("no_file_list", "positions_edited"):  # config.json edited by hand
            config = json.loads((copy / "config.json").read_text())
            if name == "no_file_list":
                del config["files"]
            else:
                config["max_source_positions"] = 4096
            (copy / "config.json").write_text(json.dumps(config))
        elif name == "truncated":
            os.truncate(copy / "weights.bin", size // 2)
        elif name == "zeroed":
            with open(copy / "weights.bin", "r+b") as f:
                f.seek(size // 3)
                f.write(bytes(min(1 << 20, size // 3)))
        damaged[name] = copy
    return damaged


def _lying_configs(work: Path, folder: Path, damaged: Dict[str, Path]) -> None:
    """config.json's own lies (into ``damaged``): each once loaded, or failed in a message
    naming no file. Needs ``work/rt/onnx-at-seed2``, another export of the same architecture."""
    size = (folder / "weights.bin").stat().st_size
    for name in ("int8_zeroed", "int8_other_weights", "graphs_swapped", "layers_string", "spm_null", "file_for_folder"):
        copy = work / "rt" / f"onnx-{name}"
        shutil.copytree(folder, copy)
        config = json.loads((copy / "config.json").read_text())
        if name == "int8_zeroed":
            config["int8"] = True
            with open(copy / "weights.bin", "r+b") as f:
                f.write(bytes(size))
        elif name == "int8_other_weights":
            config["int8"] = True
            shutil.copyfile(work / "rt" / "onnx-at-seed2" / "weights.bin", copy / "weights.bin")
        elif name == "graphs_swapped":
            graphs = config["graphs"]
            graphs["step"], graphs["step_top"] = graphs["step_top"], graphs["step"]
        elif name == "layers_string":
            config["layers"] = str(config["layers"])
        elif name == "spm_null":
            config["sentencepiece_model"] = None
        (copy / "config.json").write_text(json.dumps(config))
        damaged[name] = copy / "config.json" if name == "file_for_folder" else copy


def _refusal(path: Path) -> dict:
    """:func:`_runtime_error`'s line, and whether it was the only one."""
    r = _cli_result(path, "--beam", "1", "--max-len-b", "5")
    return {
        "message": f"exit {r['returncode']}: {r['last_line']}",
        "stderr_lines": r["stderr_lines"],
        "traceback": r["traceback"],
    }


def _damaged_folders(work: Path, folder: Path, data) -> Dict[str, dict]:
    """hrt-translate on damaged folders: each refused in one line."""
    damaged = _damaged_copies(work, folder)
    # another export's config.json: the same data, another architecture
    other = work / "rt" / "ck-hrt"
    run_cli(train_args(data.bin_dir, other, arch="hrt_tiny", max_update=2))
    run_cli(["fairseq_hrt.export.exporter", other / "checkpoint_last.pt", work / "rt" / "onnx-hrt"])
    shutil.copyfile(work / "rt" / "onnx-hrt" / "config.json", damaged["swapped"] / "config.json")
    other_at = work / "rt" / "ck-at-seed2"  # another export of the same architecture
    run_cli(train_args(data.bin_dir, other_at, "--hrt-mode", "at", arch="at_tiny", max_update=3, seed=2))
    run_cli(["fairseq_hrt.export.exporter", other_at / "checkpoint_last.pt", work / "rt" / "onnx-at-seed2"])
    _lying_configs(work, folder, damaged)
    return {name: _refusal(path) for name, path in damaged.items()}


def _killed_export(work: Path, folder: Path, data, ckpt_dir: Path) -> dict:
    """An export SIGKILLed while its files move in, over an earlier export of another
    checkpoint; then the same export again."""
    killed = work / "rt" / "onnx-killed"
    shutil.copytree(folder, killed)
    run_cli(
        train_args(data.bin_dir, ckpt_dir, "--hrt-mode", "at", arch="at_tiny", max_update=6)
    )  # resumes: new weights
    export_args = [str(ckpt_dir / "checkpoint_last.pt"), str(killed)]
    kill = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, "weights.bin", *export_args],
        capture_output=True,
        env=cli_env(),
        cwd=str(REPO),
        timeout=600,
    )
    moved = re.findall(r"^moved (\S+)$", kill.stdout.decode(), re.M)
    after_kill = _runtime_error(killed)
    leftovers = sorted(p.name for p in killed.iterdir() if p.name.startswith(".export-"))
    again = run_cli(["fairseq_hrt.export.exporter", *export_args], check=False)
    return {
        "kill_returncode": kill.returncode,
        "moved_before_kill": moved,
        "after_kill": relative(after_kill),
        "temporary_folders_left": leftovers,
        "export_again_returncode": again.returncode,
        "after_export_again": relative(_runtime_error(killed)),
    }


def _threads_on_one_translator(folder: Path, lines: List[str]) -> dict:
    """Many threads on one Translator: each call's output equals the serial one's."""
    calls = [(lines[i : i + 6], dict(beam=1 + i % 3, max_len_b=12)) for i in range(0, 24, 3)]
    serial = [Translator(str(folder)).translate(ls, **o) for ls, o in calls]
    shared = Translator(str(folder))
    with ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(lambda c: shared.translate(c[0], **c[1]), calls * 8))
    return {
        "threads": 8,
        "calls": len(calls) * 8,
        "equal_to_serial": sum(p == serial[i % len(calls)] for i, p in enumerate(parallel)),
    }


def _serve(folder: Path, *options):
    """``(process, port)`` of hrt-serve on ``folder`` with ``options``, once it listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    service = subprocess.Popen(
        [sys.executable, "-m", "hrt_runtime.serve", str(folder), "--port", str(port), *options],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # its log, a line per request: a pipe nobody reads would stop it
        env=cli_env(),
        cwd=str(REPO),
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return service, port
        except OSError:
            if time.monotonic() > deadline or service.poll() is not None:
                service.kill()
                raise RuntimeError("hrt-serve did not start")
            time.sleep(0.2)


# an untrained model runs to the length limit: slow requests
_HEAVY = dict(beam=5, max_len_b=200)


def _full_queue(lines: List[str], serve, translator) -> dict:
    """24 heavy requests at once on a queue of 2: the rest refused with 503, the answered equal
    to ``translator``'s."""
    service, port = serve("--max-batch", "8", "--max-queue", "2")
    try:
        requests = [lines[i % 20 : i % 20 + 4] for i in range(24)]
        with ThreadPoolExecutor(24) as pool:
            answers = list(pool.map(lambda ls: _post(port, {"text": ls, **_HEAVY}), requests))
        return {
            "requests": len(requests),
            "rejected_503": sum(s == 503 for s, _ in answers),
            "answered": sum(s == 200 for s, _ in answers),
            "answers_equal": sum(
                s == 200 and a["translations"] == translator.translate(ls, **_HEAVY)
                for (s, a), ls in zip(answers, requests)
            ),
            "message_503": next((a["error"] for s, a in answers if s == 503), ""),
        }
    finally:
        service.terminate()
        service.wait(30)


def _disconnects(lines: List[str], serve, translator) -> dict:
    """Clients that send a heavy request (or part of one) and go: the service goes on
    answering the others, equal to ``translator``'s."""
    service, port = serve()  # the default queue
    try:
        body = json.dumps({"text": lines[:6], **_HEAVY}).encode()
        for _ in range(4):
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(_request_bytes(body))
            c.close()
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"text"')
        c.close()
        time.sleep(0.5)
        others = [lines[i : i + 3] for i in range(0, 12, 3)]
        with ThreadPoolExecutor(4) as pool:
            later = list(pool.map(lambda ls: _post(port, {"text": ls, "beam": 1, "max_len_b": 12}), others))
        return {
            "disconnected": 5,
            "others": len(others),
            "others_equal": sum(
                s == 200 and a["translations"] == translator.translate(ls, beam=1, max_len_b=12)
                for (s, a), ls in zip(later, others)
            ),
            "service_alive": service.poll() is None,
        }
    finally:
        service.terminate()
        service.wait(30)


def runtime_and_service(work: Path) -> dict:
    """hrt-translate, Translator and hrt-serve on a tiny AT model (SentencePiece) exported with
    fairseq-hrt-export: bad input, damaged folders, a killed export, many threads on one
    Translator, a full queue, clients that disconnect."""
    data = make_tiny_spm_data(work / "rt")
    ckpt_dir = work / "rt" / "ck"
    run_cli(train_args(data.bin_dir, ckpt_dir, "--hrt-mode", "at", arch="at_tiny", max_update=3))
    folder = work / "rt" / "onnx"
    run_cli(["fairseq_hrt.export.exporter", ckpt_dir / "checkpoint_last.pt", folder])
    out: Dict[str, dict] = {"bad_input": _bad_input_rows(folder)}
    out["damaged"] = _damaged_folders(work, folder, data)
    out["killed_export"] = _killed_export(work, folder, data, ckpt_dir)
    lines = read_lines(data.raw("valid", "en"))[:24]
    out["threads"] = _threads_on_one_translator(folder, lines)
    serve = functools.partial(_serve, folder)
    translator = Translator(str(folder))
    out["full_queue"], out["disconnect"] = _full_queue(lines, serve, translator), _disconnects(lines, serve, translator)
    out.update(operator_cases(work, folder, lines, serve))
    out["bounded"] = bounded_service_cases(lines, serve)
    return out


def _cli_result(*args, stdin: bytes = b"a man rides a horse .\n", module: str = "hrt_runtime") -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        input=stdin,
        capture_output=True,
        env=cli_env(),
        cwd=str(REPO),
        timeout=300,
    )
    err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    return {
        "returncode": proc.returncode,
        "stderr_lines": len(err),
        "last_line": relative(err[-1]) if err else "",
        "traceback": any("Traceback" in line for line in err),
        "stdout": proc.stdout.decode("utf-8", "replace")[:200],
    }


def _rss_mib(pid: int) -> Dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) // 1024 for line in status if line.startswith(("VmRSS", "VmHWM"))}


def _info(port: int) -> dict:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", "/info")
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def _metrics(port: int) -> Dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415 - optional: hrt-serve's extra

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    return {
        s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _option_refusals(work: Path, folder: Path) -> Dict[str, dict]:
    """hrt-translate's options out of range, and its output to a full disk."""
    options = {}
    for name, args in (
        ("--lenpen 400", ("--lenpen", "400")),
        ("--lenpen 1e308", ("--lenpen", "1e308")),
        ("--max-len-a inf", ("--max-len-a", "inf")),
        ("--min-len 201", ("--min-len", "201")),
        ("--input DIR", ("--input", str(work))),
        # issue 77: a type error, a negative non-finite value, more threads than CPUs, min_len beyond the positions
        ("--beam 2.5", ("--beam", "2.5")),
        ("--lenpen -inf", ("--lenpen", "-inf")),
        ("--threads 4xCPUs", ("--threads", 4 * len(os.sched_getaffinity(0)))),
        ("--min-len 2000", ("--min-len", "2000")),
    ):
        options[name] = _cli_result(folder, "--beam", "2", *args)
    with open("/dev/full", "wb") as full:  # a full disk: one line, exit 1 (_cli_result captures stdout)
        proc = subprocess.run(
            [sys.executable, "-m", "hrt_runtime", str(folder), "--beam", "2"],
            input=b"a man rides a horse .\n",
            stdout=full,
            stderr=subprocess.PIPE,
            env=cli_env(),
            cwd=str(REPO),
            timeout=300,
        )
    err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
    options["> /dev/full"] = {
        "returncode": proc.returncode,
        "stderr_lines": len(err),
        "last_line": relative(err[-1]) if err else "",
        "traceback": any("Traceback" in line for line in err),
        "stdout": "",
        "expected_exit": 1,
    }
    return options


def _bind_cases(folder: Path, serve, big: List[str]):
    """``(bind, default_limit)``: hrt-serve's port and option errors, a request's own options
    out of range, and ``big`` against the default request limit."""
    bind = {}
    service, port = serve()  # the default settings
    try:
        status, answer = _post(port, {"text": big})
        default_limit = {"status": status, "error": answer.get("error", "")}
        bind["port in use"] = _cli_result(folder, "--port", port, module="hrt_runtime.serve", stdin=b"")
        status, answer = _post(port, {"text": ["a man ."], "lenpen": 400})
        bind["request lenpen 400"] = {"status": status, "error": answer.get("error", "")}
    finally:
        service.terminate()
        service.wait(30)
    bind["--port 70000"] = _cli_result(folder, "--port", "70000", module="hrt_runtime.serve", stdin=b"")
    bind["--max-wait-ms inf"] = _cli_result(folder, "--max-wait-ms", "inf", module="hrt_runtime.serve", stdin=b"")
    zero = subprocess.Popen(
        [sys.executable, "-m", "hrt_runtime.serve", str(folder), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=cli_env(),
        cwd=str(REPO),
        text=True,
    )
    try:
        banner = zero.stdout.readline().strip()
        announced = int(banner.rsplit(":", 1)[1].split()[0])
        socket.create_connection(("127.0.0.1", announced), timeout=5).close()  # listening when announced
        bind["--port 0"] = {"banner": relative(banner), "announced_port": announced, "listening": True}
    finally:
        zero.terminate()
        zero.wait(30)
    return bind, default_limit


def _hang_up_and_large_request(service, port: int, lines: List[str], long_request: List[str], big: List[str]):
    """A client that hangs up during a long request (the next one's wait), a large request
    (the service's memory before, at peak, after), and /metrics after both."""
    out: Dict[str, dict] = {}
    # a client that hangs up 0.5 s into a long request; then the next request's wait
    _send_and_leave(port, {"text": long_request, **_HEAVY}, 0.5)
    start = time.monotonic()
    status, _ = _post(port, {"text": lines[:2], **_HEAVY})
    waited = time.monotonic() - start
    info = _info(port)
    start = time.monotonic()
    _post(port, {"text": long_request, **_HEAVY})
    whole = time.monotonic() - start
    out["hang_up"] = {
        "next_status": status,
        "next_waited_s": round(waited, 2),
        "long_request_whole_s": round(whole, 2),
        "abandoned": info["stats"]["abandoned"],
        "batches_of_long_request": -(-256 // info["batching"]["max_batch"]),
    }
    # a large request: the service's memory before, at peak, after
    before = _rss_mib(service.pid)
    start = time.monotonic()
    status, _ = _post(port, {"text": big, "beam": 5, "max_len_b": 20}, timeout=1200)
    seconds = time.monotonic() - start
    after = _rss_mib(service.pid)
    out["large_request"] = {
        "status": status,
        "seconds": round(seconds, 1),
        "body_mib": round(len(json.dumps({"text": big})) / 2**20, 1),
        "rss_before_mib": before["VmRSS"],
        "rss_peak_mib": after["VmHWM"],
        "rss_after_mib": after["VmRSS"],
    }
    out["metrics"] = {k: v for k, v in _metrics(port).items() if k.startswith("hrt_serve_requests_total")}
    return out


def _sigterm_with_queue(serve, long_request: List[str]) -> dict:
    """SIGTERM with long requests queued: drained for at most --drain-seconds."""
    service, port = serve("--drain-seconds", "2", "--max-request-tokens", "1000000")
    answers: List[int] = []
    threads = [
        threading.Thread(target=lambda: answers.append(_post(port, {"text": long_request, **_HEAVY})[0]))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    time.sleep(1.0)
    start = time.monotonic()
    service.terminate()
    returncode = service.wait(120)
    for t in threads:
        t.join(120)
    return {
        "requests": len(threads),
        "drain_seconds": 2,
        "exit_after_s": round(time.monotonic() - start, 1),
        "returncode": returncode,
        "answered_200": answers.count(200),
        "answered_503": answers.count(503),
    }


def operator_cases(work: Path, folder: Path, lines: List[str], serve) -> dict:
    """What an operator hits (issue 40): options out of range, bind errors, a client that hangs
    up during a long request, a large request (memory before, at peak, after), SIGTERM with
    long requests queued, /metrics after all of it."""
    out: Dict[str, dict] = {"options": _option_refusals(work, folder)}
    big = [(" ".join(lines) * 40)[:20000] for _ in range(256)]  # 256 lines of 20 KB: a 5 MB body
    out["bind"], default_limit = _bind_cases(folder, serve, big)
    long_request = [(lines[i % len(lines)] + " ") * 8 for i in range(256)]
    service, port = serve("--max-request-tokens", "1000000")
    try:
        measured = _hang_up_and_large_request(service, port, lines, long_request, big)
        out["hang_up"], out["large_request"] = measured["hang_up"], measured["large_request"]
        out["large_request"]["default_limit"] = default_limit
        out["metrics"] = measured["metrics"]
    finally:
        service.terminate()
        service.wait(60)
    out["sigterm"] = _sigterm_with_queue(serve, long_request)
    return out


def _raw_exchange(port: int, data: bytes, seconds: float = 30) -> bytes:
    """What the service sends on a connection that sends ``data`` and then nothing, until it
    closes it (or ``seconds`` pass)."""
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.settimeout(seconds)
        try:
            c.sendall(data)
        except (BrokenPipeError, ConnectionResetError):  # answered (and closed) before the body was all sent
            pass
        chunks = []
        try:
            while True:
                chunk = c.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except socket.timeout:
            pass
        return b"".join(chunks)


def _status_and_json(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def _costly_requests(port: int, lines: List[str]) -> Dict[str, dict]:
    """The costly requests (issue 77), a request past its deadline, and a client gone during
    costly work: each stopped, and the next request answered."""
    out: Dict[str, dict] = {}
    hostile = {"text": (lines * 4)[:64], "beam": 256, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}
    status, answer = _post(port, hostile)
    small = _post(port, {"text": lines[:1], "beam": 1, "max_len_b": 12})[0]
    out["issue_request"] = {
        "status": status,
        "error": answer.get("error", ""),
        "next_status": small,
        "positions_in_flight_after": _info(port)["stats"]["positions_in_flight"],
    }
    # admitted, then past its own deadline while its batches run: 504, its batch stopped
    costly = {"text": (lines * 8)[:192], "beam": 16, "max_len_b": 200, "timeout": 0.5}
    status, answer = _post(port, costly)
    time.sleep(0.5)
    info = _info(port)["stats"]
    out["deadline"] = {
        "status": status,
        "error": answer.get("error", ""),
        "stopped_batches": info["stopped_batches"],
        "deadline_passed": info["deadline_passed"],
        "positions_in_flight_after": info["positions_in_flight"],
        "next_status": _post(port, {"text": lines[:1], "beam": 1, "max_len_b": 12})[0],
    }
    # a client gone 0.5 s into costly work: the batch stops at its next decoder step
    _send_and_leave(port, {"text": (lines * 8)[:192], "beam": 16, "max_len_b": 200}, 0.5)
    time.sleep(0.5)
    start = time.monotonic()
    next_status = _post(port, {"text": lines[:1], "beam": 1, "max_len_b": 12})[0]
    info = _info(port)["stats"]
    out["gone"] = {
        "next_status": next_status,
        "next_waited_s": round(time.monotonic() - start, 2),
        "stopped_batches": info["stopped_batches"],
        "abandoned": info["abandoned"],
    }
    return out


def _hostile_bodies(port: int) -> Dict[str, dict]:
    """Hostile bodies and lines: JSON errors."""
    bodies = {}
    for name, data in (
        ("100,000 nested [", b"[" * 100000),
        ("an 18 MiB body", b" " * (18 * 2**20)),
    ):
        raw = _raw_exchange(port, _request_bytes(data, "Connection: close"))
        status, answer = _status_and_json(raw)
        bodies[name] = {"status": status, "json": answer is not None, "error": (answer or {}).get("error", "")}
    status, answer = _post(port, {"text": ["a man rides\na horse ."]})
    bodies["a line holding \\n"] = {"status": status, "json": True, "error": answer.get("error", "")}
    return bodies


def _slow_clients(port: int) -> dict:
    """Slow clients: headers and part of a body, and headers never finished."""
    slow = []
    for i in range(100):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(
            b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"text": ["a'
            if i % 2 == 0
            else b"POST /translate HTTP/1.1\r\nHost: x\r\n"
        )
        slow.append(c)
    time.sleep(3.0)
    answered, closed = {}, 0
    for c in slow:
        c.settimeout(1.0)
        try:
            data = c.recv(65536)
        except OSError:
            data = None
        if data:
            code = data.split(b" ", 2)[1].decode()
            answered[code] = answered.get(code, 0) + 1
        elif data == b"":
            closed += 1
        c.close()
    info = _info(port)["stats"]
    counted = _metrics(port).get("hrt_serve_requests_total{outcome=abandoned}")
    return {
        "connections": len(slow),
        "answered": answered,
        "closed_without_answer": closed,
        "abandoned_info": info["abandoned"],
        "abandoned_metrics": counted,
    }


def _drain(lines: List[str], serve) -> dict:
    """The drain: 8 x 256 lines at beam 5, SIGTERM after 1 s, --drain-seconds 2; /health meanwhile."""
    service, port = serve("--drain-seconds", "2", "--max-request-tokens", "1000000")
    long_request = [(lines[i % len(lines)] + " ") * 2 for i in range(256)]
    # max_len_b 30: an untrained model runs every output to its limit; at 200 no request fits in 2 s
    body = {"text": long_request, "beam": 5, "max_len_b": 30}
    drained = drain_row(port, service, [body] * 8, timeout=300)
    return {
        "requests": drained["requests"],
        "exit_after_s": drained["exit_after_s"],
        "returncode": drained["exit"],
        "answered_200": drained["statuses"].get("200", 0),
        "answered_503": drained["statuses"].get("503", 0),
        "health_while_draining": drained["health_while_draining"],
    }


def bounded_service_cases(lines: List[str], serve) -> dict:
    """hrt-serve bounded by the work a request asks for (issue 77): the costly requests, a
    deadline, a client gone during costly work, slow clients, hostile bodies, the drain."""
    out: Dict[str, dict] = {}
    service, port = serve("--body-timeout", "1", "--idle-timeout", "1", "--drain-seconds", "5")
    try:
        out.update(_costly_requests(port, lines))
        out["bodies"] = _hostile_bodies(port)
        out["slow"] = _slow_clients(port)
    finally:
        start = time.monotonic()
        service.terminate()
        code = service.wait(60)
        out["slow"]["exit"] = code
        out["slow"]["exit_after_s"] = round(time.monotonic() - start, 1)
    out["drain"] = _drain(lines, serve)
    return out
