"""examples/multi30k/study.py: its pure parts (budgets, checkpoints per budget, logs, report)."""

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "multi30k"))
_spec = importlib.util.spec_from_file_location("hrt_study", REPO / "examples" / "multi30k" / "study.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def _study(tmp_path, *extra):
    return study.Study(study.parse_args(["--out", str(tmp_path), "--threads", "1", *extra]))


def test_budgets_and_the_at_checkpoint_of_each_budget(tmp_path):
    s = _study(tmp_path, "--scales", "8,1", "--chunk-size-sets", "2", "2,3,4")
    assert s.scales == [1, 8] and s.base == 300  # the mini profile's student budget
    assert s.budget(8).max_update == 2400
    (tmp_path / "at").mkdir()
    (tmp_path / "at" / "checkpoint_2_300.pt").write_bytes(b"")
    assert s.at_checkpoint(1) == tmp_path / "at" / "checkpoint_2_300.pt"
    assert s.at_checkpoint(8) == tmp_path / "at" / "checkpoint_last.pt"  # the longest run's end
    assert sorted(s.models()) == ["at_x1", "at_x8", "hrt_c234_x1", "hrt_c234_x8", "hrt_c2_x1", "hrt_c2_x8"]
    with pytest.raises(study.StepError, match="not a training step"):
        s.run_only(["hrt_c3_x1"])
    with pytest.raises(ValueError):
        study.parse_scales("0,1")


def test_valid_losses_by_kind_from_a_fairseq_json_log(tmp_path):
    log = tmp_path / "hrt.log"
    rows = [
        {
            "epoch": 1,
            "valid_loss": "6.1",
            "valid_at_loss": "5.0",
            "valid_cmlm_loss": "6.5",
            "valid_skip_at_loss": "6.0",
            "valid_skip_cmlm_loss": "5.5",
            "valid_num_updates": "150",
        },
        {
            "epoch": 2,
            "valid_loss": "5.1",
            "valid_at_loss": "4.5",
            "valid_skip_at_loss": "5.2",
            "valid_num_updates": "300",
        },
    ]
    lines = ['2026-11-23 | INFO | train_inner | {"loss": "7", "num_updates": "20"}']
    lines += [f"2026-11-23 | INFO | valid | {json.dumps(r)}" for r in rows]
    log.write_text("\n".join(lines) + "\nnot json {\n")
    got = study.valid_losses(log)
    assert got == [
        {"updates": 150, "at": 5.0, "cmlm": 6.5, "skip_at": 6.0, "skip_cmlm": 5.5},
        {"updates": 300, "at": 4.5, "skip_at": 5.2},
    ]
    assert study.valid_losses(tmp_path / "missing.log") == []


def _system(bleu, hits=0):
    return {"bleu": bleu, "limit_hits": hits, "bleu_by_length": {"<10": bleu + 1, "10-20": bleu, ">20": bleu - 1}}


def test_report_states_the_gap_and_the_distance_to_at_greedy():
    report = {
        "profile": "mini",
        "device": "CPU",
        "base_updates": 300,
        "scales": [1],
        "chunk_size_sets": ["2"],
        "study_seconds": 10.0,
        "models": {
            "at_x1": {"kind": "AT", "scale": 1, "updates": 300, "systems": {"greedy": _system(20.0, 3)}},
            "hrt_c2_x1": {
                "kind": "HRT",
                "scale": 1,
                "updates": 300,
                "chunk_sizes": "2",
                "systems": {
                    "at_mode_b1": _system(21.0),
                    "k2_b1": _system(19.5, 1),
                    "at_mode_b5": _system(22.0),
                    "k2_b5": _system(20.0),
                },
                "gap": {"b1": 1.5, "b5": 2.0},
                "oracles": {"reference": {"bleu": 40.0}, "at_mode": {"bleu": 20.5}},
                "valid_losses": [{"updates": 300, "at": 4.0, "cmlm": 4.5, "skip_at": 5.0, "skip_cmlm": 4.2}],
            },
        },
    }
    md = study.markdown_report(report)
    row = next(line for line in md.splitlines() if line.startswith("| HRT k=2 x1"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:10] == ["21.00", "19.50", "1.50", "22.00", "20.00", "2.00", "-0.50"]
    assert cells[10] == "0 / 1" and cells[11:13] == ["40.00", "20.50"]
    assert "| hrt_c2_x1 | 4.00 | 4.50 | 5.00 | 4.20 |" in md


def test_variants_train_the_first_set_at_the_largest_budget_with_extra_options(tmp_path):
    s = _study(
        tmp_path,
        "--scales",
        "1,8",
        "--chunk-size-sets",
        "2",
        "2,3,4",
        "--variants",
        "sd5=--skip-at-self-distill 0.5",
        "kd_c0={kd} --p-raw 0.5 --p-raw-chunked 0",
    )
    assert s.variant_name("sd5") == "hrt_c2_x8_sd5"
    assert s.variant_args("sd5") == ["--skip-at-self-distill", "0.5"]
    assert s.variant_args("kd_c0") == [
        "--distill-data",
        str(tmp_path / "kd" / "distill-bin"),
        "--p-raw",
        "0.5",
        "--p-raw-chunked",
        "0",
    ]
    assert s.needs_kd()
    (tmp_path / "at").mkdir()
    (tmp_path / "at" / "checkpoint_2_300.pt").write_bytes(b"")
    models = s.models()
    assert models["hrt_c2_x8_kd_c0"]["variant"] == "kd_c0" and models["hrt_c2_x8_kd_c0"]["updates"] == 2400
    assert not _study(tmp_path, "--variants", "sd5=--skip-at-self-distill 0.5").needs_kd()
    # the training command: the plain run's, plus the variant's options, in its own folder
    ran = {}
    s.run_step = lambda i, name, cmd, outputs, **kw: ran.setdefault(name, [str(c) for c in cmd])
    s.step_hrt(6, "2", 8)
    s.step_variant(7, "kd_c0")
    plain, variant = ran["hrt_c2_x8"], ran["hrt_c2_x8_kd_c0"]
    assert variant[variant.index("--save-dir") + 1] == str(tmp_path / "hrt_c2_x8_kd_c0")
    assert variant[-6:] == s.variant_args("kd_c0")
    assert [w for w in variant[:-6] if "hrt_c2_x8" not in w] == [w for w in plain if "hrt_c2_x8" not in w]
    # its KD set: the AT model of the largest budget translates the training set, beam 5
    s.step_kd(7)
    kd = ran["kd_distill"]
    assert kd[kd.index("--path") + 1] == str(tmp_path / "at" / "checkpoint_last.pt")
    assert kd[kd.index("--beam") + 1] == "5" and kd[kd.index("--out") + 1] == str(
        tmp_path / "kd" / "distill" / "train.de"
    )
    assert ran["kd_bin"][ran["kd_bin"].index("--destdir") + 1] == str(tmp_path / "kd" / "distill-bin")
    for bad in (["x"], ["Bad=--a"], ["a="], ["a=--x", "a=--y"]):
        with pytest.raises(ValueError, match="--variants"):
            study.parse_variants(bad)


def test_only_prepare_runs_alone_and_training_steps_need_it(tmp_path):
    """``--only prepare`` (and ``kd``) are steps; ``--only at`` before prepare says to run it first
    instead of failing in fairseq."""
    s = _study(tmp_path, "--scales", "1", "--chunk-size-sets", "2", "--only", "at")
    ran = []
    s.run_step = lambda i, name, cmd, outputs, **kw: ran.append(name)
    with pytest.raises(study.StepError, match="run --only prepare first"):
        s.run_only(["at"])
    with pytest.raises(study.StepError, match="run --only prepare first"):
        s.run_only(["kd"])
    assert ran == []
    s.run_only(["prepare"])
    assert ran == ["prepare"]  # the mini profile has no teacher
    # prepare done (its marker and dictionary): the training steps run
    (tmp_path / "markers").mkdir()
    (tmp_path / "markers" / "prepare.done").write_text("cmd\n")
    (tmp_path / "data" / "data-bin").mkdir(parents=True)
    (tmp_path / "data" / "data-bin" / "dict.en.txt").write_text("")
    s.run_only(["at", "hrt_c2_x1"])
    assert ran == ["prepare", "at", "hrt_c2_x1"]
    # in one call, prepare first makes the later steps possible
    ran.clear()
    (tmp_path / "markers" / "prepare.done").unlink()
    s.step_prepare = lambda i: (ran.append("prepare"), (tmp_path / "markers" / "prepare.done").write_text("cmd\n"))
    s.run_only(["prepare", "at"])
    assert ran == ["prepare", "at"]


def test_at_variants_and_hrt_variants_fine_tuned_from_them(tmp_path):
    """--at-variants trains AT students of the largest budget with extra options (the same KD
    data as HRT, two decoder layers); --variant-from fine-tunes an HRT variant from one of them;
    --skip-raw-hrt leaves out the HRT of raw data."""
    s = _study(
        tmp_path,
        "--scales",
        "8",
        "--chunk-size-sets",
        "2",
        "--skip-raw-hrt",
        "--at-variants",
        "dl2=--decoder-layers 2",
        "kd={kd} --p-raw 0.5",
        "--variants",
        "dl2kd={kd} --p-raw 0.5 --decoder-layers 2",
        "--variant-from",
        "dl2kd=dl2",
    )
    assert sorted(s.models()) == ["at_x8", "at_x8_dl2", "at_x8_kd", "hrt_c2_x8_dl2kd"]
    assert s.models()["at_x8_kd"]["kind"] == "AT" and s.needs_kd()
    ran = {}
    s.run_step = lambda i, name, cmd, outputs, **kw: ran.setdefault(name, [str(c) for c in cmd])
    s.step_at_variant(7, "kd")
    s.step_variant(7, "dl2kd")
    at_kd, hrt = ran["at_x8_kd"], ran["hrt_c2_x8_dl2kd"]
    assert at_kd[at_kd.index("--distill-data") + 1] == str(tmp_path / "kd" / "distill-bin")
    assert at_kd[at_kd.index("--hrt-mode") + 1] == "at" and at_kd[at_kd.index("--max-update") + 1] == "2400"
    assert hrt[hrt.index("--finetune-from-model") + 1] == str(tmp_path / "at_x8_dl2" / "checkpoint_last.pt")
    assert hrt[hrt.index("--decoder-layers") + 1] == "2"
    with pytest.raises(ValueError, match="--variant-from"):
        study.parse_variant_from(["dl2kd=nosuch"], {"dl2kd": "x"}, {"dl2": "y"})
    report = {
        "profile": "mini",
        "device": "CPU",
        "base_updates": 300,
        "scales": [8],
        "chunk_size_sets": ["2"],
        "study_seconds": 1.0,
        "variants": {"dl2kd": "x"},
        "at_variants": {"kd": "y"},
        "variant_from": {"dl2kd": "dl2"},
        "models": {
            "at_x8": {"kind": "AT", "scale": 8, "updates": 2400, "systems": {"greedy": _system(30.0)}},
            "at_x8_kd": {
                "kind": "AT",
                "scale": 8,
                "updates": 2400,
                "variant": "kd",
                "systems": {"greedy": _system(31.0)},
            },
        },
    }
    md = study.markdown_report(report)
    assert "| AT x8 | 2400 | 30.00 |" in md and "| AT x8 kd | 2400 | 31.00 |" in md
    assert "(fine-tuned from AT `dl2`)" in md


def test_a_stronger_teacher_trained_until_its_validation_bleu_stops_rising_and_its_kd(tmp_path):
    """{tkd}: the KD set of an AT teacher of --teacher-arch (raw data, validation BLEU every
    epoch, early stop by --teacher-patience, the best-BLEU checkpoint distils, beam 5); the
    teacher is a model of the report; without --teacher-arch a {tkd} variant is refused."""
    s = _study(
        tmp_path,
        "--scales",
        "8",
        "--chunk-size-sets",
        "2",
        "--skip-raw-hrt",
        "--teacher-arch",
        "at_small",
        "--teacher-patience",
        "2",
        "--at-variants",
        "dl2tkd={tkd} --p-raw 0.5 --decoder-layers 2",
        "--variants",
        "dl2tkd={tkd} --p-raw 0.5 --decoder-layers 2",
    )
    assert s.needs_teacher() and not s.needs_kd()
    assert s.variant_args("dl2tkd", s.at_variants)[:2] == ["--distill-data", str(tmp_path / "tkd" / "distill-bin")]
    assert s.models()["teacher"]["kind"] == "AT"
    ran = {}
    s.run_step = lambda i, name, cmd, outputs, **kw: ran.setdefault(name, ([str(c) for c in cmd], outputs, kw))
    s.step_teacher(7)
    s.step_teacher_kd(7)
    teacher, outputs, kw = ran["teacher"]
    assert teacher[teacher.index("--arch") + 1] == "at_small" and teacher[teacher.index("--decoder-layers") + 1] == "3"
    assert "--eval-bleu" in teacher and teacher[teacher.index("--best-checkpoint-metric") + 1] == "bleu"
    assert "--maximize-best-checkpoint-metric" in teacher and teacher[teacher.index("--patience") + 1] == "2"
    assert json.loads(teacher[teacher.index("--eval-bleu-args") + 1])["beam"] == 1
    assert teacher[teacher.index("--hrt-mode") + 1] == "at" and "--distill-data" not in teacher
    assert outputs == [tmp_path / "teacher" / "checkpoint_best.pt"] and kw["train_max_update"] == 8000
    kd = ran["tkd_distill"][0]
    assert kd[kd.index("--path") + 1] == str(tmp_path / "teacher" / "checkpoint_best.pt")
    assert kd[kd.index("--beam") + 1] == "5" and kd[kd.index("--out") + 1] == str(
        tmp_path / "tkd" / "distill" / "train.de"
    )
    if s.cpu and importlib.util.find_spec("onnxruntime"):  # the teacher's beam search on ONNX Runtime
        assert kd[kd.index("--decoder-engine") + 1] == "onnxruntime"
    assert ran["tkd_bin"][0][ran["tkd_bin"][0].index("--destdir") + 1] == str(tmp_path / "tkd" / "distill-bin")
    with pytest.raises(SystemExit):  # refused when the arguments are read, not steps later
        _study(tmp_path, "--at-variants", "t={tkd}")


# --------------------------------------------------------------------------- --converged


def _converged(tmp_path, *extra):
    return study.ConvergedStudy(
        study.parse_args(["--profile", "small", "--converged", "--out", str(tmp_path), "--threads", "1", *extra])
    )


def _converged_report_input(models: dict, oracles: dict) -> dict:
    """What ``converged_report`` reads, with the study's settings filled in."""
    return {
        "profile": "small",
        "device": "CPU",
        "patience": 10,
        "student_args": "-",
        "teacher": "t",
        "p_raw": 0.5,
        "models": models,
        "stage_oracles": oracles,
    }


def _option(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_converged_plan_order_and_its_teacher(tmp_path):
    """Seed by seed, the deepest decoder first, each HRT right after its AT, the HRT from the
    teacher after every seed's pairs; the teacher has the deepest decoder and the study's
    options, and stops by patience."""
    s = _converged(tmp_path, "--also-from-teacher")
    names = [name for name, _ in s.training_plan()]
    assert names == [
        "teacher",
        "tkd",
        "at_d2_s1",
        "hrt_d2_s1",
        "at_d1_s1",
        "hrt_d1_s1",
        "at_d2_s2",
        "hrt_d2_s2",
        "at_d1_s2",
        "hrt_d1_s2",
        "hrt_d2_s1_from_teacher",
    ]
    a = s.args
    assert a.teacher_arch == "at_small" and a.teacher_args == "--decoder-layers 2 --dropout 0.3"
    assert (a.teacher_patience, a.teacher_max_update, a.teacher_hours) == (10, 20000, 12.0)
    assert s.teacher_depth() == 2
    assert s.out == tmp_path and s.profile.vocab_size == 8000
    with pytest.raises(ValueError, match="--seeds"):
        _converged(tmp_path, "--seeds", "1,1")


def test_converged_students_and_the_two_runs_of_an_hrt_model(tmp_path, monkeypatch):
    """AT students: MixDistill of the teacher's KD, their seed and depth, BLEU validation with
    patience. HRT: fine-tuned from the AT's best checkpoint for as many updates as it had (the
    curriculum), then the same folder on with --curriculum-updates and patience."""
    s = _converged(tmp_path)
    ran = {}
    monkeypatch.setattr(s, "run_step", lambda i, name, cmd, outputs, **kw: ran.update({name: (cmd, kw)}))
    s.step_at_student(4, 1, 2)
    cmd, kw = ran["at_d1_s2"]
    assert _option(cmd, "--decoder-layers") == "1" and _option(cmd, "--seed") == "2"
    assert _option(cmd, "--distill-data") == str(tmp_path / "tkd" / "distill-bin") and _option(cmd, "--p-raw") == "0.5"
    assert _option(cmd, "--patience") == "10" and "--eval-bleu" in cmd and "--maximize-best-checkpoint-metric" in cmd
    assert _option(cmd, "--dropout") == "0.3" and _option(cmd, "--max-update") == "20000"
    assert kw["train_max_update"] == 20000

    with pytest.raises(study.StepError, match="reports no checkpoint_best.pt"):
        s.step_hrt_student(5, 1, 2)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "at_d1_s2.log").write_text(
        "... | Saved checkpoint X/checkpoint_best.pt (epoch 9 @ 1134 updates, score 30.1) (writing took 0.1 seconds)\n"
        "... | Saved checkpoint X/checkpoint_best.pt (epoch 10 @ 1260 updates, score 30.4) (writing took 0.1 seconds)\n"
        "... | Saved checkpoint X/checkpoint_last.pt (epoch 11 @ 1386 updates, score 30.2) (writing took 0.1 seconds)\n"
    )
    s.step_hrt_student(5, 1, 2)
    first, kw_first = ran["hrt_d1_s2"]
    more, kw_more = ran["hrt_d1_s2_more"]
    assert _option(first, "--finetune-from-model") == str(tmp_path / "at_d1_s2" / "checkpoint_best.pt")
    assert _option(first, "--max-update") == "1260" and kw_first["train_max_update"] == 1260
    assert "--patience" not in first and "--curriculum-updates" not in first and "--eval-bleu" in first
    assert _option(first, "--chunk-sizes") == "2" and _option(first, "--arch") == "hrt_small"
    assert _option(more, "--save-dir") == _option(first, "--save-dir") == str(tmp_path / "hrt_d1_s2")
    assert _option(more, "--curriculum-updates") == "1260" and _option(more, "--max-update") == "20000"
    assert _option(more, "--patience") == "10" and kw_more["train_max_update"] == 20000


def test_cpu_bf16_trains_every_model_under_autocast_and_nothing_else(tmp_path, monkeypatch):
    """--cpu-bf16: every training command gets the task's --cpu-autocast-bf16; distillation and
    the benchmark do not (they decode in float32); the report says how the models were trained;
    on a GPU it is refused."""
    monkeypatch.setattr(study.recipe, "cuda_available", lambda: False)
    monkeypatch.setattr(study.recipe, "cpu_has_native_bf16", lambda: True)
    plain, bf16 = _converged(tmp_path / "a"), _converged(tmp_path / "b", "--cpu-bf16")
    for s, wanted in ((plain, False), (bf16, True)):
        ran = {}
        monkeypatch.setattr(s, "run_step", lambda i, name, cmd, outputs, **kw: ran.update({name: cmd}))
        s.step_teacher(2)
        s.step_at_student(4, 2, 1)
        assert [("--cpu-autocast-bf16" in cmd) for cmd in ran.values()] == [wanted, wanted]
        assert "--cpu-autocast-bf16" not in s.distill_cmd(tmp_path / "t.pt", tmp_path / "o.de", tmp_path / "d.log")
    assert bf16.device_words() == "CPU, 1 thread(s), trained under bfloat16 autocast"
    assert plain.device_words() == "CPU, 1 thread(s)"
    monkeypatch.setattr(study.recipe, "cuda_available", lambda: True)
    with pytest.raises(study.StepError, match="--cpu-bf16 is for training on the CPU"):
        _converged(tmp_path / "c", "--cpu-bf16")


def test_cpu_bf16_is_refused_where_the_cpu_would_emulate_bfloat16(tmp_path, monkeypatch):
    """Without AVX512-BF16 or AMX, autocast emulates bfloat16 many times slower than float32:
    the recipe says so before it trains anything, and trains in float32 without the option."""
    monkeypatch.setattr(study.recipe, "cuda_available", lambda: False)
    monkeypatch.setattr(study.recipe, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(study.StepError, match="no native bfloat16.*Leave --cpu-bf16 out"):
        _converged(tmp_path / "a", "--cpu-bf16")
    assert not (tmp_path / "a").exists()
    assert _converged(tmp_path / "b").train_precision_args == []


def test_the_children_keep_freed_memory_and_the_docs_give_the_same_settings(tmp_path, monkeypatch):
    """Every command of the recipe and the study runs with glibc's malloc told to keep freed
    big tensors (a value the user exported wins); the quickstart and README's advice give the
    same values, so a user's own fairseq-train gets what the study measured."""
    keep = study.recipe.GLIBC_MALLOC_KEEP
    monkeypatch.setenv("MALLOC_TOP_PAD_", "1")
    for name in keep:
        if name != "MALLOC_TOP_PAD_":
            monkeypatch.delenv(name, raising=False)
    env = _converged(tmp_path).env
    assert {name: env[name] for name in keep} == {**keep, "MALLOC_TOP_PAD_": "1"}
    quickstart = (REPO / "examples/multi30k/quickstart.sh").read_text()
    readme = (REPO / "README.md").read_text()
    for name, value in keep.items():
        assert f'{name}="${{{name}:-{value}}}"' in quickstart, name
        assert f"{name}={value}" in readme, name


def test_cpu_training_commands_run_under_mimalloc_unless_told_glibc(tmp_path, monkeypatch):
    """The CPU training commands preload the cmeel-mimalloc wheel's library (before one the user
    preloads; a child really runs with it), the others keep the plain environment, and
    FAIRSEQ_HRT_TRAIN_MALLOC=glibc keeps glibc's malloc; another value is refused."""
    library = study.recipe.mimalloc_library()
    assert library and Path(library).name == "libmimalloc.so"
    monkeypatch.setenv("LD_PRELOAD", "libuser.so")
    monkeypatch.delenv(study.recipe.TRAIN_MALLOC_ENV, raising=False)
    s = _converged(tmp_path)
    assert s.train_env["LD_PRELOAD"] == f"{library} libuser.so" and s.env["LD_PRELOAD"] == "libuser.so"
    # freed memory kept, not handed back to the kernel (a value the user set wins)
    assert s.train_env["MIMALLOC_PURGE_DELAY"] == "-1" and "MIMALLOC_PURGE_DELAY" not in s.env
    assert {k: v for k, v in s.train_env.items() if k not in ("LD_PRELOAD", "MIMALLOC_PURGE_DELAY")} == {
        k: v for k, v in s.env.items() if k != "LD_PRELOAD"
    }
    monkeypatch.setenv("MIMALLOC_PURGE_DELAY", "100")
    assert _converged(tmp_path).train_env["MIMALLOC_PURGE_DELAY"] == "100"
    monkeypatch.delenv("MIMALLOC_PURGE_DELAY")
    monkeypatch.delenv("LD_PRELOAD")
    env = _converged(tmp_path).train_env
    maps = "import sys; print(any('libmimalloc' in line for line in open('/proc/self/maps')))"
    ran = subprocess.run([sys.executable, "-c", maps], env=env, capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "True"
    monkeypatch.setenv(study.recipe.TRAIN_MALLOC_ENV, "glibc")
    s = _converged(tmp_path)
    assert "LD_PRELOAD" not in s.train_env and s.train_env == s.env
    monkeypatch.setenv(study.recipe.TRAIN_MALLOC_ENV, "tcmalloc")
    with pytest.raises(study.StepError, match="FAIRSEQ_HRT_TRAIN_MALLOC=tcmalloc: give mimalloc or glibc"):
        _converged(tmp_path)


def test_converged_report_reads_budgets_and_validation_bleu_from_the_logs(tmp_path):
    s = _converged(tmp_path, "--seeds", "1", "--depths", "1")
    logs = tmp_path / "logs"
    logs.mkdir()

    def valid(updates, bleu, wall):
        return (
            '2026-11-25 | INFO | valid | {"epoch": 1, "valid_loss": "4", "valid_bleu": "%s", '
            '"valid_num_updates": "%d", "wall": "%d"}' % (bleu, updates, wall)
        )

    (logs / "teacher.log").write_text(
        "\n".join(
            [
                "$ train teacher",
                valid(100, 10.0, 60),
                "$ train teacher (resumed)",
                valid(200, 20.5, 30),
                valid(300, 20.1, 90),
                "... Saved checkpoint T/checkpoint_best.pt (epoch 2 @ 200 updates, score 20.5) (writing ...)",
            ]
        )
        + "\n"
    )
    # begun on a lent GPU (gpu_handoff.py): two runs there, the second resumed with a json wall
    # of 0 (a stopwatch restored from another machine) and only its end line to time it
    gpu_runs = "\n".join(
        [
            "$ [gpu] train at",
            valid(100, 20.0, 300),
            "$ [gpu] train at (resumed)",
            valid(120, 22.0, 0),
            "2026-11-26 | INFO | fairseq_cli.train | done training in 50.5 seconds",
        ]
    )
    (logs / "at_d1_s1.log").write_text(
        gpu_runs
        + "\n$ x\n"
        + valid(150, 30.0, 100)
        + "\n... checkpoint_best.pt (epoch 1 @ 150 updates, score 30.0) ...\n"
    )
    (logs / "hrt_d1_s1.log").write_text("$ x\n" + valid(150, 25.0, 200) + "\n")
    (logs / "hrt_d1_s1_more.log").write_text("$ x\n" + valid(300, 29.5, 100) + "\n" + valid(450, 29.0, 200) + "\n")
    (tmp_path / "markers").mkdir()
    (tmp_path / "markers" / "hrt_d1_s1_more.done").write_text("x\n")
    models = s.trained_models()
    assert models["teacher"]["best_updates"] == 200 and models["teacher"]["best_valid_bleu"] == 20.5
    assert models["teacher"]["hours"] == round((60 + 90) / 3600, 2)  # each run's last wall clock, summed
    assert models["teacher"]["done"] is False and models["teacher"]["updates"] == 300
    assert models["teacher"]["gpu_hours"] == 0
    at = models["at_d1_s1"]
    assert at["hours"] == round(100 / 3600, 2) and at["gpu_hours"] == round((300 + 50.5) / 3600, 2)
    assert at["best_valid_bleu"] == 30.0 and at["updates"] == 150
    hrt = models["hrt_d1_s1"]
    assert hrt["curriculum_updates"] == 150 and hrt["best_updates"] == 300 and hrt["best_valid_bleu"] == 29.5
    assert hrt["updates"] == 450 and hrt["done"] is True and hrt["hours"] == round(400 / 3600, 2)
    assert hrt["checkpoint"] == "hrt_d1_s1/checkpoint_best.pt"
    md = study.converged_report(
        {
            "profile": "small",
            "device": "CPU",
            "patience": 5,
            "student_args": "-",
            "teacher": "t",
            "p_raw": 0.5,
            "models": models,
        }
    )
    assert "| hrt_d1_s1 | yes | 450 | 300 | 150 | 29.50 | 0.11 | - |" in md
    assert "| at_d1_s1 | no | 150 | 150 | - | 30.00 | 0.13 | 0.10 |" in md


def test_status_reads_each_steps_state_from_markers_and_logs_and_touches_nothing(tmp_path, capsys):
    s = _converged(tmp_path, "--seeds", "1", "--depths", "1", "--also-from-teacher")
    logs, markers = tmp_path / "logs", tmp_path / "markers"
    logs.mkdir()
    markers.mkdir()

    def valid(epoch, updates, bleu):
        return (
            '2026-11-26 | INFO | valid | {"epoch": %d, "valid_bleu": "%s", "valid_num_updates": "%d", '
            '"wall": "%d"}' % (epoch, bleu, updates, 36 * epoch)
        )

    def inner(ups):
        return '2026-11-26 | INFO | train_inner | {"epoch": 1, "ups": "%s", "num_updates": "20", "wall": "9"}' % ups

    (logs / "teacher.log").write_text("\n".join(["$ t", inner(1.0), valid(1, 100, 20.0), valid(2, 200, 19.0)]) + "\n")
    (markers / "teacher.done").write_text("x\n")
    (logs / "tkd_distill.log").write_text("distilled\n")
    (markers / "tkd_bin.done").write_text("x\n")
    (logs / "at_d1_s1.log").write_text("\n".join(["$ a", valid(1, 50, 30.0), valid(2, 100, 31.5), inner(0.61)]) + "\n")
    (markers / "at_d1_s1.done").write_text("x\n")
    # the HRT model's curriculum is done (its own marker), its phase at p_k = 1 silent for an hour
    (logs / "hrt_d1_s1.log").write_text("$ h\n" + valid(1, 100, 25.0) + "\n")
    (markers / "hrt_d1_s1.done").write_text("x\n")
    (logs / "hrt_d1_s1_more.log").write_text("$ h\n" + valid(2, 200, 27.25) + "\n" + inner(0.33) + "\n")
    now = 1_800_000_000.0
    for path in logs.iterdir():
        os.utime(path, (now - 3600, now - 3600))
    os.utime(logs / "at_d1_s1.log", (now - 30, now - 30))
    before = sorted(p.name for p in markers.iterdir())

    rows = {r["step"]: r for r in s.status(now=now)}
    assert list(rows) == ["teacher", "tkd", "at_d1_s1", "hrt_d1_s1", "hrt_d1_s1_from_teacher"]
    assert rows["teacher"]["state"] == "done" and rows["teacher"]["best_valid"]["bleu"] == 20.0
    assert rows["teacher"]["last_valid"] == {"updates": 200, "epoch": 2, "bleu": 19.0}
    assert rows["tkd"]["state"] == "done" and rows["tkd"]["updates"] is None
    # a done marker wins over the log's age; the last logged speed is the last train_inner's
    assert rows["at_d1_s1"]["state"] == "done" and rows["at_d1_s1"]["last_ups"] == 0.61
    hrt = rows["hrt_d1_s1"]
    assert hrt["state"] == "stopped" and hrt["phase"] == "p_k = 1" and hrt["log_age_s"] == 3600
    assert hrt["best_valid"]["bleu"] == 27.25 and hrt["updates"] == 200 and hrt["last_ups"] == 0.33
    assert rows["hrt_d1_s1_from_teacher"]["state"] == "waiting" and "phase" not in rows["hrt_d1_s1_from_teacher"]

    # the same log a minute old: training; without its _more log: the curriculum
    (logs / "hrt_d1_s1_more.log").unlink()
    os.utime(logs / "hrt_d1_s1.log", (now - 60, now - 60))
    hrt = {r["step"]: r for r in s.status(now=now)}["hrt_d1_s1"]
    assert hrt["state"] == "training" and hrt["phase"] == "curriculum" and hrt["best_valid"]["bleu"] == 25.0

    table = study.status_table(s.status(now=now))
    assert "| teacher | done | 200 | 20.00 (1) | 19.00 (2) | 0.02 | 1.00 |" in table
    assert "| hrt_d1_s1 | training, curriculum | 100 | 25.00 (1) | 25.00 (1) | 0.01 | - |" in table
    assert "| hrt_d1_s1_from_teacher | waiting | - | - | - | - | - |" in table
    assert sorted(p.name for p in markers.iterdir()) == before  # read only: no lock, no marker

    # the command: the study's own options plus --status, printing the table
    args = ["--profile", "small", "--converged", "--out", str(tmp_path), "--threads", "1", "--seeds", "1"]
    study.ConvergedStudy(study.parse_args([*args, "--depths", "1", "--lanes", "2", "--status"])).run()
    assert not (tmp_path / "study").exists()
    assert "| at_d1_s1 | done | 100 | 31.50 (2) | 31.50 (2) |" in capsys.readouterr().out
    for wrong in (["--status", "--only", "teacher"], ["--status", "--publish", str(tmp_path / "pub")]):
        with pytest.raises(SystemExit):
            study.parse_args([*args, *wrong])
    with pytest.raises(SystemExit):
        study.parse_args(["--out", str(tmp_path), "--status"])


def test_converged_benchmark_measures_every_model_and_translates_the_blind_sets(tmp_path, monkeypatch):
    """One benchmark run of every AT student (and the teacher) and every HRT model: lean and ONNX
    Runtime, float and int8, CTranslate2 with its vocabulary map (a shortlist), batch 1/8/128,
    1 thread, 1.2 x source + 10; each blind source translated by every system; hrt_bound per HRT."""
    blind = tmp_path / "blind"
    blind.mkdir()
    for name in ("set_a.en", "set_b.en"):
        (blind / name).write_text("A dog.\n")
    s = _converged(tmp_path / "out", "--blind-dir", str(blind))
    ran = {}
    monkeypatch.setattr(s, "run_step", lambda i, name, cmd, outputs, **kw: ran.update({name: cmd}))
    s.step_benchmark(8)
    s.step_bounds(9)
    cmd = ran["benchmark"]
    out = tmp_path / "out"
    assert _option(cmd, "--at") == str(out / "at_d2_s1" / "checkpoint_best.pt")
    assert _option(cmd, "--hrt") == str(out / "hrt_d2_s1" / "checkpoint_best.pt")
    extra = [cmd[i + 1] for i, w in enumerate(cmd) if w == "--at-extra"]
    assert [e.split("=")[0] for e in extra] == ["at_d1_s1", "at_d2_s2", "at_d1_s2", "teacher"]
    hrt_extra = [cmd[i + 1].split("=")[0] for i, w in enumerate(cmd) if w == "--hrt-extra"]
    assert hrt_extra == ["hrt_d1_s1", "hrt_d2_s2", "hrt_d1_s2"]
    assert _option(cmd, "--engines") == "lean,onnxruntime" and _option(cmd, "--int8") == "yes"
    assert (_option(cmd, "--hrt-beams"), _option(cmd, "--hrt-at-mode")) == ("1/1", "no")
    assert _option(cmd, "--batch-sizes") == "1,8,128" and _option(cmd, "--threads") == "1"
    assert (_option(cmd, "--max-len-a"), _option(cmd, "--max-len-b")) == ("1.2", "10")
    assert _option(cmd, "--shortlist") == str(out / "shortlist" / "shortlist.pt")
    translated = [cmd[i + 1] for i, w in enumerate(cmd) if w == "--translate"]
    assert translated == [f"set_a={blind / 'set_a.en'}", f"set_b={blind / 'set_b.en'}"]
    assert _option(cmd, "--translations-dir") == "blind"
    assert sorted(n for n in ran if n.startswith("bound_")) == [
        "bound_hrt_d1_s1",
        "bound_hrt_d1_s2",
        "bound_hrt_d2_s1",
        "bound_hrt_d2_s2",
    ]
    # delivered speed against the AT student of the HRT model's depth and seed, not its AT mode
    assert _option(ran["bound_hrt_d1_s2"], "--at-path") == str(out / "at_d1_s2" / "checkpoint_best.pt")


def test_converged_stage_oracles_of_every_hrt_model_in_the_report(tmp_path, monkeypatch):
    """hrt_quality.py on every HRT model's best checkpoint (k = 2); the report splits each
    model's gap D into stage I and stage II from its oracles."""
    s = _converged(tmp_path)
    ran = {}

    def fake_run(i, name, cmd, outputs, **kw):
        ran[name] = cmd
        k2 = 30.0 if "d2" in name else 28.0
        quality = {
            "chunk_size": 2,
            "systems": {"at_mode_b1": {"bleu": 31.0}, "k2_b1": {"bleu": k2}},
            "gap": {"b1": 31.0 - k2},
            "oracles": {"reference": {"bleu": 45.0}, "at_mode": {"bleu": 30.5}},
            "stage_losses_b1": {"stage2": 0.5, "stage1": 30.5 - k2},
        }
        if "--skeleton-from" in cmd:  # hrt_quality.py's split of the gap to the AT student
            quality["systems"]["at_student_b1"] = {"bleu": 32.0}
            quality["oracles"]["at_student"] = {"bleu": 31.2}
            quality["gap_to_at_student_b1"] = 32.0 - k2
            quality["stage_losses_vs_at_student_b1"] = {"stage2": 0.8, "stage1": 31.2 - k2}
            if "d1" in name:  # the E6D2 files as older runs of hrt_quality.py wrote them: no interval
                quality["paired_bootstrap_vs_at_student_b1"] = {"difference": k2 - 32.0, "ci95": [-4.6, -3.4]}
        outputs[0].write_text(json.dumps(quality))

    monkeypatch.setattr(s, "run_step", fake_run)
    oracles = s.step_oracles(10)
    assert sorted(ran) == ["quality_hrt_d1_s1", "quality_hrt_d1_s2", "quality_hrt_d2_s1", "quality_hrt_d2_s2"]
    cmd = ran["quality_hrt_d1_s2"]
    assert _option(cmd, "--path") == str(tmp_path / "hrt_d1_s2" / "checkpoint_best.pt")
    assert _option(cmd, "--chunk-size") == "2" and _option(cmd, "--json") == str(
        tmp_path / "quality" / "hrt_d1_s2.json"
    )
    # each HRT model against the AT student of its depth and seed, the one it was fine-tuned from
    for name in ran:
        depth_seed = name[len("quality_hrt_") :]
        assert _option(ran[name], "--skeleton-from") == str(tmp_path / f"at_{depth_seed}" / "checkpoint_best.pt")
    assert oracles["hrt_d1_s1"] == {
        "at_student": 32.0,
        "gap_to_at_student": 4.0,
        "oracle_at_student": 31.2,
        "stage2_loss_vs_at_student": 0.8,
        "stage1_loss_vs_at_student": pytest.approx(3.2),
        "hrt_minus_at_student_ci95": [-4.6, -3.4],
        "chunk_size": 2,
        "at_mode": 31.0,
        "k2": 28.0,
        "gap": 3.0,
        "oracle_reference": 45.0,
        "oracle_at_mode": 30.5,
        "stage2_loss": 0.5,
        "stage1_loss": 2.5,
    }
    report = _converged_report_input({}, oracles)
    md = study.converged_report(report)
    assert "| hrt_d1_s1 | 31.00 | 28.00 | 3.00 | 2.50 | 0.50 | 45.00 | 30.50 |" in md
    assert "| hrt_d1_s1 | 32.00 | 28.00 | 4.00 | -4.60 to -3.40 | 3.20 | 0.80 | 31.20 |" in md
    assert "| hrt_d2_s1 | 32.00 | 30.00 | 2.00 | - | 1.20 | 0.80 | 31.20 |" in md
    assert s.at_student_of("hrt_d2_s1_from_teacher") == "at_d2_s1" and s.at_student_of("hrt_d3_s1") is None


def test_only_the_stage_oracles_of_a_trained_hrt_model(tmp_path, monkeypatch):
    """``--only quality_<model>`` runs that model's stage oracles and no training step (a lane
    that has finished its training can run them beside the other); before the model's phase at
    p_k = 1 has finished it is refused, and a name of no HRT model is not a step."""
    s = _converged(tmp_path, "--also-from-teacher", "--only", "quality_hrt_d2_s1_from_teacher")
    ran = []

    def fake_run(i, name, cmd, outputs, **kw):
        ran.append(name)
        if name.startswith("quality_"):
            quality = {
                "chunk_size": 2,
                "systems": {"at_mode_b1": {"bleu": 31.0}, "k2_b1": {"bleu": 30.0}},
                "gap": {"b1": 1.0},
                "oracles": {"reference": {"bleu": 45.0}, "at_mode": {"bleu": 30.5}},
                "stage_losses_b1": {"stage2": 0.5, "stage1": 0.5},
            }
            outputs[0].write_text(json.dumps(quality))

    monkeypatch.setattr(s, "run_step", fake_run)
    with pytest.raises(study.StepError, match="quality_hrt_d2_s1_from_teacher: the model is not trained yet"):
        s.run()
    s.markers.mkdir(parents=True, exist_ok=True)
    (s.markers / "hrt_d2_s1_from_teacher.done").touch()  # its curriculum, not yet the phase at p_k = 1
    with pytest.raises(study.StepError, match="not trained yet"):
        s.run()
    (s.markers / "hrt_d2_s1_from_teacher_more.done").touch()
    ran.clear()
    s.run()
    assert ran == ["prepare", "quality_hrt_d2_s1_from_teacher"]
    assert (tmp_path / "quality" / "hrt_d2_s1_from_teacher.json").exists()
    # the study's report carries the readings taken so far (a reading counts once its step is done)
    assert s.measured_oracles() == {}
    (s.markers / "quality_hrt_d2_s1_from_teacher.done").touch()  # as run_step leaves it
    s.run()
    report = json.loads((s.study_dir / "converged.json").read_text())
    assert list(report["stage_oracles"]) == ["hrt_d2_s1_from_teacher"]
    assert report["stage_oracles"]["hrt_d2_s1_from_teacher"]["k2"] == 30.0
    s.args.only = ["quality_at_d2_s1"]
    with pytest.raises(study.StepError, match="quality_at_d2_s1: not a step of this study"):
        s.run()


def test_the_levers_table_reads_the_pk1_phase_and_beam_5_per_hrt_model():
    """The phase at p_k = 1: best validation after the curriculum against the best within it
    (validations up to the curriculum's last update); b_at = 5: from the stage oracles' run."""

    def model(kind, valid, curriculum=None):
        return {
            "kind": kind,
            "done": True,
            "updates": valid[-1][0],
            "best_updates": max(valid, key=lambda v: v[1])[0],
            "best_valid_bleu": max(b for _, b in valid),
            "curriculum_updates": curriculum,
            "hours": 1.0,
            "valid_bleu": [{"updates": u, "epoch": i, "bleu": b} for i, (u, b) in enumerate(valid)],
        }

    models = {
        "at_d2_s1": model("AT", [(100, 30.0), (200, 31.0)]),
        "hrt_d2_s1": model("HRT", [(100, 28.0), (200, 30.5), (300, 30.0), (400, 31.25)], curriculum=200),
        "hrt_d1_s1": model("HRT", [(100, 20.0)], curriculum=300),
    }
    oracles = {
        "hrt_d2_s1": {
            "chunk_size": 2,
            "k2": 38.86,
            "k2_b5": 39.0,
            "at_mode": 10.85,
            "gap": -28.01,
            "oracle_reference": 67.59,
            "oracle_at_mode": 12.0,
            "stage1_loss": -26.86,
            "stage2_loss": -1.15,
            "at_student": 38.79,
            "gap_to_at_student": -0.07,
            "oracle_at_student": 38.79,
            "stage1_loss_vs_at_student": -0.07,
            "stage2_loss_vs_at_student": 0.0,
        },
    }
    report = _converged_report_input(models, oracles)
    rows = {r["model"]: r for r in study.lever_rows(report)}
    assert sorted(rows) == ["hrt_d1_s1", "hrt_d2_s1"]
    d2 = rows["hrt_d2_s1"]
    assert (d2["curriculum_best_valid"], d2["best_valid"], d2["pk1_phase"]) == (30.5, 31.25, 0.75)
    assert (d2["test_k2"], d2["beam5"]) == (38.86, 0.14)
    # still in its curriculum: no phase at p_k = 1 to read
    assert rows["hrt_d1_s1"]["pk1_phase"] is None and rows["hrt_d1_s1"]["beam5"] is None
    md = study.converged_report(report)
    assert "| hrt_d2_s1 | 30.50 | 31.25 | +0.75 | 38.86 | +0.14 | -0.07 |" in md
    assert "| hrt_d1_s1 | 20.00 | 20.00 | - | - | - | - |" in md


def test_the_targets_read_the_benchmarks_rows_with_their_test_outputs(tmp_path):
    """The quality gap's paired interval comes from the rows' own outputs (``hyps/``, named in
    report.json) against the test references the report names, truncated to the sentences the
    benchmark translated; a row whose outputs are gone leaves its group without an interval."""
    s = _converged(tmp_path)
    bench = tmp_path / "benchmark"
    (bench / "hyps").mkdir(parents=True)
    refs = [f"ein satz nummer {i} mit einigen worten" for i in range(30)]
    (tmp_path / "data" / "raw").mkdir(parents=True)
    (tmp_path / "data" / "raw" / "test.de").write_text("\n".join(refs + ["not translated"]) + "\n")
    outputs = [r.replace("einigen", "vielen") for r in refs]
    systems = []
    for name, family, model, decoding in (
        ("AT[at_d2_s1] greedy", "AT", "at_d2_s1", {"beam": 1}),
        ("HRT[hrt_d2_s1] k=2", "HRT", "hrt_d2_s1", {"decode_chunk_size": 2, "beam": 1, "b_nat": 1}),
    ):
        hyps = f"hyps/{model}.txt"
        (bench / hyps).write_text("\n".join(outputs) + "\n")
        speed = {b: {"words_per_second": 100.0} for b in ("1", "128")}
        systems.append(
            dict(name=name, family=family, checkpoint=f"../{model}/checkpoint_best.pt", decoding=decoding,
                 bleu=30.0, chrf=50.0, speed=speed, hyps=hyps)
        )  # fmt: skip
    report = {"meta": {"test": {"raw_ref": "../data/raw/test.de", "sentences": 30}}, "systems": systems}
    (bench / "report.json").write_text(json.dumps(report))
    (quality,) = s.targets()["quality"]
    assert (quality["gap"], quality["gap_ci95"], quality["ci_side"]) == (0.0, [0.0, 0.0], "above")
    (bench / "hyps" / "hrt_d2_s1.txt").unlink()
    (quality,) = s.targets()["quality"]
    assert "gap_ci95" not in quality and quality["met"]


def _write_files(root, files):
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _files_under(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_publish_copies_the_finished_studys_results_and_names_their_folders(tmp_path):
    """--publish: the benchmark report, every blind output, converged.*, each HRT model's bound and
    quality into one results folder, with SOURCES.md naming where the relative paths point."""
    out, dest = tmp_path / "out", tmp_path / "results"
    s = _converged(out, "--publish", str(dest))
    with pytest.raises(study.StepError, match="run the study without --only first"):
        s.run()
    files = {
        "benchmark/report.md": "r",
        "benchmark/report.json": "{}",
        "benchmark/pareto.png": "p",
        "benchmark/blind/set_a/AT greedy.de": "Ein Hund.\n",
        "benchmark/blind/set_b/HRT k=2 b_at=1 b_nat=1.de": "Zwei.\n",
        "study/converged.md": "c",
        "study/converged.json": "{}",
        "bounds/hrt_d2_s1/hrt_bound.md": "b",
        "bounds/hrt_d2_s1/hrt_bound.json": "{}",
        "quality/hrt_d2_s1.json": "{}",
        "at_d2_s1/checkpoint_best.pt": "not copied",
    }
    _write_files(out, files)
    s.run()  # trains nothing: no marker is written
    assert not (out / "markers").exists()
    published = _files_under(dest)
    assert published == [
        "SOURCES.md",
        "blind/set_a/AT greedy.de",
        "blind/set_b/HRT k=2 b_at=1 b_nat=1.de",
        "bounds/hrt_d2_s1.json",
        "bounds/hrt_d2_s1.md",
        "converged.json",
        "converged.md",
        "pareto.png",
        "quality/hrt_d2_s1.json",
        "report.json",
        "report.md",
    ]
    assert (dest / "blind" / "set_a" / "AT greedy.de").read_text() == "Ein Hund.\n"
    assert f"`{out / 'benchmark'}`" in (dest / "SOURCES.md").read_text()
    with pytest.raises(SystemExit):
        study.parse_args(["--profile", "small", "--publish", str(dest)])


def test_a_step_run_by_another_process_is_refused_not_run_twice(tmp_path):
    """Two processes on one step (overlapping --only lanes) would train into the same folder:
    the second stops with a message while the first holds the step's lock, and runs it after."""
    s = _converged(tmp_path)
    s.markers.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "made.txt"
    cmd = [sys.executable, "-c", f"open({str(out)!r}, 'w').write('x')"]
    with open(s.markers / "at_d1_s1.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("process 123 (since then)\n")
        held.flush()
        with pytest.raises(study.StepError, match=r"process 123 \(since then\) is running this step now"):
            s.run_step(4, "at_d1_s1", cmd, [out])
        assert not out.exists() and not (s.markers / "at_d1_s1.done").exists()
    s.run_step(4, "at_d1_s1", cmd, [out])
    assert out.exists() and (s.markers / "at_d1_s1.done").exists()
    assert (s.markers / "at_d1_s1.lock").read_text().startswith("process ")


# A stand-in for fairseq-train: logs the updates its plan file gives as fairseq's json lines,
# ends by patience when the plan says so, writes its checkpoint and counts its runs; its time cap
# is an ordinary option here. The plan is outside the command, as a run's outcome is.
_FAKE_TRAIN = """
import sys, pathlib
out = pathlib.Path(sys.argv[1])
updates, ending = out.with_suffix(".plan").read_text().split()
print('{"epoch": 1, "train_num_updates": "%s"}' % updates)
if ending == "patience":
    print("early stop since valid performance hasn't improved for last 10 runs")
out.write_text("checkpoint")
runs = out.with_suffix(".runs")
runs.write_text(str(int(runs.read_text()) + 1 if runs.exists() else 1))
"""


def _fake_train(folder, hours: float, *extra: str, plan: str = "100 patience"):
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "checkpoint_best.pt"
    out.with_suffix(".plan").write_text(plan)
    return [sys.executable, "-c", _FAKE_TRAIN, str(out), "--stop-time-hours", str(hours), *extra], out


def _runs(out) -> int:
    runs = out.with_suffix(".runs")
    return int(runs.read_text()) if runs.exists() else 0


def test_an_unfinished_training_step_resumes_under_another_time_cap_and_nothing_else(tmp_path, capsys):
    """fairseq counts --stop-time-hours over restarts: a run interrupted under one cap may go on
    under another (the only change to its command that a resumed run takes)."""
    s = _converged(tmp_path)
    s.markers.mkdir(parents=True, exist_ok=True)
    first, out = _fake_train(tmp_path, 12)
    (s.markers / "at_d1_s1.cmd").write_text(study.shlex.join(first) + "\n")  # interrupted: no marker
    other, _ = _fake_train(tmp_path, 12, "--lr", "1")
    with pytest.raises(study.StepError, match="an interrupted run of another command"):
        s.run_step(4, "at_d1_s1", other, [out], train_max_update=1000)
    assert _runs(out) == 0
    raised, _ = _fake_train(tmp_path, 40)
    s.run_step(4, "at_d1_s1", raised, [out], train_max_update=1000)
    assert "its time cap is now 40 h (its last run had 12 h)" in capsys.readouterr().err
    assert _runs(out) == 1
    assert study.shlex.split((s.markers / "at_d1_s1.done").read_text()) == raised


def test_a_done_training_step_under_another_time_cap_stands_or_trains_on_as_its_cap_decides(tmp_path, capsys):
    """Done by patience under 12 h: a higher cap makes the same model (skipped), a lower one might
    not (refused). Stopped by its 12 h cap: a higher cap trains it on, a lower one is refused."""
    s = _converged(tmp_path)
    teacher = tmp_path / "teacher"
    by_patience, out = _fake_train(teacher, 12)
    s.run_step(3, "teacher", by_patience, [out], train_max_update=1000)
    assert _runs(out) == 1
    s.run_step(3, "teacher", _fake_train(teacher, 40)[0], [out], train_max_update=1000)
    assert "done earlier under a 12 h time cap, which did not stop it; it stands under 40 h" in capsys.readouterr().err
    assert _runs(out) == 1 and (s.markers / "teacher.done").read_text().split()[-1] == "12"
    with pytest.raises(study.StepError, match="trained under a 12 h time cap; this run's 2 h would have stopped"):
        s.run_step(3, "teacher", _fake_train(teacher, 2)[0], [out], train_max_update=1000)
    with pytest.raises(study.StepError, match="made by another command"):
        s.run_step(3, "teacher", _fake_train(teacher, 40, "--lr", "1")[0], [out], train_max_update=1000)
    assert _runs(out) == 1

    student = tmp_path / "at"
    by_cap, out = _fake_train(student, 12, plan="300 cap")
    s.run_step(4, "at_d1_s1", by_cap, [out], train_max_update=1000)
    assert "stopped by the time cap after 300 of 1000 updates" in capsys.readouterr().err
    with pytest.raises(study.StepError, match="which stopped it; this run's 6 h"):
        s.run_step(4, "at_d1_s1", _fake_train(student, 6)[0], [out], train_max_update=1000)
    more, _ = _fake_train(student, 40, plan="700 patience")
    s.run_step(4, "at_d1_s1", more, [out], train_max_update=1000)
    assert "stopped by its 12 h time cap, training on up to 40 h" in capsys.readouterr().err
    assert _runs(out) == 2
    assert (s.markers / "at_d1_s1.done").read_text().split()[-1] == "40"


def test_the_interim_benchmark_measures_the_first_seed_alone_and_writes_its_targets(tmp_path, monkeypatch):
    """--interim-benchmark: the first seed's students and the teacher, benchmarked as the study's
    own benchmark is (same options), into benchmark_s1, with the bounds of the first seed's HRT
    models; its targets (one seed) beside the study's report; refused until they are trained."""
    out = tmp_path / "out"
    s = _converged(out, "--interim-benchmark", "--also-from-teacher")
    assert s.interim_benchmark() == "benchmark_s1"
    assert s.seed_models(1) == ["at_d2_s1", "hrt_d2_s1", "at_d1_s1", "hrt_d1_s1"]
    ran = {}
    monkeypatch.setattr(s, "run_step", lambda i, name, cmd, outputs, **kw: ran.update({name: cmd}))
    monkeypatch.setattr(s, "targets", lambda bench, hrt: {"bench": bench, "hrt": hrt, "quality": []})
    monkeypatch.setattr(study.study_targets, "targets_markdown", lambda t, title: f"{title}: {t['bench']}\n")
    s.step_interim_benchmark(8)
    cmd = ran["benchmark_s1"]
    assert _option(cmd, "--out-dir") == str(out / "benchmark_s1")
    assert _option(cmd, "--log-file") == str(out / "logs" / "benchmark_s1.log")
    assert _option(cmd, "--at") == str(out / "at_d2_s1" / "checkpoint_best.pt")
    assert _option(cmd, "--hrt") == str(out / "hrt_d2_s1" / "checkpoint_best.pt")
    assert [cmd[i + 1].split("=")[0] for i, w in enumerate(cmd) if w == "--at-extra"] == ["at_d1_s1", "teacher"]
    assert [cmd[i + 1].split("=")[0] for i, w in enumerate(cmd) if w == "--hrt-extra"] == ["hrt_d1_s1"]
    assert sorted(n for n in ran if n.startswith("bound_")) == ["bound_hrt_d1_s1", "bound_hrt_d2_s1"]
    assert "shortlist" in ran
    # the same measurement as the study's own benchmark, but for the models and the folder
    s.step_benchmark(8)
    final = ran["benchmark"]
    named = {"--at", "--hrt", "--at-extra", "--hrt-extra", "--out-dir", "--log-file"}

    def measured(c):  # the command less what names the models and the folders
        return [w for i, w in enumerate(c) if w not in named and c[i - 1] not in named]

    assert measured(cmd) == measured(final) and len(measured(cmd)) > 30
    targets = json.loads((out / "study" / "benchmark_s1_targets.json").read_text())
    assert targets["bench"] == "benchmark_s1" and targets["hrt"] == ["hrt_d2_s1", "hrt_d1_s1"]
    title = "The targets on seed 1 alone, from the interim benchmark (benchmark_s1)"
    assert (out / "study" / "benchmark_s1_targets.md").read_text() == f"{title}: benchmark_s1\n"
    # by --only (the lanes' way), refused while a first-seed model is untrained
    s = _converged(out, "--interim-benchmark", "--only", "benchmark_s1")
    ran.clear()
    monkeypatch.setattr(s, "run_step", lambda i, name, cmd, outputs, **kw: ran.update({name: cmd}))
    monkeypatch.setattr(s, "targets", lambda bench, hrt: {"bench": bench, "hrt": hrt, "quality": []})
    with pytest.raises(study.StepError, match="train at_d2_s1, hrt_d2_s1, at_d1_s1, hrt_d1_s1 first"):
        s.run()
    assert list(ran) == ["prepare"]
    s.markers.mkdir(parents=True, exist_ok=True)
    for name in ("at_d2_s1", "at_d1_s1", "hrt_d2_s1_more", "hrt_d1_s1_more"):
        (s.markers / f"{name}.done").touch()
    s.run()
    assert list(ran) == ["prepare", "shortlist", "bound_hrt_d2_s1", "bound_hrt_d1_s1", "benchmark_s1"]
    # the study's report carries its verdicts once the step is done (run_step leaves its marker)
    assert title not in (out / "study" / "converged.md").read_text()
    (s.markers / "benchmark_s1.done").touch()
    s.run()
    assert f"{title}: benchmark_s1" in (out / "study" / "converged.md").read_text()
    for wrong in (["--interim-benchmark", "--seeds", "1"], ["--interim-benchmark"]):
        with pytest.raises(SystemExit):
            study.parse_args(["--profile", "small", *(["--converged"] if "--seeds" in wrong else []), *wrong])


def test_publish_copies_the_interim_benchmark_when_it_is_all_there_is(tmp_path):
    out, dest = tmp_path / "out", tmp_path / "results"
    s = _converged(out, "--interim-benchmark", "--publish", str(dest))
    files = {
        "benchmark_s1/report.md": "r",
        "benchmark_s1/report.json": "{}",
        "benchmark_s1/blind/set_a/AT greedy.de": "Ein Hund.\n",
        "study/benchmark_s1_targets.md": "t",
        "study/benchmark_s1_targets.json": "{}",
        "quality/hrt_d2_s1.json": "{}",
    }
    _write_files(out, files)
    s.run()
    published = _files_under(dest)
    assert published == [
        "SOURCES.md",
        "benchmark_s1/blind/set_a/AT greedy.de",
        "benchmark_s1/report.json",
        "benchmark_s1/report.md",
        "benchmark_s1/targets.json",
        "benchmark_s1/targets.md",
        "quality/hrt_d2_s1.json",
    ]
    assert f"`{out / 'benchmark_s1'}`" in (dest / "SOURCES.md").read_text()
