"""An exported folder checked when it is opened: ``config.json`` lists every file the export
wrote with its size and SHA-256 (``"files"``), and :func:`check_folder` compares them.

Why: a truncated ``weights.bin`` used to load and then fail inside ONNX Runtime at the first
``translate`` (``Deserialize tensor ... out of bounds``); the same file with bytes zeroed (same
size) translated into garbage with exit code 0; a ``config.json`` copied from another export
failed with ``Required inputs (['buckets']) are missing``. Now each is one message naming the
file and saying to export again.

Sizes are compared at every check (a ``stat`` per file); checksums when a folder is opened,
once per process and file: a file whose size, modification time and inode are unchanged since
it was hashed is not hashed again (``--decoder-engine onnxruntime`` opens its folder twice).
Hashing runs at disk or page-cache speed (about 1 GB/s on one core): a few milliseconds for the
``mini`` shape's 10 MiB, tens for the ``small`` shape's 50 MiB. Standard library only.
"""

import hashlib
import os
import threading
from typing import Dict, List

FILES = "files"  # config.json's key: {name: {"bytes": int, "sha256": hex}}
FILES_INT8 = "files_int8"  # whether the list was made for an int8 folder (see check_folder)

_verified: Dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> SHA-256 already computed
_verified_lock = threading.Lock()


class DamagedFolderError(ValueError):
    """An exported folder whose files are not those its ``config.json`` lists."""


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def list_files(folder: str, exclude=("config.json",)) -> Dict[str, Dict]:
    """Every regular file of ``folder`` (but ``exclude``) with its size and SHA-256: what the
    exporter records in ``config.json`` just before writing it."""
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name in exclude or name.startswith(".") or not os.path.isfile(path):
            continue
        files[name] = {"bytes": os.path.getsize(path), "sha256": sha256_of(path)}
    return files


def _cached_sha256(path: str) -> str:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    with _verified_lock:
        found = _verified.get(key)
    if found is None:
        found = sha256_of(path)
        with _verified_lock:
            _verified[key] = found
    return found


def _advice(folder: str) -> str:
    return (
        f"export again (fairseq-hrt-export CHECKPOINT {folder}, on the machine that trains), or copy the whole "
        "folder again"
    )


def check_folder(folder: str, config: Dict, checksums: bool = True) -> None:
    """Raise :class:`DamagedFolderError` unless every file ``config`` lists has its recorded
    size (and, with ``checksums``, SHA-256). A folder without the list (exported before it
    existed, or its config.json edited) is refused: nothing would then say that its files are
    the export's (2 MB of zeroed weights translated into garbage with exit code 0). An int8
    copy made from a float folder's ``config.json`` (its list made before the graphs and
    ``weights.bin`` were quantized) has the files it copied unchanged checked."""
    recorded = config.get(FILES)
    if recorded is None:
        raise DamagedFolderError(
            f"{folder}: config.json has no file list ({FILES!r}), so its files cannot be checked; {_advice(folder)}"
        )
    if not isinstance(recorded, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
        for e in recorded.values()
    ):
        raise DamagedFolderError(f"{folder}: config.json's list of files is unreadable; {_advice(folder)}")
    rewritten = set()
    if bool(config.get("int8")) != bool(config.get(FILES_INT8, False)):
        rewritten = set(config.get("graphs", {}).values()) | {config.get("weights")}
    named = [
        *config.get("graphs", {}).values(),
        config.get("source_dictionary"),
        config.get("target_dictionary"),
        config.get("sentencepiece_model"),
        config.get("weights"),
    ]
    unlisted = [n for n in named if n and n not in recorded and n not in rewritten]
    if unlisted:
        raise DamagedFolderError(
            f"{folder}: config.json names {', '.join(unlisted)} "
            f"but does not list {'it' if len(unlisted) == 1 else 'them'} "
            f"among the exported files (a config.json of another export?); {_advice(folder)}"
        )
    checked = [n for n in recorded if n not in rewritten]
    damaged: List[str] = []
    for name in checked:
        path = os.path.join(folder, name)
        want = recorded[name]["bytes"]
        if not os.path.isfile(path):
            damaged.append(f"{name} is missing")
            continue
        size = os.path.getsize(path)
        if size != want:
            damaged.append(
                f"{name} has {size} bytes, the export wrote {want}" + (" (truncated)" if size < want else "")
            )
    if not damaged and checksums:
        for name in checked:
            if _cached_sha256(os.path.join(folder, name)) != recorded[name]["sha256"]:
                damaged.append(f"{name} is not the file the export wrote (its SHA-256 differs; same size)")
    if not damaged:
        return
    if len(damaged) > 1:
        raise DamagedFolderError(
            f"{folder}: config.json does not describe the files beside it ({'; '.join(damaged[:3])}"
            f"{'; ...' if len(damaged) > 3 else ''}): a config.json of another export, files of "
            f"two exports mixed, or damaged files; {_advice(folder)}"
        )
    raise DamagedFolderError(f"{folder}: damaged file: {'; '.join(damaged)}; {_advice(folder)}")
