"""The recipe's record of finished steps: WORK/markers/<step>.json, one per step, holding what
the step read (its commands, its input files, the steps before it), their digest and when it
finished.

A step counts as done only while the digest of its inputs is the one its marker holds. Its
inputs are its own commands, the files it reads (size and modification time: a replaced corpus
or checkpoint counts, as ``make`` would have it) and the markers of the steps it reads from, so
a step done again changes the digest of every step after it and they are done again in turn.
A step of several jobs (shards, one model per k) keeps one marker per job in
WORK/markers/<step>/ under the same digest, so a rerun does only the jobs that are missing.
"""

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence


def file_fingerprint(path: Path) -> str:
    """What a rerun compares of an input file: its size and modification time, cheap enough
    for checkpoints of gigabytes."""
    path = Path(path)
    if not path.exists():
        return "missing"
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def step_inputs(commands: Sequence[str], files: Iterable[Path], upstream: Dict[str, str]) -> dict:
    """What a step reads, as its marker records it: its commands, its input files'
    fingerprints and the finish stamps of the steps it reads from (``upstream``: step -> stamp)."""
    return dict(
        commands=list(commands),
        files={str(p): file_fingerprint(Path(p)) for p in sorted({str(p) for p in files})},
        upstream=dict(sorted(upstream.items())),
    )


def digest_of(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def what_changed(before: dict, now: dict) -> str:
    """The inputs that differ, in words: which steps were done again, which files replaced."""
    upstream, files = before.get("upstream", {}), before.get("files", {})
    changes = [f"step {s} done again" for s in now["upstream"] if upstream.get(s) != now["upstream"][s]]
    changes += [f"{p} changed" for p in now["files"] if files.get(p) != now["files"][p]]
    if before.get("commands") != now["commands"]:
        changes.append("its command changed")
    return ", ".join(changes) or "its inputs changed"


class Markers:
    """WORK/markers: what each step and job finished, with which inputs."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def _path(self, step: str) -> Path:
        return self.folder / f"{step}.json"

    def read(self, step: str) -> Optional[dict]:
        try:
            return json.loads(self._path(step).read_text())
        except (OSError, ValueError):
            return None  # never finished, or a marker of an older recipe (``<step>.done``)

    def stamp(self, step: str) -> str:
        """The finish stamp downstream steps digest: its inputs and when it finished."""
        marker = self.read(step)
        if marker is None or marker.get("finished") is None:
            return "not done"
        return f"{marker['inputs']}@{marker['finished']}"

    def is_done(self, step: str, digest: str) -> bool:
        marker = self.read(step)
        return marker is not None and marker["inputs"] == digest and marker.get("finished") is not None

    def stale(self, step: str, digest: str) -> bool:
        """Started or finished once with other inputs than those it would read now: what it
        left (a half-trained model included) must not be resumed from."""
        marker = self.read(step)
        return marker is not None and marker["inputs"] != digest

    def step_started(self, step: str, inputs: dict):
        digest = digest_of(inputs)
        if self.read(step) is None or self.stale(step, digest):
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_atomic(self._path(step), dict(inputs=digest, read=inputs, finished=None))

    def done_jobs(self, step: str, digest: str) -> List[str]:
        """The jobs of an unfinished step that finished with these inputs."""
        folder = self.folder / step
        if not folder.is_dir():
            return []
        return [p.stem for p in folder.glob("*.json") if json.loads(p.read_text()).get("inputs") == digest]

    def job_done(self, step: str, job: str, command: str, digest: str):
        folder = self.folder / step
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / f"{job}.json", dict(command=command, inputs=digest))

    def step_done(self, step: str, inputs: dict, seconds: float):
        self.folder.mkdir(parents=True, exist_ok=True)
        record = dict(inputs=digest_of(inputs), read=inputs, finished=time.time(), seconds=round(seconds, 1))
        _write_atomic(self._path(step), record)

    def change(self, step: str, inputs: dict) -> str:
        """Why a stale step runs again, in words."""
        return what_changed((self.read(step) or {}).get("read", {}), inputs)

    def forget(self, step: str):
        """Drops a step's markers (its jobs' too): it runs again."""
        self._path(step).unlink(missing_ok=True)
        shutil.rmtree(self.folder / step, ignore_errors=True)

    def seconds(self, step: str) -> Optional[float]:
        marker = self.read(step)
        return None if marker is None else marker.get("seconds")


def _write_atomic(path: Path, record: dict):
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(partial, path)
