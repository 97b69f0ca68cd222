"""The one way the measuring scripts write their outputs (reports, tables, hypotheses):
atomically, so an interrupted run never leaves a half-written report. Below every other
module of ``benchmarks/`` (the CTranslate2 reference writes its vocabulary map with it too)."""

import json
import os
from typing import Mapping, Optional, Union


def file_stamp(path: str) -> str:
    """An input file as the outputs made from it remember it: its absolute path, size and
    modification time (a checkpoint rewritten in place gets a new stamp)."""
    st = os.stat(path)
    return f"{os.path.abspath(path)} {st.st_size} {st.st_mtime_ns}"


def write_files(out_dir: str, files: Mapping[str, Union[str, bytes]]):
    """The one way the measuring scripts write their outputs (reports, tables, hypotheses):
    atomically. Every ``{name: text or bytes}`` is first written whole to a temporary file in
    ``out_dir`` (the same file system), then the temporary files replace their targets with
    ``os.replace``, in the order given (put the file whose presence means "complete" last).
    A write that fails or is interrupted leaves the old files intact and no temporary file."""
    os.makedirs(out_dir or ".", exist_ok=True)
    parts = []
    try:
        for name, content in files.items():
            path = os.path.join(out_dir, name)
            part = f"{path}.{os.getpid()}.part"
            parts.append((part, path))
            if isinstance(content, bytes):
                with open(part, "wb") as f:
                    f.write(content)
            else:
                with open(part, "w", encoding="utf-8") as f:
                    f.write(content)
        for part, path in parts:
            os.replace(part, path)
    finally:
        for part, _ in parts:
            if os.path.exists(part):
                os.remove(part)


def write_file(path: str, content: Union[str, bytes]):
    """One file, atomically (:func:`write_files`)."""
    write_files(os.path.dirname(path), {os.path.basename(path): content})


def write_report(out_dir: str, stem: str, report: dict, text: str, echo: bool = True, json_text: Optional[str] = None):
    """``OUT/STEM.md`` and ``OUT/STEM.json`` of a measuring script, atomically, the JSON last
    (the markdown is also printed unless ``echo`` is false). ``json_text``: the JSON as the
    script formats it (default ``json.dumps(report, indent=2)``)."""
    if echo:
        print(text)
    write_files(
        out_dir, {stem + ".md": text, stem + ".json": json.dumps(report, indent=2) if json_text is None else json_text}
    )
