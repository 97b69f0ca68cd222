"""An exported folder (``fairseq-hrt-export``) as ONNX Runtime sessions: encode, step, parallel pass.

Only ``numpy`` and ``onnxruntime``: this is what a deployed model runs on.
"""

import io
import json
import os
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from hrt_runtime.errors import Refused, RefusedMissing
from hrt_runtime.families import AT, DESCRIPTION, HRT, MASK_PREDICT
from hrt_runtime.integrity import OUTPUT_BIAS, OUTPUT_WEIGHT, FolderFiles, check_folder, named_files, not_regular
from hrt_runtime.onnx_proto import GraphInfo, parse_graph_info
from hrt_runtime.sessions import GraphSessions

# 3: the non-causal pass takes its query columns (its last layer computed there only);
# 4: greedy.onnx, the greedy search as one Loop (a folder of version 3 decodes without it);
# 5: every graph carries config.json's declared values (DECLARED) in its metadata, compared at
# load. Folders of versions 3 and 4 are still read (their graphs carry nothing to compare: their
# file list and the graphs' shapes are checked); graphs that carry the values are always compared;
# 6: step_tokens.onnx, the greedy step without its score (no log-softmax), for searches whose
# caller reads no scores (a folder of version 5 decodes them with step.onnx).
FORMAT, VERSION = "fairseq-hrt-onnx", 6
READABLE_VERSIONS = (3, 4, 5, 6)
STAMPED_SINCE = 5

# what config.json declares about the graphs, written into each graph's metadata under
# DECLARED_KEY by the exporter: an edited config.json (positions, chunk sizes, symbols) is then
# refused at load instead of translating into garbage or failing inside ONNX Runtime
DECLARED = (
    "kind",
    "layers",
    "heads",
    "head_dim",
    "embed_dim",
    "vocab_size",
    "max_target_positions",
    "max_source_positions",
    "relative_window",
    "recurrent",
    "cell_dim",
    "length_classes",
    "pad",
    "eos",
    "unk",
    "bos",
    "mask",
    "source_eos",
    "source_pad",
    "source_unk",
    "chunk_start",
    "trained_chunk_sizes",
    "banned",
)
DECLARED_KEY = "fairseq_hrt.declared"


def declared_of(config: Dict) -> str:
    """The values ``config`` declares about its graphs, as the JSON each graph carries."""
    return json.dumps({key: config.get(key) for key in DECLARED}, sort_keys=True)


def check_declared(folder: str, config: Dict, graph: str, metadata: Dict[str, str]) -> None:
    """Refuse a ``config.json`` whose declared values are not those the graph ``graph`` carries
    (``metadata``: its custom metadata), naming each that disagrees."""
    carried = metadata.get(DECLARED_KEY)
    if carried is None:
        if config["version"] >= STAMPED_SINCE:
            raise Refused(
                f"{folder}: {graph} carries no declared values, which version {config['version']} graphs do "
                "(a graph of an older export, or not one of fairseq-hrt-export?); export again"
            )
        return
    carried = json.loads(carried)
    declared = json.loads(declared_of(config))
    differ = [key for key in DECLARED if declared.get(key) != carried.get(key)]
    if differ:
        raise Refused(
            f"{folder}: config.json disagrees with its graphs on "
            + ", ".join(f"{key} (config.json {declared.get(key)!r}, {graph} {carried.get(key)!r})" for key in differ)
            + "; export again (config.json was edited, or comes from another export)"
        )


def check_shapes(folder: str, config: Dict, outputs) -> None:
    """Refuse a ``config.json`` whose layers, heads or head size disagree with the encoder's
    outputs (``outputs``: its session's ``get_outputs()``: the bias, then every layer's keys and
    values ``(B, H, S, d)``, then the length predictor's log-probabilities if it has one)."""
    layers, heads, head_dim = config["layers"], config["heads"], config["head_dim"]
    found = len(outputs) - 1
    if found - found % 2 != 2 * layers:
        raise Refused(
            f"{folder}: config.json declares {layers} decoder layers, the encoder graph gives keys and values "
            f"for {found // 2}; export again"
        )
    shape = outputs[1].shape
    for what, axis, value in (("heads", 1, heads), ("head_dim", 3, head_dim)):
        if len(shape) == 4 and isinstance(shape[axis], int) and shape[axis] != value:
            raise Refused(
                f"{folder}: config.json declares {what} {value}, the encoder graph {shape[axis]}; export again"
            )


# the greedy loop graph (greedy.onnx, fairseq_hrt/export/loop.py): the settings it reads beside the
# encoder side, and the name of its input holding a state's start (``past_k0`` -> ``initial_k0``)
LOOP_SETTINGS = ("stride", "max_len", "min_len", "usual_bias", "early_bias", "final_bias", "encoder_bias")
LOOP_ROWS_INPUTS = ("out_weight", "out_bias", "out_ids")  # greedy_restricted.onnx: a shortlist's rows


def loop_state_name(past_name: str) -> str:
    return "initial_" + past_name.split("_", 1)[1]


# the most rows the greedy loop decodes: it runs rows that have ended until the last one ends,
# where the search's own steps drop them, so the loop pays off on small batches only. int8
# graphs: one row, as their activations are quantized with one scale per batch, which rows that
# ended would change
LOOP_ROWS, LOOP_ROWS_INT8 = 2, 1

# the graphs of a folder by role (config.json's "graphs"): what ExportedModel feeds each and how
# many outputs it reads (encode, step, greedy_loop, parallel), checked at load for every graph: a
# config.json whose "graphs" named step_top.onnx as "step" (and step.onnx as "step_top") loaded,
# decoded at beam 1, then failed at beam 5 inside ONNX Runtime (``Invalid input name: k``)
RESTRICTED = "_restricted"  # a shortlist's graph: also fed the output rows
ROLES = ("encoder", "step", "step_tokens", "step_top", "parallel", "greedy")
KNOWN_ROLES = (*ROLES, *(role + RESTRICTED for role in ROLES if role != "encoder"))
NEEDED_ROLES = {
    AT: ("encoder", "step", "step_top"),
    HRT: ("encoder", "step", "step_top", "parallel"),
    MASK_PREDICT: ("encoder", "parallel"),
}


def encoder_side_names(layers: int) -> List[str]:
    """The inputs every decoder graph takes from the encoder (:meth:`Encoded.feeds`)."""
    return ["encoder_bias", *(f"enc_k{i}" for i in range(layers)), *(f"enc_v{i}" for i in range(layers))]


def past_names_of(config: Dict) -> List[str]:
    """A step's state inputs: per layer keys and values, or an SSRU decoder's cell."""
    layers = config["layers"]
    if config.get("recurrent"):
        return [f"past_c{i}" for i in range(layers)]
    return [f"past_k{i}" for i in range(layers)] + [f"past_v{i}" for i in range(layers)]


def graph_signature(config: Dict, role: str) -> Optional[Tuple[FrozenSet[str], int]]:
    """The input names :class:`ExportedModel` feeds the graph of ``role`` and the number of
    outputs it reads (``None``: a role it does not run)."""
    base = role[: -len(RESTRICTED)] if role.endswith(RESTRICTED) else role
    rows = ("out_weight", "out_bias") if base != role else ()  # OutputRows.feeds
    encoder, past = encoder_side_names(config["layers"]), past_names_of(config)
    if role == "encoder":  # a length predictor's log-probabilities last (Mask-Predict)
        return frozenset(["src_tokens"]), 1 + 2 * config["layers"] + (1 if config.get("length_classes") else 0)
    if base in ("step", "step_tokens", "step_top"):
        relative = ["buckets"] if config.get("relative_window", 0) > 0 else []
        top = ["k"] if base == "step_top" else []
        names = ["tokens", "position", "logit_bias", *relative, *encoder, *past, *rows, *top]
        return frozenset(names), 2 + len(past)
    if base == "parallel":
        return frozenset(["tokens", "positions", "queries", "select", "logit_bias", *encoder, *rows]), 2
    if base == "greedy":
        initial = [loop_state_name(name) for name in past]
        return frozenset(["start", *LOOP_SETTINGS, *encoder, *initial, *(LOOP_ROWS_INPUTS if rows else ())]), 2
    return None


def _names(names) -> str:
    return ", ".join(sorted(names)) or "none"


def check_role(folder: str, config: Dict, role: str, name: str, info: GraphInfo) -> None:
    """Refuse the graph file ``name`` (``info``: its inputs and outputs) unless it takes the
    inputs and gives the outputs the runtime feeds and reads for ``role``."""
    expected = graph_signature(config, role)
    if expected is None:
        raise Refused(
            f'{folder}: config.json\'s "graphs" names {name} as {role!r}, a role this runtime does not run '
            f"({', '.join(KNOWN_ROLES)}); export again (config.json was edited, or comes from another export)"
        )
    inputs, outputs = expected
    found = set(info.inputs)
    differ = [
        *([f"inputs the role is not fed: {_names(found - inputs)}"] if found - inputs else []),
        *([f"inputs it lacks: {_names(inputs - found)}"] if inputs - found else []),
        *([f"{len(info.outputs)} outputs, the role reads {outputs}"] if len(info.outputs) != outputs else []),
    ]
    if differ:
        raise Refused(
            f'{folder}: config.json\'s "graphs" names {name} as the {role!r} graph, which it is not '
            f"({'; '.join(differ)}); export again (config.json was edited, or comes from another export)"
        )


def check_graph_roles(folder: str, config: Dict, files: FolderFiles) -> None:
    """Every graph of ``config``'s ``"graphs"`` read from ``files`` (its inputs, outputs and
    metadata, without a session: :mod:`hrt_runtime.onnx_proto`) and checked: the declared values it carries
    (:func:`check_declared`) and its role (:func:`check_role`); and the roles the model's kind
    needs all present."""
    graphs = config["graphs"]
    missing = [role for role in NEEDED_ROLES.get(config["kind"], ("encoder",)) if role not in graphs]
    if missing:
        raise Refused(
            f'{folder}: config.json\'s "graphs" has no {", ".join(missing)} graph, which '
            f"{DESCRIPTION.get(config['kind'], 'a ' + config['kind'] + ' model')} needs; export again (config.json was "
            "edited, or comes from another export)"
        )
    for role, name in graphs.items():
        try:
            info = parse_graph_info(bytes(files.read(name)))
        except ValueError as e:
            raise Refused(f"{folder}: {name} (the {role!r} graph) is not an ONNX graph ({e}); export again") from None
        check_declared(folder, config, name, info.metadata)
        check_role(folder, config, role, name, info)


REQUIRED = (
    "kind",
    "layers",
    "heads",
    "head_dim",
    "vocab_size",
    "max_target_positions",
    "max_source_positions",
    "pad",
    "eos",
    "unk",
    "source_eos",
    "source_pad",
    "source_unk",
    "chunk_start",
    "trained_chunk_sizes",
    "banned",
    "source_dictionary",
    "target_dictionary",
    "graphs",
)


# the type of every config.json key the runtime reads, checked at load: a value of another type
# (``"layers": "1"``) once failed later in a Python TypeError that named no file
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value) -> bool:
    return _is_int(value) and value >= 0


def _file_name(value) -> bool:
    """A file of the folder itself: config.json names no path outside it."""
    return isinstance(value, str) and value not in ("", ".", "..") and os.path.basename(value) == value


def _optional(check: Callable) -> Callable:
    return lambda value: value is None or check(value)


def _counts(value) -> bool:
    return isinstance(value, list) and all(_count(v) for v in value)


def _graph_names(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _file_name(v) for k, v in value.items())


def _chunk_starts(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and k.isdigit() and _count(v) for k, v in value.items())


KEY_TYPES: Dict[str, Tuple[Callable, str]] = {
    **{
        key: (_count, "an integer >= 0")
        for key in (
            "layers",
            "heads",
            "head_dim",
            "vocab_size",
            "max_target_positions",
            "max_source_positions",
            "pad",
            "eos",
            "unk",
            "source_eos",
            "source_pad",
            "source_unk",
            "relative_window",
            "cell_dim",
            "length_classes",
        )
    },
    "kind": (lambda v: isinstance(v, str), "a string"),
    "bos": (_optional(_count), "an integer >= 0 or null"),
    "mask": (_optional(_count), "an integer >= 0 or null"),
    "recurrent": (lambda v: isinstance(v, bool), "true or false"),
    "int8": (lambda v: isinstance(v, bool), "true or false"),
    "chunk_start": (_chunk_starts, "an object of chunk sizes (strings of digits) to integers >= 0"),
    "trained_chunk_sizes": (_counts, "a list of integers >= 0"),
    "banned": (_counts, "a list of integers >= 0"),
    "source_dictionary": (_file_name, "a file name in the folder"),
    "target_dictionary": (_file_name, "a file name in the folder"),
    "sentencepiece_model": (_optional(_file_name), "a file name in the folder or null"),
    "weights": (_optional(_file_name), "a file name in the folder or null"),
    "graphs": (_graph_names, "an object of graph roles to file names in the folder"),
    "parameters_sha256": (_optional(lambda v: isinstance(v, str)), "a string or null"),
}


def check_types(path: str, config: Dict) -> None:
    """Refuse a ``config.json`` (at ``path``) with a key the runtime reads of another type,
    naming the key, the type it must have and the value found."""
    for key, (check, expected) in KEY_TYPES.items():
        if key in config and not check(config[key]):
            raise Refused(
                f"{path}: {key!r} must be {expected}, not {json.dumps(config[key])[:80]}; export again "
                "(config.json was edited, or comes from another export)"
            )


def read_config(folder: str) -> Dict:
    """The ``config.json`` of an exported folder, checked: a folder of this format and version,
    with every key and every file it names, each file as the export wrote it
    (:func:`hrt_runtime.integrity.check_folder`)."""
    if os.path.isfile(folder):
        raise RefusedMissing(  # what the commands report in one line, as for a missing folder
            f"{folder} is a file, not a folder: give the folder fairseq-hrt-export wrote (the one holding config.json)"
        )
    if not os.path.isdir(folder):
        raise RefusedMissing(f"{folder}: no such folder (the output folder of fairseq-hrt-export)")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise RefusedMissing(f"{folder}: no config.json (not a folder written by fairseq-hrt-export)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(f"{path} is not valid JSON ({e}); export the checkpoint again") from None
    if not isinstance(config, dict):
        raise Refused(
            f"{path} is not a fairseq-hrt-export configuration (a JSON {type(config).__name__}, "
            "not an object); export the checkpoint again"
        )
    if config.get("format") != FORMAT or config.get("version") not in READABLE_VERSIONS:
        raise Refused(
            f"{folder}: format {config.get('format')!r} version {config.get('version')!r}, "
            f"this runtime reads {FORMAT!r} versions {', '.join(map(str, READABLE_VERSIONS))}; "
            "export the checkpoint again "
            "with the fairseq-hrt-export of this version"
        )
    missing = [key for key in REQUIRED if key not in config]
    if missing:
        raise Refused(f"{path} lacks {', '.join(missing)}; export the checkpoint again")
    check_types(path, config)
    problems = {name: not_regular(os.path.join(folder, name)) for name in named_files(config)}
    odd = [f"{name} {said}" for name, said in problems.items() if said and not said.startswith("is missing")]
    if odd:
        raise Refused(f"{folder}: {'; '.join(odd)}; copy the whole folder again, or export again")
    absent = [name for name, problem in problems.items() if problem]
    if absent:
        raise RefusedMissing(
            f"{folder}: config.json names {', '.join(absent)}, which "
            f"{'is' if len(absent) == 1 else 'are'} missing (an incomplete copy of the folder, or a "
            "config.json of another export?); copy the whole folder again, or export again"
        )
    check_folder(folder, config)  # every file's size, and its SHA-256 once per process
    return config


class Encoded:
    """The encoder side of a batch: the source padding bias ``(B, 1, 1, S)`` and every decoder
    layer's encoder-attention keys and values ``(B, H, S, d)``, one row per sentence."""

    __slots__ = ("bias", "keys", "values", "length_lprobs", "_feeds")

    def __init__(self, bias: np.ndarray, keys: List[np.ndarray], values: List[np.ndarray]):
        self.bias, self.keys, self.values = bias, keys, values
        self.length_lprobs: Optional[np.ndarray] = None  # Mask-Predict models: (B, classes)
        self._feeds: Optional[Dict[str, np.ndarray]] = None

    @property
    def size(self) -> int:
        """The number of sentences."""
        return self.bias.shape[0]

    def select(self, index) -> "Encoded":
        """The sentences ``index`` (in that order; repeats allowed)."""
        return Encoded(self.bias[index], [k[index] for k in self.keys], [v[index] for v in self.values])

    def feeds(self) -> Dict[str, np.ndarray]:
        """The graphs' encoder inputs (made once: a step reads them at every position)."""
        if self._feeds is None:
            feeds = {"encoder_bias": self.bias}
            feeds.update({f"enc_k{i}": k for i, k in enumerate(self.keys)})
            feeds.update({f"enc_v{i}": v for i, v in enumerate(self.values)})
            self._feeds = feeds
        return self._feeds


class OutputRows:
    """The output-layer rows a batch decodes over: all (``ids`` ``None``) or a shortlist's
    sorted ids with their weight rows (gathered once per batch, fed to the restricted graphs)."""

    def __init__(
        self, ids: Optional[np.ndarray], weight: Optional[np.ndarray] = None, bias: Optional[np.ndarray] = None
    ):
        self.ids, self.weight, self.bias = ids, weight, bias

    def feeds(self) -> Dict[str, np.ndarray]:
        return {} if self.ids is None else {"out_weight": self.weight, "out_bias": self.bias}

    def to_full(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.ids is None else self.ids[rows]

    def position(self, token: int) -> Optional[int]:
        if self.ids is None:
            return token
        i = int(np.searchsorted(self.ids, token))
        return i if i < self.ids.size and int(self.ids[i]) == token else None

    def positions(self, tokens: Sequence[int]) -> List[int]:
        found = (self.position(int(t)) for t in tokens)
        return [p for p in found if p is not None]


class StepState:
    """The state of one left-to-right search (:meth:`ExportedModel.begin`): the sentences'
    encoder side, its rows repeated per hypothesis (made when the rows per sentence change),
    the past keys/values (or SSRU cells) as the last step returned them, and the stride and
    output rows of the search."""

    __slots__ = ("encoded", "rows_encoded", "past", "stride", "rows", "feeds")

    def __init__(self, encoded: "Encoded", past: List[np.ndarray], stride: int, rows: "OutputRows"):
        self.encoded, self.rows_encoded, self.past, self.stride, self.rows = encoded, None, past, stride, rows
        self.feeds: Dict[str, np.ndarray] = {}  # the step's feeds, kept from step to step


def _npy(data: bytearray) -> np.ndarray:
    """The array of a ``.npy`` file's bytes ``data``, a view of them (no second copy)."""
    header = io.BytesIO(bytes(data[:65536]))
    version = np.lib.format.read_magic(header)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(header)
    array = np.frombuffer(data, dtype, count=int(np.prod(shape)), offset=header.tell())
    return array.reshape(shape, order="F" if fortran else "C")


def read_output_layer(files: FolderFiles) -> Tuple[np.ndarray, np.ndarray]:
    """The output projection's weight ``(V, C)`` and bias ``(V,)`` (zeros when it has none),
    from ``output_weight.npy`` / ``output_bias.npy`` as opened at start (held in memory: a
    mapping of the file would show what is written over it later)."""
    weight = _npy(files.read(OUTPUT_WEIGHT))
    has_bias = OUTPUT_BIAS in files.recorded
    bias = _npy(files.read(OUTPUT_BIAS)).astype(np.float32) if has_bias else np.zeros(weight.shape[0], np.float32)
    return weight, bias


class ExportedModel:
    """The sessions of an exported folder, made on first use from its files as opened and
    checked at start (:class:`~hrt_runtime.integrity.FolderFiles`: a re-export into the folder
    changes nothing it decodes). ``threads``: ONNX Runtime's intra-op threads (inter-op 1: the
    graphs are chains of operators; workers do not spin); ``memory_arena``: the sessions keep ONNX
    Runtime's CPU memory arena (off by default: see :func:`hrt_runtime.sessions.session_options`)."""

    def __init__(self, folder: str, threads: int = 1, memory_arena: bool = False):
        self.folder = folder
        self.config = read_config(folder)
        c = self.config
        self.files = FolderFiles(folder, c)
        self.kind = c["kind"]
        self.layers, self.heads, self.head_dim = c["layers"], c["heads"], c["head_dim"]
        self.vocab_size = c["vocab_size"]
        self.pad, self.eos, self.unk = c["pad"], c["eos"], c["unk"]
        self.bos, self.mask = c.get("bos"), c.get("mask")
        self.source_eos, self.source_pad = c["source_eos"], c["source_pad"]
        self.max_target_positions = c["max_target_positions"]
        self.chunk_start = {int(k): v for k, v in c["chunk_start"].items()}
        self.threads = threads
        self.loop_rows = LOOP_ROWS_INT8 if c.get("int8") else LOOP_ROWS
        self.window = int(c.get("relative_window", 0))
        self._buckets: Dict = {}
        self.sessions = GraphSessions(
            folder, c["graphs"], self.kind, threads, self.files, c.get("weights"), memory_arena=memory_arena
        )
        self._positions: Dict[int, np.ndarray] = {}
        self._output_layer = None  # (weight, bias) of the output projection, for shortlists
        # the step's state: per layer keys and values, or an SSRU decoder's cell
        self.recurrent = bool(c.get("recurrent", False))
        self.cell_dim = int(c.get("cell_dim", 0))
        self.past_names = past_names_of(c)
        self.check_graphs()

    def runner(self, graph: str):
        """``feeds -> outputs`` of a graph (:meth:`.sessions.GraphSessions.runner`)."""
        return self.sessions.runner(graph)

    def position(self, p: int) -> np.ndarray:
        """The ``(1,)`` position row ``p`` (made once)."""
        found = self._positions.get(p)
        if found is None:
            found = self._positions[p] = np.array([p], np.int64)
        return found

    def check_graphs(self):
        """Every graph against its role and the values ``config.json`` declares
        (:func:`check_graph_roles`, without sessions: a session per graph would keep every
        graph's weights), and the encoder's session (made now: every translation needs it)
        against the declared shapes (:func:`check_shapes`)."""
        check_graph_roles(self.folder, self.config, self.files)
        check_shapes(self.folder, self.config, self.session("encoder").get_outputs())

    def session(self, graph: str):
        """A graph's ONNX Runtime session, made on first use."""
        return self.sessions.session(graph)

    # ------------------------------------------------------------------------ passes

    def encode(self, src_tokens: np.ndarray) -> Encoded:
        """Source tokens ``(B, S)`` (left-padded, ending in ``</s>``, as fairseq batches them)."""
        out = self.runner("encoder")({"src_tokens": np.ascontiguousarray(src_tokens, dtype=np.int64)})
        encoded = Encoded(out[0], out[1 : 1 + self.layers], out[1 + self.layers : 1 + 2 * self.layers])
        encoded.length_lprobs = out[1 + 2 * self.layers] if len(out) > 1 + 2 * self.layers else None
        return encoded

    def empty_past(self, rows: int) -> List[np.ndarray]:
        """The state before the first step: no keys/values, or SSRU cells of zeros."""
        if self.recurrent:
            return [np.zeros((rows, self.cell_dim), np.float32) for _ in range(self.layers)]
        return [np.zeros((rows, self.heads, 0, self.head_dim), np.float32) for _ in range(2 * self.layers)]

    def buckets(self, step: int, stride: int) -> np.ndarray:
        """The relative-key index of keys ``0..step`` (positions ``j x stride``) seen from ``step``."""
        key = (step, stride)
        found = self._buckets.get(key)
        if found is None:
            w = self.window
            found = self._buckets[key] = (np.clip((np.arange(step + 1) - step) * stride, -w, w) + w).astype(np.int64)
        return found

    # ------------------------------------------------- the backend of hrt_runtime.search

    def stride_of(self, start: int) -> int:
        """Distance of consecutive target positions from a start symbol (``<s_k>``: k)."""
        return next((k for k, s in self.chunk_start.items() if s == start), 1)

    def begin(self, encoded: Encoded, rows: int, steps: int, start: int, out_rows: OutputRows) -> StepState:
        """The state of a left-to-right search from ``start`` over ``rows`` hypotheses of
        ``encoded``'s sentences (sentence-major) for at most ``steps`` positions."""
        return StepState(encoded, None, self.stride_of(start), out_rows)  # the past: made by the first step

    def step(
        self,
        state: StepState,
        tokens: np.ndarray,
        step: int,
        logit_bias: np.ndarray,
        top: int = 1,
        scores: bool = True,
    ):
        """One left-to-right step of ``tokens`` ``(N,)`` (``N / sentences`` rows per sentence)
        at position ``step x stride``, the state grown by it. Returns ``top`` 1: ``(score (N,),
        row (N,))``; else ``(scores (N, top), rows (N, top))``, scores normalised
        log-probabilities of ``log_softmax + logit_bias``. ``scores`` false (``top`` 1): the
        score is ``None`` where the folder has the step without it (``step_tokens.onnx``, no
        log-softmax; not for a shortlist's rows), the same rows."""
        n = tokens.shape[0]
        feeds = state.feeds
        if state.rows_encoded is None or state.rows_encoded.bias.shape[0] != n:
            sentences = state.encoded.bias.shape[0]
            per = n // sentences  # a sentence's rows share its encoder rows
            state.rows_encoded = (
                state.encoded if per == 1 else state.encoded.select(np.repeat(np.arange(sentences), per))
            )
            feeds.update(state.rows_encoded.feeds())
            feeds.update(state.rows.feeds())
        if state.past is None:
            state.past = self.empty_past(n)
        feeds["tokens"] = tokens
        feeds["position"] = self.position(step * state.stride)
        feeds["logit_bias"] = logit_bias
        feeds.update(zip(self.past_names, state.past))
        if self.window > 0:
            feeds["buckets"] = self.buckets(step, state.stride)
        if top != 1:
            feeds["k"] = self.position(top)
        graph = ("step" if top == 1 else "step_top") + ("_restricted" if state.rows.ids is not None else "")
        unscored = not scores and graph == "step" and "step_tokens" in self.config["graphs"]
        out = self.runner("step_tokens" if unscored else graph)(feeds)
        state.past = out[2:]
        return (None if unscored else out[0]), out[1]

    def greedy_loop(
        self,
        encoded: Encoded,
        start: int,
        max_len: int,
        min_len: int,
        biases: Sequence[np.ndarray],
        out_rows: OutputRows,
    ):
        """Every step of a greedy search from ``start`` in one run of ``greedy.onnx``: ``(tokens,
        scores)``, each ``(N, T)``, the steps' tokens and log-probabilities (a row is read up to
        its first ``</s>``), under the search's three logit biases ``(usual, before min_len, at
        max_len)`` (``biases``), ``min_len`` and ``max_len``, over the output rows ``out_rows`` (a shortlist's:
        ``greedy_restricted.onnx``). ``None`` where the loop does not serve the batch (a folder
        exported without it, more than :data:`LOOP_ROWS` rows): the search then makes the steps
        itself, with the same result."""
        n = encoded.size
        graph = "greedy" if out_rows.ids is None else "greedy_restricted"
        if n > self.loop_rows or graph not in self.config["graphs"]:
            return None
        feeds = {
            "start": np.full(n, start, np.int64),
            "stride": np.array(self.stride_of(start), np.int64),
            "max_len": np.array(max_len, np.int64),
            "min_len": np.array(min_len, np.int64),
            "usual_bias": biases[0],
            "early_bias": biases[1],
            "final_bias": biases[2],
            **encoded.feeds(),
            **out_rows.feeds(),
        }
        if out_rows.ids is not None:
            feeds["out_ids"] = out_rows.ids
        feeds.update((loop_state_name(name), past) for name, past in zip(self.past_names, self.empty_past(n)))
        tokens, scores = self.runner(graph)(feeds)  # tokens: ids, not rows
        return tokens.T, scores.T

    def reorder(self, state: StepState, index: np.ndarray, step: int, sentences: Optional[np.ndarray] = None):
        """Row ``r`` of the state becomes old row ``index[r]``; ``sentences``: only these of
        the state's sentences remain (finished ones leave the batch)."""
        state.past = [p[index] for p in state.past]
        if sentences is not None:
            state.encoded = state.encoded.select(sentences)
            state.rows_encoded = None

    def parallel(
        self,
        encoded: Encoded,
        tokens: np.ndarray,
        positions: np.ndarray,
        queries: np.ndarray,
        select: np.ndarray,
        logit_bias: np.ndarray,
        out_rows: OutputRows,
    ):
        """One non-causal pass over ``tokens`` ``(B, T)`` (``encoded``: B rows) whose output is
        read at the columns ``queries`` (sorted; the last layer is computed there only):
        ``(score (M,), row (M,))`` of the best allowed token of the slots ``select`` (flat
        indices into ``B x Q``)."""
        restricted = "_restricted" if out_rows.ids is not None else ""
        feeds = {
            "tokens": tokens,
            "positions": positions,
            "queries": queries,
            "select": select,
            "logit_bias": logit_bias,
            **encoded.feeds(),
            **out_rows.feeds(),
        }
        return tuple(self.runner("parallel" + restricted)(feeds))

    # ------------------------------------------------------------------- output rows

    def output_layer(self):
        """The output projection (:func:`read_output_layer`), read once."""
        if self._output_layer is None:
            self._output_layer = read_output_layer(self.files)
        return self._output_layer

    def rows(self, ids: Optional[np.ndarray]) -> OutputRows:
        """The output rows ``ids`` (sorted; ``None``: the whole vocabulary)."""
        if ids is None:
            return OutputRows(None)
        ids = np.asarray(ids, np.int64)
        weight, bias = self.output_layer()
        return OutputRows(ids, np.ascontiguousarray(weight[ids], dtype=np.float32), bias[ids])
