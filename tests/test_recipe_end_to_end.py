"""examples/multi30k/recipe.py end to end (``--profile tiny``), and the benchmark on the models it
trains: a test of the example, so it runs the example (tests/test_benchmark_smoke.py tests the
benchmark without it).

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

from benchmarks import benchmark
from fairseq_hrt import shortlist as sl
from fairseq_hrt.symbols import dictionary_fingerprint
from fairseq_hrt.testing.tiny_runs import (
    REPO,
    SHARED_MULTI30K,
    corpus_source,
    default_prefer,
    write_lines,
    write_raw_corpus,
)
from tests.comet_tiny import build_tiny_comet
from tests.test_benchmark_smoke import (
    AT_SYSTEMS,
    CT2_SYSTEMS,
    EXPECTED_SYSTEMS,
    HAVE_CT2,
    with_engine_rows,
)

_spec = importlib.util.spec_from_file_location("hrt_recipe", REPO / "examples" / "multi30k" / "recipe.py")
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)
PROFILE = recipe.PROFILES["tiny"]
BATCH_SIZES = PROFILE.bench_batch_sizes.split(",")


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


def benchmark_command(data: Path, out: Path):
    """benchmarks/benchmark.py on the tiny recipe's test set and AT model (more options follow)."""
    return [
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
    ]


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
        benchmark_command(data, out)
        + [
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
        benchmark_command(data, out)
        + [
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
