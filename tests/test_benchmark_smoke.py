"""The Multi30k benchmark recipe end to end (``--profile tiny``) and the pure parts of the
benchmark and of sequence-level distillation.

The smoke test checks the report's *structure* (every system, every batch size, ratios,
signature, COMET marked absent, a PNG), not its numbers: the tiny profile runs every step of
the recipe (teacher, distillation, AT, HRT and MP students, benchmark) on 300 pairs with
tens of updates, in about a minute and a half. The ``quick`` profile (a few hundred updates,
about 5 minutes) is the README's smoke run; its structure is the same.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fairseq.data import Dictionary

from benchmarks import benchmark, ct2_reference, measure, time_split
from fairseq_hrt import shortlist as sl
from fairseq_hrt.distill import select_by_sentence_bleu, sentence_bleu_scores
from fairseq_hrt.generation.quantize import is_quantized, quantize_int8
from fairseq_hrt.shortlist import Shortlist
from fairseq_hrt.symbols import dictionary_fingerprint, hrt_symbols
from fairseq_hrt.testing.tiny_runs import (
    REPO,
    SHARED_MULTI30K,
    corpus_source,
    default_prefer,
    write_lines,
    write_raw_corpus,
)
from tests.comet_tiny import build_tiny_comet
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


def _load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe = _load_module("hrt_recipe", REPO / "examples" / "multi30k" / "recipe.py")
PROFILE = recipe.PROFILES["tiny"]
BATCH_SIZES = PROFILE.bench_batch_sizes.split(",")


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


# --------------------------------------------------------------------------- end to end


def _raw_dir(root: Path):
    """None (the recipe finds ../shared/data/multi30k-en-de) or a synthetic corpus with the
    recipe's six files, when the shared data is absent or HRT_TEST_DATA=synthetic."""
    if corpus_source(default_prefer()) == "multi30k" and (SHARED_MULTI30K / "test.en").is_file():
        return None
    raw = root / "raw"
    write_raw_corpus(raw, n_train=2000, n_valid=100, prefer="synthetic", seed=1)
    held_out = write_raw_corpus(root / "held-out", n_train=1, n_valid=100, prefer="synthetic", seed=7)
    for lang in ("en", "de"):
        write_lines(raw / f"test.{lang}", Path(f"{held_out['valid']}.{lang}").read_text().splitlines())
    return raw


def _recipe(out: Path, raw, threads: int = 1):
    cmd = [
        sys.executable,
        str(REPO / "examples" / "multi30k" / "recipe.py"),
        "--profile",
        "tiny",
        "--out",
        str(out),
        "--threads",
        str(threads),
    ]
    if raw is not None:
        cmd += ["--raw-dir", str(raw)]
    env = {k: v for k, v in os.environ.items() if k not in ("COMET_MODEL", "COMET_ENCODER")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-8000:]
    return proc.stdout


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    raw = _raw_dir(root)
    out = root / "recipe-tiny"
    first = _recipe(out, raw)
    return out, raw, first


@pytest.mark.slow
def test_tiny_recipe_report_structure(tiny_run):
    out, raw, output = tiny_run
    bench = out / "benchmark"
    report = json.loads((bench / "report.json").read_text())

    names = [s["name"] for s in report["systems"]]
    assert names == EXPECTED_SYSTEMS
    assert report["skipped"] == (
        [] if HAVE_CT2 else [{"family": "CTranslate2", "reason": report["skipped"][0]["reason"]}]
    )
    assert report["meta"]["batch_sizes"] == [int(b) for b in BATCH_SIZES]
    assert report["meta"]["threads"] == 1 and report["meta"]["torch"] and report["meta"]["device"]
    assert report["meta"]["runs_bs1"] == 5 and report["meta"]["baseline"] == "the fastest AT greedy of this run"
    baselines = report["meta"]["baseline_per_batch_size"]
    assert sorted(baselines) == sorted(BATCH_SIZES)
    assert set(baselines.values()) <= {"AT greedy", "AT greedy (fairseq engine)"}
    for s in report["systems"]:
        assert isinstance(s["bleu"], float)
        assert s["length_ratio"] >= 0 and 0 <= s["brevity_penalty"] <= 1  # tiny models may say nothing
        assert s["brevity_penalty"] == 1.0 or s["length_ratio"] < 1  # BLEU's BP penalises short output only
        assert s["comet"] is None
        assert sorted(s["speed"]) == sorted(BATCH_SIZES)
        for b in BATCH_SIZES:
            sp = s["speed"][b]
            assert sp["words_per_second"] > 0 and sp["ratio_vs_baseline"] > 0
            assert len(sp["run_seconds"]) == (5 if b == "1" else 1)
    by_name = {s["name"]: s for s in report["systems"]}
    for b in BATCH_SIZES:
        assert by_name[baselines[b]]["speed"][b]["ratio_vs_baseline"] == 1.0
        assert all(
            by_name[n]["speed"][b]["ratio_vs_baseline"] <= 1.0 for n in ("AT greedy", "AT greedy (fairseq engine)")
        )
    assert report["bleu_signature"].startswith("nrefs:1|") and "version:" in report["bleu_signature"]
    assert report["comet"]["available"] is False and report["comet"]["reason"]
    assert set(report["pareto"]) == set(BATCH_SIZES) and all(report["pareto"][b] for b in BATCH_SIZES)

    # paths relative to the report's folder, never this machine's absolute ones
    assert str(out) not in (bench / "report.json").read_text()
    assert all(s["checkpoint"].startswith("../") for s in report["systems"])
    md = (bench / "report.md").read_text()
    assert str(out) not in md
    assert "COMET: not available (" in md and report["bleu_signature"] in md
    assert "| system | BLEU | chrF | len (BP) |" in md and "x source length" in md
    for name in EXPECTED_SYSTEMS:
        assert f"| {name} |" in md
    assert md.strip() in output  # the recipe prints the table at the end
    assert (bench / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    n_test = report["meta"]["test"]["sentences"]
    assert n_test == PROFILE.bench_sentences
    for name in EXPECTED_SYSTEMS:
        assert len((bench / "hyps" / f"{benchmark.slug(name)}.txt").read_text().splitlines()) == n_test
    # each row names its outputs, relative to the report's folder
    assert all(s["hyps"] == f"hyps/{benchmark.slug(s['name'])}.txt" for s in report["systems"])
    if HAVE_CT2:
        # the CTranslate2 conversion is the same model: fp32 greedy and beam search give
        # fairseq's translations (a rounding difference may flip a rare near-tie)
        # and greedy with the vocabulary map of the recipe's shortlist, the "+shortlist" row's
        # (beam search need not: test_onnxruntime_rows_and_the_ctranslate2_vocabulary_map)
        for fairseq_name, ct2_name in [
            *zip(["AT greedy", "AT beam 5"], CT2_SYSTEMS),
            ("AT greedy +shortlist", "CTranslate2 AT greedy +vmap"),
        ]:
            ours = (bench / "hyps" / f"{benchmark.slug(fairseq_name)}.txt").read_text().splitlines()
            theirs = (bench / "hyps" / f"{benchmark.slug(ct2_name)}.txt").read_text().splitlines()
            assert sum(a == b for a, b in zip(ours, theirs)) >= n_test - 1, ct2_name
    else:
        assert [sk["family"] for sk in report["skipped"]] == ["CTranslate2"]

    # every step ran once and left its marker; the distilled corpus is line-aligned
    for step in ("prepare", "teacher", "distill", "distill_bin", "at", "hrt", "mp", "shortlist", "benchmark"):
        assert (out / "markers" / f"{step}.done").is_file(), step
    # HRT trains one chunk size, k = 2, fine-tuned from the AT student
    hrt_cmd = (out / "markers" / "hrt.done").read_text().split()
    assert hrt_cmd[hrt_cmd.index("--chunk-sizes") + 1] == "2"
    assert hrt_cmd[hrt_cmd.index("--finetune-from-model") + 1] == str(out / "at" / "checkpoint_last.pt")
    assert "--curriculum-updates" not in hrt_cmd  # p_k = 1 at the last update
    n_train = len((out / "data" / "spm" / "train.en").read_text().splitlines())
    assert len((out / "distill" / "train.de").read_text().splitlines()) == n_train == PROFILE.subset


@pytest.mark.slow
def test_tiny_recipe_rerun_skips_every_step(tiny_run):
    out, raw, _ = tiny_run
    again = _recipe(out, raw, threads=2)  # the thread count does not make a step's output different
    assert again.count("skipped, done earlier") == 9, again


@pytest.mark.slow
def test_distill_keeps_empty_lines_aligned(tiny_run, tmp_path):
    out, _, _ = tiny_run
    src = write_lines(tmp_path / "src.en", ["▁A ▁man", "", "▁A ▁dog ▁runs ▁.", ""])
    ref = write_lines(tmp_path / "ref.de", ["Ein Mann", "", "Ein Hund rennt.", ""])
    hyp = tmp_path / "out" / "distilled.de"

    def distill(out_file, *extra):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "fairseq_hrt.distill",
                "--data",
                str(out / "data" / "data-bin"),
                "--path",
                str(out / "teacher" / "checkpoint_last.pt"),
                "--src",
                str(src),
                "--out",
                str(out_file),
                "--beam",
                "2",
                "--nbest",
                "2",
                "--select-by-bleu",
                str(ref),
                "--cpu",
                "--threads",
                "1",
                "--no-progress-bar",
                *extra,
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
            env=dict(
                os.environ, CUDA_VISIBLE_DEVICES="", FAIRSEQ_HRT_ONNX_CACHE=str(out.parent / "distill-onnx-cache")
            ),
        )

    distill(hyp)
    lines = hyp.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 5 and lines[-1] == ""  # 4 lines, each ending in a newline
    assert lines[1] == "" and lines[3] == ""
    assert not (tmp_path / "out" / "distilled.de.part").exists()
    if importlib.util.find_spec("onnxruntime"):  # the same n-best search on ONNX Runtime: the same targets
        distill(tmp_path / "ort.de", "--decoder-engine", "onnxruntime")
        assert (tmp_path / "ort.de").read_text(encoding="utf-8") == hyp.read_text(encoding="utf-8")


@pytest.mark.slow
def test_benchmark_reports_comet_with_a_local_model_and_skips_missing_systems(tiny_run, tmp_path):
    """COMET's real plumbing (a tiny random COMET model built offline, tests/comet_tiny.py):
    with a local model every system gets a score; families without a checkpoint are listed."""
    pytest.importorskip("comet")

    out, _, _ = tiny_run
    ckpt = build_tiny_comet(tmp_path / "comet")
    data = out / "data"
    bench = tmp_path / "bench"
    blind = tmp_path / "blind.en"
    blind.write_text("A dog runs.\n\nTwo men play football in the park.\n", encoding="utf-8")
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "benchmark.py"),
            "--data",
            str(data / "data-bin"),
            "--spm",
            str(data / "spm" / "spm.model"),
            "--src",
            str(data / "spm" / "test.en"),
            "--raw-src",
            str(data / "raw" / "test.en"),
            "--raw-ref",
            str(data / "raw" / "test.de"),
            "--at",
            str(out / "at" / "checkpoint_last.pt"),
            "--max-sentences",
            "6",
            "--bs1-sentences",
            "2",
            "--batch-sizes",
            "1,4",
            "--runs",
            "2",
            "--cpu",
            "--comet-model",
            str(ckpt),
            "--out-dir",
            str(bench),
            "--ctranslate2",
            "no",
            "--translate",
            f"blind={blind}",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    report = json.loads((bench / "report.json").read_text())
    # chrF beside BLEU, with its signature; each system's model shape; --translate's outputs,
    # one line per source line, named by the system
    assert report["chrf_signature"].startswith("nrefs:1|") and "chrF" not in report["bleu_signature"]
    for s in report["systems"]:
        assert isinstance(s["chrf"], float)
        assert s["shape"]["arch"] == "at_tiny" and s["shape"]["encoder_layers"] == 2 and s["shape"]["parameters"] > 0
        lines = (bench / "translations" / "blind" / f"{s['name']}.de").read_text(encoding="utf-8").split("\n")
        assert len(lines) == 4 and lines[3] == ""
    assert report["translated"] == {"blind": {"source": os.path.relpath(blind, bench), "folder": "translations/blind"}}
    assert report["comet"]["available"] is True and report["comet"]["model"] == str(Path(ckpt).resolve())
    assert [s["name"] for s in report["systems"]] == with_engine_rows(AT_SYSTEMS)
    assert all(isinstance(s["comet"], float) for s in report["systems"])
    assert [s["family"] for s in report["skipped"]] == ["HRT", "MP"]
    # paths relative to the report's folder, never this machine's absolute ones
    assert str(out) not in (bench / "report.json").read_text()
    assert all(s["checkpoint"].startswith("../") for s in report["systems"])
    md = (bench / "report.md").read_text()
    assert str(out) not in md
    assert "not available" not in md and "| HRT: skipped |" in md and "| MP: skipped |" in md


class Stopped(Exception):
    """Stands for the kill of a long benchmark (a session's end, a SIGTERM)."""


def test_an_interrupted_benchmark_resumes_with_its_finished_batch_sizes_and_translations(
    tiny_run, tmp_path, monkeypatch
):
    """``--resume`` keeps what an interrupted run of the same command finished: a batch size
    whose passes all ran (its speeds as that process measured them), the whole-test outputs, and
    the ``--translate`` files written; the rest is measured again, and the report says which
    batch sizes came from the earlier process."""
    out, _, _ = tiny_run
    data = out / "data"
    bench = tmp_path / "bench"
    blind = tmp_path / "blind.en"
    blind.write_text("A dog runs.\nTwo men play football in the park.\n", encoding="utf-8")
    argv = [
        *("--data", str(data / "data-bin"), "--spm", str(data / "spm" / "spm.model")),
        *("--src", str(data / "spm" / "test.en"), "--raw-src", str(data / "raw" / "test.en")),
        *("--raw-ref", str(data / "raw" / "test.de"), "--at", str(out / "at" / "checkpoint_last.pt")),
        *("--max-sentences", "6", "--bs1-sentences", "2", "--batch-sizes", "1,4", "--runs", "1"),
        *("--engines", "lean", "--int8", "no", "--ctranslate2", "no", "--cpu"),
        *("--out-dir", str(bench), "--translate", f"blind={blind}"),
    ]
    real_time_runs, real_write_file = benchmark.time_runs, benchmark.write_file
    timed = []  # the batch sizes' round-robin timings called, per process

    def time_runs(fn, **kw):
        if isinstance(fn, dict):
            timed.append(len(timed))
            if stop_at_timing is not None and len(timed) == stop_at_timing:
                raise Stopped
        return real_time_runs(fn, **kw)

    translation_writes = []

    def write_file(path, content):
        if "translations" in str(path):
            translation_writes.append(Path(path).name)
            if stop_at_translation is not None and len(translation_writes) == stop_at_translation:
                raise Stopped
        return real_write_file(path, content)

    monkeypatch.setattr(benchmark, "time_runs", time_runs)
    monkeypatch.setattr(benchmark, "write_file", write_file)
    state_file = bench / benchmark.RESUME_FILE

    # 1. stopped while timing batch size 4: batch size 1 is saved, no report
    stop_at_timing, stop_at_translation = 2, None
    with pytest.raises(Stopped):
        benchmark.main(argv)
    state = json.loads(state_file.read_text())
    assert list(state["batch_sizes"]) == ["1"] and not (bench / "report.json").exists()
    speeds_bs1 = state["batch_sizes"]["1"]["speed"]
    assert sorted(speeds_bs1) == sorted(AT_SYSTEMS)

    # 2. resumed: only batch size 4 is timed; stopped after the first system's translation
    timed.clear()
    stop_at_timing, stop_at_translation = None, 2
    with pytest.raises(Stopped):
        benchmark.main(argv + ["--resume"])
    assert len(timed) == 1
    state = json.loads(state_file.read_text())
    assert list(state["batch_sizes"]) == ["1", "4"] and sorted(state["outputs"]) == sorted(AT_SYSTEMS)
    assert [names for names in state["translated"].values()] == [["AT greedy"]]
    # the state keeps the passes; the texts are in hyps/, and one lost there is decoded again, untimed
    assert all(set(o) == {"passes_per_sentence", "accepted_per_verify_pass"} for o in state["outputs"].values())
    lost = bench / "hyps" / (benchmark.slug("AT beam 5") + ".txt")
    lost_text = lost.read_text(encoding="utf-8")
    lost.unlink()

    # 3. resumed again: nothing is timed, the finished translation is kept, the report is whole
    timed.clear()
    translation_writes.clear()
    stop_at_translation = None
    report = benchmark.main(argv + ["--resume"])
    assert timed == [] and translation_writes == ["AT beam 5.de"]
    assert not state_file.exists() and (bench / "report.json").exists()
    assert report["meta"]["resumed_batch_sizes"] == {
        "1": state["batch_sizes"]["1"]["date"],
        "4": state["batch_sizes"]["4"]["date"],
    }
    for s in report["systems"]:
        assert s["speed"]["1"]["run_seconds"] == speeds_bs1[s["name"]]["run_seconds"]
        assert isinstance(s["bleu"], float) and s["speed"]["4"]["ratio_vs_baseline"] is not None
        lines = (bench / "translations" / "blind" / f"{s['name']}.de").read_text(encoding="utf-8").splitlines()
        assert len(lines) == 2
    assert "interrupted and resumed: bs=1" in (bench / "report.md").read_text()
    assert lost.read_text(encoding="utf-8") == lost_text


def test_a_resume_file_of_another_command_is_not_used(tmp_path):
    """The fingerprint of a command: a checkpoint rewritten in place (a study's
    ``checkpoint_best.pt``) or a measuring option changes it; the output folder, the log and
    the files to translate do not."""
    ckpt = tmp_path / "checkpoint_best.pt"
    ckpt.write_bytes(b"weights")

    def args(**kw):
        base = dict(at=str(ckpt), at_extra=[f"b={ckpt}"], runs=5, out_dir="a", log_file=None, translate=[])
        base["resume"] = False
        return SimpleNamespace(**{**base, **kw})

    first = benchmark.command_fingerprint(args(), ["AT greedy"])
    assert first == benchmark.command_fingerprint(args(out_dir="b", translate=["x=y"], resume=True), ["AT greedy"])
    assert str(ckpt.resolve()) in first["files"]
    assert first != benchmark.command_fingerprint(args(runs=3), ["AT greedy"])
    assert first != benchmark.command_fingerprint(args(), ["AT greedy", "AT beam 5"])
    os.utime(ckpt, ns=(0, 0))
    assert first != benchmark.command_fingerprint(args(), ["AT greedy"])
    state = tmp_path / "resume.json"
    state.write_text(json.dumps({"command": first, "batch_sizes": {"1": {}}, "outputs": {}, "translated": {}}))
    fresh = benchmark.ResumeState(str(state), benchmark.command_fingerprint(args(), ["AT greedy"]), resume=True)
    assert fresh.data["batch_sizes"] == {}
    same = benchmark.ResumeState(str(state), first, resume=True)
    assert same.data["batch_sizes"] == {"1": {}}
    assert benchmark.ResumeState(str(state), first, resume=False).data["batch_sizes"] == {}


def restrictive_shortlist(data_bin: Path, path: Path, per_source=2, seed=0):
    """A shortlist of the recipe's dictionaries that must change the tiny models' output:
    ``per_source`` random words per source token, none of the 5 most frequent target words
    (what an undertrained model repeats), and only the special symbols always on; but the
    source token every fairseq batch holds, </s>, brings the 2nd and 3rd most frequent words
    (the models' next favourites: a vocabulary map without them decodes otherwise)."""
    _, _, src_dict, tgt_dict = sl.load_dictionaries(str(data_bin), None, None)
    words = torch.tensor(
        [i for i in range(tgt_dict.nspecial + 5, len(tgt_dict)) if not tgt_dict[i].startswith(("<", "madeupword"))]
    )
    g = torch.Generator().manual_seed(seed)
    translations = torch.stack([words[torch.randperm(len(words), generator=g)[:per_source]] for _ in src_dict.symbols])
    translations[src_dict.eos()] = torch.arange(tgt_dict.nspecial + 1, tgt_dict.nspecial + 1 + per_source)
    sl.Shortlist(
        translations,
        torch.tensor(sl.special_ids(tgt_dict)),
        dictionary_fingerprint(src_dict, tgt_dict),
        len(src_dict),
        len(tgt_dict),
    ).save(str(path))
    return src_dict, tgt_dict, sl.Shortlist.load(str(path))


@pytest.mark.slow
def test_onnxruntime_rows_and_the_ctranslate2_vocabulary_map(tiny_run, tmp_path):
    """--engines lean,onnxruntime --shortlist: the ONNX Runtime rows (plain and "+shortlist")
    give the lean rows' translations, hence their BLEU; the CTranslate2 "+vmap" rows restrict
    CTranslate2's output (the shortlist changes it, and a sentence decoded alone gets only its
    candidates) and greedy gives the lean "+shortlist" row's translations (the same
    candidates; one near-tie may flip, as without a map).

    Beam search need not agree here: the tiny models never end a sentence, and at the maximum
    length fairseq scores the </s> it forces while CTranslate2 stops without one, so two
    hypotheses of close scores (two repeated candidates) may swap."""
    pytest.importorskip("onnxruntime")
    out, _, _ = tiny_run
    data = out / "data"
    src_dict, tgt_dict, short = restrictive_shortlist(data / "data-bin", tmp_path / "shortlist.pt")
    bench = tmp_path / "bench"
    n_test = 6
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "benchmark.py"),
            "--data",
            str(data / "data-bin"),
            "--spm",
            str(data / "spm" / "spm.model"),
            "--src",
            str(data / "spm" / "test.en"),
            "--raw-src",
            str(data / "raw" / "test.en"),
            "--raw-ref",
            str(data / "raw" / "test.de"),
            "--at",
            str(out / "at" / "checkpoint_last.pt"),
            "--hrt",
            str(out / "hrt" / "checkpoint_last.pt"),
            "--at-beams",
            "1,3",
            "--hrt-beams",
            "1/1",
            "--engines",
            "lean,onnxruntime",
            "--int8",
            "no",
            "--hrt-options",
            "refine20:hrt_refine_fraction=0.2",
            "--shortlist",
            str(tmp_path / "shortlist.pt"),
            "--max-sentences",
            str(n_test),
            "--bs1-sentences",
            "2",
            "--batch-sizes",
            "1,3",
            "--runs",
            "1",
            "--max-len-b",
            "12",
            "--cpu",
            "--out-dir",
            str(bench),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES="", FAIRSEQ_HRT_ONNX_CACHE=str(tmp_path / "onnx-cache")),
    )
    report = json.loads((bench / "report.json").read_text())
    lean_rows = ["AT greedy", "AT beam 3", "HRT AT-mode b=1", "HRT k=2 b_at=1 b_nat=1"]

    def engine_rows(name):
        return [name, name + " (onnxruntime)", name + " +shortlist", name + " (onnxruntime) +shortlist"]

    ct2_rows = (
        ["CTranslate2 AT greedy", "CTranslate2 AT greedy +vmap", "CTranslate2 AT beam 3", "CTranslate2 AT beam 3 +vmap"]
        if HAVE_CT2
        else []
    )
    refine = "HRT k=2 b_at=1 b_nat=1 refine20"
    assert [s["name"] for s in report["systems"]] == (
        engine_rows("AT greedy")
        + engine_rows("AT beam 3")
        + ct2_rows
        + engine_rows("HRT AT-mode b=1")
        + engine_rows("HRT k=2 b_at=1 b_nat=1")
        + [refine, refine + " +shortlist"]
    )
    # ONNX Runtime has no stage-II options: its rows of them are left out, and the report says why
    refused = [sk for sk in report["skipped"] if sk.get("system")]
    assert [sk["system"] for sk in refused] == [refine + " (onnxruntime)", refine + " (onnxruntime) +shortlist"]
    assert all("--hrt-refine-fraction" in sk["reason"] for sk in refused)
    assert f"| {refine} (onnxruntime): skipped |" in (bench / "report.md").read_text()
    bleu = {s["name"]: s["bleu"] for s in report["systems"]}

    def hyps(name):
        lines = (bench / "hyps" / f"{benchmark.slug(name)}.txt").read_text().splitlines()
        assert len(lines) == n_test
        return lines

    for name in lean_rows:
        for suffix in ("", " +shortlist"):  # ONNX Runtime decodes as the lean engine does, token for token
            assert hyps(name + " (onnxruntime)" + suffix) == hyps(name + suffix), name + suffix
            assert bleu[name + " (onnxruntime)" + suffix] == bleu[name + suffix]
    for name in ("AT greedy", "AT beam 3"):
        assert hyps(name + " +shortlist") != hyps(name)  # the shortlist restricts the output
    if not HAVE_CT2:
        return
    vmap = (bench / "ctranslate2-at" / "vmap.txt").read_text().splitlines()
    assert vmap[0].startswith("\t") and len(vmap) > 1
    greedy = hyps("CTranslate2 AT greedy +vmap")
    assert sum(a == b for a, b in zip(hyps("AT greedy +shortlist"), greedy)) >= n_test - 1
    for ct2_name in ("CTranslate2 AT greedy", "CTranslate2 AT beam 3"):
        assert hyps(ct2_name + " +vmap") != hyps(ct2_name), ct2_name

    import ctranslate2  # noqa: PLC0415 - optional: CTranslate2

    translator = ctranslate2.Translator(str(bench / "ctranslate2-at"), device="cpu", intra_threads=1)
    produced = 0
    for line in (data / "spm" / "test.en").read_text().splitlines()[:3]:
        tokens = src_dict.encode_line(line, add_if_not_exist=False).long()  # with </s>, as fairseq reads it
        allowed = {tgt_dict[i] for i in short.candidates(tokens.unsqueeze(0), src_dict.pad()).tolist()}
        pieces = [p if p in src_dict.indices else "<unk>" for p in line.split()]
        output = translator.translate_batch([pieces], beam_size=1, max_decoding_length=12, use_vmap=True)[0].hypotheses[
            0
        ]
        assert set(output) <= allowed
        produced += len(output)
    assert produced  # not an empty output alone


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
