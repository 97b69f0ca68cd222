"""Jacobi decoding (--decoding pj/pgj/hgj), hrt-spec and DDGviz: greedy search's output,
in at most as many decoder passes."""

import json
import os
import random
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
from fairseq import checkpoint_utils

from benchmarks import benchmark
from benchmarks.measure import FairseqRunner
from fairseq_hrt import ddgviz
from fairseq_hrt.generation import jacobi
from fairseq_hrt.generation.jacobi import ParallelGreedyGenerator, PassRecord
from fairseq_hrt.generation.strategies import DECODING_STRATEGIES, decoding_choices
from fairseq_hrt.testing.tiny_runs import run_cli
from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample, random_tiny_models
from tests.tiny_data import hyp_lines

random.seed(12)
RAGGED = [[random.randrange(0, 40) for _ in range(random.randint(0, 14))] for _ in range(20)]
METHODS = ["pj", "pgj", "hgj"]


def assert_same_hypotheses(ref, ours):
    assert len(ref) == len(ours)
    for r, o in zip(ref, ours):
        assert o[0]["tokens"].tolist() == r[0]["tokens"].tolist()
        assert float(o[0]["score"]) == pytest.approx(float(r[0]["score"]), abs=1e-4)
        assert torch.allclose(o[0]["positional_scores"], r[0]["positional_scores"], atol=1e-4)


# ------------------------------------------------------------------------- pure functions


def test_block_ends():
    final = torch.tensor([1, 2, 3, 4, 7, 10])
    assert jacobi.block_ends("pgj", final, 3, None, 100).tolist() == [4, 4, 4, 7, 10, 13]
    assert jacobi.block_ends("pgj", final, 3, None, 9).tolist() == [4, 4, 4, 7, 9, 9]
    assert jacobi.block_ends("pj", final, 3, None, 50).tolist() == [50] * 6
    # HGJ: blocks up to position P = 5, then one position per pass
    parallel_end = torch.full_like(final, 5)
    assert jacobi.block_ends("hgj", final, 3, parallel_end, 100).tolist() == [4, 4, 4, 6, 8, 11]
    assert jacobi.block_ends("hrt-spec", final, 4, None, 12).tolist() == [6, 7, 8, 9, 12, 12]
    with pytest.raises(ValueError, match="unknown"):
        jacobi.block_ends("jacobi", final, 3, None, 10)


def test_accepted_lengths():
    inputs = torch.tensor([[5, 7, 8, 9], [5, 7, 8, 9], [5, 7, 8, 9], [5, 1, 8, 9]])
    preds = torch.tensor([[7, 8, 9, 4], [7, 8, 1, 4], [7, 8, 9, 4], [7, 8, 9, 4]])
    widths = torch.tensor([4, 4, 2, 4])
    # row 0: every guess agrees (a fixed point: all 4 final); row 1: the third guess is
    # wrong; row 2: only 2 real slots; row 3: the first guess is wrong, only one is final
    assert jacobi.accepted_lengths(inputs, preds, widths).tolist() == [4, 3, 2, 1]


def test_first_true_and_parallel_end():
    mask = torch.tensor([[False, True, True], [False, False, False], [True, False, False]])
    assert jacobi.first_true(mask).tolist() == [1, 3, 0]
    assert jacobi.hgj_parallel_end(torch.tensor([10, 1]), 0).tolist() == [11, 1]
    assert jacobi.hgj_parallel_end(torch.tensor([10, 1]), 7).tolist() == [7, 7]


def test_dependency_graph():
    # final output a b c </s> (ids 4 5 6 2); pass 1 guesses 4 9 6 2 -> a final; pass 2 from
    # "a": b right, c and </s> still right from pass 1 -> b, c, </s> final
    records = [
        PassRecord(
            sentence=0,
            final_before=1,
            positions=[1, 2, 3, 4],
            tokens=[4, 9, 6, 2],
            probs=[0.9, 0.5, 0.8, 0.7],
            accepted=1,
        ),
        PassRecord(
            sentence=0, final_before=2, positions=[2, 3, 4], tokens=[5, 6, 2], probs=[0.9, 0.8, 0.9], accepted=3
        ),
    ]
    g = ddgviz.dependency_graph(records, [4, 5, 6, 2])
    assert g["final_at"] == [1, 2, 2, 2]
    assert g["right_from"] == [1, 2, 1, 1]
    assert g["parent"] == [0, 1, 0, 0]  # b waited for a; c and </s> only for the source
    assert g["state"][0] == ["final", "wrong", "right", "right"]
    assert g["state"][1] == ["idle", "final", "final", "final"]
    assert g["prob"][1][0] is None and g["prob"][0][1] == 0.5


# ------------------------------------------------------------------- random-weight models


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    data_dir, task, hrt, at = random_tiny_models(tmp_path_factory, "jacobi")
    return data_dir, task, {"hrt_tiny": hrt, "at_tiny": at}


def test_registered_and_declared():
    for name in METHODS + ["hrt-spec"]:
        assert name in DECODING_STRATEGIES and name in decoding_choices()


SEARCHES = [
    (),
    ("--min-len", "4"),
    ("--unkpen", "0.5", "--temperature", "1.3"),
    ("--max-len-a", "0.5", "--max-len-b", "3"),
]


@pytest.mark.parametrize("search", SEARCHES, ids=lambda s: " ".join(s) or "default")
@pytest.mark.parametrize("arch", ["at_tiny", "hrt_tiny"])
def test_random_models_equal_greedy(random_models, arch, search):
    """Every method and block size gives greedy's hypotheses; random models run to the
    maximum length, so the forced </s> and the banned symbols are exercised."""
    data_dir, task, models = random_models
    model = models[arch]
    flags = ("--beam", "1", "--max-len-b", "9", *search)
    sample = make_sample(task, RAGGED)
    _, greedy = build_generator(data_dir, model, *flags, "--decoding", "beam")
    ref = greedy.generate([model], sample)
    methods = METHODS + (["hrt-spec"] if arch == "hrt_tiny" else [])
    for method in methods:
        for b in ("1", "2", "5"):
            _, gen = build_generator(data_dir, model, *flags, "--decoding", method, "--jacobi-block-size", b)
            assert isinstance(gen, ParallelGreedyGenerator)
            out = gen.generate([model], sample)
            assert_same_hypotheses(ref, out)
            for hypo in out:
                if method != "hrt-spec":  # never more passes than greedy's one per token
                    assert 1 <= hypo[0]["steps"] <= hypo[0]["tokens"].numel()
                if method == "pgj" and b == "1":  # blocks of one token: greedy itself
                    assert hypo[0]["steps"] == hypo[0]["tokens"].numel()


def test_trace_records_every_pass(random_models):
    data_dir, task, models = random_models
    _, gen = build_generator(data_dir, models["at_tiny"], "--beam", "1", "--max-len-b", "6", "--decoding", "pj")
    gen.trace = []
    out = gen.generate([models["at_tiny"]], make_sample(task, RAGGED[:3]))
    for row, hypo in enumerate(out):
        records = [r for r in gen.trace if r.sentence == row]
        assert len(records) == hypo[0]["steps"]
        assert sum(r.accepted for r in records) >= hypo[0]["tokens"].numel()
        assert records[0].positions == list(range(1, 8))  # PJ: positions 1..max_len + 1
    assert gen.stats["sentences"] == 3 and "decoder passes per sentence" in gen.summary()


@pytest.mark.parametrize(
    "arch,flags,message",
    [
        ("at_tiny", ("--decoding", "pgj", "--beam", "1", "--jacobi-block-size", "0"), "block-size must be >= 1"),
        ("at_tiny", ("--decoding", "pj", "--beam", "5"), "greedy search .beam 1., got --beam 5"),
        ("hrt_tiny", ("--decoding", "hrt-spec", "--beam", "3"), "got --beam 3"),
        ("at_tiny", ("--decoding", "hrt-spec", "--beam", "1"), "no non-autoregressive mode"),
        ("cmlm_tiny", ("--decoding", "pgj", "--beam", "1"), "no left-to-right decoder"),
        ("cmlm_tiny", ("--decoding", "hrt-spec", "--beam", "1"), "needs an HRT model"),
        ("hrt_tiny", ("--decoding", "pgj", "--beam", "1", "--decode-chunk-size", "2"), "AT mode"),
        (
            "at_tiny",
            ("--decoding", "hgj", "--beam", "1", "--jacobi-parallel-length", "-1"),
            "parallel-length must be >= 0",
        ),
        ("at_tiny", ("--decoding", "pgj", "--beam", "1", "--sampling"), "does not support --sampling"),
    ],
)
def test_bad_options_are_refused(tmp_path, arch, flags, message):
    extra = ("--hrt-mode", "cmlm") if arch == "cmlm_tiny" else ()
    _, model = build_task_and_model(str(tmp_path), arch=arch, extra=extra)
    with pytest.raises(ValueError, match=message):
        build_generator(str(tmp_path), model, *flags)


def test_fairseq_transformer_checkpoint_shape(tmp_path):
    """fairseq's post-norm transformer with learned positions (not an at_* arch)."""
    extra = (
        "--encoder-embed-dim",
        "32",
        "--decoder-embed-dim",
        "32",
        "--encoder-ffn-embed-dim",
        "64",
        "--decoder-ffn-embed-dim",
        "64",
        "--encoder-layers",
        "1",
        "--decoder-layers",
        "2",
        "--encoder-attention-heads",
        "4",
        "--decoder-attention-heads",
        "2",
        "--hrt-mode",
        "at",
        "--decoder-learned-pos",
    )
    task, model = build_task_and_model(str(tmp_path), arch="transformer", extra=extra, seed=5)
    sample = make_sample(task, RAGGED)
    _, greedy = build_generator(str(tmp_path), model, "--beam", "1", "--max-len-b", "7")
    for method in METHODS:
        _, gen = build_generator(str(tmp_path), model, "--beam", "1", "--max-len-b", "7", "--decoding", method)
        assert_same_hypotheses(greedy.generate([model], sample), gen.generate([model], sample))


# ------------------------------------------------------------------------------- DDGviz


def test_ddgviz_writes_png_html_json(random_models, tmp_path):
    data_dir, task, models = random_models
    sample = make_sample(task, RAGGED[:2])
    graphs = ddgviz.build_graphs(task, models["at_tiny"], sample, ["s0", "s1"], "pgj", 2, max_len_b=5)
    written = ddgviz.write_outputs(graphs, str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == ["ddg-0.html", "ddg-0.png", "ddg-1.html", "ddg-1.png"]
    with open(tmp_path / "ddg-0.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "ddg-0.html").read_text()
    assert "<svg" in page and "<script>" in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    assert page.count('class="cell') == graphs[0]["passes"] * len(graphs[0]["words"])
    saved = json.loads((tmp_path / "ddg.json").read_text())
    assert [g["passes"] for g in saved] == [g["passes"] for g in graphs]


def _jsdom_runner():
    """``node`` that can ``require('jsdom')`` (NODE_PATH), or None."""
    node = shutil.which("node")
    if node is None:
        return None
    probe = subprocess.run([node, "-e", "require('jsdom')"], capture_output=True, env=dict(os.environ))
    return node if probe.returncode == 0 else None


JSDOM_CHECK = r"""
const { JSDOM, VirtualConsole } = require('jsdom');
const fs = require('fs');
const errors = [];
const vc = new VirtualConsole();
vc.on('jsdomError', e => errors.push(String(e)));
vc.on('error', e => errors.push(String(e)));
const dom = new JSDOM(fs.readFileSync(process.argv[2], 'utf8'), { runScripts: 'dangerously', virtualConsole: vc });
const doc = dom.window.document;
const word = doc.querySelector('text.word[data-token="2"]') || doc.querySelector('text.word');
word.dispatchEvent(new dom.window.MouseEvent('mouseover', { bubbles: true }));
console.log(JSON.stringify({ errors, ready: doc.body.getAttribute('data-ddg-ready'),
  cells: doc.querySelectorAll('rect.cell').length, status: doc.getElementById('status').textContent }));
"""


def test_ddgviz_page_runs_without_console_errors(random_models, tmp_path):
    """The page in a headless DOM (jsdom: ``npm install jsdom`` and NODE_PATH pointing at its
    node_modules); skipped where there is none -- no browser is part of the install."""
    node = _jsdom_runner()
    if node is None:
        pytest.skip("no node with jsdom (npm install jsdom; export NODE_PATH=.../node_modules)")
    data_dir, task, models = random_models
    graphs = ddgviz.build_graphs(
        task, models["at_tiny"], make_sample(task, RAGGED[:1]), ["s0"], "pj", None, max_len_b=5
    )
    ddgviz.write_outputs(graphs, str(tmp_path))
    script = tmp_path / "check.js"
    script.write_text(JSDOM_CHECK)
    out = subprocess.run([node, str(script), str(tmp_path / "ddg-0.html")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert int(result["ready"]) == len(graphs[0]["words"])  # the page's script ran to its end
    assert result["cells"] == graphs[0]["passes"] * len(graphs[0]["words"])
    assert "depends on" in result["status"]  # hovering a token ran the handler


# -------------------------------------------------------------------- trained tiny models


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["at_tiny", "hrt_tiny"])
def test_trained_models_equal_greedy(trained, arch):
    """Trained models end sentences at different steps: ragged batches of 16, every sentence
    stops on its own; hrt-spec equals the HRT model's AT-mode greedy."""
    data, ckpts = trained
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(ckpts[arch])], arg_overrides={"data": str(data.bin_dir)}
    )
    model = models[0].eval()
    task.load_dataset("valid")
    langs = ("--source-lang", "en", "--target-lang", "de", "--beam", "1")
    _, greedy = build_generator(str(data.bin_dir), model, *langs, "--decoding", "beam")
    runs = [("pj", "1"), ("pgj", "2"), ("pgj", "4"), ("hgj", "3")]  # pj has no block size
    if arch == "hrt_tiny":
        runs += [("hrt-spec", "2"), ("hrt-spec", "5")]
    batches = list(task.get_batch_iterator(task.dataset("valid"), max_sentences=16).next_epoch_itr(shuffle=False))
    refs = [greedy.generate([model], s) for s in batches]
    lengths = {len(h[0]["tokens"]) for ref in refs for h in ref}
    assert len(lengths) > 2  # sentences really end at different steps
    for method, b in runs:
        _, gen = build_generator(str(data.bin_dir), model, *langs, "--decoding", method, "--jacobi-block-size", b)
        tokens = passes = 0
        for sample, ref in zip(batches, refs):
            out = gen.generate([model], sample)
            assert_same_hypotheses(ref, out)
            tokens += sum(h[0]["tokens"].numel() for h in out)
            passes += sum(h[0]["steps"] for h in out)
        if method != "hrt-spec":
            assert passes <= tokens


@pytest.mark.slow
def test_fairseq_generate_pgj_and_ddgviz_cli(trained, tmp_path):
    data, ckpts = trained
    common = [
        "generate",
        data.bin_dir,
        "--path",
        ckpts["hrt_tiny"],
        "--gen-subset",
        "valid",
        "--batch-size",
        "7",
        "--user-dir",
        "fairseq_hrt",
        "--task",
        "hrt_translation",
        "--source-lang",
        "en",
        "--target-lang",
        "de",
        "--cpu",
        "--beam",
        "1",
    ]
    greedy = run_cli(common + ["--decoding", "beam"]).stdout
    for method in ("pgj", "hrt-spec"):
        out = run_cli(common + ["--decoding", method, "--print-step"]).stdout
        assert hyp_lines(out) == hyp_lines(greedy) and len(hyp_lines(out)) == 40
        steps = [int(line.split("\t")[1]) for line in out.splitlines() if line.startswith("I-")]
        assert len(steps) == 40 and min(steps) >= 1
    run_cli(
        [
            "fairseq_hrt.ddgviz",
            data.bin_dir,
            "--path",
            ckpts["at_tiny"],
            "--source-lang",
            "en",
            "--target-lang",
            "de",
            "--gen-subset",
            "valid",
            "--ids",
            "0,3",
            "--method",
            "pgj",
            "--cpu",
            "--out-dir",
            tmp_path / "ddg",
        ]
    )
    assert sorted(os.listdir(tmp_path / "ddg")) == ["ddg-0.html", "ddg-0.png", "ddg-3.html", "ddg-3.png", "ddg.json"]


# ---------------------------------------------------------------------- benchmark rows


def _benchmark_module():
    return benchmark


def test_benchmark_parallel_rows_and_passes():
    benchmark = _benchmark_module()
    args = SimpleNamespace(
        at="at.pt",
        at_beams="1",
        hrt="hrt.pt",
        hrt_chunk_sizes="2",
        hrt_beams="1/1",
        mp=None,
        ctranslate2="no",
        engines="lean",
        int8="no",
        parallel="pj,pgj,hgj,hrt-spec",
        jacobi_block_size=3,
        spec_block_size=4,
    )
    names = [s.name for s in benchmark.systems_from_args(args)[0]]
    assert names[-4:] == ["AT PJ", "AT PGJ b=3", "AT HGJ b=3", "HRT hrt-spec b=4"]
    with pytest.raises(ValueError, match="--parallel"):
        benchmark.systems_from_args(SimpleNamespace(**dict(vars(args), parallel="jacobi")))
    # passes per sentence: from the generator's counters for parallel rows, one per token for greedy

    runner = FairseqRunner.__new__(FairseqRunner)
    runner.generator = SimpleNamespace(stats={"sentences": 12, "passes": 50, "draft_passes": 20, "tokens": 60})
    runner.greedy = True
    assert runner.passes({}, {"sentences": 2, "passes": 10, "draft_passes": 4, "tokens": 12}) == (4.0, 48 / 24)
    runner.generator = SimpleNamespace()
    assert runner.passes({0: [1, 2, 3], 1: [4, 5]}, {}) == (2.5, None)
    runner.greedy = False  # beam search: no pass count
    assert runner.passes({0: [1, 2, 3]}, {}) == (None, None)
