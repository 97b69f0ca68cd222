"""examples/multi30k/study_targets.py: the converged study's verdicts from a benchmark report."""

import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "multi30k"))

import study_targets  # noqa: E402


def row(name, family, model, decoding, bleu, bs1, bs128, chrf=None):
    return {
        "name": name,
        "family": family,
        "checkpoint": f"../{model}/checkpoint_best.pt",
        "decoding": decoding,
        "bleu": bleu,
        "chrf": bleu + 20 if chrf is None else chrf,
        "speed": {"1": {"words_per_second": bs1}, "128": {"words_per_second": bs128}},
    }


def _suffix(extra):  # row names are unique in a report, as the benchmark makes them
    return " int8" if extra.get("quantize") == "int8" else ""


def at(model, bleu, bs1, bs128, **extra):
    decoding = {"beam": 1, "decoder_engine": "lean", **extra}
    return row(f"AT[{model}] greedy{_suffix(extra)}", "AT", model, decoding, bleu, bs1, bs128)


def hrt(model, bleu, bs1, bs128, k=2, **extra):
    decoding = {"decode_chunk_size": k, "beam": 1, "b_nat": 1, "decoder_engine": "lean", **extra}
    return row(f"HRT[{model}] k={k}{_suffix(extra)}", "HRT", model, decoding, bleu, bs1, bs128)


def ct2(model, bleu, bs1, suffix="", **extra):
    return row(f"CTranslate2 AT[{model}] greedy{suffix}", "CT2", model, {"beam": 1, **extra}, bleu, bs1, 9000.0)


REPORT = {
    "systems": [
        at("at_d2_s1", 38.8, 1000.0, 8000.0),
        at("at_d2_s2", 38.8, 1000.0, 8000.0),
        at("at_d2_s1", 38.0, 1500.0, 9000.0, quantize="int8"),
        at("at_d2_s2", 38.2, 1500.0, 9000.0, quantize="int8"),
        at("teacher", 37.9, 900.0, 7000.0),
        hrt("hrt_d2_s1", 38.9, 1300.0, 7800.0),
        hrt("hrt_d2_s2", 38.3, 1200.0, 7400.0),  # mean 38.6: 0.2 under the AT mean, within 0.3
        hrt("hrt_d2_s1", 37.0, 1900.0, 9000.0, quantize="int8"),
        hrt("hrt_d2_s2", 37.2, 1900.0, 9000.0, quantize="int8"),  # mean 37.1: 1.0 under
        hrt("hrt_d2_s1", 11.0, 900.0, 7000.0, k=1),  # AT mode: not a target row
        hrt("hrt_d2_s1_from_teacher", 39.5, 1300.0, 7800.0),  # another question: not in the means
        hrt("hrt_d1_s1", 37.0, 1400.0, 8000.0),  # no AT student of depth 1 in the run
        ct2("at_d2_s1", 38.8, 1240.0),  # float: as good, but slower than HRT's mean 1250
        ct2("teacher", 38.6, 1300.0),  # float: faster, and as good as HRT's mean (38.6)
        ct2("at_d2_s1", 38.0, 2000.0, " int8", compute_type="int8"),  # int8: better and faster than HRT int8
        ct2("at_d2_s1", 38.9, 5000.0, " int8 +vmap", shortlist="s.pt", compute_type="int8"),
    ]
}


def test_quality_is_the_seed_mean_gap_to_the_at_students_per_row_variant():
    quality = study_targets.quality_targets(REPORT)
    assert [(t["depth"], t["variant"]) for t in quality] == [(2, "lean, float"), (2, "lean, int8")]
    fl, i8 = quality
    assert fl["seeds"] == [1, 2] and fl["hrt_bleu"] == [38.9, 38.3] and fl["at_bleu"] == [38.8, 38.8]
    assert (fl["hrt_mean"], fl["at_mean"], fl["gap"], fl["met"]) == (38.6, 38.8, -0.2, True)
    assert (i8["gap"], i8["met"]) == (-1.0, False)
    assert fl["chrf_gap"] == pytest.approx(-0.2)


def test_a_ctranslate2_row_of_the_same_precision_as_good_and_as_fast_misses_the_target():
    ct2_rows = {(t["depth"], t["variant"]): t for t in study_targets.ctranslate2_targets(REPORT)}
    fl, i8 = ct2_rows[2, "lean, float"], ct2_rows[2, "lean, int8"]
    assert fl["hrt_bleu"] == 38.6 and fl["hrt_words_per_second"] == 1250.0
    # the teacher's row ties HRT's BLEU and is faster; at_d2_s1's is better but slower; the int8
    # rows are another precision
    assert fl["dominated_by"] == ["CTranslate2 AT[teacher] greedy"] and not fl["met"]
    assert i8["dominated_by"] == ["CTranslate2 AT[at_d2_s1] greedy int8", "CTranslate2 AT[at_d2_s1] greedy int8 +vmap"]
    # the depth-1 HRT model has its row, though no AT student to compare its quality with: the
    # CTranslate2 rows are better but slower
    assert ct2_rows[1, "lean, float"]["hrt_bleu"] == 37.0 and ct2_rows[1, "lean, float"]["met"]


def test_batch_128_ratio_per_seed_and_the_bound_share_per_model():
    ratios = {t["variant"]: t for t in study_targets.batch_ratio_targets(REPORT)}
    assert ratios["lean, float"]["ratios"] == [0.975, 0.925] and ratios["lean, float"]["mean"] == 0.95
    assert ratios["lean, float"]["met"] and ratios["lean, int8"]["ratios"] == [1.0, 1.0]
    bound = {
        "rows": [
            {"engine": "onnxruntime", "batch": 1, "bound": 1.2, "delivered": {"ratio": 1.1, "share_of_bound": 0.917}},
            {"engine": "onnxruntime", "batch": 128, "bound": 1.0, "delivered": {"ratio": 0.9, "share_of_bound": 0.9}},
            {"engine": "lean", "batch": 1, "bound": 1.3, "delivered": {"ratio": 1.0, "share_of_bound": 0.77}},
        ]
    }
    low = {"rows": [dict(bound["rows"][0], delivered={"ratio": 1.0, "share_of_bound": 0.833, "at_from": "x"})]}
    shares = study_targets.bound_targets({"hrt_d2_s1": bound, "hrt_d2_s2": low})
    assert [(t["model"], t["share_of_bound"], t["met"]) for t in shares] == [
        ("hrt_d2_s1", 0.917, True),
        ("hrt_d2_s2", 0.833, False),
    ]


def test_the_markdown_says_met_or_missed_beside_the_numbers():
    md = study_targets.targets_markdown(study_targets.study_targets(REPORT, {}))
    assert "| 2 | lean, float | 1, 2 | 38.60 (38.90 / 38.30) | 38.80 (38.80 / 38.80) | -0.20 | - | -0.20 | met |" in md
    assert (
        "| 2 | lean, int8 | 1, 2 | 37.10 (37.00 / 37.20) | 38.10 (38.00 / 38.20) | -1.00 | - | -1.00 | **missed** |"
        in md
    )
    assert "| 2 | lean, float | 38.60 | 1250.0 | CTranslate2 AT[teacher] greedy | **missed** |" in md
    assert "| 2 | lean, float | 0.975 / 0.925 | 0.950 | met |" in md
    assert "share of the bound" not in md  # no bounds given: no table


def _sentences(n=150, seed=0, drop=0.0, of=None):
    """``n`` made-up sentences (or ``of``'s with each word dropped at rate ``drop``)."""
    rng = random.Random(seed)
    if of is None:
        return [" ".join(f"w{rng.randrange(50)}" for _ in range(rng.randint(8, 14))) for _ in range(n)]
    return [" ".join(w for w in line.split() if rng.random() >= drop) or "w0" for line in of]


def test_the_quality_gap_comes_with_its_paired_interval_given_the_rows_outputs():
    refs = _sentences()
    at_out = {s: _sentences(seed=s, drop=0.1, of=refs) for s in (1, 2)}
    texts = {f"AT[at_d2_s{s}] greedy": at_out[s] for s in (1, 2)}
    # HRT's float rows: the AT students' own outputs (no difference in any resample)
    texts.update({f"HRT[hrt_d2_s{s}] k=2": at_out[s] for s in (1, 2)})
    fl, i8 = study_targets.quality_targets(REPORT, texts, refs)
    assert (fl["gap_ci95"], fl["ci_side"]) == ([0.0, 0.0], "above")
    assert "gap_ci95" not in i8  # the int8 rows' outputs were not given
    # far worse outputs: the whole interval lies beyond the margin
    texts.update({f"HRT[hrt_d2_s{s}] k=2": _sentences(seed=9 + s, drop=0.4, of=refs) for s in (1, 2)})
    fl, _ = study_targets.quality_targets(REPORT, texts, refs)
    assert fl["ci_side"] == "below" and fl["gap_ci95"][1] < -study_targets.QUALITY_MARGIN
    md = study_targets.targets_markdown(study_targets.study_targets(REPORT, {}, texts, refs))
    low, high = fl["gap_ci95"]
    assert f"| -0.20 | {low:+.2f} to {high:+.2f} (below -0.3) | -0.20 | met |" in md


def test_a_gaps_interval_against_the_margin():
    assert study_targets.margin_side([-0.3, 0.2]) == "above"
    assert study_targets.margin_side([-0.5, -0.1]) == "straddles"
    assert study_targets.margin_side([-1.2, -0.31]) == "below"


def test_model_and_variant_of_a_row():
    r = row("x", "HRT", "hrt_d1_s2", {"decoder_engine": "onnxruntime", "quantize": "int8", "shortlist": "s"}, 1, 1, 1)
    assert study_targets.model_of(r) == "hrt_d1_s2"
    assert study_targets.variant_of(r) == ("onnxruntime", "int8", True)
    c = row("y", "CT2", "at_d1_s2", {"beam": 1, "compute_type": "int8"}, 1, 1, 1)
    assert study_targets.variant_of(c) == ("ctranslate2", "int8", False)
