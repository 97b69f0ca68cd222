"""The converged study's targets, read from its one benchmark run and its bounds (issue: HRT
where its claim should hold). Pure functions of ``benchmark/report.json`` and of each HRT
model's ``hrt_bound.json``, so the verdicts come from the measurements and nothing else:

* **quality**: HRT k = 2 (b_at = b_nat = 1) within ``QUALITY_MARGIN`` BLEU of the AT student of
  the same decoder depth, seed and data, seed means over the seeds that have both, per row
  variant (engine, precision, shortlist); chrF beside it, since a close BLEU can hide a worse
  translation; given the rows' test outputs, the gap's 95 % paired-bootstrap interval over the
  test sentences (the test set's own noise, of the order of the margin) and whether it lies
  wholly above or below the margin;
* **CTranslate2 at batch 1**: no CTranslate2 AT row of the run has as high a BLEU and as high a
  speed as HRT k = 2 (seed means), float against float and int8 against int8;
* **the bound at batch 1**: each HRT model delivers at least ``BOUND_SHARE`` of its
  fixed-length bound (``hrt_bound.py``, ONNX Runtime, against its AT student);
* **batch 128**: HRT k = 2 runs at least ``BATCH128_RATIO`` x its AT student's greedy speed
  (seed mean of the per-seed ratios), per row variant.

A model is named by its checkpoint's folder (``at_d2_s1``, ``hrt_d1_s2``, ...). The HRT model
fine-tuned from the teacher (``hrt_d2_s1_from_teacher``) answers another question (which start)
and is left out of the seed means.
"""

import re
from pathlib import PurePosixPath
from statistics import mean
from typing import Dict, Iterator, List, Optional, Tuple

from fairseq_hrt.scoring.metrics import mean_paired_bleu_difference

QUALITY_MARGIN = 0.3
BOUND_SHARE = 0.9
BATCH128_RATIO = 0.95

_SEEDED = re.compile(r"^(at|hrt)_d(\d+)_s(\d+)$")


def model_of(system: dict) -> str:
    """The study's name of a row's model: its checkpoint's folder."""
    return PurePosixPath(system["checkpoint"].replace("\\", "/")).parent.name


def variant_of(system: dict) -> Tuple[str, str, bool]:
    """``(engine, precision, shortlist)`` of a row: what must match for two rows to be compared."""
    d = system["decoding"]
    if system["family"] == "CT2":
        return "ctranslate2", "int8" if d.get("compute_type") == "int8" else "float", bool(d.get("shortlist"))
    if d.get("compile"):
        return f"{d.get('decoder_engine')} compiled", "float", bool(d.get("shortlist"))
    return (
        d.get("decoder_engine") or "lean",
        "int8" if d.get("quantize") == "int8" else "float",
        bool(d.get("shortlist")),
    )


def variant_label(variant: Tuple[str, str, bool]) -> str:
    engine, precision, shortlist = variant
    return f"{engine}, {precision}" + (", shortlist" if shortlist else "")


def _is_at_greedy(system: dict) -> bool:
    return system["family"] == "AT" and system["decoding"].get("beam") == 1


def _is_hrt_k2(system: dict) -> bool:
    d = system["decoding"]
    return (
        system["family"] == "HRT"
        and int(d.get("decode_chunk_size", 1)) == 2
        and d.get("beam") == 1
        and d.get("b_nat", 1) == 1
        and set(d) <= {"decode_chunk_size", "beam", "b_nat", "decoder_engine", "quantize", "shortlist", "compile"}
    )


def seeded_rows(report: dict) -> Dict[Tuple[str, int, Tuple[str, str, bool]], Dict[int, dict]]:
    """``{(kind, depth, variant): {seed: row}}`` of the AT students' greedy rows and the HRT
    students' k = 2 rows (b_at = b_nat = 1), kind ``"at"`` or ``"hrt"``."""
    out: Dict[Tuple[str, int, Tuple[str, str, bool]], Dict[int, dict]] = {}
    for s in report["systems"]:
        m = _SEEDED.match(model_of(s))
        if not m or not (_is_at_greedy(s) if m.group(1) == "at" else _is_hrt_k2(s)):
            continue
        key = (m.group(1), int(m.group(2)), variant_of(s))
        out.setdefault(key, {})[int(m.group(3))] = s
    return out


def hrt_groups(report: dict) -> Iterator[Tuple[int, Tuple[str, str, bool], Dict[int, dict], Dict[int, dict]]]:
    """``(depth, variant, {seed: HRT k = 2 row}, {seed: AT student row})`` per decoder depth
    (deepest first) and row variant that has HRT rows; the AT side may lack seeds, or be empty."""
    rows = seeded_rows(report)
    for (kind, depth, variant), hrt in sorted(rows.items(), key=lambda kv: (-kv[0][1], kv[0][2])):
        if kind == "hrt":
            yield depth, variant, hrt, rows.get(("at", depth, variant), {})


def _speed(system: dict, batch: str) -> Optional[float]:
    v = system.get("speed", {}).get(batch)
    return v["words_per_second"] if v else None


def margin_side(ci95: List[float], margin: float = QUALITY_MARGIN) -> str:
    """Where a gap's interval lies against ``-margin``: ``"above"`` (within the margin even at
    its low end), ``"below"`` (beyond it even at its high end) or ``"straddles"`` (this test set
    cannot tell)."""
    low, high = ci95
    if low >= -margin - 1e-9:
        return "above"
    return "below" if high < -margin - 1e-9 else "straddles"


def quality_targets(
    report: dict, texts: Optional[Dict[str, List[str]]] = None, refs: Optional[List[str]] = None
) -> List[dict]:
    """Per decoder depth and row variant: HRT k = 2 against the AT student, seed means; with
    ``texts`` (row name -> its test outputs) and ``refs``, the seed-mean gap's paired-bootstrap
    interval (``gap_ci95``) and its side of the margin."""
    out = []
    for depth, variant, hrt, at in hrt_groups(report):
        seeds = sorted(set(hrt) & set(at))
        if not seeds:
            continue
        hrt_bleu, at_bleu = [hrt[s]["bleu"] for s in seeds], [at[s]["bleu"] for s in seeds]
        hrt_chrf, at_chrf = [hrt[s]["chrf"] for s in seeds], [at[s]["chrf"] for s in seeds]
        gap = mean(hrt_bleu) - mean(at_bleu)
        out.append(
            {
                "depth": depth,
                "variant": variant_label(variant),
                "seeds": seeds,
                "hrt_bleu": hrt_bleu,
                "at_bleu": at_bleu,
                "hrt_mean": round(mean(hrt_bleu), 2),
                "at_mean": round(mean(at_bleu), 2),
                "gap": round(gap, 2),
                "chrf_gap": round(mean(hrt_chrf) - mean(at_chrf), 2),
                "met": gap >= -QUALITY_MARGIN - 1e-9,
            }
        )
        rows = [(hrt[s]["name"], at[s]["name"]) for s in seeds]
        if texts is not None and refs is not None and all(a in texts and b in texts for a, b in rows):
            paired = mean_paired_bleu_difference([(texts[a], texts[b]) for a, b in rows], refs)
            out[-1]["gap_ci95"] = [round(x, 2) for x in paired["ci95"]]
            out[-1]["ci_side"] = margin_side(paired["ci95"])
    return out


def ctranslate2_targets(report: dict, batch: str = "1") -> List[dict]:
    """Per depth and variant: the CTranslate2 AT rows of the same precision that dominate HRT
    k = 2's seed mean at ``batch`` (as high a BLEU and at least as fast)."""
    ct2 = [s for s in report["systems"] if s["family"] == "CT2" and _speed(s, batch) is not None]
    out = []
    for depth, variant, hrt, _ in hrt_groups(report):
        speeds = [_speed(s, batch) for s in hrt.values()]
        if None in speeds:
            continue
        bleu, wps = mean(s["bleu"] for s in hrt.values()), mean(speeds)
        precision = variant[1]
        dominating = [
            s["name"] for s in ct2 if variant_of(s)[1] == precision and s["bleu"] >= bleu and _speed(s, batch) >= wps
        ]
        out.append(
            {
                "depth": depth,
                "variant": variant_label(variant),
                "seeds": sorted(hrt),
                "hrt_bleu": round(bleu, 2),
                "hrt_words_per_second": round(wps, 1),
                "dominated_by": dominating,
                "met": not dominating,
            }
        )
    return out


def batch_ratio_targets(report: dict, batch: str = "128") -> List[dict]:
    """Per depth and variant: HRT k = 2's speed over its AT student's greedy at ``batch``, per
    seed and their mean."""
    out = []
    for depth, variant, hrt, at in hrt_groups(report):
        seeds = [s for s in sorted(set(hrt) & set(at)) if _speed(hrt[s], batch) and _speed(at[s], batch)]
        if not seeds:
            continue
        ratios = [_speed(hrt[s], batch) / _speed(at[s], batch) for s in seeds]
        out.append(
            {
                "depth": depth,
                "variant": variant_label(variant),
                "seeds": seeds,
                "ratios": [round(r, 3) for r in ratios],
                "mean": round(mean(ratios), 3),
                "met": mean(ratios) >= BATCH128_RATIO,
            }
        )
    return out


def bound_targets(bounds: Dict[str, dict], engine: str = "onnxruntime", batch: int = 1) -> List[dict]:
    """Per HRT model: the share of its fixed-length bound it delivers (``hrt_bound.json``)."""
    out = []
    for name, bound in sorted(bounds.items()):
        for row in bound.get("rows", []):
            if row.get("engine") == engine and row.get("batch") == batch and "delivered" in row:
                d = row["delivered"]
                out.append(
                    {
                        "model": name,
                        "bound": row["bound"],
                        "delivered_ratio": d["ratio"],
                        "at_from": d.get("at_from"),
                        "share_of_bound": d["share_of_bound"],
                        "met": d["share_of_bound"] >= BOUND_SHARE,
                    }
                )
    return out


def study_targets(
    report: dict,
    bounds: Dict[str, dict],
    texts: Optional[Dict[str, List[str]]] = None,
    refs: Optional[List[str]] = None,
) -> dict:
    return {
        "quality": quality_targets(report, texts, refs),
        "ctranslate2_bs1": ctranslate2_targets(report, "1"),
        "bound_bs1": bound_targets(bounds, batch=1),
        "ratio_bs128": batch_ratio_targets(report, "128"),
    }


def _yes(met: bool) -> str:
    return "met" if met else "**missed**"


def targets_markdown(targets: dict, title: str = "The targets, from the benchmark run and the bounds") -> str:
    """The verdicts as tables, each row with the numbers it was decided on."""
    lines = [
        f"### {title}",
        "",
        f"HRT k = 2 (b_at = b_nat = 1) against the AT student of its decoder depth and seed: quality within "
        f"{QUALITY_MARGIN} BLEU (seed means, test2016), no CTranslate2 row of the same precision as good and as "
        f"fast at batch 1, at least {BOUND_SHARE:.0%} of its fixed-length bound at batch 1, at least "
        f"{BATCH128_RATIO}x its AT student at batch 128. `gap, 95 %`: the paired-bootstrap interval of the "
        "seed-mean gap over the test sentences (1000 resamples), and where it lies against the margin.",
        "",
        "| decoder layers | rows | seeds | HRT k = 2 BLEU | AT student BLEU | gap | gap, 95 % | chrF gap | quality |",
        "|---:|---|---|---:|---:|---:|---|---:|---|",
    ]
    for t in targets["quality"]:
        ci = t.get("gap_ci95")
        ci_cell = f"{ci[0]:+.2f} to {ci[1]:+.2f} ({t['ci_side']} -{QUALITY_MARGIN})" if ci else "-"
        lines.append(
            f"| {t['depth']} | {t['variant']} | {', '.join(map(str, t['seeds']))} | {t['hrt_mean']:.2f} "
            f"({' / '.join(f'{b:.2f}' for b in t['hrt_bleu'])}) | {t['at_mean']:.2f} "
            f"({' / '.join(f'{b:.2f}' for b in t['at_bleu'])}) | {t['gap']:+.2f} | {ci_cell} | "
            f"{t['chrf_gap']:+.2f} | {_yes(t['met'])} |"
        )
    lines += [
        "",
        "| decoder layers | rows | HRT k = 2 BLEU | words/s at batch 1 | CTranslate2 rows as good and as fast "
        "| target |",
        "|---:|---|---:|---:|---|---|",
    ]
    for t in targets["ctranslate2_bs1"]:
        lines.append(
            f"| {t['depth']} | {t['variant']} | {t['hrt_bleu']:.2f} | {t['hrt_words_per_second']:.1f} | "
            f"{', '.join(t['dominated_by']) or 'none'} | {_yes(t['met'])} |"
        )
    if targets["bound_bs1"]:
        lines += [
            "",
            "| HRT model | bound at batch 1 | delivered (against) | share of the bound | target |",
            "|---|---:|---:|---:|---|",
        ]
        for t in targets["bound_bs1"]:
            lines.append(
                f"| {t['model']} | {t['bound']:.3f} | {t['delivered_ratio']:.3f} ({t['at_from']}) | "
                f"{t['share_of_bound']:.0%} | {_yes(t['met'])} |"
            )
    lines += [
        "",
        "| decoder layers | rows | HRT k = 2 / AT student at batch 128, per seed | mean | target |",
        "|---:|---|---|---:|---|",
    ]
    for t in targets["ratio_bs128"]:
        lines.append(
            f"| {t['depth']} | {t['variant']} | {' / '.join(f'{r:.3f}' for r in t['ratios'])} | {t['mean']:.3f} | "
            f"{_yes(t['met'])} |"
        )
    return "\n".join(lines) + "\n"
