#!/usr/bin/env python
"""What ``hrt-translate`` costs as a stream, and what the folder check costs at load.

* **latency**: ``(echo A; sleep 4; echo B) | hrt-translate``: seconds from writing A to reading
  A's translation (before B is written), and to the end;
* **memory**: peak RSS and wall time of ``hrt-translate --input FILE`` for ``--lines`` counts of
  sentences (``--input`` repeated) and a 200 KB file of random bytes;
* **integrity**: the sizes check and the SHA-256 check of :mod:`hrt_runtime.integrity` on each
  ``--folder`` (page cache warm), against loading the Translator and translating one line.

``--roots`` runs the first two with other copies of the runtime (``PYTHONPATH`` roots, e.g. an
older revision's ``git archive REV hrt_runtime | tar -x -C DIR``); rows are named by root.
Writes ``runtime_stream.json`` and ``runtime_stream.md`` to ``--out``.

    python -m benchmarks.runtime_stream --folder model-onnx --input test.en --lines 2000 20000 --out DIR
"""

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from typing import Dict, List

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_files import write_files  # noqa: E402
from hrt_runtime import integrity  # noqa: E402
from hrt_runtime.translator import Translator  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = ["--beam", "1", "--max-len-a", "1.2", "--max-len-b", "10"]


def _env(root: str) -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=root.split("=", 1)[-1], OMP_NUM_THREADS="1")


def latency(root: str, folder: str, pause: float = 4.0) -> Dict:
    proc = subprocess.Popen(
        [sys.executable, "-m", "hrt_runtime", os.path.abspath(folder), *OPTIONS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(root),
        cwd="/",
    )
    time.sleep(3.0)  # loaded
    started = time.perf_counter()
    proc.stdin.write(b"A man is riding a bike.\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], pause)
    first = time.perf_counter() - started if ready else None
    if ready:
        proc.stdout.readline()
    time.sleep(max(0.0, pause - (time.perf_counter() - started)))
    proc.stdin.write(b"Two dogs play in the snow.\n")
    proc.stdin.close()
    proc.stdout.read()
    end = time.perf_counter() - started
    proc.wait()
    return {"root": root.split("=", 1)[0], "first_line_s": first, "pause_s": pause, "all_output_s": end}


def memory(root: str, folder: str, path: str, name: str) -> Dict:
    """Peak RSS of one hrt-translate run (measured alone: ru_maxrss of the child that ran)."""
    code = (
        "import resource, subprocess, sys, json, time; t = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL); "
        "print(json.dumps({'rc': p.returncode, 'lines_out': p.stdout.count(b'\\n'), 'wall_s': time.perf_counter() - t, "
        "'peak_rss_mib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            sys.executable,
            "-m",
            "hrt_runtime",
            os.path.abspath(folder),
            "--input",
            path,
            *OPTIONS,
        ],
        capture_output=True,
        text=True,
        env=_env(root),
        cwd="/",
    )
    return {"root": root.split("=", 1)[0], "input": name, **json.loads(out.stdout)}


def integrity_cost(folder: str) -> Dict:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    total = sum(e["bytes"] for e in config["files"].values())
    sizes, sums = [], []
    for _ in range(5):
        started = time.perf_counter()
        integrity.check_folder(folder, config, checksums=False)
        sizes.append(time.perf_counter() - started)
        integrity._verified.clear()
        started = time.perf_counter()
        integrity.check_folder(folder, config, checksums=True)
        sums.append(time.perf_counter() - started)
    integrity._verified.clear()
    started = time.perf_counter()
    Translator(folder).translate("a", beam=1)
    load = time.perf_counter() - started
    return {
        "folder": folder,
        "files_mib": total / 2**20,
        "sizes_ms": 1000 * statistics.median(sizes),
        "sha256_ms": 1000 * statistics.median(sums),
        "load_and_first_call_ms": 1000 * load,
    }


def markdown(result: Dict) -> str:
    out = ["| runtime | A readable after (s) | all output after (s) |", "| --- | ---: | ---: |"]
    for r in result["latency"]:
        first = (
            f"{r['first_line_s']:.3f}" if r["first_line_s"] is not None else f"not within {r['pause_s']:.0f} (at EOF)"
        )
        out.append(f"| {r['root']} | {first} | {r['all_output_s']:.2f} |")
    out += [
        "",
        "| runtime | input | exit | lines out | peak RSS (MiB) | wall (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["memory"]:
        out.append(
            f"| {r['root']} | {r['input']} | {r['rc']} | {r['lines_out']} "
            f"| {r['peak_rss_mib']:.0f} | {r['wall_s']:.1f} |"
        )
    out += [
        "",
        "| folder | files (MiB) | sizes check (ms) | SHA-256 check (ms) | Translator load + first call (ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["integrity"]:
        out.append(
            f"| {r['folder']} | {r['files_mib']:.1f} | {r['sizes_ms']:.2f} | {r['sha256_ms']:.1f} | "
            f"{r['load_and_first_call_ms']:.0f} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", required=True, help="the exported folder the stream rows translate with")
    p.add_argument("--input", required=True, help="sentences, repeated to --lines")
    p.add_argument("--lines", type=int, nargs="+", default=[2000, 20000])
    p.add_argument(
        "--roots", nargs="+", default=[f"this={REPO}"], help="runtime copies to compare, NAME=PATH (PYTHONPATH roots)"
    )
    p.add_argument("--integrity-folders", nargs="*", default=None, help="default: --folder")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    work = os.path.abspath(os.path.join(a.out, "inputs"))
    os.makedirs(work, exist_ok=True)
    with open(a.input, encoding="utf-8") as f:
        sentences = [line for line in f.read().split("\n") if line.strip()]
    inputs: List = []
    for n in a.lines:
        path = os.path.join(work, f"{n}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(sentences[i % len(sentences)] for i in range(n)) + "\n")
        inputs.append((path, f"{n} lines"))
    binary = os.path.join(work, "random-200KB.bin")
    with open(binary, "wb") as f:
        f.write(os.urandom(200_000))
    inputs.append((binary, "200 KB of random bytes"))
    result = {
        "latency": [latency(root, a.folder) for root in a.roots],
        "memory": [memory(root, a.folder, path, name) for path, name in inputs for root in a.roots],
        "integrity": [integrity_cost(f) for f in (a.integrity_folders or [a.folder])],
        "options": OPTIONS,
        "machine": f"{os.cpu_count()} CPUs",
    }
    for path, _ in inputs:
        os.remove(path)
    os.rmdir(work)
    table = markdown(result)
    print(table)
    write_files(a.out, {"runtime_stream.json": json.dumps(result, indent=1) + "\n", "runtime_stream.md": table})


if __name__ == "__main__":
    main()
