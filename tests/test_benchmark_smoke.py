"""The pure parts of the benchmark and of sequence-level distillation, and the benchmark's rows,
resume and time split on tiny models. The benchmark run end to end by the Multi30k recipe
(``--profile tiny``) is tests/test_recipe_end_to_end.py, a test of the example."""

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
from fairseq.data import Dictionary

from benchmarks import benchmark, ct2_reference, measure, time_split
from fairseq_hrt.distill import select_by_sentence_bleu, sentence_bleu_scores
from fairseq_hrt.generation.quantize import is_quantized, quantize_int8
from fairseq_hrt.shortlist import Shortlist
from fairseq_hrt.symbols import hrt_symbols
from tests.hrt_fixtures import build_task_and_model

HAVE_CT2 = importlib.util.find_spec("ctranslate2") is not None
AT_SYSTEMS = ["AT greedy", "AT beam 5"]
CT2_SYSTEMS = ["CTranslate2 AT greedy", "CTranslate2 AT beam 5"]


def hrt_mp_systems(chunk_sizes):
    return [
        "HRT AT-mode b=1",
        "HRT AT-mode b=5",
        *[f"HRT k={k} b_at={b} b_nat=1" for k in chunk_sizes for b in (1, 5)],
        "MP I=1 l=5",
        "MP I=4 l=5",
        "MP I=10 l=5",
    ]


def with_engine_rows(names, shortlist=False):
    """benchmark.py's default rows: lean engine, fairseq engine and int8 (on CPU) per system,
    and with --shortlist a "+shortlist" row; Mask-Predict has no engine rows."""
    out = []
    for name in names:
        out += [name] + ([] if name.startswith("MP") else [name + " (fairseq engine)"]) + [name + " int8"]
        out += [name + " +shortlist", name + " int8 +shortlist"] if shortlist else []
    return out


# the recipe trains HRT for k = 2 only (one model per k, as the papers) and benchmarks it
# the recipe builds a lexical shortlist and benchmarks every system with it too (CTranslate2
# with its vocabulary map of the same shortlist, and in int8 beside the int8 rows)
EXPECTED_SYSTEMS = (
    with_engine_rows(AT_SYSTEMS, shortlist=True)
    + (
        [n for name in CT2_SYSTEMS for n in (name, name + " int8", name + " +vmap", name + " int8 +vmap")]
        if HAVE_CT2
        else []
    )
    + with_engine_rows(hrt_mp_systems([2]), shortlist=True)
)


# --------------------------------------------------------------------------- pure parts


def test_select_by_sentence_bleu_keeps_the_closest_hypothesis():
    ref = "A man in a blue shirt is standing on a ladder."
    nbest = ["A man is on a ladder.", "A man in a blue shirt stands on a ladder.", "Someone is outside."]
    assert select_by_sentence_bleu(nbest, ref) == 1
    scores = sentence_bleu_scores(nbest, ref)
    assert scores[1] == max(scores) and all(0 <= s <= 100 for s in scores)


def test_select_by_sentence_bleu_tie_goes_to_the_better_model_score():
    assert select_by_sentence_bleu(["a b c", "a b c"], "x y z") == 0
    assert select_by_sentence_bleu(["only one"], "anything") == 0
    with pytest.raises(ValueError):
        select_by_sentence_bleu([], "ref")


def test_pareto_front():
    points = [(100, 30.0), (200, 29.0), (150, 28.0), (300, 20.0), (50, 31.0), (300, 19.0), (None, 40.0)]
    # (150, 28) is dominated by (200, 29); (300, 19) by (300, 20); a point without a speed is never on it
    assert benchmark.pareto_front(points) == [4, 0, 1, 3]
    assert benchmark.pareto_front([(1, 1), (1, 1)]) == [0, 1]  # equal points do not dominate each other
    assert benchmark.pareto_front([]) == []


def test_speed_ratios_are_relative_to_the_baseline_at_the_same_batch_size():
    wps = {"AT greedy": {"1": 100.0, "8": 400.0}, "HRT k=2": {"1": 150.0, "8": 500.0}}
    ratios = benchmark.speed_ratios(wps, "AT greedy")
    assert ratios["AT greedy"] == {"1": 1.0, "8": 1.0}
    assert ratios["HRT k=2"] == {"1": 1.5, "8": 1.25}
    assert benchmark.speed_ratios({"HRT k=2": {"1": 150.0}}, "AT greedy") == {"HRT k=2": {"1": None}}


def test_systems_and_skipped_families():
    args = SimpleNamespace(
        at="at.pt",
        at_beams="1,5",
        hrt=None,
        hrt_chunk_sizes="2,3,4",
        hrt_beams="1/1,5/1",
        mp="mp.pt",
        mp_iterations="1,4,10",
        mp_length_beam=5,
        ctranslate2="no",
    )
    systems, skipped = benchmark.systems_from_args(args)
    assert [s.name for s in systems] == ["AT greedy", "AT beam 5", "MP I=1 l=5", "MP I=4 l=5", "MP I=10 l=5"]
    assert [s["family"] for s in skipped] == ["HRT"]
    args.hrt = "hrt.pt"
    args.ctranslate2 = "auto"
    systems = benchmark.systems_from_args(args)[0]
    assert [s.name for s in systems] == AT_SYSTEMS + CT2_SYSTEMS + hrt_mp_systems([2, 3, 4])
    # the CTranslate2 rows decode the AT checkpoint
    assert {s.checkpoint for s in systems if s.family == "CT2"} == {"at.pt"}
    with pytest.raises(ValueError):
        benchmark.parse_beam_pairs("1/5")  # b_nat > b_at


def test_engine_and_int8_rows_and_the_fastest_baseline():
    args = SimpleNamespace(
        at="at.pt",
        at_beams="1",
        hrt="hrt.pt",
        hrt_chunk_sizes="2",
        hrt_beams="1/1",
        mp="mp.pt",
        mp_iterations="1",
        mp_length_beam=5,
        ctranslate2="no",
        engines="lean,fairseq",
        int8="yes",
    )
    systems = benchmark.systems_from_args(args)[0]
    assert [s.name for s in systems] == with_engine_rows(
        ["AT greedy", "HRT AT-mode b=1", "HRT k=2 b_at=1 b_nat=1", "MP I=1 l=5"]
    )
    assert [s.decoding.get("decoder_engine") for s in systems[:3]] == ["lean", "fairseq", "lean"]
    assert systems[2].decoding["quantize"] == "int8"
    speeds = {
        "AT greedy": {"1": 300.0, "8": 900.0},
        "AT greedy (fairseq engine)": {"1": 100.0, "8": 1000.0},
        "AT greedy int8": {"1": 5000.0, "8": 5000.0},
    }
    for s in systems:
        s.speed = {b: {"words_per_second": w} for b, w in speeds.get(s.name, {}).items()}
    # int8 is not a baseline candidate: the fastest float AT greedy of each batch size is
    assert benchmark.fastest_baseline(systems, ["1", "8"]) == {"1": "AT greedy", "8": "AT greedy (fairseq engine)"}
    ratios = benchmark.speed_ratios(speeds, {"1": "AT greedy", "8": "AT greedy (fairseq engine)"})
    assert ratios["AT greedy"] == {"1": 1.0, "8": 0.9}
    with pytest.raises(ValueError):
        benchmark.parse_engines("lean,fast")


def test_compiled_rows_for_left_to_right_systems_only():
    """--compile yes adds a compiled lean row per AT and HRT system (not Mask-Predict, whose
    decoding has no lean step); a compiled AT greedy row is a float AT greedy decoder, so it
    may be the baseline."""
    args = SimpleNamespace(
        at="at.pt",
        at_beams="1",
        hrt="hrt.pt",
        hrt_chunk_sizes="2",
        hrt_beams="1/1",
        mp="mp.pt",
        mp_iterations="1",
        mp_length_beam=5,
        ctranslate2="no",
        engines="lean",
        int8="no",
        compile="yes",
    )
    systems = benchmark.systems_from_args(args)[0]
    assert [s.name for s in systems] == [
        "AT greedy",
        "AT greedy compiled",
        "HRT AT-mode b=1",
        "HRT AT-mode b=1 compiled",
        "HRT k=2 b_at=1 b_nat=1",
        "HRT k=2 b_at=1 b_nat=1 compiled",
        "MP I=1 l=5",
    ]
    compiled = systems[1]
    assert compiled.decoding["compile"] is True and compiled.decoding["decoder_engine"] == "lean"
    _, options = benchmark.adapter_of(compiled).generation(compiled)
    assert options["compile"] is True and benchmark.adapter_of(systems[0]).generation(systems[0])[1]["compile"] is False
    for s in systems:
        s.speed = {"1": {"words_per_second": {"AT greedy": 300.0, "AT greedy compiled": 450.0}.get(s.name, 9999.0)}}
    assert benchmark.fastest_baseline(systems, ["1"]) == {"1": "AT greedy compiled"}


def test_onnxruntime_rows_and_a_shortlist_row_per_engine_that_restricts_the_output_layer():
    """--engines with onnxruntime: one row per engine ("(onnxruntime)"); --shortlist: a
    "+shortlist" row per engine that restricts the output layer (lean: the plain name,
    onnxruntime: its suffix before "+shortlist"; none for fairseq's engine) and a CTranslate2
    "+vmap" row beside each CTranslate2 row; --int8: an int8 row per engine that quantizes
    (onnxruntime's own, lean's) and CTranslate2's int8 beside its float row; compiled rows stay
    lean whatever engine --engines names first; Mask-Predict keeps one row of each."""
    args = SimpleNamespace(
        at="at.pt",
        at_beams="1",
        hrt="hrt.pt",
        hrt_chunk_sizes="2",
        hrt_beams="1/1",
        mp="mp.pt",
        mp_iterations="1",
        mp_length_beam=5,
        ctranslate2="auto",
        engines="onnxruntime,fairseq,lean",
        int8="yes",
        compile="yes",
        shortlist="s.pt",
    )
    systems = benchmark.systems_from_args(args)[0]

    def rows(name):
        return [
            name + " (onnxruntime)",
            name + " (fairseq engine)",
            name,
            name + " (onnxruntime) int8",
            name + " int8",
            name + " (onnxruntime) +shortlist",
            name + " +shortlist",
            name + " (onnxruntime) int8 +shortlist",
            name + " int8 +shortlist",
            name + " compiled",
        ]

    assert [s.name for s in systems] == (
        rows("AT greedy")
        + ["CTranslate2 AT greedy", "CTranslate2 AT greedy int8", "CTranslate2 AT greedy +vmap"]
        + ["CTranslate2 AT greedy int8 +vmap"]
        + rows("HRT AT-mode b=1")
        + rows("HRT k=2 b_at=1 b_nat=1")
        + ["MP I=1 l=5", "MP I=1 l=5 int8", "MP I=1 l=5 +shortlist", "MP I=1 l=5 int8 +shortlist"]
    )
    by_name = {s.name: s for s in systems}

    def options(name):
        return benchmark.adapter_of(by_name[name]).generation(by_name[name])[1]

    assert options("AT greedy (onnxruntime) +shortlist")["decoder_engine"] == "onnxruntime"
    assert options("AT greedy (onnxruntime) +shortlist")["shortlist"] == "s.pt"
    assert options("AT greedy +shortlist")["decoder_engine"] == "lean"
    assert options("HRT k=2 b_at=1 b_nat=1 int8")["decoder_engine"] == "lean"
    assert options("HRT k=2 b_at=1 b_nat=1 (onnxruntime) int8")["decoder_engine"] == "onnxruntime"
    assert options("HRT k=2 b_at=1 b_nat=1 (onnxruntime) int8")["quantize"] == "int8"
    assert by_name["CTranslate2 AT greedy int8"].decoding == {"beam": 1, "compute_type": "int8"}
    assert options("HRT k=2 b_at=1 b_nat=1 compiled")["decoder_engine"] == "lean"
    assert options("AT greedy (onnxruntime)")["shortlist"] is None
    assert by_name["AT greedy (onnxruntime)"].baseline_candidate  # a float AT greedy decoder
    assert by_name["CTranslate2 AT greedy +vmap"].decoding == {"beam": 1, "shortlist": "s.pt"}
    assert by_name["CTranslate2 AT greedy int8 +vmap"].decoding == {
        "beam": 1,
        "shortlist": "s.pt",
        "compute_type": "int8",
    }
    assert options("HRT k=2 b_at=1 b_nat=1 (onnxruntime) int8 +shortlist")["quantize"] == "int8"
    assert options("HRT k=2 b_at=1 b_nat=1 int8 +shortlist")["shortlist"] == "s.pt"
    assert by_name["CTranslate2 AT greedy"].decoding == {"beam": 1}
    # with no engine of --engines that supports shortlists, the "+shortlist" row is the lean engine's
    args.engines, args.int8, args.compile = "fairseq", "no", "no"
    assert [s.name for s in benchmark.systems_from_args(args)[0] if s.family == "AT"] == [
        "AT greedy (fairseq engine)",
        "AT greedy +shortlist",
    ]
    # --hrt-at-mode no: HRT's k rows only
    args.hrt_at_mode = "no"
    assert [s.name for s in benchmark.systems_from_args(args)[0] if s.family == "HRT"] == [
        "HRT k=2 b_at=1 b_nat=1 (fairseq engine)",
        "HRT k=2 b_at=1 b_nat=1 +shortlist",
    ]


def test_every_at_student_has_its_ctranslate2_rows_and_one_the_converter_refuses_is_named(monkeypatch):
    """CTranslate2 rows (float, int8, +vmap) for --at and every --at-extra checkpoint, named by
    the student; a checkpoint CTranslate2 cannot convert has none and is listed as skipped."""
    refused = {"ssru.pt": "an SSRU decoder"}
    monkeypatch.setattr(measure.CT2Adapter, "unsupported", staticmethod(lambda checkpoint: refused.get(checkpoint)))
    args = SimpleNamespace(
        at="at.pt",
        at_extra=["kd=kd.pt", "ssru=ssru.pt"],
        at_beams="1",
        hrt=None,
        mp=None,
        ctranslate2="auto",
        engines="lean",
        int8="yes",
        compile="no",
        shortlist="s.pt",
    )
    systems, skipped = benchmark.systems_from_args(args)
    ct2 = [(s.name, s.checkpoint) for s in systems if s.family == "CT2"]
    assert ct2 == [
        ("CTranslate2 AT greedy", "at.pt"),
        ("CTranslate2 AT greedy int8", "at.pt"),
        ("CTranslate2 AT greedy +vmap", "at.pt"),
        ("CTranslate2 AT greedy int8 +vmap", "at.pt"),
        ("CTranslate2 AT[kd] greedy", "kd.pt"),
        ("CTranslate2 AT[kd] greedy int8", "kd.pt"),
        ("CTranslate2 AT[kd] greedy +vmap", "kd.pt"),
        ("CTranslate2 AT[kd] greedy int8 +vmap", "kd.pt"),
    ]
    assert {"family": "CT2", "reason": "CTranslate2 AT[ssru]: an SSRU decoder"} in skipped


def test_rows_an_engine_cannot_decode_are_refused(tmp_path):
    """ONNX Runtime rows of options it does not honour (stage-II options) or of a checkpoint
    it cannot export (a model quantized by PyTorch) are refused with the reason; the benchmark
    leaves them out and lists them as skipped."""
    (tmp_path / "hrt").mkdir()
    task, hrt = build_task_and_model(str(tmp_path / "hrt"), arch="hrt_tiny")
    args = SimpleNamespace(
        at=None,
        at_beams="1",
        hrt="hrt.pt",
        hrt_chunk_sizes="2",
        hrt_beams="1/1",
        mp=None,
        mp_iterations="1",
        mp_length_beam=1,
        ctranslate2="no",
        engines="lean,onnxruntime",
        hrt_options=["refine20:hrt_refine_fraction=0.2"],
    )
    by_name = {s.name: s for s in benchmark.systems_from_args(args)[0]}
    hrt_ctx = SimpleNamespace(model=lambda checkpoint, quantize="none", engine="lean": (hrt, task))
    row = by_name["HRT k=2 b_at=1 b_nat=1 refine20 (onnxruntime)"]
    assert "--hrt-refine-fraction" in benchmark.adapter_of(row).refused(row, hrt_ctx)
    row = by_name["HRT k=2 b_at=1 b_nat=1 refine20"]
    assert benchmark.adapter_of(row).refused(row, hrt_ctx) is None

    (tmp_path / "at").mkdir()
    task, at = build_task_and_model(str(tmp_path / "at"), arch="at_tiny", extra=("--hrt-mode", "at"))
    quantize_int8(at)  # a model the exporter refuses: PyTorch's int8 modules
    ctx = SimpleNamespace(model=lambda checkpoint, quantize="none", engine="lean": (at, task))
    args = SimpleNamespace(at="at.pt", at_beams="1", hrt=None, mp=None, ctranslate2="no", engines="lean,onnxruntime")
    lean, onnx = benchmark.systems_from_args(args)[0]
    assert benchmark.adapter_of(lean).refused(lean, ctx) is None
    assert "quantized" in benchmark.adapter_of(onnx).refused(onnx, ctx)


def test_ctranslate2_vocabulary_map_of_a_shortlist():
    """vmap.txt: the always-on targets under an empty source (with those of </s>, which
    fairseq appends to every source), then each source token with targets; padding is no
    source; targets spelled as CTranslate2 spells them (<blank> for <pad>)."""
    d = Dictionary()
    for word in ("a", "b", "c", "x", "y", "z"):
        d.add_symbol(word)
    n = len(d)  # 0 <s>, 1 <pad>, 2 </s>, 3 <unk>, 4 a, 5 b, 6 c, 7 x, 8 y, 9 z
    translations = torch.full((n, 2), -1)
    translations[4] = torch.tensor([8, 7])  # a -> y x (best first)
    translations[5, 0] = 9  # b -> z
    translations[3, 0] = 7  # <unk> -> x
    translations[2, 0] = 6  # </s> -> c: in every batch
    translations[1, 0] = 5  # <pad> -> b: never
    short = Shortlist(translations, torch.tensor([0, 1, 2, 3, 4]), "fp", n, n)
    symbols = list(d.symbols)
    symbols[1] = "<blank>"
    assert ct2_reference.vmap_text(short, d, symbols).split("\n") == [
        "\t<s> <blank> </s> <unk> a c",
        "<unk>\tx",
        "a\ty x",
        "b\tz",
        "",
    ]
    # symbols no decoder outputs are left out (CTranslate2 must not be asked to suppress candidates)
    assert ct2_reference.vmap_text(short, d, symbols, leave_out=["a", "y"]).split("\n") == [
        "\t<s> <blank> </s> <unk> c",
        "<unk>\tx",
        "a\tx",
        "b\tz",
        "",
    ]
    d.add_symbol("two words")
    wide = Shortlist(torch.full((n + 1, 1), n), torch.tensor([2]), "fp", n + 1, n + 1)
    with pytest.raises(ValueError, match="white space"):
        ct2_reference.vmap_text(wide, d, list(d.symbols))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["lean", "onnxruntime"])
def test_time_split_parts_add_up_and_hrt_halves_the_steps(trained, tmp_path, monkeypatch, engine):
    """benchmarks/time_split.py: encoder + decoder steps + stage II + other = the measured
    total; stage II only for k = 2, which takes about half of AT mode's steps per sentence;
    the same with ONNX Runtime's session runs timed in place."""
    if engine == "onnxruntime":
        pytest.importorskip("onnxruntime")
        monkeypatch.setenv("FAIRSEQ_HRT_ONNX_CACHE", str(tmp_path / "onnx-cache"))

    data, ckpts = trained
    time_split.main(
        [
            "--data",
            str(data.bin_dir),
            "--src",
            str(data.raw("valid", "en")),
            "--at",
            str(ckpts["at_tiny"]),
            "--hrt",
            str(ckpts["hrt_tiny"]),
            "--batch-sizes",
            "1,8",
            "--bs1-sentences",
            "20",
            "--engine",
            engine,
            "--out-dir",
            str(tmp_path),
        ]
    )
    report = json.loads((tmp_path / "time_split.json").read_text())
    assert (tmp_path / "time_split.md").read_text().count("| HRT k=2 b_at=1 b_nat=1 |") == 2
    for name, by_batch in report["systems"].items():
        for bs, result in by_batch.items():
            parts = result["parts_ms_per_sentence"]
            assert sum(parts.values()) == pytest.approx(result["ms_per_sentence"])
            assert parts["encoder"] > 0 and parts["decoder steps"] > 0
            assert (parts["stage II"] > 0) == name.startswith("HRT k=2")
            if engine == "onnxruntime":  # the session runs alone: part of each step (batch 1: the greedy loop)
                assert 0 < result["run_ms_per_decoder_step"] <= result["ms_per_decoder_step"]
    at_mode, k2 = report["systems"]["HRT AT-mode b=1"]["1"], report["systems"]["HRT k=2 b_at=1 b_nat=1"]["1"]
    assert k2["decoder_steps_per_batch"] < 0.75 * at_mode["decoder_steps_per_batch"]
    assert report["engine"] == engine


def test_time_split_backend_call_times_count_each_part_and_restore_the_methods(tmp_path):
    """The GPU split of benchmarks/time_split.py: every encoder, step and stage-II call of the
    engine's backend is timed (the GPU synchronised around it), and the methods are the
    class's again afterwards."""
    from fairseq_hrt.generation.lean import LeanSequenceGenerator  # noqa: PLC0415 - one test's imports
    from hrt_runtime.search import SearchConfig  # noqa: PLC0415
    from tests.hrt_fixtures import make_sample  # noqa: PLC0415
    from tests.test_generator import SPECIALS  # noqa: PLC0415

    task, hrt = build_task_and_model(str(tmp_path), arch="hrt_tiny", seed=3)
    d = task.target_dictionary
    generator = LeanSequenceGenerator(
        hrt.eval(),
        d,
        SearchConfig(beam=1, max_len_b=8),
        [d.index(s) for s in SPECIALS],
        chunk_start=task.chunk_start_idx,
        mask=task.mask_idx,
        chunk_size=2,
    )
    syncs = []
    with time_split.backend_call_times(generator.backend, lambda: syncs.append(1)) as times:
        generator.generate([hrt], make_sample(task, [[1, 2, 3], [4, 5]]))
    counts = {scope: calls for scope, (_, calls) in times.items()}
    assert counts["hrt.encoder"] == 1 and counts["hrt.step"] >= 2 and counts["hrt.stage2"] == 1
    assert all(seconds > 0 for seconds, _ in times.values())
    assert len(syncs) == 2 * sum(counts.values())
    assert not {"encode_fairseq", "step", "parallel"} & set(vars(generator.backend))


def test_ctranslate2_suppresses_the_plugins_special_symbols():
    """ct2_reference.SPECIAL_SYMBOLS (written out: the module runs without PyTorch) are the
    symbols the task adds to every dictionary."""
    assert list(ct2_reference.SPECIAL_SYMBOLS) == hrt_symbols()


def test_ctranslate2_outputs_obey_a_source_relative_maximum_length():
    """--max-len-a: CTranslate2's batches get fairseq's limit, a x the batch's longest source
    (with </s>) + b, and the outputs come back in input order."""

    class Translator:
        def __init__(self):
            self.calls = []

        def translate_batch(self, sources, max_decoding_length, **kwargs):
            self.calls.append((len(sources), max_decoding_length))
            return [type("R", (), {"hypotheses": [["x"] * min(len(s), max_decoding_length)]}) for s in sources]

    sources = [["a"] * n for n in (5, 1, 9, 3)]
    t = Translator()
    out = ct2_reference.translate(t, sources, 2, 1, 10, [], max_len_a=1.5)
    assert t.calls == [(2, int(1.5 * 4 + 10)), (2, int(1.5 * 10 + 10))]  # sorted by length: (1, 3), (5, 9)
    assert [len(out[i]) for i in range(4)] == [5, 1, 9, 3]
    t = Translator()
    ct2_reference.translate(t, sources, 2, 1, 10, [])
    assert t.calls == [(4, 10)]  # without a: CTranslate2 batches, one global L


def test_hrt_rows_with_decoding_options_by_name():
    """--hrt-options adds HRT rows whose decoding options reach the generator by their name."""
    args = SimpleNamespace(
        at=None,
        at_beams="1",
        hrt="hrt.pt",
        hrt_chunk_sizes="2",
        hrt_beams="1/1",
        mp=None,
        mp_iterations="10",
        mp_length_beam=1,
        ctranslate2="no",
        hrt_options=["refine20:hrt_refine_fraction=0.2", "rescore:hrt_rescore=true,beam=3,b_nat=3"],
    )
    systems = benchmark.systems_from_args(args)[0]
    by_name = {s.name: s for s in systems}
    assert list(by_name)[-2:] == ["HRT k=2 b_at=1 b_nat=1 refine20", "HRT k=2 b_at=3 b_nat=3 rescore"]
    row = by_name["HRT k=2 b_at=3 b_nat=3 rescore"]
    gen_args, options = benchmark.adapter_of(row).generation(row)
    assert gen_args == {"beam": 3} and options["hrt_rescore"] is True and options["b_nat"] == 3
    assert options["decode_chunk_size"] == "2" and options["decoder_engine"] == "lean"
    args.hrt_options = ["bad:chunk_size=2"]
    with pytest.raises(ValueError, match="not a decoding option"):
        benchmark.systems_from_args(args)


def test_hrt_extra_checkpoints_get_their_own_rows():
    args = SimpleNamespace(
        at=None,
        at_beams="1",
        hrt="hrt.pt",
        hrt_chunk_sizes="2",
        hrt_beams="1/1",
        mp=None,
        mp_iterations="1",
        mp_length_beam=1,
        ctranslate2="no",
        engines="lean",
        hrt_extra=["s2=hrt2.pt"],
        hrt_options=["refine20:hrt_refine_fraction=0.2"],
    )
    rows = {s.name: s.checkpoint for s in benchmark.systems_from_args(args)[0]}
    assert rows["HRT[s2] k=2 b_at=1 b_nat=1"] == "hrt2.pt" and rows["HRT[s2] AT-mode b=1"] == "hrt2.pt"
    assert rows["HRT k=2 b_at=1 b_nat=1"] == "hrt.pt" and not any(
        n.startswith("HRT[s2]") and "refine" in n for n in rows
    )


def test_int8_rows_load_the_model_their_engine_quantizes(monkeypatch):
    """An int8 row of the lean engine decodes PyTorch's int8 copy; one of ONNX Runtime decodes
    the float model (it quantizes its exported graphs itself), so both share the float copy
    with the float rows."""
    loads = []

    def fake_load(checkpoint, data, use_cuda, fp16):
        loads.append(checkpoint)
        return torch.nn.Sequential(torch.nn.Linear(4, 4)), "task"

    monkeypatch.setattr(measure, "load", fake_load)
    ctx = measure.Context("data", "spm.model", "out")
    float_model, _ = ctx.model("m.pt")
    assert not is_quantized(float_model)
    assert ctx.model("m.pt", "int8", "onnxruntime")[0] is float_model
    lean_int8, _ = ctx.model("m.pt", "int8", "lean")
    assert is_quantized(lean_int8) and lean_int8 is not float_model
    assert loads == ["m.pt", "m.pt"]
