"""``--decoder-tie-layers``: one set of weights for all decoder layers (AT, SSRU, HRT and
Mask-Predict models), stored once in the checkpoint."""

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.sequence_generator import SequenceGenerator

from fairseq_hrt.generation.lean import LeanSequenceGenerator
from hrt_runtime.search import SearchConfig
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample
from tests.test_generator import SPECIALS
from tests.test_lean import RAGGED, assert_same_hypotheses

ARCHS = {
    "at_tiny": ("--hrt-mode", "at"),
    "at_tiny_ssru": ("--hrt-mode", "at"),
    "hrt_tiny": (),
    "cmlm_tiny": ("--hrt-mode", "cmlm"),
}
TIED = ("--decoder-layers", "3", "--decoder-tie-layers")


def layers_are_tied(decoder: torch.nn.Module) -> bool:
    """Whether every decoder layer runs the weights of layer 0."""
    layers = list(decoder.layers)
    first = dict(layers[0].named_parameters())
    return all(
        all(param is first.get(name) for name, param in layer.named_parameters(remove_duplicate=False))
        for layer in layers[1:]
    )


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def decoder_layer_keys(state_dict):
    return {k for k in state_dict if k.startswith("decoder.layers.")}


@pytest.mark.parametrize("arch", ARCHS)
def test_tied_decoder_has_one_layers_parameters(tmp_path, arch):
    _, one = build_task_and_model(str(tmp_path), arch=arch, extra=ARCHS[arch])
    _, tied = build_task_and_model(str(tmp_path), arch=arch, extra=ARCHS[arch] + TIED)
    _, untied = build_task_and_model(str(tmp_path), arch=arch, extra=ARCHS[arch] + TIED[:2])
    assert len(tied.decoder.layers) == 3 and layers_are_tied(tied.decoder)
    assert not layers_are_tied(untied.decoder)
    assert count(tied) == count(one) < count(untied)
    # every layer is its own module (fairseq keys attention caches by module)
    assert len({id(layer) for layer in tied.decoder.layers}) == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_stores_one_copy_and_reloads_tied(tmp_path, arch):
    _, tied = build_task_and_model(str(tmp_path), arch=arch, extra=ARCHS[arch] + TIED, seed=2)
    _, one = build_task_and_model(str(tmp_path), arch=arch, extra=ARCHS[arch], seed=2)
    state = tied.state_dict()
    assert decoder_layer_keys(state) == decoder_layer_keys(one.state_dict())  # layers.0.* only
    path = tmp_path / "tied.pt"
    torch.save({"model": state}, path)
    _, fresh = build_task_and_model(str(tmp_path), arch=arch, extra=ARCHS[arch] + TIED, seed=7)
    fresh.load_state_dict(torch.load(path)["model"])
    assert layers_are_tied(fresh.decoder)
    for (name, ours), (_, theirs) in zip(fresh.named_parameters(), tied.named_parameters()):
        assert torch.equal(ours, theirs), name


def _untied_copy(tmp_path, arch, tied):
    """An untied 3-layer model whose every decoder layer holds the tied model's weights."""
    _, untied = build_task_and_model(str(tmp_path), arch=arch, extra=ARCHS[arch] + TIED[:2], seed=9)
    state = dict(tied.state_dict())
    for key in list(state):
        if key.startswith("decoder.layers.0."):
            for i in (1, 2):
                state[key.replace("decoder.layers.0.", f"decoder.layers.{i}.")] = state[key]
    untied.load_state_dict(state)
    return untied


@pytest.mark.parametrize("arch", ARCHS)
def test_outputs_equal_a_model_whose_layers_hold_the_same_weights(tmp_path, arch):
    task, tied = build_task_and_model(str(tmp_path), arch=arch, extra=ARCHS[arch] + TIED, seed=3)
    untied = _untied_copy(tmp_path, arch, tied)
    net = make_sample(task, RAGGED[:5])["net_input"]
    torch.manual_seed(0)
    prev = torch.randint(4, 40, (5, 7))
    prev[:, 0] = task.target_dictionary.eos()
    kwargs = [{}] if arch.startswith("at_") else [{"causal": True}, {"causal": False}]
    for extra in kwargs:
        with torch.no_grad():
            ours, _ = tied(net["src_tokens"], net["src_lengths"], prev, **extra)
            theirs, _ = untied(net["src_tokens"], net["src_lengths"], prev, **extra)
        assert torch.allclose(ours, theirs, atol=1e-6)


@pytest.mark.parametrize("arch", ["at_tiny", "hrt_tiny"])
def test_lean_engine_decodes_tied_layers_as_fairseq(tmp_path, arch):
    task, model = build_task_and_model(str(tmp_path), arch=arch, extra=ARCHS[arch] + TIED, seed=4)
    d = task.target_dictionary
    suppress = SPECIALS if arch == "hrt_tiny" else []
    sample = make_sample(task, RAGGED)
    for beam in (1, 5):
        ref = SequenceGenerator([model], d, beam_size=beam, max_len_b=9, tokens_to_suppress=suppress).generate(
            [model], sample
        )
        ours = LeanSequenceGenerator(model, d, SearchConfig(beam=beam, max_len_b=9), [d.index(s) for s in suppress])
        assert_same_hypotheses(ref, ours.generate([model], sample))
    # the lean engine builds one plan (one set of fused weights) for the tied layers
    plan = LeanSequenceGenerator(model, d, SearchConfig(beam=1)).decoder_pass.plan()
    assert len({id(layer) for layer in plan.layers}) == 1


def test_hrt_decoding_of_a_tied_model_same_with_both_engines(tmp_path):
    data_dir = str(tmp_path)
    task, model = build_task_and_model(data_dir, arch="hrt_tiny", extra=TIED, seed=5)
    sample = make_sample(task, RAGGED)
    flags = ("--max-len-b", "16", "--decode-chunk-size", "2", "--beam", "3")
    _, ref = build_generator(data_dir, model, *flags, "--decoder-engine", "fairseq")
    _, ours = build_generator(data_dir, model, *flags, "--decoder-engine", "lean")
    assert_same_hypotheses(ref.generate([model], sample), ours.generate([model], sample))


# ----------------------------------------------------------------------------- bad input


def test_layers_to_keep_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--decoder-tie-layers cannot go with --decoder-layers-to-keep"):
        build_task_and_model(
            str(tmp_path), arch="at_tiny", extra=ARCHS["at_tiny"] + TIED + ("--decoder-layers-to-keep", "0,1")
        )


def test_untied_checkpoint_with_different_layers_is_refused(tmp_path):
    _, untied = build_task_and_model(str(tmp_path), arch="at_tiny", extra=ARCHS["at_tiny"] + TIED[:2], seed=1)
    _, tied = build_task_and_model(str(tmp_path), arch="at_tiny", extra=ARCHS["at_tiny"] + TIED, seed=2)
    with pytest.raises(ValueError, match="the checkpoint's decoder layers differ"):
        tied.load_state_dict(untied.state_dict())


# ------------------------------------------------------------------------ trained models


@pytest.mark.slow
def test_trained_tied_checkpoint(trained_ssru):
    """fairseq-train with --decoder-tie-layers: the checkpoint holds one layer, it loads
    tied, and the option travels with it (no flag needed at decoding time)."""
    data, ckpts, _ = trained_ssru
    state = torch.load(ckpts["at_tiny_ssru_tied"], map_location="cpu", weights_only=True)
    layers = {k.split(".")[2] for k in state["model"] if k.startswith("decoder.layers.")}
    assert layers == {"0"}
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpts["at_tiny_ssru_tied"])], arg_overrides={"data": str(data.bin_dir)}
    )
    assert len(models[0].decoder.layers) == 2 and layers_are_tied(models[0].decoder)
