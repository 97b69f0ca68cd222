"""A decoder's modules as plain functions (:class:`StepPlan`), what every pass runs: fused
q/k/v projections (:mod:`~fairseq_hrt.passes.projections`), read from the decoder's own
modules (so ``--quantize int8`` and ``model.half()`` apply)."""

from torch import Tensor

from fairseq_hrt.models.ssru_transformer import SSRUDecoderLayer
from fairseq_hrt.passes.output_vocab import restricted_output_layer
from fairseq_hrt.passes.projections import as_function, fused_projections, projection, ssru_projections


def is_recurrent(layer) -> bool:
    """Whether a decoder layer is an SSRU layer (no self-attention)."""
    return isinstance(layer, SSRUDecoderLayer)


class LayerPlan:
    """One decoder layer's modules as functions (:func:`as_function`). ``folded``: the queries'
    scaling is in their projections' weights (an exported graph's constants) and
    ``q_scaling`` is ``None``; else the queries are scaled after their projection, as the
    module does (the lean engines: their logits equal the module's bit for bit)."""

    def __init__(self, layer, folded: bool = False):
        encoder_attn = layer.encoder_attn
        self.pre_norm = layer.normalize_before
        self.recurrent = is_recurrent(layer)
        self.heads, self.head_dim = encoder_attn.num_heads, encoder_attn.head_dim
        self.dim = self.heads * self.head_dim
        self.relative_keys = None
        scaling = encoder_attn.scaling
        if self.recurrent:  # SSRU layer: its norm stands where the self-attention's does
            self.ssru_projections = ssru_projections(layer.ssru)
            self.self_attn_norm = as_function(layer.ssru_layer_norm)
        else:
            self_attn = layer.self_attn
            scaling = self_attn.scaling
            qkv = (self_attn.q_proj, self_attn.k_proj, self_attn.v_proj)
            self.qkv = fused_projections(*qkv, scales=(scaling, 1.0, 1.0) if folded else None)
            keys = getattr(self_attn, "relative_keys", None)
            self.relative_keys = keys.weight.t() if keys is not None else None
            self.self_out = as_function(self_attn.out_proj)
            self.self_attn_norm = as_function(layer.self_attn_layer_norm)
        self.q_scaling = None if folded else scaling
        self.encoder_q = projection(encoder_attn.q_proj, encoder_attn.scaling if folded else 1.0)
        self.encoder_out = as_function(encoder_attn.out_proj)
        self.encoder_attn_norm = as_function(layer.encoder_attn_layer_norm)
        self.final_norm = as_function(layer.final_layer_norm)
        self.fc1, self.fc2 = as_function(layer.fc1), as_function(layer.fc2)
        self.activation = layer.activation_fn


class StepPlan:
    """The decoder's embedding, layers (:class:`LayerPlan`, ``folded`` see there) and output
    as functions."""

    def __init__(self, decoder, folded: bool = False):
        scale, embed = decoder.embed_scale, decoder.embed_tokens
        project_in = as_function(decoder.project_in_dim)

        def embed_tokens(tokens):
            x = scale * embed(tokens)
            return project_in(x) if project_in is not None else x

        self.embed = embed_tokens
        self.layernorm_embedding = as_function(decoder.layernorm_embedding)
        # tied decoder layers (--decoder-tie-layers) share one plan: one set of fused weights
        plans = {}
        self.layers = []
        for layer in decoder.layers:
            key = tuple(id(p) for p in layer.parameters()) or id(layer)
            if key not in plans:
                plans[key] = LayerPlan(layer, folded)
            self.layers.append(plans[key])
        final_norm, project_out = as_function(decoder.layer_norm), as_function(decoder.project_out_dim)
        self.output_projection = decoder.output_projection
        projection_ = as_function(decoder.output_projection)

        def features(x):
            if final_norm is not None:
                x = final_norm(x)
            if project_out is not None:
                x = project_out(x)
            return x

        self.features = features
        self.output = lambda x: projection_(features(x))

    def restricted_output(self, vocab: Tensor):
        """The output layer for the rows ``vocab`` only (a shortlist's candidates)."""
        project = restricted_output_layer(self.output_projection, vocab)
        features = self.features
        return lambda x: project(features(x))
