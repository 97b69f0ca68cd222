"""COMET scoring from a LOCAL checkpoint only -- nothing is ever downloaded.

This machine has no access to the Hugging Face hub, so COMET weights must already be on
disk. Without them, every entry point says so (:class:`CometUnavailable`, CLI exit code 2)
instead of producing a number.

What has to be on disk (e.g. for ``Unbabel/wmt22-comet-da``, copied from a machine with
internet, ``huggingface-cli download Unbabel/wmt22-comet-da --local-dir wmt22-comet-da``)::

    wmt22-comet-da/
        hparams.yaml              # class_identifier, encoder_model, pretrained_model, ...
        checkpoints/model.ckpt    # ALL weights: encoder (XLM-R large) + estimator

and, because COMET builds its encoder *skeleton* and tokenizer from ``pretrained_model``
(``xlm-roberta-large`` for wmt22-comet-da) before loading the checkpoint into it, that
model's ``config.json`` and tokenizer files (``tokenizer.json`` and/or
``sentencepiece.bpe.model``, ``tokenizer_config.json``) -- its 2 GB of weights are NOT
needed. They are found in one of two places:

1. ``encoder_path=`` / ``--encoder DIR`` / env ``COMET_ENCODER``;
2. ``<model dir>/encoder/`` (keeps a model self-contained: copy the xlm-roberta-large
   config + tokenizer files there).

The model is found from ``model_path=`` / ``--model PATH`` or env ``COMET_MODEL``: a
``.ckpt`` file (with ``hparams.yaml`` in the folder above its ``checkpoints/`` folder, as
COMET lays it out) or the model directory itself.

Run as ``python -m fairseq_hrt.scoring.comet --src F --hyp F --ref F [--model PATH]`` or
``fairseq-hrt-comet ...``. unbabel-comet is imported lazily: it takes seconds to import.
"""

import argparse
import contextlib
import inspect
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import List, Optional

import torch
import yaml

from hrt_runtime import text_input

logger = logging.getLogger(__name__)

ENV_MODEL = "COMET_MODEL"
ENV_ENCODER = "COMET_ENCODER"
EXIT_UNAVAILABLE = 2

_HOW_TO = (
    "COMET weights cannot be downloaded here (no access to the Hugging Face hub). "
    "Point to a local COMET model with --model PATH (Python: model_path=PATH) or the "
    f"environment variable {ENV_MODEL}=PATH, where PATH is a COMET checkpoint file "
    "(.../checkpoints/model.ckpt) or a downloaded model directory containing "
    "checkpoints/model.ckpt and hparams.yaml -- e.g. Unbabel/wmt22-comet-da copied from a "
    "machine with internet (`huggingface-cli download Unbabel/wmt22-comet-da --local-dir "
    "wmt22-comet-da`). The config.json + tokenizer files of its encoder (xlm-roberta-large "
    f"for wmt22-comet-da, no weights needed) must be local too: --encoder DIR / {ENV_ENCODER}, "
    "or <model dir>/encoder/."
)


class CometUnavailable(RuntimeError):
    """No usable local COMET model (or encoder files): COMET cannot score here."""


# --------------------------------------------------------------------------- resolution


def _is_lfs_pointer(path: Path) -> bool:
    try:
        if path.stat().st_size > 1024:
            return False
        with open(path, "rb") as f:
            return f.read(64).startswith(b"version https://git-lfs")
    except OSError:
        return False


def resolve_comet_model(path_or_none: Optional[str] = None) -> str:
    """Return the path of a local COMET checkpoint file (``.ckpt``).

    Looks at ``path_or_none``, then the ``COMET_MODEL`` environment variable. Accepts a
    ``.ckpt`` file or a model directory holding ``checkpoints/model.ckpt``; in both cases
    ``hparams.yaml`` must sit in the model directory (COMET's layout). Raises
    :class:`CometUnavailable` with instructions when nothing usable is given.
    """
    if path_or_none:
        source, raw = "argument", str(path_or_none)
    elif os.environ.get(ENV_MODEL):
        source, raw = f"${ENV_MODEL}", os.environ[ENV_MODEL]
    else:
        raise CometUnavailable(f"no local model: no model path given and {ENV_MODEL} is not set. " + _HOW_TO)

    path = Path(os.path.expanduser(raw))
    if not path.exists():
        raise CometUnavailable(f"no local model: {path} (from {source}) does not exist. " + _HOW_TO)
    if path.is_dir():
        ckpt = path / "checkpoints" / "model.ckpt"
        if not ckpt.is_file():
            raise CometUnavailable(
                f"no local model: directory {path} (from {source}) has no checkpoints/model.ckpt. " + _HOW_TO
            )
    else:
        ckpt = path
        if ckpt.suffix != ".ckpt":
            raise CometUnavailable(
                f"no local model: {path} (from {source}) is not a COMET checkpoint (.ckpt file "
                "or model directory). " + _HOW_TO
            )
    if _is_lfs_pointer(ckpt):
        raise CometUnavailable(
            f"no local model: {ckpt} is a Git LFS pointer, not the weights (the model was "
            "cloned without `git lfs pull`). " + _HOW_TO
        )
    if _hparams_file(ckpt) is None:
        raise CometUnavailable(
            f"no local model: no hparams.yaml found for {ckpt} (expected in "
            f"{ckpt.resolve().parents[1]}, next to checkpoints/). " + _HOW_TO
        )
    return str(ckpt.resolve())


def _hparams_file(ckpt: Path) -> Optional[Path]:
    ckpt = Path(ckpt).resolve()
    # COMET's own layout: <model>/checkpoints/model.ckpt + <model>/hparams.yaml
    for candidate in (ckpt.parents[1] / "hparams.yaml", ckpt.parent / "hparams.yaml"):
        if candidate.is_file():
            return candidate
    return None


def _read_hparams(ckpt: Path) -> dict:
    with open(_hparams_file(ckpt)) as f:
        # FullLoader, as COMET itself reads this file (some hparams.yaml files carry tags)
        return yaml.load(f, Loader=yaml.FullLoader) or {}


def _looks_like_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _resolve_encoder(ckpt: Path, hparams: dict, encoder_path: Optional[str]) -> str:
    """Where COMET reads its encoder's config + tokenizer from (see module doc)."""
    bundled = Path(ckpt).resolve().parents[1] / "encoder"
    if encoder_path or os.environ.get(ENV_ENCODER):
        source = "argument" if encoder_path else f"${ENV_ENCODER}"
        path = Path(os.path.expanduser(encoder_path or os.environ[ENV_ENCODER]))
    else:
        source, path = "the model directory", bundled
    if not _looks_like_hf_dir(path):
        raise CometUnavailable(
            f"encoder files missing: COMET model {ckpt} builds its encoder from "
            f"pretrained_model={hparams.get('pretrained_model')!r} (hparams.yaml), and {path} (from "
            f"{source}) is not a directory with its config.json and tokenizer files; nothing "
            "is downloaded here. " + _HOW_TO
        )
    return str(path.resolve())


# --------------------------------------------------------------------------- loading


@contextlib.contextmanager
def _offline_and_quiet():
    """Force the Hugging Face libraries offline and keep COMET/Lightning from taking over
    logging, for the duration of a COMET import/load/predict.

    The env vars only take effect when huggingface_hub/transformers get imported inside
    this block; the hard guarantee is ``local_files_only=True``, passed to every
    ``from_pretrained`` COMET makes (see :func:`load_comet_model`).
    """
    saved_env = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    root = logging.getLogger()
    root_handlers, root_level = list(root.handlers), root.level
    noisy = {
        "comet": logging.WARNING,  # "Encoder model frozen."
        "pytorch_lightning": logging.WARNING,  # "GPU available: False, used: False" ...
        "lightning.pytorch": logging.WARNING,
        "lightning.fabric": logging.WARNING,
        "transformers": logging.ERROR,  # tokenizer-class advice about local encoder dirs
    }
    noisy_levels = {n: logging.getLogger(n).level for n in noisy}
    for n, lvl in noisy.items():
        logging.getLogger(n).setLevel(lvl)
    try:
        yield
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # `import comet` calls logging.basicConfig(level=INFO): undo it for our callers.
        for h in list(root.handlers):
            if h not in root_handlers:
                root.removeHandler(h)
        root.setLevel(root_level)
        for n, lvl in noisy_levels.items():
            logging.getLogger(n).setLevel(lvl)


# Buffers that newer transformers versions no longer save; absent from old checkpoints or
# from the model without any weight being left uninitialised.
_HARMLESS_MISSING = ("position_ids", "token_type_ids")

_MODEL_CACHE = {}  # (checkpoint, encoder) -> model; one entry (COMET models are large)


def load_comet_model(model_path: Optional[str] = None, encoder_path: Optional[str] = None):
    """Load a COMET model from a local checkpoint, fully offline. Cached (one model).

    What ``comet.load_from_checkpoint`` does, in two plain steps:

    * the model class of ``class_identifier`` is built from hparams.yaml, with
      ``pretrained_model`` pointed at the local encoder files and
      ``load_pretrained_weights=False`` / ``local_files_only=True``, so only the encoder's
      config + tokenizer are read;
    * the checkpoint's ``state_dict`` is loaded into it. ``torch.load`` gets
      ``weights_only=False`` for this one file: a Lightning checkpoint pickles non-tensor
      objects next to the weights, which PyTorch >= 2.6's default refuses; the user chose
      this local file, so it is trusted as it was with PyTorch < 2.6. Weights that the model
      has and the checkpoint lacks are an error (scoring with random layers would give a
      number that means nothing).
    """
    ckpt = Path(resolve_comet_model(model_path))
    hparams = _read_hparams(ckpt)
    encoder = _resolve_encoder(ckpt, hparams, encoder_path)
    key = (str(ckpt), encoder)
    if key in _MODEL_CACHE:
        return _MODEL_CACHE[key]

    with _offline_and_quiet(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' and Lightning's advice while building
        from comet.models import str2model  # noqa: PLC0415 - optional: unbabel-comet (seconds to import)

        identifier = hparams.get("class_identifier")
        if identifier not in str2model:
            raise CometUnavailable(
                f"no local model: {ckpt}: hparams.yaml has class_identifier={identifier!r}, "
                f"not one of this COMET version's models {sorted(str2model)}"
            )
        model_class = str2model[identifier]
        accepted = inspect.signature(model_class.__init__).parameters
        kwargs = {k: v for k, v in hparams.items() if k in accepted}
        kwargs.update(load_pretrained_weights=False, local_files_only=True, pretrained_model=encoder)
        # Same workaround as comet.load_from_checkpoint (COMET issue #244).
        if kwargs.get("layer_transformation") == "sparsemax_patch":
            kwargs["layer_transformation"] = "softmax"
        try:
            model = model_class(**kwargs)
        except OSError as e:  # transformers: config/tokenizer files not usable
            raise CometUnavailable(
                f"encoder files missing: COMET model {ckpt} needs the config + tokenizer "
                f"of its encoder {hparams.get('pretrained_model')!r}; loading them from "
                f"{encoder!r} failed (offline, nothing is downloaded): {e}. " + _HOW_TO
            ) from e
        state = torch.load(str(ckpt), map_location="cpu", weights_only=False)["state_dict"]
        result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k.split(".")[-1] not in _HARMLESS_MISSING]
    if missing:
        raise RuntimeError(
            f"COMET checkpoint {ckpt} does not match its model: {len(missing)} weights "
            f"missing (e.g. {missing[:5]}); refusing to score with random weights. "
            "Is hparams.yaml from the same model?"
        )
    model.eval()
    model._fairseq_hrt_paths = key  # (checkpoint, encoder), reported by comet_score
    _MODEL_CACHE.clear()
    _MODEL_CACHE[key] = model
    return model


# --------------------------------------------------------------------------- scoring


def comet_score(
    srcs: List[str],
    hyps: List[str],
    refs: Optional[List[str]],
    model_path: Optional[str] = None,
    batch_size: int = 16,
    gpus: int = 0,
    encoder_path: Optional[str] = None,
    progress_bar: bool = False,
) -> dict:
    """COMET scores of ``hyps`` (with sources ``srcs`` and references ``refs``).

    Returns ``{"score": system score (mean of segment scores), "scores": [per segment],
    "model": checkpoint path, "encoder": encoder files used, "n": segments}``.
    ``refs`` may be None only for reference-free (QE) models. ``gpus``: 0 (CPU) or 1.
    Raises :class:`CometUnavailable` when no local model is available.
    """
    if gpus not in (0, 1):
        raise ValueError(
            f"gpus={gpus}: only 0 (CPU) or 1 GPU is supported (COMET's multi-GPU predict "
            "re-launches the process with DDP)"
        )
    srcs, hyps = list(srcs), list(hyps)
    if not hyps:
        raise ValueError("cannot score an empty corpus (0 hypotheses)")
    if len(srcs) != len(hyps) or (refs is not None and len(refs) != len(hyps)):
        raise ValueError(
            f"sources ({len(srcs)}), hypotheses ({len(hyps)}) and references "
            f"({'none' if refs is None else len(refs)}) must be aligned line by line"
        )
    model = load_comet_model(model_path, encoder_path)
    if refs is None:
        if model.requires_references():
            raise ValueError("this COMET model needs references (refs=None given)")
        samples = [{"src": s, "mt": h} for s, h in zip(srcs, hyps)]
    else:
        refs = list(refs)
        samples = [{"src": s, "mt": h, "ref": r} for s, h, r in zip(srcs, hyps, refs)]

    with _offline_and_quiet(), warnings.catch_warnings():
        # Lightning's "consider increasing num_workers" and similar advice
        warnings.simplefilter("ignore")
        out = model.predict(samples, batch_size=batch_size, gpus=gpus, progress_bar=progress_bar)
    scores = [float(s) for s in out.scores]
    if len(scores) != len(samples) or not all(math.isfinite(s) for s in scores):
        raise RuntimeError(f"COMET returned {len(scores)} scores for {len(samples)} segments or non-finite ones")
    ckpt, encoder = model._fairseq_hrt_paths
    return {
        "score": sum(scores) / len(scores),
        "scores": scores,
        "model": ckpt,
        "encoder": encoder,
        "n": len(scores),
    }


# --------------------------------------------------------------------------- CLI


def _read_lines(path: str) -> List[str]:
    return text_input.read_lines(path)


def cli_main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fairseq-hrt-comet",
        description="COMET score from a LOCAL checkpoint (nothing is downloaded). "
        f"Exit code {EXIT_UNAVAILABLE} when no local model is available.",
    )
    parser.add_argument("--src", required=True, help="source sentences, one per line")
    parser.add_argument("--hyp", required=True, help="system translations, one per line")
    parser.add_argument("--ref", help="references, one per line (omit only for QE models)")
    parser.add_argument(
        "--model",
        help=f"COMET checkpoint (.ckpt) or model directory; default: ${ENV_MODEL}",
    )
    parser.add_argument(
        "--encoder",
        help=f"directory with the encoder's config.json + tokenizer files; default: ${ENV_ENCODER}, "
        "then <model dir>/encoder/",
    )
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--gpus", type=int, default=0, choices=(0, 1))
    parser.add_argument("--json", action="store_true", help="print a JSON object (with segment scores)")
    args = parser.parse_args(argv)

    srcs, hyps = _read_lines(args.src), _read_lines(args.hyp)
    refs = _read_lines(args.ref) if args.ref else None
    try:
        result = comet_score(
            srcs,
            hyps,
            refs,
            model_path=args.model,
            batch_size=args.batch_size,
            gpus=args.gpus,
            encoder_path=args.encoder,
        )
    except CometUnavailable as e:
        print(f"COMET: not available ({e})", file=sys.stderr)
        if args.json:
            print(json.dumps({"score": None, "available": False, "reason": str(e)}))
        return EXIT_UNAVAILABLE
    except ValueError as e:
        print(f"COMET: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(dict(result, available=True)))
    else:
        print(f"COMET = {result['score']:.4f}  ({result['n']} segments, model: {result['model']})")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
