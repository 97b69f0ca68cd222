"""A checkpoint for decoding elsewhere: without its optimizer state, its weights in float16,
tied weights (shared embeddings) saved once. ``benchmarks/gpu_run.sh prepare`` carries the
models to a GPU machine this way (a `small` model: 107 MB -> 18 MB).

    python benchmarks/slim_checkpoint.py CHECKPOINT OUT [--keep-float32]

fairseq loads the result as any checkpoint (float16 weights are cast into the model's own
precision); it cannot resume training from it.
"""

import argparse
import logging
import os

import torch

from fairseq_hrt import compat

logger = logging.getLogger("slim_checkpoint")


def slim_state(state: dict, half: bool = True) -> dict:
    """``state`` (a fairseq checkpoint) without ``last_optimizer_state``, its floating-point
    weights in float16 (``half``); weights that shared storage still do (saved once)."""
    state = dict(state)
    state.pop("last_optimizer_state", None)
    if half:
        halves = {}
        state["model"] = {
            k: halves.setdefault(v.untyped_storage().data_ptr(), v.half()) if v.is_floating_point() else v
            for k, v in state["model"].items()
        }
    return state


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a fairseq checkpoint (.pt)")
    parser.add_argument("out", help="where the slim checkpoint goes")
    parser.add_argument("--keep-float32", action="store_true", help="keep the weights' precision")
    args = parser.parse_args(argv)
    compat.register_checkpoint_types()
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    torch.save(slim_state(state, half=not args.keep_float32), args.out)
    logger.info(
        "%s (%.1f MB) -> %s (%.1f MB)",
        args.checkpoint,
        os.path.getsize(args.checkpoint) / 1e6,
        args.out,
        os.path.getsize(args.out) / 1e6,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
