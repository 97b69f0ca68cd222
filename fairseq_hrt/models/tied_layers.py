"""``--decoder-tie-layers``: one set of weights for every decoder layer (Marian's "tied"
students, WNGT 2019 section 3.2, after the Universal Transformer's depth-wise recurrence).

Each layer stays its own module -- fairseq keys a layer's incremental state (its attention
cache) by module, so one module object run twice would read its own cache back -- but every
parameter of layers ``1..L-1`` *is* the parameter of layer 0 (the same ``nn.Parameter``).
The optimizer therefore sees one copy (``model.parameters()`` yields a shared parameter
once), and the checkpoint stores one: the decoder's state dict keeps only ``layers.0.*``, and
loading fills ``layers.i.*`` from ``layers.0.*`` again.

Applies to every model of ``--task hrt_translation``: AT (``at_*``, ``*_ssru``), HRT and
Mask-Predict.
"""

import logging
import re

import torch
from torch import nn

from fairseq_hrt.cli_logging import RefusedOptions

logger = logging.getLogger(__name__)


def check_tie_options(cfg):
    """Options that cannot go with tied decoder layers: one clear error."""
    if getattr(cfg, "decoder_layers_to_keep", None):
        raise RefusedOptions(
            "--decoder-tie-layers cannot go with --decoder-layers-to-keep: tied layers are one set of "
            "weights run --decoder-layers times; set --decoder-layers to the depth you want instead"
        )


def share_parameters(target: nn.Module, source: nn.Module):
    """Make every parameter of ``target`` the parameter of the same name in ``source``
    (two modules of one structure)."""
    source_params = dict(source.named_parameters())
    target_names = [name for name, _ in target.named_parameters(remove_duplicate=False)]
    if sorted(target_names) != sorted(source_params):
        raise ValueError("--decoder-tie-layers needs decoder layers of one structure")
    for name in target_names:
        owner_path, _, attr = name.rpartition(".")
        owner = target.get_submodule(owner_path) if owner_path else target
        setattr(owner, attr, source_params[name])


def _layer_key(prefix: str, key: str):
    """``(layer index, rest of the key)`` of a decoder-layer key under ``prefix``, else None."""
    match = re.match(re.escape(prefix) + r"layers\.(\d+)\.(.*)$", key)
    return (int(match.group(1)), match.group(2)) if match else None


def _store_one_copy(module, state_dict, prefix, local_metadata):
    for key in list(state_dict):
        parsed = _layer_key(prefix, key)
        if parsed is not None and parsed[0] > 0:
            del state_dict[key]


def _fill_copies(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    layers = len(module.layers)
    for key in [k for k in state_dict if (_layer_key(prefix, k) or (None,))[0] == 0]:
        rest = _layer_key(prefix, key)[1]
        for i in range(1, layers):
            other = f"{prefix}layers.{i}.{rest}"
            if other not in state_dict:
                state_dict[other] = state_dict[key]
            elif not torch.equal(state_dict[other], state_dict[key]):
                raise RefusedOptions(
                    f"--decoder-tie-layers: the checkpoint's decoder layers differ ({other} != {key}), "
                    "so it cannot load into a model with tied decoder layers; start from a checkpoint "
                    "with one decoder layer (or tied ones), or train without --decoder-tie-layers"
                )


def tie_decoder_layers(decoder: nn.Module):
    """Tie ``decoder.layers`` (fairseq's ``TransformerDecoderBase``, the HRT and SSRU decoders)
    to layer 0, in place; the decoder's state dict then stores layer 0 only."""
    if getattr(decoder, "tied_layers", False):
        return decoder
    layers = decoder.layers
    first = layers[0]
    for layer in list(layers)[1:]:
        share_parameters(layer, first)
    decoder.register_state_dict_post_hook(_store_one_copy)
    decoder.register_load_state_dict_pre_hook(_fill_copies)
    decoder.tied_layers = True
    logger.info("--decoder-tie-layers: %d decoder layers share one set of weights", len(layers))
    return decoder
