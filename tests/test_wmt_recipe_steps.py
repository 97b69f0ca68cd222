"""examples/wmt/recipe.py's bookkeeping of steps and the inputs it checks: a user's own corpus
(``--corpus``) is read where it is and a misaligned one stops before anything runs; a step's
marker holds what it read, so a step whose inputs changed is done again with every step after
it (what it made kept in WORK/stale/), ``--redo`` does the same on demand; a cut-short
checkpoint, an empty held-out line, wrong option combinations and a slice asked onto GPUs this
machine lacks end in one line; on GPUs the slice trains in fp16 (torchrun, a distillation
shard per GPU). The CPU steps run here are the cheap ones (prepare, binarize): no training."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from fairseq_hrt.testing.tiny_runs import REPO, cli_env
from tests.test_wmt_recipe import RECIPE, SHARED_DATA, recipe

NEWSTEST = SHARED_DATA / "wmt16-en-ro-newstest"

pytestmark = pytest.mark.skipif(not (NEWSTEST / "test.ro").is_file(), reason="needs ../shared/data's newstest2016")


def run_recipe(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(RECIPE), *map(str, args)], cwd=REPO, env=cli_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def make_corpus(folder, train=200, held_out=30):
    """A corpus in the layout --corpus documents, cut from newstest2016 En-Ro."""
    folder.mkdir(parents=True, exist_ok=True)
    for lang in ("en", "ro"):
        lines = (NEWSTEST / f"test.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)
        (folder / f"train.{lang}").write_text("".join(lines[:train]), encoding="utf-8")
        (folder / f"valid.{lang}").write_text("".join(lines[train : train + held_out]), encoding="utf-8")
        (folder / f"test.{lang}").write_text("".join(lines[-held_out:]), encoding="utf-8")
    return folder


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_a_misaligned_corpus_stops_before_anything_runs_naming_the_files_and_counts(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    lines = (corpus / "train.ro").read_text(encoding="utf-8").splitlines(keepends=True)
    (corpus / "train.ro").write_text("".join(lines[:-1]), encoding="utf-8")
    work = tmp_path / "w"
    proc = run_recipe("--setup", "wmt16_en_ro", "--work", work, "--slice", "--slice-size", "smoke", "--corpus", corpus)
    assert proc.returncode != 0
    assert last_line(proc) == (
        f"[recipe] --corpus: {corpus}/train.en has 200 lines and {corpus}/train.ro has 199: "
        "the two sides of a split must be line-aligned; fix it, then run the same command again"
    )
    assert len(proc.stderr.strip().splitlines()) == 2, proc.stderr  # the banner and the refusal
    assert not (work / "markers").exists() and not (work / "submitit").exists()


@pytest.mark.parametrize("line,why", [("\n", "empty"), ("word " * 300 + "\n", "longer than 250 words")])
def test_an_empty_or_over_long_held_out_line_is_named_with_its_number(tmp_path, line, why):
    corpus = make_corpus(tmp_path / "corpus")
    lines = (corpus / "test.ro").read_text(encoding="utf-8").splitlines(keepends=True)
    lines[6] = line
    (corpus / "test.ro").write_text("".join(lines), encoding="utf-8")
    proc = run_recipe(
        "--setup", "wmt16_en_ro", "--work", tmp_path / "w", "--slice", "--slice-size", "smoke", "--corpus", corpus
    )
    assert proc.returncode != 0
    assert last_line(proc).startswith(f"[recipe] --corpus: {corpus}/test.ro: line(s) 7 {why}")


def test_a_corpus_is_read_in_place_and_a_changed_file_redoes_the_steps_after_it(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    before = {p.name: p.read_bytes() for p in corpus.iterdir()}
    work = tmp_path / "w"
    common = ["--setup", "wmt16_en_ro", "--work", work, "--slice", "--slice-size", "smoke", "--corpus", corpus]
    first = run_recipe(*common, "--steps", "download,prepare,binarize")
    assert first.returncode == 0, first.stderr
    assert "download: none (--corpus:" in first.stderr
    assert {p.name: p.read_bytes() for p in corpus.iterdir()} == before  # never written
    assert not (work / "download").exists()
    prepared = json.loads((work / "markers" / "prepare.json").read_text())
    assert f"--raw {corpus} " in prepared["read"]["commands"][0]
    assert str(corpus / "train.en") in prepared["read"]["files"]

    again = run_recipe(*common, "--steps", "prepare,binarize")
    assert "prepare: skipped, done earlier" in again.stderr and "binarize: skipped, done earlier" in again.stderr

    # the user fixes a sentence of the corpus: prepare and binarize are done again, and say why
    old_dict = (work / "data-bin" / "dict.en.txt").read_text()
    text = (corpus / "train.en").read_text(encoding="utf-8")
    (corpus / "train.en").write_text("Zebras zigzag zealously .\n" + text.split("\n", 1)[1], encoding="utf-8")
    redone = run_recipe(*common, "--steps", "prepare,binarize")
    assert redone.returncode == 0, redone.stderr
    assert f"step prepare: its inputs changed since it ran ({corpus}/train.en changed)" in redone.stderr
    assert "step binarize: its inputs changed since it ran (step prepare done again" in redone.stderr
    stale = sorted((work / "stale").iterdir())
    assert [p.name.split("-")[0] for p in stale] == ["binarize", "prepare"]
    assert (stale[0] / "data-bin" / "dict.en.txt").read_text() == old_dict  # kept, not deleted
    first_line = (work / "data" / "spm" / "train.en").read_text().splitlines()[0]
    assert first_line.replace(" ", "").replace("▁", " ").strip() == "Zebras zigzag zealously ."

    # --redo: done again on demand; a results.md of the old models goes with it
    (work / "results.md").write_text("old numbers\n")
    forced = run_recipe(*common, "--steps", "binarize", "--redo", "binarize")
    assert forced.returncode == 0, forced.stderr
    assert "step binarize: --redo: doing it again, and the steps after it" in forced.stderr
    assert not (work / "results.md").exists()
    assert any((p / "results.md").is_file() for p in (work / "stale").iterdir())


def test_a_corpus_of_another_language_pair_runs_with_langs(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.ro").rename(corpus / f"{split}.xx")  # a pair the set-ups do not have
    work = tmp_path / "w"
    common = ["--setup", "wmt16_en_ro", "--work", work, "--slice", "--slice-size", "smoke", "--corpus", corpus]
    proc = run_recipe(*common, "--steps", "prepare")
    assert proc.returncode != 0 and "lacks train.ro, valid.ro, test.ro" in last_line(proc)
    proc = run_recipe(*common, "--langs", "en-xx", "--steps", "prepare,binarize")
    assert proc.returncode == 0, proc.stderr
    assert (work / "data-bin" / "dict.xx.txt").is_file() and (work / "data-bin" / "test.en-xx.xx.bin").is_file()
    r = recipe.Recipe(recipe.parse_args([*map(str, common), "--langs", "en-xx"]))
    evaluate = r.step("evaluate").jobs[0].command
    assert "--target-lang xx" in evaluate and "--remove-ro-diacritics" not in evaluate


def test_a_cut_short_checkpoint_names_the_file_and_the_step_that_makes_it(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    work = tmp_path / "w"
    common = ["--setup", "wmt16_en_ro", "--work", work, "--slice", "--slice-size", "smoke", "--corpus", corpus]
    assert run_recipe(*common, "--steps", "prepare,binarize").returncode == 0
    (work / "teacher").mkdir()
    checkpoint = work / "teacher" / "checkpoint_last.pt"
    whole = tmp_path / "whole.pt"
    torch.save({"model": {"w": torch.zeros(1000)}}, whole)
    checkpoint.write_bytes(whole.read_bytes()[:2000])
    proc = run_recipe(*common, "--steps", "distill")
    assert proc.returncode != 0
    assert last_line(proc) == (
        f"[recipe] step distill: {checkpoint} (2000 bytes) is not a whole checkpoint (cut short by a full disk "
        "or a killed copy?); make it again with --steps teacher --redo teacher"
    )
    shutil.copyfile(whole, checkpoint)  # a whole one passes the check (the distillation itself is not run here)
    assert recipe.checkpoint_problem(checkpoint) is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "prepare", "--redo", "binarize"], "--redo binarize: not among --steps prepare"),
        (["--corpus", "c", "--slice-train-lines", "5"], "with --corpus, cut your files"),
        (["--redo", "teach"], "--redo: unknown step(s) teach"),
        (["--langs", "en-fr"], "--langs en-fr: two language codes, SRC-TGT (e.g. en-fr), and only with --corpus"),
    ],
)
def test_wrong_option_combinations_are_refused_in_one_line(tmp_path, argv, message):
    proc = run_recipe("--setup", "wmt16_en_ro", "--work", tmp_path / "w", "--slice", "--slice-size", "smoke", *argv)
    assert proc.returncode == 2 and message in last_line(proc)


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the refusal where no GPU is visible")
def test_the_slice_on_a_gpu_is_refused_in_one_line_where_none_is_visible(tmp_path):
    proc = run_recipe(
        "--setup", "wmt16_en_ro", "--work", tmp_path / "w", "--slice", "--slice-size", "smoke", "--gpus", "1", "--fp16"
    )
    assert proc.returncode == 2
    assert last_line(proc).endswith("--gpus 1: 0 GPU(s) visible here; drop --gpus to run on the CPU")


def test_the_slice_on_gpus_trains_in_fp16_under_torchrun_with_a_shard_per_gpu(tmp_path):
    argv = [
        "--setup",
        "wmt16_en_ro",
        "--work",
        str(tmp_path / "w"),
        "--slice",
        "--slice-size",
        "smoke",
        "--gpus",
        "2",
        "--fp16",
    ]
    r = recipe.Recipe(recipe.parse_args(argv + ["--print-commands"]))
    assert not r.cpu
    for name in ("teacher", "at_student", "hrt", "mp"):
        for job in r.step(name).jobs:
            assert job.command.startswith("torchrun --nproc-per-node 2 -m fairseq_cli.train "), job.command
            assert " --fp16" in job.command and " --cpu" not in job.command
            assert "--arch at_tiny" in job.command or "_tiny" in job.command  # the slice's models
    shards = r.step("distill").jobs
    assert [j.gpu for j in shards] == [0, 1] and all("--fp16" in j.command for j in shards)
    for name in ("evaluate", "benchmark"):
        assert all("--fp16" in j.command and "--cpu" not in j.command for j in r.step(name).jobs)
    cpu = recipe.Recipe(recipe.parse_args(argv[:7] + ["--print-commands"]))
    assert cpu.cpu and cpu.shards == 2 and all(" --cpu" in j.command for j in cpu.step("teacher").jobs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_slice_runs_on_a_gpu_in_fp16(tmp_path):
    """The slice with --gpus 1 --fp16 end to end (skipped without a GPU; docs/gpu.md)."""
    work = tmp_path / "w"
    env = cli_env({"CUDA_VISIBLE_DEVICES": "0"})
    argv = ["--setup", "wmt16_en_ro", "--work", work, "--slice", "--slice-size", "smoke", "--gpus", "1", "--fp16"]
    argv += ["--slice-train-lines", "400", "--slice-test-lines", "40"]
    proc = subprocess.run(
        [sys.executable, str(RECIPE), *map(str, argv)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["model"] for r in json.loads((work / "results.json").read_text())["rows"]}
    assert {"teacher", "at-greedy", "hrt-k2", "mp-i10"} <= rows
    assert "--fp16" in (work / "logs" / "teacher.log").read_text()
