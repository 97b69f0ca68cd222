"""Build a tiny, randomly initialised COMET model on disk, entirely offline.

Used by the scoring tests (and reusable by benchmark tests) to exercise the real COMET
loading + prediction code path without any downloaded weights. The scores such a model
produces are meaningless; only the plumbing is real.

On-disk layout produced by :func:`build_tiny_comet` (the same layout as a downloaded
``Unbabel/wmt22-comet-da`` snapshot, plus a local encoder directory)::

    <root>/encoder/                 config.json + tokenizer files (no weights needed)
    <root>/model/hparams.yaml       class_identifier, pretrained_model (a hub name), ...
    <root>/model/checkpoints/model.ckpt   {"state_dict", "hyper_parameters", ...}
    <root>/model/encoder/           a copy of <root>/encoder (``bundle_encoder=True``)

Usage::

    from tests.comet_tiny import build_tiny_comet   # or: from comet_tiny import ...
    ckpt = build_tiny_comet(tmp_path)               # -> .../model/checkpoints/model.ckpt
"""

import os
import shutil
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import yaml

_SENTENCES = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Hybrid regressive translation decodes in two stages.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Die Katze saß auf der Matte.",
    "Machine translation systems are evaluated with BLEU and COMET.",
    "Non-autoregressive models predict all target tokens in parallel.",
    "Mask-predict refines the translation over several iterations.",
    "Wir übersetzen Sätze aus dem Deutschen ins Englische.",
    "Speed is measured in source words per second.",
]


def build_tiny_encoder(out_dir, vocab_size=120, seed=0):
    """Save a tiny XLM-RoBERTa config + tokenizer (sentencepiece trained here) in ``out_dir``.

    Only config.json and tokenizer files are written: COMET loads the encoder with
    ``load_pretrained_weights=False`` and takes every weight from its own checkpoint.
    """
    from transformers import XLMRobertaConfig, XLMRobertaTokenizer, XLMRobertaTokenizerFast  # noqa: PLC0415 - optional: transformers (COMET)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spm_dir = out_dir / "_spm"
    spm_dir.mkdir(exist_ok=True)
    corpus = spm_dir / "corpus.txt"
    corpus.write_text("\n".join(_SENTENCES * 3) + "\n", encoding="utf-8")
    prefix = spm_dir / "sentencepiece.bpe"
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        seed_sentencepiece_size=10000,
        num_threads=1,
        minloglevel=2,  # quiet
    )
    slow = XLMRobertaTokenizer(vocab_file=str(prefix) + ".model")
    fast = XLMRobertaTokenizerFast(vocab_file=str(prefix) + ".model")
    fast.save_pretrained(str(out_dir))  # tokenizer.json + sentencepiece.bpe.model + configs

    config = XLMRobertaConfig(
        vocab_size=len(slow),  # spm pieces + fairseq offset + <mask>
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=130,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    config.save_pretrained(str(out_dir))
    for p in spm_dir.iterdir():
        p.unlink()
    spm_dir.rmdir()
    return out_dir


def build_tiny_comet(
    root, seed=0, hparams_pretrained_model="tiny-xlmr-not-on-disk", encoder_dir=None, bundle_encoder=True
):
    """Build a tiny COMET ``RegressionMetric`` under ``root``; return the checkpoint path.

    ``hparams_pretrained_model``: what to record as ``pretrained_model`` in the checkpoint
    and hparams.yaml: a hub-style name, as a real downloaded model such as wmt22-comet-da
    records ``xlm-roberta-large``. ``bundle_encoder``: copy the encoder files to
    ``<model dir>/encoder/`` (a self-contained model); without them the encoder directory
    must be given (``encoder_path=`` / ``COMET_ENCODER``), which is ``root/encoder``.
    ``encoder_dir``: reuse an encoder directory built earlier by :func:`build_tiny_encoder`
    instead of building ``root/encoder``.
    """
    import pytorch_lightning as pl  # noqa: PLC0415 - optional: pytorch_lightning (COMET)
    from comet.models import RegressionMetric  # noqa: PLC0415 - optional: unbabel-comet (seconds to import)

    root = Path(root)
    enc_dir = Path(encoder_dir) if encoder_dir else build_tiny_encoder(root / "encoder")
    model_dir = root / "model"
    (model_dir / "checkpoints").mkdir(parents=True, exist_ok=True)

    torch.manual_seed(seed)
    model = RegressionMetric(
        encoder_model="XLM-RoBERTa",
        pretrained_model=str(enc_dir.resolve()),
        hidden_sizes=[16],
        layer="mix",
        pool="avg",
        dropout=0.1,
        nr_frozen_epochs=0.3,
        load_pretrained_weights=False,
        local_files_only=True,
    )
    hparams = dict(model.hparams)
    hparams["class_identifier"] = "regression_metric"
    hparams["pretrained_model"] = hparams_pretrained_model
    if bundle_encoder:
        shutil.copytree(enc_dir, model_dir / "encoder", dirs_exist_ok=True)
    # Real COMET checkpoints do not force these; the loader in fairseq_hrt sets them.
    hparams.pop("load_pretrained_weights", None)
    hparams.pop("local_files_only", None)

    # What Lightning's load_from_checkpoint reads: state_dict, hyper_parameters and the
    # version key (used to decide on checkpoint migrations). "callbacks" is a stand-in for
    # the non-tensor objects real Lightning checkpoints pickle next to the weights (callback
    # states with numpy scalars, ...): like them, it makes torch.load's default
    # weights_only=True (PyTorch >= 2.6) refuse the file, so the tests cover that handling.
    ckpt = {
        "state_dict": model.state_dict(),
        "hyper_parameters": hparams,
        "pytorch-lightning_version": pl.__version__,
        "epoch": 0,
        "global_step": 0,
        "callbacks": {"EarlyStopping{'monitor': 'val_kendall'}": {"best_score": np.float64(0.0)}},
    }
    ckpt_path = model_dir / "checkpoints" / "model.ckpt"
    torch.save(ckpt, str(ckpt_path))
    with open(model_dir / "hparams.yaml", "w") as f:
        yaml.safe_dump(hparams, f)
    return ckpt_path


if __name__ == "__main__":  # pragma: no cover - manual helper
    import sys

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(build_tiny_comet(sys.argv[1] if len(sys.argv) > 1 else "tiny_comet"))
