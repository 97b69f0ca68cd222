"""The report of ``benchmarks/paper_shapes.py``: its rows in the benchmark's schema (words/s per
bucket and overall, ratios to the fastest AT greedy and to each HRT row's own AT with its
bound), ``report.md``'s tables and the picture of the speed-up by source length."""

import logging
from typing import Dict, List, Optional

# what each shape's block keeps of the run that measured it (--append puts runs together)
PER_SHAPE_META = ("date", "sentences_per_bucket", "runs", "bound_runs", "bound_batches")


def row_speed(row: dict, batches_of, shares: Dict[str, int], words_of) -> dict:
    """A row's words/s per batch size: per bucket, and overall at newstest2014's bucket shares."""
    speed = {}
    for bsz, per_bucket in row["speed"].items():
        buckets = {}
        time_full, words_full = 0.0, 0.0
        for b, m in per_bucket.items():
            words = words_of[int(bsz)][b]
            n = sum(len(x.tokens) for x in batches_of[int(bsz)][b])
            buckets[b] = {
                "words_per_second": round(words / m["seconds"], 1),
                "seconds": m["seconds"],
                "run_seconds": m["run_seconds"],
                "sentences": n,
                "words": words,
                "positions": sum(m["positions"]),
            }
            time_full += shares[b] * m["seconds"] / n
            words_full += shares[b] * words / n
        speed[bsz] = {"words_per_second": round(words_full / time_full, 1), "buckets": buckets}
    return speed


def own_at(systems: List[dict], s: dict, bsz: str) -> Optional[dict]:
    """The AT row of HRT row ``s``'s engine and quantization at batch ``bsz``."""
    return next(
        (
            o
            for o in systems
            if o["family"] == "AT"
            and o["decoding"]["engine"] == s["decoding"]["engine"]
            and o["decoding"]["quantize"] == s["decoding"]["quantize"]
            and bsz in o["speed"]
        ),
        None,
    )


def add_ratios(systems: List[dict], measured: dict, bsz: str) -> None:
    """Each row's ratios at batch ``bsz`` to the fastest AT greedy row and, for HRT, to its own
    engine's AT (with the fixed-length bound per bucket)."""
    at = [s for s in systems if s["family"] in ("AT", "CTranslate2") and bsz in s["speed"]]
    if not at:
        return
    fastest = max(at, key=lambda s: s["speed"][bsz]["words_per_second"])
    for s in systems:
        if bsz not in s["speed"]:
            continue
        sp = s["speed"][bsz]
        sp["baseline"] = fastest["name"]
        sp["ratio_vs_baseline"] = round(sp["words_per_second"] / fastest["speed"][bsz]["words_per_second"], 3)
        for b, cell in sp["buckets"].items():
            base = fastest["speed"][bsz]["buckets"].get(b)
            if base:
                cell["ratio_vs_baseline"] = round(cell["words_per_second"] / base["words_per_second"], 3)
        own = own_at(systems, s, bsz) if s["family"] == "HRT" else None
        if own is None:
            continue
        sp["own_at"] = own["name"]
        sp["ratio_vs_own_at"] = round(sp["words_per_second"] / own["speed"][bsz]["words_per_second"], 3)
        bound = measured.get("bounds", {}).get(bsz, {}).get(s["name"], {})
        for b, cell in sp["buckets"].items():
            cell["ratio_vs_own_at"] = round(
                cell["words_per_second"] / own["speed"][bsz]["buckets"][b]["words_per_second"], 3
            )
            if b in bound:
                cell["bound"] = bound[b]["bound"]
                cell["share_of_bound"] = round(cell["ratio_vs_own_at"] / bound[b]["bound"], 3)


def summarize(shape: str, measured: dict, batches_of, shares: Dict[str, int], words_of) -> List[dict]:
    """The benchmark's rows (``report.json``'s ``systems``) of one shape: words/s per bucket
    and overall, ratios to the fastest AT greedy row and, for HRT, to its engine's AT."""
    systems = []
    for name, row in measured["rows"].items():
        systems.append(
            {
                "name": name,
                "family": row["family"],
                "shape": shape,
                "decoding": {
                    "beam": 1,
                    "engine": row["engine"],
                    "quantize": row["quantize"],
                    **({"chunk_size": row["k"], "b_at": 1, "b_nat": 1} if row["family"] == "HRT" else {}),
                },
                "model": measured["models"]["HRT" if row["family"] == "HRT" else "AT"],
                "speed": row_speed(row, batches_of, shares, words_of),
                "positions_by_bucket": {
                    bsz: {b: m["positions"] for b, m in per_bucket.items()} for bsz, per_bucket in row["speed"].items()
                },
            }
        )
    for bsz in {b for s in systems for b in s["speed"]}:
        add_ratios(systems, measured, bsz)
    return systems


def same_positions(systems: List[dict]) -> Dict[str, List[str]]:
    """``{batch size: rows whose decoder positions differ from the first row's}`` (empty lists: equal work)."""
    out = {}
    for bsz in sorted({b for s in systems for b in s["positions_by_bucket"]}, key=int):
        with_bsz = [s for s in systems if bsz in s["positions_by_bucket"]]
        first = with_bsz[0]["positions_by_bucket"][bsz]
        out[bsz] = [s["name"] for s in with_bsz if s["positions_by_bucket"][bsz] != first]
    return out


def shape_notes(shape: str, block: dict, meta: dict) -> List[str]:
    """A shape's heading and notes: when and how it was measured, what a step reads, what was
    left out, whether every row did the same work."""
    w = block["weights_per_step_mb"]
    when = block.get("measured") or {k: meta.get(k) for k in PER_SHAPE_META}
    out = [
        f"## {block['title']}",
        "",
        f"Measured {when['date']}: sentences per bucket (batch:sentences) {when['sentences_per_bucket']}, "
        f"the fastest of {when['runs']} passes; bound at batch {', '.join(block['bounds']) or '(none)'} "
        f"(the fastest of {when['bound_runs']}).",
        "",
        f"Weights a decoder step reads: AT {w['AT']['float32']} MB float32 / {w['AT']['int8']} MB int8, "
        f"HRT {w['HRT']['float32']} / {w['HRT']['int8']} MB.",
    ]
    for bsz, empty in block["empty_buckets"].items():
        if empty:
            out.append(f"- batch {bsz}: no sentence in bucket {', '.join(empty)} (left out of its tables and overall)")
    for name, why in block["errors"].items():
        out.append(f"- not measured: **{name}**: {why}")
    ct2 = block.get("ctranslate2") or {}
    if ct2.get("isa"):
        out.append(f"- CTranslate2 {ct2.get('version', '')} on this machine: {'; '.join(ct2['isa'])}")
    differ = block["positions_differ"]
    out.append(
        "- equal work: "
        + (
            "every row decoded the same positions at every batch size."
            if not any(differ.values())
            else "; ".join(f"batch {b}: {', '.join(v)} decoded other positions" for b, v in differ.items() if v)
        )
    )
    return out


def batch_tables(rows: List[dict], bsz: str) -> List[str]:
    """The tables of one batch size: every row's words/s per bucket, and HRT's against its own AT."""
    sample = rows[0]["speed"][bsz]["buckets"]
    head = " | ".join(f"{b} ({sample[b]['sentences']})" for b in sample)
    out = [
        "",
        f"### batch {bsz} (words/s, x the fastest AT greedy: {rows[0]['speed'][bsz]['baseline']})",
        "",
        f"| row | {head} | overall | x fastest AT | x own AT |",
        "|---|" + "---:|" * (len(sample) + 3),
    ]
    for s in sorted(rows, key=lambda s: -s["speed"][bsz]["words_per_second"]):
        sp = s["speed"][bsz]
        cells = " | ".join(
            f"{c['words_per_second']:.0f} ({c.get('ratio_vs_baseline', 0):.2f}x)" for c in sp["buckets"].values()
        )
        own = f"{sp['ratio_vs_own_at']:.2f}x" if "ratio_vs_own_at" in sp else ""
        out.append(f"| {s['name']} | {cells} | {sp['words_per_second']:.0f} | {sp['ratio_vs_baseline']:.2f}x | {own} |")
    hrt_rows = [s for s in rows if s["family"] == "HRT" and "ratio_vs_own_at" in s["speed"][bsz]]
    if hrt_rows:
        out += [
            "",
            "HRT against its own engine's AT, per bucket: delivered / bound (share of the bound)",
            "",
            f"| row | {' | '.join(sample)} |",
            "|---|" + "---:|" * len(sample),
        ]
        for s in hrt_rows:
            cells = []
            for c in s["speed"][bsz]["buckets"].values():
                cell = f"{c['ratio_vs_own_at']:.2f}x"
                if "bound" in c:
                    cell += f" / {c['bound']:.2f}x ({c['share_of_bound']:.0%})"
                cells.append(cell)
            out.append(f"| {s['name']} | {' | '.join(cells)} |")
    return out


def split_table(per_row: Dict[str, dict], bsz: str) -> List[str]:
    """The fixed-length split of every HRT row at batch ``bsz`` (ms per batch, each part timed
    with the device synchronised): where the bound comes from."""
    if not per_row:
        return []
    out = [
        "",
        f"### fixed-length split, batch {bsz} (ms per batch at the bucket's batches' mean lengths; bound = "
        "(encoder + AT steps) / (encoder + Skip-AT steps + stage II))",
        "",
        "| row | bucket | source / target | encoder | AT steps | Skip-AT steps | stage II | bound |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, buckets in per_row.items():
        for b, c in buckets.items():
            out.append(
                f"| {name} | {b} | {c['src_len']} / {c['tgt_len']} | {c['encoder_ms']:.2f} | {c['at_steps_ms']:.2f} "
                f"| {c['skip_at_steps_ms']:.2f} | {c['stage2_ms']:.2f} | {c['bound']:.2f}x |"
            )
    return out


def report_text(report: dict) -> str:
    meta = report["meta"]
    isa = ", ".join(meta.get("cpu_isa") or []) or "none of the listed"
    out = [
        "# HRT against AT at the papers' shapes, newstest2014 lengths, equal output length "
        f"({meta.get('dtype', 'float32')}, {meta['threads']} thread(s))",
        "",
        f"{meta['device']}; CPU instruction sets: {isa}. torch {meta['torch']}, onnxruntime "
        f"{meta['onnxruntime']}, ctranslate2 {meta['ctranslate2']}; {meta['date']}. Random weights, vocabulary "
        f"{meta['vocab']}; sources: "
        f"{meta['sentences']} lines of `{meta['src']}` cut by a {meta['spm_vocab']}-piece BPE trained on "
        f"`{meta['spm_train']}` ({meta['mean_source_tokens']} tokens per sentence on average, "
        f"{meta['tokens_per_word']} per word). Every sentence decodes L + 1 positions, L = 1.1 x its source "
        "tokens rounded up to 4q + 3 (the longest sentence's in a batch). Source words/s, the fastest of "
        "each shape's passes, round-robin over rows and buckets, CTranslate2's passes among ours (its child "
        "process times each pass itself); overall = newstest2014's bucket shares "
        f"({', '.join(f'{b}: {n}' for b, n in meta['bucket_shares'].items())} sentences).",
        "",
    ]
    for shape, why in meta.get("not_measured", {}).items():
        out += [f"- shape **{shape}** not measured: {why}", ""]
    for shape in report["shapes"]:
        systems = [s for s in report["systems"] if s["shape"] == shape]
        out += shape_notes(shape, report["shapes"][shape], meta)
        for bsz in sorted({b for s in systems for b in s["speed"]}, key=int):
            out += batch_tables([s for s in systems if bsz in s["speed"]], bsz)
        for bsz, per_row in report["shapes"][shape]["bounds"].items():
            out += split_table(per_row, bsz)
        out.append("")
    return "\n".join(out) + "\n"


def plot(report: dict, path: str) -> Optional[str]:
    """HRT k = 2's speed-up over its own engine's AT against source length, per shape and
    engine (batch 1), with the HRT paper's Figure 5 (CPU)."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: the picture

        matplotlib.use("Agg")
        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font search logs at DEBUG
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as e:
        return f"no picture: {e}"
    names = list(report["meta"]["bucket_shares"])
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = {"onnxruntime": "-", "lean": ":"}
    for n, shape in enumerate(report["shapes"]):
        color = f"C{n}"
        for s in report["systems"]:
            speed = s["speed"].get("1", {})
            if s["shape"] != shape or s["decoding"].get("chunk_size") != 2 or "ratio_vs_own_at" not in speed:
                continue
            cells = speed["buckets"]
            xs = [i for i, b in enumerate(names) if b in cells]
            int8 = s["decoding"]["quantize"] == "int8"
            ax.plot(
                xs,
                [cells[names[i]]["ratio_vs_own_at"] for i in xs],
                marker="x" if int8 else "o",
                linestyle="--" if int8 else styles.get(s["decoding"]["engine"], "-"),
                color=color,
                label=f"{shape}, {s['decoding']['engine']}{' int8' if int8 else ''}",
            )
    ax.plot([0, 4], [1.6, 2.0], "k*", markersize=12, label="HRT paper, Fig. 5 (CPU, batch 32, b_at 5)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_xlabel("source tokens (newstest2014)")
    ax.set_ylabel("HRT k = 2 / AT greedy, same engine (batch 1)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
