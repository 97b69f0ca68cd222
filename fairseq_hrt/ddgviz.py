"""DDGviz: the decoding dependency graph of Jacobi decoding (Santilli et al. 2023, sec. 3.5).

For each sentence it decodes with ``--method`` (``pj`` by default, as the paper; ``pgj``,
``hgj``, ``hrt-spec``) and draws, pass by pass (vertical axis) and token by token
(horizontal axis), which tokens of the final translation (= greedy's) were already right,
which became *final* in that pass, with the model's probability of each, and an arrow from
the token each one waited for: a token that became right in pass ``t`` depends on the
closest token to its left that became right in pass ``t - 1`` (tokens right from pass 1
depend on the source only). Tokens right in the same pass were decoded in parallel. With
``hrt-spec`` the rows are its verifying (AT-mode) passes; each follows a drafting pass.

Output per sentence: ``ddg-<id>.png`` (matplotlib) and ``ddg-<id>.html`` (a standalone page,
inline SVG and script, no network), plus ``ddg.json`` with the graphs. Examples::

    python -m fairseq_hrt.ddgviz DATA_BIN --path CKPT --source-lang en --target-lang de \\
        --spm spm.model --sentence "A man rides a bike." --out-dir ddg/
    python -m fairseq_hrt.ddgviz DATA_BIN --path CKPT --source-lang en --target-lang de \\
        --gen-subset test --ids 0,5,7 --method pgj --jacobi-block-size 3 --out-dir ddg/
"""

import argparse
import html
import json
import logging
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
import sentencepiece as spm
import torch
from fairseq import checkpoint_utils, utils

import fairseq_hrt  # noqa: F401
from fairseq_hrt.cli_logging import RefusedOptions, install_refusal_hook, setup_logging
from fairseq_hrt.generation.options import DecodingOptions
from fairseq_hrt.models.kinds import family_of

logger = logging.getLogger("fairseq_hrt.ddgviz")

CELL_COLORS = {"final": "#1b7837", "right": "#a6dba0", "wrong": "#f4a582", "idle": "#ffffff"}


# ------------------------------------------------------------------------- pure part


def dependency_graph(records, final_tokens: Sequence[int]) -> Dict[str, list]:
    """The DDG of one sentence from its decoding passes.

    ``records``: the sentence's :class:`~fairseq_hrt.generation.jacobi.PassRecord` in pass
    order; ``final_tokens``: its output (positions ``1..n``). Returns, per output position
    ``p`` (index ``p - 1``): ``final_at`` (pass in which it became final), ``right_from``
    (first pass from which every prediction at ``p`` was the final token), ``parent``
    (position it depended on, 0 = the source) and per pass ``state`` (``final`` / ``right``
    / ``wrong`` / ``idle``) and ``prob`` (the model's probability of its prediction, or None).
    """
    n = len(final_tokens)
    passes = len(records)
    state = [["idle"] * n for _ in range(passes)]
    prob: List[List[Optional[float]]] = [[None] * n for _ in range(passes)]
    predicted: List[List[Optional[int]]] = [[None] * n for _ in range(passes)]
    final_at = [None] * n
    for t, rec in enumerate(records, start=1):
        for pos, tok, pr in zip(rec.positions, rec.tokens, rec.probs):
            if 1 <= pos <= n:
                predicted[t - 1][pos - 1] = tok
                prob[t - 1][pos - 1] = pr
                state[t - 1][pos - 1] = "right" if tok == final_tokens[pos - 1] else "wrong"
        for pos in range(rec.final_before, rec.final_before + rec.accepted):
            if 1 <= pos <= n and final_at[pos - 1] is None:
                final_at[pos - 1] = t
                state[t - 1][pos - 1] = "final"
    right_from = []
    for i in range(n):
        seen = [t for t in range(passes) if predicted[t][i] is not None]
        wrong = [t for t in seen if predicted[t][i] != final_tokens[i]]
        right_from.append((wrong[-1] + 2) if wrong else (seen[0] + 1 if seen else final_at[i]))
    parent = []
    for i in range(n):
        left = [j for j in range(i) if right_from[j] == right_from[i] - 1]
        parent.append(left[-1] + 1 if left else 0)
    return {"final_at": final_at, "right_from": right_from, "parent": parent, "state": state, "prob": prob}


def graph_for_page(graph: dict, words: List[str], source: str, sid, method: str) -> dict:
    return dict(graph, words=words, source=source, id=sid, method=method, passes=len(graph["state"]))


# ------------------------------------------------------------------------- drawing


# beyond these sizes a PNG cannot show every cell legibly: cells become pixels of one image,
# the per-cell probabilities and cell borders are left out (the HTML page keeps them all)
MAX_LABELLED_CELLS = 2000
MAX_FIGURE_INCHES = (40, 30)


def draw_png(g: dict, path: str):
    import matplotlib  # noqa: PLC0415 - optional: matplotlib, for plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional: matplotlib, for plots
    from matplotlib.colors import to_rgb  # noqa: PLC0415 - optional: matplotlib, for plots
    from matplotlib.patches import FancyArrowPatch  # noqa: PLC0415 - optional: matplotlib, for plots

    n, passes = len(g["words"]), g["passes"]
    width = min(max(6, 0.9 * n + 1.5), MAX_FIGURE_INCHES[0])
    height = min(max(3, 0.6 * passes + 2), MAX_FIGURE_INCHES[1])
    fig, ax = plt.subplots(figsize=(width, height))
    # one image for the grid: a patch per cell costs minutes for a runaway 200-token output
    cells = np.array([[to_rgb(CELL_COLORS[g["state"][t][i]]) for i in range(n)] for t in range(passes)])
    ax.imshow(cells.reshape(passes, n, 3), extent=(0, n, passes, 0), interpolation="nearest", aspect="auto")
    labelled = n * passes <= MAX_LABELLED_CELLS
    if labelled:
        ax.hlines(range(passes + 1), 0, n, colors="#999999", lw=0.5)
        ax.vlines(range(n + 1), 0, passes, colors="#999999", lw=0.5)
        for t in range(passes):
            for i in range(n):
                st = g["state"][t][i]
                if g["prob"][t][i] is not None and st != "idle":
                    ax.text(
                        i + 0.5,
                        t + 0.5,
                        f"{g['prob'][t][i]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if st == "final" else "black",
                    )
    for i, par in enumerate(g["parent"]):
        if par > 0:
            start = (par - 1 + 0.5, g["right_from"][par - 1] - 1 + 0.5)
            end = (i + 0.5, g["right_from"][i] - 1 + 0.5)
            ax.add_patch(
                FancyArrowPatch(
                    start,
                    end,
                    arrowstyle="-|>",
                    mutation_scale=8,
                    color="#2166ac",
                    connectionstyle="arc3,rad=-0.2",
                    lw=1,
                )
            )
    ax.set_xlim(0, n)
    ax.set_ylim(passes, 0)
    x_every = max(1, -(-n // 60))  # at most 60 tick labels per axis
    y_every = max(1, -(-passes // 60))
    ax.set_xticks([i + 0.5 for i in range(0, n, x_every)])
    ax.set_xticklabels(g["words"][::x_every], rotation=45, ha="right", fontsize=8)
    ax.set_yticks([t + 0.5 for t in range(0, passes, y_every)])
    ax.set_yticklabels([str(t + 1) for t in range(0, passes, y_every)], fontsize=8)
    ax.set_ylabel("decoder pass")
    note = "" if labelled else " (too many cells for probabilities: see the HTML page)"
    ax.set_title(
        f"DDG ({g['method']}), sentence {g['id']}: {len(g['words'])} tokens in {passes} passes\n"
        f"dark: final in that pass, light green: already right, orange: wrong{note}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def svg_of(g: dict) -> str:
    """The DDG as an SVG drawing: a cell per pass and token, an arrow from each token to the
    one it waited for, the words below."""
    n, passes = len(g["words"]), g["passes"]
    cw, ch, left, top = 64, 30, 60, 30
    width, height = left + n * cw + 20, top + passes * ch + 110
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" id="ddg">',
        '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#2166ac"/></marker></defs>',
    ]
    for t in range(passes):
        parts.append(
            f'<text x="{left - 8}" y="{top + t * ch + ch / 2 + 4}" text-anchor="end" font-size="11">{t + 1}</text>'
        )
        for i in range(n):
            st = g["state"][t][i]
            pr = g["prob"][t][i]
            title = f"pass {t + 1}, token {i + 1} ({g['words'][i]}): {st}" + (f", p={pr:.3f}" if pr is not None else "")
            parts.append(
                f'<rect class="cell {st}" data-token="{i + 1}" x="{left + i * cw}" y="{top + t * ch}" width="{cw}" '
                f'height="{ch}" fill="{CELL_COLORS[st]}" stroke="#999"><title>{html.escape(title)}</title></rect>'
            )
            if pr is not None and st != "idle":
                color = "white" if st == "final" else "black"
                parts.append(
                    f'<text x="{left + i * cw + cw / 2}" y="{top + t * ch + ch / 2 + 4}" text-anchor="middle" '
                    f'font-size="10" fill="{color}" pointer-events="none">{pr:.2f}</text>'
                )
    for i, par in enumerate(g["parent"]):
        if par > 0:
            x1, y1 = left + (par - 1) * cw + cw / 2, top + (g["right_from"][par - 1] - 1) * ch + ch / 2
            x2, y2 = left + i * cw + cw / 2, top + (g["right_from"][i] - 1) * ch + ch / 2
            parts.append(
                f'<path class="edge" data-from="{par}" data-to="{i + 1}" '
                f'd="M{x1},{y1} Q{(x1 + x2) / 2},{min(y1, y2) - 12} '
                f'{x2},{y2}" stroke="#2166ac" fill="none" marker-end="url(#arrow)"/>'
            )
    for i, w in enumerate(g["words"]):
        x, y = left + i * cw + cw / 2, top + passes * ch + 12
        parts.append(
            f'<text class="word" data-token="{i + 1}" x="{x}" y="{y}" font-size="11" '
            f'transform="rotate(40 {x} {y})">{html.escape(w)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def html_page(g: dict) -> str:
    """A standalone page: the DDG as inline SVG, a script that highlights a token's
    dependency chain on hover, no external resources."""
    n, passes = len(g["words"]), g["passes"]
    data = json.dumps({"parent": g["parent"], "words": g["words"]}).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>DDG sentence {html.escape(str(g["id"]))}</title>
<style>body{{font-family:sans-serif;margin:20px}} .edge.on{{stroke:#b2182b;stroke-width:3}}
rect.cell.on{{stroke:#b2182b;stroke-width:2}}
.legend span{{display:inline-block;width:14px;height:14px;margin:0 4px 0 12px;vertical-align:middle}}</style>
</head><body>
<h2>Decoding dependency graph ({html.escape(g["method"])}), sentence {html.escape(str(g["id"]))}</h2>
<p>Source: {html.escape(g["source"])}</p>
<p>{n} tokens in {passes} decoder passes (greedy: {n}). Rows: passes; columns: the final (= greedy) tokens.
Hover a token to see the chain of tokens it waited for.</p>
<p class="legend"><span style="background:{CELL_COLORS["final"]}"></span>became final
<span style="background:{CELL_COLORS["right"]}"></span>already right
<span style="background:{CELL_COLORS["wrong"]}"></span>wrong
<span style="border:1px solid #999"></span>not evaluated</p>
{svg_of(g)}
<p id="status"></p>
<script>
(function () {{
  var ddg = {data};
  function chain(token) {{
    var out = [];
    while (token > 0) {{ out.push(token); token = ddg.parent[token - 1]; }}
    return out;
  }}
  function highlight(token) {{
    var on = chain(token);
    document.querySelectorAll('rect.cell').forEach(function (r) {{
      r.classList.toggle('on', on.indexOf(Number(r.getAttribute('data-token'))) >= 0);
    }});
    document.querySelectorAll('path.edge').forEach(function (e) {{
      e.classList.toggle('on', on.indexOf(Number(e.getAttribute('data-to'))) >= 0);
    }});
    document.getElementById('status').textContent = 'token ' + token + ' (' + ddg.words[token - 1] + ') depends on: ' +
      (on.length > 1 ? on.slice(1).map(function (t) {{ return ddg.words[t - 1]; }}).join(' <- ') : 'the source only');
  }}
  document.querySelectorAll('[data-token]').forEach(function (el) {{
    el.addEventListener('mouseover', function () {{ highlight(Number(el.getAttribute('data-token'))); }});
  }});
  document.body.setAttribute('data-ddg-ready', String(ddg.words.length));
}})();
</script>
</body></html>
"""


# ------------------------------------------------------------------------- decoding


def trace(task, model, sample, method: str, block_size: Optional[int], max_len_b: int):
    """Decode ``sample`` with the generator of ``--decoding method`` (the task's one factory),
    every pass recorded: ``(hypotheses, records)``."""
    if method == "hrt-spec" and not family_of(model).chunk_sizes:
        raise RefusedOptions("--method hrt-spec needs an HRT model (it drafts with the non-autoregressive mode)")
    options = DecodingOptions(decoding=method, jacobi_block_size=block_size).replace(beam=1, max_len_b=max_len_b)
    gen = task.build_decoding([model], options)
    gen.trace = []  # record every pass (PassRecord)
    hypos = gen.generate([model], sample)
    return hypos, gen.trace


def build_graphs(task, model, sample, sources: List[str], method: str, block_size, max_len_b: int, spm=None):
    hypos, records = trace(task, model, sample, method, block_size, max_len_b)
    d = task.target_dictionary
    graphs = []
    for row, hypo in enumerate(hypos):
        tokens = hypo[0]["tokens"].tolist()
        graph = dependency_graph([r for r in records if r.sentence == row], tokens)
        words = [d[t] for t in tokens]
        graphs.append(graph_for_page(graph, words, sources[row], int(sample["id"][row]), method))
    return graphs


def make_sample(task, lines: List[str]):
    d = task.source_dictionary
    tokens = [d.encode_line(line, add_if_not_exist=False).long() for line in lines]
    width = max(t.numel() for t in tokens)
    src = torch.full((len(tokens), width), d.pad(), dtype=torch.long)
    for i, t in enumerate(tokens):
        src[i, width - t.numel() :] = t
    return {
        "id": torch.arange(len(tokens)),
        "net_input": {"src_tokens": src, "src_lengths": torch.tensor([t.numel() for t in tokens])},
    }


def write_outputs(graphs: List[dict], out_dir: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for g in graphs:
        png, page = os.path.join(out_dir, f"ddg-{g['id']}.png"), os.path.join(out_dir, f"ddg-{g['id']}.html")
        draw_png(g, png)
        with open(page, "w", encoding="utf-8") as f:
            f.write(html_page(g))
        written += [png, page]
    with open(os.path.join(out_dir, "ddg.json"), "w", encoding="utf-8") as f:
        json.dump(graphs, f, indent=1)
    return written


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m fairseq_hrt.ddgviz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("data", help="binarized data directory (dictionaries; --gen-subset reads from it)")
    p.add_argument("--path", required=True, help="checkpoint (AT, fairseq transformer or HRT model)")
    p.add_argument("--source-lang")
    p.add_argument("--target-lang")
    p.add_argument("--sentence", action="append", default=[], help="a source sentence (repeatable)")
    p.add_argument("--input", help="file of source sentences, one per line")
    p.add_argument("--spm", help="SentencePiece model: --sentence/--input are raw text (else: the model's pieces)")
    p.add_argument("--gen-subset", help="draw sentences of this split of DATA instead (with --ids)")
    p.add_argument("--ids", default="0", help="sentence ids of --gen-subset, comma-separated")
    p.add_argument("--method", default="pj", choices=("pj", "pgj", "hgj", "hrt-spec"))
    p.add_argument("--jacobi-block-size", type=int, help="block size of pgj/hgj/hrt-spec")
    p.add_argument("--max-len-b", type=int, default=200)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args(argv)
    if not (args.sentence or args.input or args.gen_subset):
        p.error("give sentences (--sentence / --input) or --gen-subset")
    return args


def main(argv=None):
    install_refusal_hook()  # under `python -m fairseq_hrt.ddgviz` only: a refusal is one line
    args = parse_args(argv)

    setup_logging()

    overrides = {"data": args.data}
    if args.source_lang:
        overrides.update(source_lang=args.source_lang, target_lang=args.target_lang)
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([args.path], arg_overrides=overrides)
    model = models[0].eval()
    if torch.cuda.is_available() and not args.cpu:
        model.cuda()
    if args.gen_subset:
        task.load_dataset(args.gen_subset)
        dataset = task.dataset(args.gen_subset)
        ids = [int(i) for i in args.ids.split(",") if i.strip()]
        sample = dataset.collater([dataset[i] for i in ids])
        sources = [task.source_dictionary.string(dataset[i]["source"]) for i in ids]
        sample = {"id": sample["id"], "net_input": {k: sample["net_input"][k] for k in ("src_tokens", "src_lengths")}}
    else:
        lines = list(args.sentence)
        if args.input:
            with open(args.input, encoding="utf-8") as f:
                lines += [line.rstrip("\n") for line in f if line.strip()]
        sources = lines
        if args.spm:
            sp = spm.SentencePieceProcessor(model_file=args.spm)
            lines = [" ".join(sp.encode(line, out_type=str)) for line in lines]
        sample = make_sample(task, lines)
    if next(model.parameters()).is_cuda:
        sample = utils.move_to_cuda(sample)
    graphs = build_graphs(task, model, sample, sources, args.method, args.jacobi_block_size, args.max_len_b)
    written = write_outputs(graphs, args.out_dir)
    for g in graphs:
        logger.info("sentence %s: %d tokens in %d passes (%s)", g["id"], len(g["words"]), g["passes"], args.method)
    logger.info("wrote %s", ", ".join(written))
    return graphs


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
