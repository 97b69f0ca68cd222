"""The input and output names and the metadata of an ONNX graph file, read from its protobuf
without ``onnx`` and without an ONNX Runtime session (standard library only).

Why: every graph of an exported folder is checked at load against the role ``config.json``
gives it (:func:`hrt_runtime.model.check_roles`); a session per graph would keep each graph's
weights in memory or, made and dropped, cost far more time than reading the few fields needed
here: the graphs hold their
structure only, the weights being in ``weights.bin``.

Field numbers: onnx/onnx.proto (``ModelProto``, ``GraphProto``, ``ValueInfoProto``,
``TensorProto``, ``StringStringEntryProto``), stable since ONNX 1.0.
"""

from typing import Dict, Iterator, NamedTuple, Tuple

MODEL_GRAPH, MODEL_METADATA = 7, 14
GRAPH_INITIALIZER, GRAPH_INPUT, GRAPH_OUTPUT = 5, 11, 12
VALUE_NAME, TENSOR_NAME = 1, 8
ENTRY_KEY, ENTRY_VALUE = 1, 2
VARINT, FIXED64, BYTES, FIXED32 = 0, 1, 2, 5


class GraphInfo(NamedTuple):
    inputs: Tuple[str, ...]  # the inputs a run is fed (initializers listed as inputs left out)
    outputs: Tuple[str, ...]
    metadata: Dict[str, str]  # the model's metadata_props (what a session's custom_metadata_map gives)


def _varint(data: bytes, i: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("a truncated or overlong varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i
        shift += 7


def _fields(data: bytes, start: int, end: int) -> Iterator[Tuple[int, int, int]]:
    """``(field number, start, end)`` of every length-delimited field of the message
    ``data[start:end]``; the other fields are skipped."""
    i = start
    while i < end:
        key, i = _varint(data, i)
        wire = key & 7
        if wire == VARINT:
            _, i = _varint(data, i)
        elif wire == FIXED64:
            i += 8
        elif wire == FIXED32:
            i += 4
        elif wire == BYTES:
            length, i = _varint(data, i)
            if i + length > end:
                raise ValueError("a field runs past its message")
            yield key >> 3, i, i + length
            i += length
        else:
            raise ValueError(f"wire type {wire}, which ONNX files do not use")
    if i != end:
        raise ValueError("a field runs past its message")


def _string(data: bytes, start: int, end: int, number: int) -> str:
    """The string field ``number`` of the message ``data[start:end]`` (the last one; empty if absent)."""
    found = ""
    for field, a, b in _fields(data, start, end):
        if field == number:
            found = data[a:b].decode("utf-8")
    return found


def parse_graph_info(data: bytes) -> GraphInfo:
    """The :class:`GraphInfo` of a serialized ``ModelProto``; ``ValueError`` if it is none."""
    graph = None
    metadata: Dict[str, str] = {}
    for field, a, b in _fields(data, 0, len(data)):
        if field == MODEL_GRAPH:
            graph = (a, b)
        elif field == MODEL_METADATA:
            metadata[_string(data, a, b, ENTRY_KEY)] = _string(data, a, b, ENTRY_VALUE)
    if graph is None:
        raise ValueError("no graph")
    inputs, outputs, initializers = [], [], set()
    for field, a, b in _fields(data, *graph):
        if field == GRAPH_INPUT:
            inputs.append(_string(data, a, b, VALUE_NAME))
        elif field == GRAPH_OUTPUT:
            outputs.append(_string(data, a, b, VALUE_NAME))
        elif field == GRAPH_INITIALIZER:
            initializers.add(_string(data, a, b, TENSOR_NAME))
    return GraphInfo(tuple(n for n in inputs if n not in initializers), tuple(outputs), metadata)


def read_graph_info(path: str) -> GraphInfo:
    with open(path, "rb") as f:
        return parse_graph_info(f.read())
