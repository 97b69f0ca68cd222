"""Model shapes shared by the ``hrt_*``, ``at_*`` and ``cmlm_*`` architectures.

One definition per size, so that an AT checkpoint of a named size always has exactly the
tensors of the HRT / Mask-Predict model of that size (fine-tuning from AT, SPEC section 2).
Values already on ``args`` (command-line flags) win, as in every fairseq architecture.
"""

# name -> (embed dim, FFN dim, attention heads, encoder layers, decoder layers)
SHAPES = {
    # CPU-sized deep-encoder/shallow-decoder shape for benchmarks on 2 cores
    "small": (256, 1024, 4, 6, 1),
    # the quickstart's shape (about 1.3M parameters with a 4k vocabulary): convergence
    # studies on 2 CPU cores (docs/multi30k-studies.md)
    "mini": (128, 256, 2, 3, 1),
    # test-sized
    "tiny": (32, 64, 2, 2, 1),
}


def set_shape_defaults(args, name: str):
    embed_dim, ffn_dim, heads, encoder_layers, decoder_layers = SHAPES[name]
    for side, layers in (("encoder", encoder_layers), ("decoder", decoder_layers)):
        for option, value in (
            ("embed_dim", embed_dim),
            ("ffn_embed_dim", ffn_dim),
            ("attention_heads", heads),
            ("layers", layers),
        ):
            key = f"{side}_{option}"
            setattr(args, key, getattr(args, key, value))


def deep_shallow(encoder_layers: int, base):
    """The arch function of a deep-encoder / shallow-decoder shape: ``encoder_layers`` encoder
    layers and 1 decoder layer (flags on ``args`` win), then the model's ``base`` architecture."""

    def arch(args):
        args.encoder_layers = getattr(args, "encoder_layers", encoder_layers)
        args.decoder_layers = getattr(args, "decoder_layers", 1)
        base(args)

    return arch
