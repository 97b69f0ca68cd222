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

:class:`FolderFiles` fixes the folder at start: every listed file is opened once, checked
through its handle, and read later from that handle only, its bytes checked again. A
re-export into the folder being served (its files replaced by renames) once gave graphs not
yet loaded from the new export beside those of the old one: 0 of 20 lines matched either model.
Standard library only.
"""

import hashlib
import io
import os
import stat
import threading
from typing import Dict, List, Optional

from hrt_runtime.errors import Refused

FILES = "files"  # config.json's key: {name: {"bytes": int, "sha256": hex}}
# whether the list was made for an int8 folder: the exporter records it with the list, after the
# graphs and weights.bin are quantized, so it equals config.json's "int8" (see check_folder)
FILES_INT8 = "files_int8"
# the files an export writes that config.json does not name: the output layer's rows (shortlists)
OUTPUT_WEIGHT, OUTPUT_BIAS = "output_weight.npy", "output_bias.npy"
AUXILIARY = (OUTPUT_WEIGHT, OUTPUT_BIAS)

_verified: Dict[tuple, str] = {}  # (device, inode, size, mtime_ns) -> SHA-256 already computed
_verified_lock = threading.Lock()
_BLOCK = 1 << 24  # the most bytes one read asks for


class DamagedFolderError(Refused):
    """An exported folder whose files are not those its ``config.json`` lists."""


class FolderChanged(DamagedFolderError):
    """A file of a folder in use that is no longer what was checked when it was opened."""


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fd_sha256(fd: int, size: int) -> str:
    digest = hashlib.sha256()
    for offset in range(0, size, _BLOCK):
        digest.update(os.pread(fd, min(_BLOCK, size - offset), offset))
    return digest.hexdigest()


def _kind_of(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def not_regular(path: str) -> Optional[str]:
    """What is wrong with ``path`` as a file of a folder, in words (``None``: a regular file).
    A FIFO or a link to ``/dev/zero`` was once called missing; reading either would block or
    never end, so each is named for what it is."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is missing" + (" (a link to nothing)" if os.path.islink(path) else "")
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISREG(mode):
        return None
    link = f"a link to {os.path.realpath(path)}, " if os.path.islink(path) else ""
    return f"is {link}{_kind_of(mode)}, not a regular file"


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


def _fd_cached_sha256(fd: int) -> str:
    """The SHA-256 of the open file ``fd``, keyed by the identity of what is hashed (the handle's
    own inode: a key taken from the path could name a file renamed in after the hash)."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _verified_lock:
        found = _verified.get(key)
    if found is None:
        found = _fd_sha256(fd, st.st_size)
        with _verified_lock:
            _verified[key] = found
    return found


def _cached_sha256(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return _fd_cached_sha256(fd)
    finally:
        os.close(fd)


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
        problem = not_regular(path)
        if problem:
            damaged.append(f"{name} {problem}")
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


class FolderFiles:
    """Every file ``config`` lists (``"files"``), opened once, when the folder is opened, and
    checked through these handles against the recorded sizes and SHA-256 (after
    :func:`check_folder`: the handles may hold other files than the paths did). Everything
    read later comes from the handles, checked again (:meth:`read`): an export that renames
    new files into the folder leaves the open ones as they were, so what is served stays the
    export checked at start until a restart; a file written over in place is refused
    (:class:`FolderChanged`), never served beside the rest of the old export."""

    def __init__(self, folder: str, config: Dict):
        self.folder, self.recorded = folder, config[FILES]
        # file objects: closed with the model that holds them, whoever drops it
        self._files: Dict[str, io.FileIO] = {}
        try:
            for name in self.recorded:
                self._files[name] = self._open(name)
            for name, f in self._files.items():
                if _fd_cached_sha256(f.fileno()) != self.recorded[name]["sha256"]:
                    raise DamagedFolderError(
                        f"{folder}: {name} changed while the folder was opened (its SHA-256 is not the "
                        f"recorded one); open it again once nothing writes into it, or {_advice(folder)}"
                    )
        except BaseException:
            self.close()
            raise

    def _open(self, name: str) -> io.FileIO:
        path = os.path.join(self.folder, name)
        try:  # non-blocking: a FIFO put in the file's place must not hang the open
            f = io.FileIO(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK))
        except OSError as e:
            raise DamagedFolderError(
                f"{self.folder}: {name} cannot be opened ({e.strerror}); {_advice(self.folder)}"
            ) from None
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.recorded[name]["bytes"]:
            f.close()
            what = f"has {st.st_size} bytes" if stat.S_ISREG(st.st_mode) else f"is {_kind_of(st.st_mode)}"
            raise DamagedFolderError(
                f"{self.folder}: {name} {what} since the folder was checked, the export wrote "
                f"{self.recorded[name]['bytes']} bytes; open it again once nothing writes into it, "
                f"or {_advice(self.folder)}"
            )
        return f

    def read(self, name: str) -> bytearray:
        """The whole of the file ``name`` as it was opened, refused (:class:`FolderChanged`) if
        its bytes are no longer those recorded (written over in place since)."""
        fd, size = self._files[name].fileno(), self.recorded[name]["bytes"]
        data = bytearray(size)
        view, done = memoryview(data), 0
        while done < size:
            got = os.preadv(fd, [view[done : done + _BLOCK]], done)
            if got == 0:
                break
            done += got
        if done != size or hashlib.sha256(data).hexdigest() != self.recorded[name]["sha256"]:
            raise FolderChanged(
                f"{self.folder}: {name} was written over since the folder was opened (it is not the file "
                "checked then), so its model is not served beside the rest of the one loaded; restart to serve "
                "the folder as it is now"
            )
        return data

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()
