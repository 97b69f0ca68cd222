"""CTranslate2 as the outside reference for AT decoding speed.

fairseq's SequenceGenerator is the fastest AT decoder inside fairseq, but it is Python-driven;
CTranslate2 (C++, ``pip install ctranslate2``) converts the same fairseq AT checkpoint and
decodes it with an optimised engine. Its rows in the benchmark show how much of HRT's
speed-up over fairseq's AT would survive against a production AT decoder.

The AT archs of this plugin (``at_*``) are archs of fairseq's own ``transformer`` model, so
CTranslate2's fairseq converter takes them as they are. HRT and CMLM models are not
Transformer checkpoints CTranslate2 knows: they have no CTranslate2 rows. Neither have SSRU
students (``*_ssru``: CTranslate2 has no SSRU layer) nor models trained with
``--decoder-tie-layers`` (their checkpoint stores one decoder layer):
:func:`unsupported_checkpoint_reason` says why, and :func:`convert` refuses them with it.

Beside the benchmark's "+shortlist" rows, CTranslate2 decodes with its vocabulary map
(``translate_batch(use_vmap=True)``): :func:`write_vmap` writes ``vmap.txt`` in the converted
model's folder from the same lexical shortlist, so both runtimes restrict a batch's output
layer to the same candidates (each source token's shortlist and the frequent tokens).
"""

import json
import os
from typing import Dict, List, Optional, Sequence

from benchmarks.report_files import file_stamp, write_file

USER_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fairseq_hrt")

# symbols of the hrt_translation dictionary that fairseq's decoders never output (the
# plugin's SequenceGenerator suppresses them too): fairseq_hrt.symbols.hrt_symbols(), written
# out here because this module runs in processes without PyTorch (runtime_vs_ct2.py), which
# importing the plugin would load; tests/test_benchmark_smoke.py checks that they agree
SPECIAL_SYMBOLS = ("<mask>",) + tuple(f"<s{k}>" for k in range(2, 9))


def unavailable_reason(use_cuda: bool = False) -> Optional[str]:
    """None when CTranslate2 can be used (on the GPU when ``use_cuda``), else why not."""
    try:
        import ctranslate2  # noqa: PLC0415 - optional: CTranslate2
    except ImportError as e:
        return f"the ctranslate2 package is not installed ({e}); pip install ctranslate2==4.8.5"
    if use_cuda and ctranslate2.get_cuda_device_count() == 0:
        # the PyPI wheel is built for one CUDA major version; it sees no GPU with another
        return (
            f"ctranslate2 {ctranslate2.__version__} sees no CUDA device (its wheel needs the CUDA "
            "libraries it was built for); run the benchmark with --ctranslate2 no, or install a matching build"
        )
    return None


_unsupported_reasons: Dict[str, Optional[str]] = {}  # _stamp(checkpoint) -> reason


def unsupported_checkpoint_reason(checkpoint: str) -> Optional[str]:
    """None when CTranslate2's fairseq converter can take this AT checkpoint, else why not
    (a missing file is left to the loader's own error). The checkpoint is read once while it
    is unchanged (the benchmark asks when listing rows and when listing skipped families)."""
    if not os.path.isfile(checkpoint):
        return None
    stamp = _stamp(checkpoint)
    if stamp not in _unsupported_reasons:
        _unsupported_reasons[stamp] = _unsupported_reason(checkpoint)
    return _unsupported_reasons[stamp]


def _unsupported_reason(checkpoint: str) -> Optional[str]:
    import torch  # noqa: PLC0415 - optional: PyTorch (runtime_vs_ct2 runs this module without it)

    from fairseq_hrt.compat import register_checkpoint_types  # noqa: PLC0415 - optional, as torch

    register_checkpoint_types()  # what fairseq pickles beside the weights, on PyTorch's allow-list
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    cfg = state.get("cfg") or {}
    model_cfg = cfg.get("model") if hasattr(cfg, "get") else None
    if model_cfg is None:
        model_cfg = state.get("args")
    arch = getattr(model_cfg, "arch", None) or "?"
    if getattr(model_cfg, "_name", None) == "transformer_ssru" or any(".ssru." in k for k in state.get("model", {})):
        return (
            f"{checkpoint} is an SSRU student (--arch {arch}): CTranslate2 has no SSRU decoder layer "
            "(its converter knows self-attention Transformers only); no CTranslate2 row for it"
        )
    if getattr(model_cfg, "decoder_tie_layers", False):
        return (
            f"{checkpoint} was trained with --decoder-tie-layers (the checkpoint stores one decoder "
            "layer); CTranslate2's converter expects every layer's weights; no CTranslate2 row for it"
        )
    return None


def _stamp(checkpoint: str) -> str:
    return file_stamp(checkpoint) + "\n"  # a line of converted_from.txt


def convert(checkpoint: str, data_dir: str, out_dir: str, source_lang: str, target_lang: str) -> str:
    """Convert a fairseq AT checkpoint to a CTranslate2 model directory under ``out_dir``
    (done once: the conversion is kept and reused while the checkpoint is unchanged)."""
    from ctranslate2.converters import FairseqConverter  # noqa: PLC0415 - optional: CTranslate2

    reason = unsupported_checkpoint_reason(checkpoint)
    if reason:
        raise ValueError(f"CTranslate2 cannot convert this checkpoint: {reason}")
    target = os.path.join(out_dir, "ctranslate2-" + os.path.basename(os.path.dirname(os.path.abspath(checkpoint))))
    stamp_file = os.path.join(target, "converted_from.txt")
    if os.path.exists(stamp_file) and open(stamp_file).read() == _stamp(checkpoint):
        return target
    FairseqConverter(
        checkpoint,
        data_dir,
        source_lang=source_lang,
        target_lang=target_lang,
        user_dir=USER_DIR,
        # no unsafe_deserialization: loading the user dir puts fairseq's pickled types on PyTorch's allow-list
    ).convert(target, force=True)
    write_file(stamp_file, _stamp(checkpoint))
    return target


def load(model_dir: str, use_cuda: bool, fp16: bool, threads: int, compute_type: Optional[str] = None):
    """A translator of the converted model; ``compute_type`` (default: the precision of the
    fairseq models it is compared with) e.g. ``int8`` beside the int8 rows."""
    import ctranslate2  # noqa: PLC0415 - optional: CTranslate2

    return ctranslate2.Translator(
        model_dir,
        device="cuda" if use_cuda else "cpu",
        compute_type=compute_type or ("float16" if fp16 else "float32"),
        inter_threads=1,
        intra_threads=threads,
    )


VMAP_FILE = "vmap.txt"  # the name CTranslate2 reads its vocabulary map from, in the model folder


def vmap_text(shortlist, source_dictionary, target_symbols: Sequence[str], leave_out: Sequence[str] = ()) -> str:
    """A lexical shortlist (:class:`fairseq_hrt.shortlist.Shortlist`) as CTranslate2's
    vocabulary map: one line per source token with targets, ``source<TAB>target target ...``
    (its shortlist, best first), and a first line with an empty source, the targets every
    batch may produce (the shortlist's frequent tokens and special symbols). Sources are the
    fairseq dictionary's symbols (the pieces the model reads); targets are written as
    ``target_symbols`` spells target id i (the converted model's vocabulary: CTranslate2 calls
    fairseq's ``<pad>`` ``<blank>``).

    CTranslate2 then decodes a batch over the union of the targets of its source tokens and
    the always-on ones (plus ``<unk>``, ``<s>`` and ``</s>``, which the shortlist holds too),
    which are the candidates :meth:`Shortlist.candidates` gives the fairseq-hrt engines for the
    same batch: fairseq appends ``</s>`` to every source, so its targets (none in a shortlist
    of ``fairseq-hrt-shortlist``, which keeps special symbols out of its statistics) are
    always-on here; padding is never a source token. Targets in ``leave_out`` are left out
    (:data:`SPECIAL_SYMBOLS`, which no decoder outputs: see :func:`translate`)."""
    src = source_dictionary.symbols
    translations = shortlist.translations.tolist()
    if len(target_symbols) != shortlist.target_size:
        raise ValueError(f"{len(target_symbols)} target symbols, the shortlist has {shortlist.target_size}")

    def symbol(symbols, i, side):
        token = symbols[i]
        if not token or any(c.isspace() for c in token):
            raise ValueError(
                f"{side} symbol {i} ({token!r}) is empty or holds white space: it cannot be written "
                "in a CTranslate2 vocabulary map"
            )
        return token

    eos, pad = source_dictionary.eos(), source_dictionary.pad()
    dropped = set(leave_out)
    always = set(shortlist.always.tolist()) | {t for t in translations[eos] if t >= 0}
    lines = [
        "\t" + " ".join(symbol(target_symbols, t, "target") for t in sorted(always) if target_symbols[t] not in dropped)
    ]
    for s, row in enumerate(translations):
        targets = [t for t in row if t >= 0 and target_symbols[t] not in dropped]
        if targets and s not in (eos, pad):
            lines.append(
                symbol(src, s, "source") + "\t" + " ".join(symbol(target_symbols, t, "target") for t in targets)
            )
    return "\n".join(lines) + "\n"


def write_vmap(model_dir: str, shortlist, source_dictionary, target_dictionary) -> str:
    """Write :func:`vmap_text` as the converted model's ``vmap.txt`` (read when CTranslate2
    loads the model; ``translate_batch(use_vmap=True)`` uses it); returns its path. The
    model's target vocabulary must be fairseq's, id for id (but ``<pad>``, which CTranslate2
    names ``<blank>``)."""
    symbols = list(target_dictionary.symbols)
    vocabulary = target_vocabulary(model_dir)
    if vocabulary is not None:
        differ = [i for i, (a, b) in enumerate(zip(vocabulary, symbols)) if a != b and i != target_dictionary.pad()]
        if len(vocabulary) != len(symbols) or differ:
            raise ValueError(
                f"the CTranslate2 model {model_dir} has another target vocabulary than the fairseq "
                f"dictionary ({len(vocabulary)} / {len(symbols)} tokens, first difference at "
                f"{differ[:1]})"
            )
        symbols = vocabulary
    path = os.path.join(model_dir, VMAP_FILE)
    write_file(path, vmap_text(shortlist, source_dictionary, symbols, leave_out=SPECIAL_SYMBOLS))
    return path


def target_vocabulary(model_dir: str) -> Optional[List[str]]:
    """The target tokens of a converted model (its target or shared vocabulary file), or None."""
    for name in ("target_vocabulary", "shared_vocabulary"):
        path = os.path.join(model_dir, name + ".json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        path = os.path.join(model_dir, name + ".txt")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read().split("\n")
    return None


def suppressed(vocabulary: Sequence[str]) -> List[List[str]]:
    present = set(vocabulary)
    return [[s] for s in SPECIAL_SYMBOLS if s in present]


def translate(
    translator,
    sources: List[List[str]],
    batch_size: int,
    beam: int,
    max_len: int,
    suppress: List[List[str]],
    max_len_a: float = 0.0,
    use_vmap: bool = False,
) -> Dict[int, List[str]]:
    """Translate pieces, ``batch_size`` sentences at a time (CTranslate2 sorts the inputs by
    length before splitting them into batches, as fairseq's batching does). Returns
    ``{sentence index: output pieces}`` (untimed: the benchmark times it with
    :func:`benchmarks.timing.time_runs`). With ``max_len_a``, a batch's outputs are at most
    ``max_len_a x`` its longest source (with ``</s>``, fairseq's padded width) ``+ max_len``
    tokens, as fairseq's ``--max-len-a/b``: the batches are then made here, sorted by length.
    ``use_vmap``: decode each batch over the candidates of the model's vocabulary map
    (:func:`write_vmap`), which leaves the suppressed symbols out instead: CTranslate2 4.8.5
    corrupts its heap when ``suppress_sequences`` name tokens of the map's candidates (aborts
    in malloc or segfaults, on a d = 256, 8k-vocabulary model)."""
    options = dict(beam_size=beam, suppress_sequences=suppress or None)
    if use_vmap:
        options.update(use_vmap=True, suppress_sequences=None)
    if not max_len_a:
        results = translator.translate_batch(
            sources, max_batch_size=batch_size, batch_type="examples", max_decoding_length=max_len, **options
        )
        return {i: r.hypotheses[0] for i, r in enumerate(results)}
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out = {}
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        longest = max(len(sources[i]) for i in batch) + 1
        results = translator.translate_batch(
            [sources[i] for i in batch],
            max_batch_size=batch_size,
            batch_type="examples",
            max_decoding_length=int(max_len_a * longest + max_len),
            **options,
        )
        out.update({i: r.hypotheses[0] for i, r in zip(batch, results)})
    return out


def forced_length(translator, batches: List[dict]) -> List[int]:
    """Greedy decoding of ``batches`` (``{"tokens": sources, "length": n[, "return_scores":
    true]}``), every sentence forced to exactly ``n`` decoder steps (its minimum and maximum decoding length: ``n``
    tokens, no ``</s>``); returns the steps per sentence, in order."""
    positions = []
    for batch in batches:
        results = translator.translate_batch(
            batch["tokens"],
            beam_size=1,
            max_batch_size=len(batch["tokens"]),
            batch_type="examples",
            min_decoding_length=batch["length"],
            max_decoding_length=batch["length"],
            return_scores=batch.get("return_scores", False),  # True: its log-softmax at every step
        )
        positions += [len(r.hypotheses[0]) for r in results]
    return positions
