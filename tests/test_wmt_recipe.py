"""examples/wmt/recipe.py, the papers' WMT set-ups: the full-scale commands it prints parse with
fairseq's own parser and carry setups.py's values (the --update-freq arithmetic included), a
step goes through submitit's local executor and leaves its marker, a step run before its
inputs exist stops with one line naming the step to run first, and (slow) the whole --slice
run of the smallest set-up on a user's own corpus (--corpus) writes results.md with every
model's row. The same slice on a real SLURM cluster: test_slurm_cluster.py."""

import ast
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys

import pytest
from fairseq import options

from fairseq_hrt.testing.tiny_runs import REPO, USER_DIR, cli_env, run_cli

RECIPE = REPO / "examples" / "wmt" / "recipe.py"
SHARED_DATA = REPO.parent / "shared" / "data"
_spec = importlib.util.spec_from_file_location("wmt_recipe", RECIPE)
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)
SETUPS = recipe.SETUPS

needs_shared_data = pytest.mark.skipif(
    not (SHARED_DATA / "wmt16-en-ro-newstest" / "test.ro").is_file(),
    reason="the slice is cut from ../shared/data/wmt16-en-ro-newstest",
)


def run_recipe(*args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(RECIPE), *args], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"recipe.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def fairseq_train_args(command: str):
    """The namespace fairseq-train's parser makes of a training job's command line (the words
    after fairseq-train or torchrun's -m fairseq_cli.train)."""
    words = shlex.split(command)
    start = words.index("fairseq-train") + 1 if "fairseq-train" in words else words.index("fairseq_cli.train") + 1
    argv = words[start:]
    argv[argv.index("--user-dir") + 1] = USER_DIR
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, input_args=argv)


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("launcher,gpus,nodes", [("local", 8, 1), ("slurm", 4, 2)])
def test_full_scale_training_commands_parse_with_the_papers_values(tmp_path, setup, launcher, gpus, nodes):
    s = SETUPS[setup]
    argv = ["--setup", setup, "--work", str(tmp_path / "w"), "--print-commands", "--launcher", launcher]
    args = recipe.parse_args(argv + ["--gpus", str(gpus), "--nodes", str(nodes)])
    r = recipe.Recipe(args)
    trainings = {"teacher": s.teacher, "at": s.at, "mp": s.mp, **{f"hrt-k{k}": s.hrt for k in s.hrt_chunk_sizes}}
    seen = []
    for name in recipe.STEPS:
        for job in r.step(name).jobs:
            if not job.train:
                continue
            seen.append(job.label)
            training = trainings[job.label]
            parsed = fairseq_train_args(job.command)
            assert parsed.arch == training.arch
            assert parsed.max_update == training.max_update and parsed.lr == [training.lr]
            assert parsed.warmup_updates == training.warmup and parsed.dropout == training.dropout
            assert parsed.max_tokens == training.max_tokens
            assert ast.literal_eval(parsed.adam_betas) == training.adam_betas and parsed.adam_eps == training.adam_eps
            # the paper's tokens per update on nodes x GPUs, rounded up
            expected = math.ceil(training.tokens_per_update / (gpus * nodes * training.max_tokens))
            assert parsed.update_freq == [expected]
            assert parsed.keep_interval_updates == s.average_last
            assert (launcher == "slurm") == (parsed.distributed_port > 0)
            assert job.command.startswith("torchrun") == (launcher == "local")
            if job.label.startswith("hrt-k"):
                assert parsed.chunk_sizes == job.label[len("hrt-k") :] and parsed.finetune_from_model
            if job.label != "teacher":
                assert parsed.p_raw == s.p_raw and parsed.distill_data
    assert seen == ["teacher", "at", *[f"hrt-k{k}" for k in s.hrt_chunk_sizes], *(["mp"] if s.mp_student else [])]
    # distillation: one shard per GPU, then merge
    shards = r.step("distill").jobs
    assert [f"--shard-id {i}" in j.command for i, j in enumerate(shards)] == [True] * gpus * nodes
    assert f"--num-shards {gpus * nodes}" in r.step("merge").jobs[0].command


def test_slurm_jobs_ask_for_one_task_per_gpu_on_every_node(tmp_path, monkeypatch):
    # submitit's SLURM executor only looks for srun on PATH when it is made
    fake_srun = tmp_path / "bin" / "srun"
    fake_srun.parent.mkdir()
    fake_srun.write_text("#!/bin/sh\n")
    fake_srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_srun.parent}:{os.environ['PATH']}")
    argv = ["--setup", "wmt16_en_ro", "--work", str(tmp_path / "w"), "--launcher", "slurm", "--gpus", "4"]
    r = recipe.Recipe(recipe.parse_args(argv + ["--nodes", "2", "--partition", "gpu"]))
    teacher, distill = r.step("teacher"), r.step("distill")
    params = r.executor(teacher, teacher.jobs[0])._executor.parameters
    assert (params["nodes"], params["gpus_per_node"], params["ntasks_per_node"]) == (2, 4, 4)
    assert params["partition"] == "gpu"
    params = r.executor(distill, distill.jobs[0])._executor.parameters
    assert (params["nodes"], params["gpus_per_node"], params["ntasks_per_node"]) == (1, 1, 1)
    assert len(distill.jobs) == 8  # one shard per GPU of the 2 x 4


def test_print_commands_prints_every_step_and_the_update_freq_arithmetic():
    out = run_recipe("--setup", "wmt22_e12d1", "--work", "work/wmt22_e12d1", "--print-commands").stdout
    for i, name in enumerate(recipe.STEPS, 1):
        assert f"# step {i}/{len(recipe.STEPS)}: {name}" in out
    # [DLCL]'s 8 x 4096 x 2 tokens on the default 8 GPUs of 4096 tokens: --update-freq 2
    assert "--update-freq 2 = 65536 tokens per update (paper) / (8 GPU(s) x 4096 max-tokens)" in out
    assert "--chunk-sizes 2 " in out and "--chunk-sizes 4 " in out and "--arch hrt_e12d1" in out
    assert "python -m fairseq_hrt.distill --merge --out work/wmt22_e12d1/distill/train.de --num-shards 8" in out


@needs_shared_data
def test_a_step_runs_through_submitit_and_a_step_out_of_order_names_the_one_to_run_first(tmp_path):
    work = tmp_path / "w"
    common = ["--setup", "wmt16_en_ro", "--work", str(work), "--slice", "--slice-size", "smoke"]
    common += ["--slice-train-lines", "20"]
    run_recipe(*common, "--steps", "download", "--launcher", "local")
    marker = work / "markers" / "download.json"
    assert "make_slice.py --setup wmt16_en_ro" in json.loads(marker.read_text())["read"]["commands"][0]
    raw = work / "download" / "wmt16_en_ro" / "raw"
    assert len((raw / "train.ro").read_text().splitlines()) == 20
    assert len((raw / "valid.en").read_text().splitlines()) == 250
    assert list((work / "submitit" / "download").glob("*_result.pkl")), "not run by submitit"
    again = run_recipe(*common, "--steps", "download")
    assert "skipped, done earlier" in again.stderr

    # binarize before prepare: one line, the step to run first, nothing lost
    proc = run_recipe(*common, "--steps", "binarize", check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].endswith("which step prepare makes: run --steps prepare first")
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr  # the recipe's banner and the error
    assert marker.is_file() and not (work / "markers" / "binarize.json").exists()


@pytest.fixture(scope="module")
def slice_work(tmp_path_factory):
    """The work folder of a whole --slice run of wmt16_en_ro on a user's own corpus (--corpus:
    400 training pairs, 250 valid, 40 test of newstest2016, written as a user would)."""
    root = tmp_path_factory.mktemp("wmt_slice")
    corpus = root / "my-corpus"
    corpus.mkdir()
    for lang in ("en", "ro"):
        lines = (SHARED_DATA / "wmt16-en-ro-newstest" / f"test.{lang}").read_text(encoding="utf-8").splitlines(True)
        for split, (start, stop) in {"train": (0, 400), "valid": (1500, 1750), "test": (1750, 1790)}.items():
            (corpus / f"{split}.{lang}").write_text("".join(lines[start:stop]), encoding="utf-8")
    work = root / "w"
    slice_args = ["--slice", "--slice-size", "smoke", "--corpus", str(corpus), "--threads", "1"]
    run_recipe("--setup", "wmt16_en_ro", "--work", str(work), *slice_args)
    return work


@pytest.mark.slow
@needs_shared_data
def test_the_slice_runs_every_step_and_writes_the_results_table(slice_work):
    work = slice_work
    for name in recipe.STEPS[1:]:  # download: none, the corpus is read where it is
        assert json.loads((work / "markers" / f"{name}.json").read_text())["finished"], name
    assert not (work / "download").exists()
    # two shards merged in source order: one distilled line per training pair prepare's cleaning
    # kept (of the 400: newstest2016 has a pair of over 80 words, setups.py's clean_max_len)
    assert (work / "distill" / "train.ro.shard-1-of-2").is_file()
    kept = len((work / "data" / "raw" / "train.ro").read_bytes().split(b"\n")) - 1
    assert 0 < kept < 400
    assert len((work / "distill" / "train.ro").read_bytes().split(b"\n")) - 1 == kept
    results = json.loads((work / "results.json").read_text())
    rows = {r["model"]: r for r in results["rows"]}
    assert set(results["step_seconds"]) == set(recipe.STEPS[1:])  # the time of every step, in results.md
    assert set(rows) == {"teacher", "at-greedy", "at-beam2", "hrt-k2", "mp-i10"}
    for r in rows.values():
        assert r["sacrebleu"] is not None and r["tokenized_bleu"] is not None and r["chrf"] is not None
        assert r["comet"] is None  # no local COMET model here
    for name in ("at-greedy", "hrt-k2", "mp-i10"):
        assert all(rows[name]["words_per_second"][b] > 0 for b in ("1", "8", "128")), name
    assert rows["at-greedy"]["speedup_vs_at_greedy"] == {"1": 1.0, "8": 1.0, "128": 1.0}
    table = (work / "results.md").read_text()
    for name in rows:
        assert f"| {name} |" in table
    assert "| model | sacreBLEU | tokenized BLEU | chrF | COMET |" in table
    assert f"your corpus {work.parent / 'my-corpus'} (train 400, valid 250, test 40 pairs)" in table
    for model in ("at", "hrt-k2", "mp"):
        assert (work / model / "checkpoint_avg.pt").is_file()
        assert any((work / "export" / model).iterdir())


@pytest.mark.slow
@needs_shared_data
def test_the_full_scale_models_train_and_fine_tune_from_the_at_student(slice_work, tmp_path):
    """One update of each full-scale training command of wmt16_en_ro on the slice's data: the
    papers' shapes train, and HRT and Mask-Predict load the AT student's weights."""
    r = recipe.Recipe(recipe.parse_args(["--setup", "wmt16_en_ro", "--work", str(slice_work), "--gpus", "0"]))
    for step in ("teacher", "at_student", "hrt", "mp"):
        for job in r.step(step).jobs:
            words = shlex.split(job.command)
            assert words[0] == "fairseq-train"
            budget = {
                "--max-update": "1",
                "--max-tokens": "600",
                "--update-freq": "1",
                "--save-dir": tmp_path / job.label,
            }
            for option, value in budget.items():
                words[words.index(option) + 1] = str(value)
            if "--finetune-from-model" in words:
                words[words.index("--finetune-from-model") + 1] = str(tmp_path / "at" / "checkpoint_last.pt")
            run_cli(["fairseq_cli.train", *words[1:], "--disable-validation", "--num-workers", "0"], cwd=REPO)
            assert (tmp_path / job.label / "checkpoint_last.pt").is_file(), job.label
