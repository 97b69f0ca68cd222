"""Decoding options are data (DecodingOptions), engines and strategies come from open
registries, the search rules and banned symbols have one home, quantization happens at load
time: the structure the generators are built on."""

import dataclasses

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from fairseq_hrt.generation import engines as engines_module
from fairseq_hrt.generation import strategies
from fairseq_hrt.generation.engines import ENGINES, register_engine
from fairseq_hrt.generation.lean import LeanEngine
from fairseq_hrt.generation.options import DecodingOptions
from fairseq_hrt.generation.quantize import is_quantized
from fairseq_hrt.models.kinds import AT, HRT, MASK_PREDICT, family_of
from fairseq_hrt.passes.search_rules import SearchRules, banned_symbols
from hrt_runtime.model import OutputRows
from hrt_runtime.search import SearchConfig
from tests.hrt_fixtures import build_generator, build_task_and_model, generation_args, make_sample

RAGGED = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("decoding_options"))
    built = {arch: build_task_and_model(data_dir, arch=arch, seed=5) for arch in ("hrt_tiny", "at_tiny", "cmlm_tiny")}
    return data_dir, built


def test_options_from_the_task_and_per_call_generation_options(models):
    data_dir, built = models
    args = generation_args(
        data_dir,
        "--decode-chunk-size",
        "2",
        "--b-nat",
        "1",
        "--beam",
        "3",
        "--max-len-a",
        "1.2",
        "--max-len-b",
        "10",
        "--decoder-engine",
        "fairseq",
    )
    task, _ = built["hrt_tiny"]
    options = DecodingOptions.from_fairseq(args, args)
    assert (options.decode_chunk_size, options.decoder_engine, options.b_nat) == ("2", "fairseq", 1)
    assert options.search_config == SearchConfig(beam=3, max_len_a=1.2, max_len_b=10)
    # a task option given with the generation options (the hub's per-call keywords) wins

    call = OmegaConf.create({"beam": 1, "decoding": "beam", "decode_chunk_size": "1"})
    options = DecodingOptions.from_fairseq(args, call)
    assert (options.decoding, options.decode_chunk_size, options.search_config.beam) == ("beam", "1", 1)
    assert options.replace(beam=4, b_nat=2).search_config.beam == 4 and options.replace(b_nat=2).b_nat == 2
    with pytest.raises(ValueError, match="unknown decoding option"):
        options.replace(chunk_size=2)
    assert options.search_config.for_chunk_size(2) == dataclasses.replace(
        options.search_config, max_len_a=0.0, max_len_b=100
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.b_nat = 3  # data, passed down, never written back


def test_sequence_generator_only_flags_are_collected_and_refused_by_lean(models):
    data_dir, built = models
    _, at = built["at_tiny"]
    args = generation_args(data_dir, "--sampling", "--no-repeat-ngram-size", "2")
    assert DecodingOptions.from_fairseq(args, args).sequence_generator_only == ("--sampling", "--no-repeat-ngram-size")
    with pytest.raises(
        ValueError,
        match="--decoder-engine lean does not support --sampling, --no-repeat-ngram-size; "
        "decode with --decoder-engine fairseq",
    ):
        build_generator(data_dir, at, "--sampling", "--no-repeat-ngram-size", "2")


def test_building_a_generator_never_changes_the_task_or_the_model(models):
    data_dir, built = models
    _, hrt = built["hrt_tiny"]
    before = {k: v.clone() for k, v in hrt.state_dict().items()}
    task, gen = build_generator(data_dir, hrt, "--decode-chunk-size", "2", "--beam", "2")
    cfg_before = dataclasses.asdict(task.cfg) if dataclasses.is_dataclass(task.cfg) else dict(vars(task.cfg))
    task.build_decoding(
        [hrt], DecodingOptions.from_fairseq(task.cfg).replace(decoding="beam", decode_chunk_size="1", beam=1)
    )
    assert (dataclasses.asdict(task.cfg) if dataclasses.is_dataclass(task.cfg) else dict(vars(task.cfg))) == cfg_before
    assert all(torch.equal(before[k], v) for k, v in hrt.state_dict().items()) and not is_quantized(hrt)


def test_int8_is_a_load_time_option(models):
    data_dir, built = models
    _, at = built["at_tiny"]
    task, _ = build_generator(data_dir, at)
    with pytest.raises(ValueError, match="applied when the model is loaded"):
        task.build_decoding([at], DecodingOptions(quantize="int8"))
    assert not is_quantized(at)


def test_model_kinds_and_their_banned_symbols(models):
    _, built = models
    task, hrt = built["hrt_tiny"]
    d = task.target_dictionary
    kinds = {arch: family_of(m).kind for arch, (_, m) in built.items()}
    assert kinds == {"hrt_tiny": HRT, "at_tiny": AT, "cmlm_tiny": MASK_PREDICT}
    specials = {task.mask_idx, d.bos(), *task.chunk_start_idx.values()}
    assert set(banned_symbols(task, built["at_tiny"][1])) == {d.pad()}
    assert set(banned_symbols(task, hrt)) == {d.pad()} | specials
    assert set(banned_symbols(task, built["cmlm_tiny"][1])) == {d.pad(), d.eos()} | specials


def test_search_rules_one_step_for_every_row_or_one_per_slot(models):
    """Greedy's rules give the same choice whether a step is shared by the rows (the lean
    engine) or given per slot (Jacobi decoding), including min-len, forced </s> and --unkpen."""
    _, built = models
    task, _ = built["hrt_tiny"]
    d = task.target_dictionary
    torch.manual_seed(0)
    logits = torch.randn(4, len(d))
    logits[:, d.pad()] += 20  # banned: must never win
    for options, temperature in ((SearchConfig(beam=1, min_len=2), 1.0), (SearchConfig(beam=1, unk_penalty=3.0), 0.7)):
        rules = SearchRules(options, d, banned=[task.mask_idx], temperature=temperature)
        for step in (0, 1, 3, 5):
            shared = rules.greedy(rules.logits(logits), step, max_len=5)
            per_slot = rules.greedy(rules.logits(logits), torch.full((4,), step), max_len=5)
            assert torch.equal(shared[1], per_slot[1]) and torch.allclose(shared[0], per_slot[0])
            assert not bool(shared[1].eq(d.pad()).any()) and not bool(shared[1].eq(task.mask_idx).any())
            if step == 5:
                assert bool(shared[1].eq(d.eos()).all())  # forced at the maximum length
            if step < options.min_len:
                assert not bool(shared[1].eq(d.eos()).any())
    # over a shortlist's rows the choice is the same token when the best one is a candidate
    rules = SearchRules(SearchConfig(beam=1), d)
    best = rules.greedy(logits, 1, 5)[1]
    rows = OutputRows(np.unique(np.concatenate([best.numpy(), [d.eos(), d.unk()]])).astype(np.int64))
    restricted = rules.greedy(logits.index_select(1, torch.from_numpy(rows.ids)), 1, 5, rows)[1]
    assert np.array_equal(rows.to_full(restricted.numpy()), best.numpy())


def test_an_engines_own_option_is_refused_by_the_other_engines_and_engine_free_strategies(models):
    """An engine's own option (DecoderEngine.own_options: a DecodingOptions task field) is
    refused by every other engine and by a strategy that decodes without an engine, from the
    declaration alone (nothing else names it)."""
    data_dir, built = models
    task_fields = {f.name for f in dataclasses.fields(type(built["at_tiny"][0].cfg))}
    owned = [(name, option) for name, engine in ENGINES.items() for option in engine.own_options]
    assert owned == [("onnxruntime", "onnx_model")]
    for owner, option in owned:
        assert option in task_fields and option in DecodingOptions.__dataclass_fields__
        flag = "--" + option.replace("_", "-")
        options = DecodingOptions().replace(**{option: "/a/folder"})
        assert all((flag in e.unsupported(options)) == (n != owner) for n, e in ENGINES.items())
        with pytest.raises(ValueError, match=f"{flag}: an engine's own option"):
            build_generator(data_dir, built["at_tiny"][1], "--decoding", "pj", "--beam", "1", flag, "/a/folder")


def test_an_engine_registers_and_is_picked_by_name(models, monkeypatch):
    """A new engine is one registered class: --decoder-engine accepts its name, and what it
    declares it does not support is refused in one message."""
    data_dir, built = models
    task, at = built["at_tiny"]
    calls = []

    monkeypatch.setattr(engines_module, "ENGINES", ENGINES.copy())
    monkeypatch.setattr(strategies, "ENGINES", engines_module.ENGINES)

    @register_engine("counting")
    class CountingEngine(LeanEngine):
        supports_shortlist = False

        def left_to_right(self, ctx, config, banned):
            calls.append(config.beam)
            return super().left_to_right(ctx, config, banned)

    assert "counting" in engines_module.engine_choices()
    sample = make_sample(task, RAGGED)
    _, ours = build_generator(data_dir, at, "--decoder-engine", "counting", "--beam", "2", "--max-len-b", "6")
    _, ref = build_generator(data_dir, at, "--beam", "2", "--max-len-b", "6")
    assert calls == [2]
    got, want = task.inference_step(ours, [at], sample), task.inference_step(ref, [at], sample)
    assert [h[0]["tokens"].tolist() for h in got] == [h[0]["tokens"].tolist() for h in want]
    with pytest.raises(ValueError, match="--decoder-engine must be one of"):
        build_generator(data_dir, at, "--decoder-engine", "nosuch")
