"""The files of an exported folder (:mod:`.exporter`) around its graphs: the weights stored
once (``weights.bin``), what ``config.json`` declares stamped into every graph, the files listed
with their sizes and digests, and the folder written in a temporary folder and moved in whole.
"""

import hashlib
import json
import os
import shutil
import tempfile
from typing import Dict, List

from hrt_runtime.integrity import FILES, FILES_INT8, list_files
from hrt_runtime.model import DECLARED_KEY, declared_of

CONFIG = "config.json"
WEIGHTS = "weights.bin"


def share_weights(folder: str, graphs: List[str]):
    """Store every weight of the ``graphs`` once, in ``folder/weights.bin`` (ONNX external
    data, 64-byte aligned): the step, top-k, restricted and non-causal graphs hold the same
    planned weights, which each graph file would otherwise carry (a folder of several times the
    model's size)."""
    import onnx  # noqa: PLC0415 - optional: onnx, for exporting
    from onnx import numpy_helper  # noqa: PLC0415 - optional: onnx, for exporting

    offsets: Dict[str, int] = {}
    with open(os.path.join(folder, WEIGHTS), "wb") as weights:
        for name in graphs:
            path = os.path.join(folder, name)
            graph_model = onnx.load(path)  # external data already there are read back in
            for init in graph_model.graph.initializer:
                array = numpy_helper.to_array(init)
                if array.size < 16:  # small constants stay inside the graph
                    continue
                data = array.tobytes()
                key = hashlib.sha1(data + str(array.dtype).encode() + str(array.shape).encode()).hexdigest()
                if key not in offsets:
                    weights.write(b"\0" * (-weights.tell() % 64))
                    offsets[key] = weights.tell()
                    weights.write(data)
                init.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data"):
                    init.ClearField(field)
                del init.external_data[:]
                for k, v in (("location", WEIGHTS), ("offset", str(offsets[key])), ("length", str(len(data)))):
                    entry = init.external_data.add()
                    entry.key, entry.value = k, v
                init.data_location = onnx.TensorProto.EXTERNAL
            onnx.save(graph_model, path)


def temporary_folder(out_dir: str, prefix: str) -> str:
    """A new folder ``out_dir/<prefix><pid>-*`` where an export writes before its files move
    in, after removing those of exports whose process is gone (killed midway: nothing else
    would ever delete them)."""
    for name in os.listdir(out_dir):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return tempfile.mkdtemp(dir=out_dir, prefix=f"{prefix}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def finish(tmp: str, out_dir: str, config: Dict) -> None:
    """An export written in ``tmp`` (:func:`temporary_folder`) made ``out_dir``'s: its files
    recorded in ``config`` (:func:`record_files`), config.json written, and the files moved in,
    config.json last, so the folder appears whole or not at all."""
    record_files(tmp, config)
    with open(os.path.join(tmp, CONFIG), "w") as f:
        json.dump(config, f, indent=1)
    for name in sorted(os.listdir(tmp), key=lambda n: n == CONFIG):
        os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    os.rmdir(tmp)


def stamp_graphs(folder: str, config: Dict) -> None:
    """Write what ``config`` declares about the graphs (:data:`hrt_runtime.model.DECLARED`) into
    every graph's metadata: the runtime compares it with ``config.json`` at load, so an edited
    ``config.json`` (positions, chunk sizes, symbols) is refused instead of translating into
    garbage. The weights stay where they are (``weights.bin``)."""
    import onnx  # noqa: PLC0415 - optional: onnx, for exporting

    for name in sorted(set(config["graphs"].values())):
        path = os.path.join(folder, name)
        graph_model = onnx.load(path, load_external_data=False)
        kept = [(p.key, p.value) for p in graph_model.metadata_props if p.key != DECLARED_KEY]
        del graph_model.metadata_props[:]
        for key, value in [*kept, (DECLARED_KEY, declared_of(config))]:
            entry = graph_model.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(graph_model, path)


def record_files(folder: str, config: Dict) -> None:
    """List in ``config`` every file of the finished export in ``folder`` with its size and
    SHA-256: the runtime compares them when it opens the folder
    (:func:`hrt_runtime.integrity.check_folder`), so a truncated or altered file, or a
    config.json of another export, is named at load instead of failing or translating wrongly.
    Called on the finished files (an int8 folder's after quantization:
    :func:`~fairseq_hrt.export.exporter.quantize_folder`), with the ``"int8"`` they were listed
    for, which the runtime requires to be config.json's."""
    config[FILES] = list_files(folder)
    config[FILES_INT8] = bool(config.get("int8"))
