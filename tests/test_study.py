"""examples/multi30k/study.py: its pure parts (budgets, checkpoints per budget, logs, report)."""

import importlib.util
import json
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
