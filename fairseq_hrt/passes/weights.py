"""What decoding keeps of a model's weights (the decoder pass's plan of fused projections,
captured CUDA graphs, an ONNX export) is kept with :func:`weights_version` and made again when
it differs, so that no cache outlives the weights it was made from.

fairseq's optimizers write the weights through ``p.data``, which the parameters' version
counters do not see (an ``--eval-bleu`` validation once decoded with the fused projections of
the previous one): the HRT task counts each of its optimizer steps on the model it trains
(:meth:`~fairseq_hrt.tasks.training_hooks.TrainingHooks.optimizer_step`,
:func:`count_weights_written`). A module of its own, so that the task imports no decoding code.
"""

import operator

import torch

# on every submodule, so that the decoder's version (the plan's) and the whole model's
# (captured graphs, exports) both move
_WRITES = "_weights_writes"


def count_weights_written(model) -> None:
    """Record that ``model``'s weights were written where no version counter sees it (an
    optimizer step of fairseq's): :func:`weights_version` of the model and of each of its
    submodules changes."""
    for module in model.modules():
        setattr(module, _WRITES, getattr(module, _WRITES, 0) + 1)


# Walking a model's modules for its parameters costs more than reading them (most of a check:
# benchmarks/results/host-costs-cpu), and an engine checks the version at every batch: each module
# checked keeps its parameters (_PARAMETERS) with the count of parameters and submodules
# registered anywhere (``module.weight = Parameter(..)``, a layer replaced) when it listed
# them, and lists them again once that count moved.
_PARAMETERS = "_weights_parameters"
_registered = 0


def _registered_one(module, name, value):
    global _registered
    _registered += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered_one)
torch.nn.modules.module.register_module_module_registration_hook(_registered_one)


def _parameters(module) -> tuple:
    kept = module.__dict__.get(_PARAMETERS)
    if kept is None or kept[0] != _registered:
        kept = module.__dict__[_PARAMETERS] = (_registered, tuple(module.parameters()))
    return kept[1]


_data_ptr = torch.Tensor.data_ptr
_version_of = operator.attrgetter("_version")


def weights_version(module) -> tuple:
    """What changes whenever ``module``'s weights may have: the writes counted on it
    (:func:`count_weights_written`), then each parameter's storage address and version counter
    (a write through the parameter itself, ``load_state_dict``'s copies included; a cast or a
    move makes new storage while the old is still held, and bumps the counter too). What is
    computed from the weights and kept (the plan's fused projections, captured graphs) is kept
    with the version it was computed at and computed again when it differs. The parameters are
    listed again after any module registered a parameter or a submodule."""
    written = getattr(module, _WRITES, 0)
    parameters = _parameters(module)
    # two C-level maps: a check a batch costs half what per-parameter tuples did (host-costs-cpu)
    return written, tuple(map(_data_ptr, parameters)), tuple(map(_version_of, parameters))
