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
Standard library only.
"""

import hashlib
import os
import threading
from typing import Dict, List

from hrt_runtime.errors import Refused

FILES = "files"  # config.json's key: {name: {"bytes": int, "sha256": hex}}
# whether the list was made for an int8 folder: the exporter records it with the list, after the
# graphs and weights.bin are quantized, so it equals config.json's "int8" (see check_folder)
FILES_INT8 = "files_int8"
# the files an export writes that config.json does not name: the output layer's rows (shortlists)
OUTPUT_WEIGHT, OUTPUT_BIAS = "output_weight.npy", "output_bias.npy"
AUXILIARY = (OUTPUT_WEIGHT, OUTPUT_BIAS)

_verified: Dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> SHA-256 already computed
_verified_lock = threading.Lock()


class DamagedFolderError(Refused):
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


def named_files(config: Dict) -> List[str]:
    """The files ``config`` names: its graphs, dictionaries, SentencePiece model and weights."""
    names = [
        *config.get("graphs", {}).values(),
        config.get("source_dictionary"),
        config.get("target_dictionary"),
        config.get("sentencepiece_model"),
        config.get("weights"),
    ]
    return [name for name in names if name]


def _int8_note(config: Dict) -> str:
    """Why the list may disagree with the files, when config.json's ``"int8"`` is not the one
    the list was made with (empty when they agree)."""
    int8, listed_int8 = bool(config.get("int8")), bool(config.get(FILES_INT8, False))
    if int8 == listed_int8:
        return ""
    if int8:
        return (
            ' (config.json says "int8": true, but its file list is a float folder\'s: "int8" added by hand, or an '
            "int8 folder of a fairseq-hrt-export that listed its files before quantizing them)"
        )
    return ' (config.json says the folder is float, but its file list is an int8 folder\'s: "int8" edited by hand)'


def check_folder(folder: str, config: Dict, checksums: bool = True) -> None:
    """Raise :class:`DamagedFolderError` unless every file ``config`` lists has its recorded
    size (and, with ``checksums``, SHA-256), every file it names is listed, and every listed
    file is named (or is one of the export's :data:`AUXILIARY` files). A folder without the
    list (exported before it existed, or its config.json edited) is refused: nothing would
    then say that its files are the export's (2 MB of zeroed weights translated into garbage
    with exit code 0). Nothing config.json says exempts a listed file: ``"int8": true`` added
    to a float folder once skipped the graphs and ``weights.bin``; the exporter lists an int8
    folder's files after quantizing them, so an int8 folder whose list is a float one's (an
    older export's) is refused, to be exported again. A listed file that config.json does not
    name (``"sentencepiece_model": null`` beside the exported ``.model``, a graph dropped from
    ``"graphs"``) is refused too: the folder would run without it, e.g. read raw pieces."""
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
    named = named_files(config)
    unlisted = [n for n in named if n not in recorded]
    if unlisted:
        raise DamagedFolderError(
            f"{folder}: config.json names {', '.join(unlisted)} "
            f"but does not list {'it' if len(unlisted) == 1 else 'them'} "
            f"among the exported files (a config.json of another export?); {_advice(folder)}"
        )
    unnamed = [n for n in recorded if n not in named and n not in AUXILIARY]
    if unnamed:
        raise DamagedFolderError(
            f"{folder}: config.json lists {', '.join(unnamed)} among the exported files but does not name "
            f'{"it" if len(unnamed) == 1 else "them"} (its "graphs" or "sentencepiece_model" edited?), so the '
            f"folder would run without {'it' if len(unnamed) == 1 else 'them'}; {_advice(folder)}"
        )
    damaged: List[str] = []
    for name in recorded:
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
        for name in recorded:
            if _cached_sha256(os.path.join(folder, name)) != recorded[name]["sha256"]:
                damaged.append(f"{name} is not the file the export wrote (its SHA-256 differs; same size)")
    note = _int8_note(config)
    if not damaged and note:
        raise DamagedFolderError(
            f"{folder}: config.json's int8 flag disagrees with its file list{note}; {_advice(folder)}"
        )
    if not damaged:
        return
    if len(damaged) > 1:
        raise DamagedFolderError(
            f"{folder}: config.json does not describe the files beside it ({'; '.join(damaged[:3])}"
            f"{'; ...' if len(damaged) > 3 else ''}){note}: a config.json of another export, files of "
            f"two exports mixed, or damaged files; {_advice(folder)}"
        )
    raise DamagedFolderError(f"{folder}: damaged file: {'; '.join(damaged)}{note}; {_advice(folder)}")
