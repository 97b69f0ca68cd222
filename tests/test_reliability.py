"""Killed or failing runs: a truncated checkpoint refused with the --restore-file to use, the
task's checkpointed state, a training run SIGKILLed while it writes a
checkpoint and resumed (the recipe killed and re-run: tests/test_recipe_killed.py).

The long loops (every model kind, random kill moments, full disk, ...) are in
benchmarks/fault_table.py, which prints the README's fault table (its cases are in
benchmarks/faults.py); these are their compact versions."""

import logging
import os
import signal

import pytest
import torch
from fairseq import tasks

from benchmarks import faults
from fairseq_hrt import checkpoint_files
from fairseq_hrt.criterions.hrt_loss import HRTLossCriterion
from fairseq_hrt.testing.tiny_runs import make_tiny_data, parse_logs, train_args
from tests.hrt_fixtures import build_task_and_model, training_args


def _save(path, value=1.0):
    torch.save({"model": {"w": torch.full((1000,), value)}, "optimizer_history": [{"num_updates": int(value)}]}, path)


# ------------------------------------------------------------------------ checkpoint files


def _truncated_folder(tmp_path):
    good_old, good_new, last = (
        tmp_path / "checkpoint_1_5.pt",
        tmp_path / "checkpoint_2_10.pt",
        tmp_path / "checkpoint_last.pt",
    )
    _save(good_old, 5.0)
    _save(good_new, 10.0)
    os.utime(good_old, (1, 1))  # older
    _save(last, 12.0)
    last.write_bytes(last.read_bytes()[:3000])  # killed half-way through fairseq's copy
    return good_old, good_new, last


def test_a_truncated_checkpoint_names_the_restore_file_to_use(tmp_path):
    good_old, good_new, last = _truncated_folder(tmp_path)
    assert checkpoint_files.is_truncated_archive(str(last))
    assert not checkpoint_files.is_truncated_archive(str(good_new))
    with pytest.raises(checkpoint_files.CheckpointReadError) as info:
        checkpoint_files.check_checkpoint_to_restore(str(tmp_path), "checkpoint_last.pt", None)
    message = str(info.value)
    assert str(last) in message and "truncated" in message
    assert f"--restore-file {good_new}" in message  # the newest complete one
    assert "checkpoint_2_10.pt, checkpoint_1_5.pt" in message
    assert checkpoint_files.readable_checkpoints(str(tmp_path)) == [str(good_new), str(good_old)]
    # an explicit --restore-file of a complete checkpoint, or nothing to restore, passes
    checkpoint_files.check_checkpoint_to_restore(str(tmp_path), str(good_new), None)
    checkpoint_files.check_checkpoint_to_restore(str(tmp_path / "fresh"), "checkpoint_last.pt", None)


def test_the_task_refuses_to_resume_from_a_truncated_checkpoint(tmp_path):
    """fairseq-train builds the criterion just before it restores the checkpoint: the task
    checks the file there, so a truncated checkpoint_last.pt is one message instead of PyTorch's
    traceback; a folder of complete checkpoints trains as before."""
    (tmp_path / "data").mkdir()
    save = tmp_path / "ck"
    save.mkdir()
    _, good_new, _ = _truncated_folder(save)
    args = training_args(str(tmp_path / "data"), extra=["--save-dir", str(save), "--criterion", "hrt_loss"])
    task = tasks.setup_task(args)
    with pytest.raises(checkpoint_files.CheckpointReadError, match=f"--restore-file {good_new}"):
        task.build_criterion(args)
    (save / "checkpoint_last.pt").unlink()
    _save(save / "checkpoint_last.pt", 12.0)
    assert isinstance(task.build_criterion(args), HRTLossCriterion)


def test_task_state_refuses_another_dictionary_and_warns_about_another_schedule(tmp_path, caplog):
    task, _ = build_task_and_model(str(tmp_path), extra=["--max-update", "40"])
    state = task.get_checkpoint_dict()[type(task).__name__]
    assert state["curriculum_updates"] == 40 and state["chunk_sizes"] == [2, 3]
    task.set_checkpoint_dict(dict(state))  # the same run resumes silently
    with caplog.at_level(logging.WARNING):
        task.set_checkpoint_dict({**state, "curriculum_updates": 80})
    assert any("curriculum_updates 80 -> 40" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="another dictionary"):
        task.set_checkpoint_dict({**state, "dictionary": "00000000"})
    # same symbols in another order -> another fingerprint
    (tmp_path / "other").mkdir()
    other, _ = build_task_and_model(str(tmp_path / "other"), extra=["--max-update", "40"])
    assert other.dictionary_fingerprint() == task.dictionary_fingerprint()
    other.source_dictionary.symbols[5], other.source_dictionary.symbols[6] = (
        other.source_dictionary.symbols[6],
        other.source_dictionary.symbols[5],
    )
    assert other.dictionary_fingerprint() != task.dictionary_fingerprint()


# --------------------------------------------------------------------- killed training


@pytest.mark.slow
def test_hrt_training_killed_while_writing_a_checkpoint_resumes_the_curriculum(tmp_path):
    """One SIGKILL half-way through a checkpoint write (the fault table's launcher), one resume:
    the previous checkpoint_last.pt is complete, the run resumes from it, loses less than one
    save interval and trains every later update with the curriculum's p_k = t / T."""
    data = make_tiny_data(tmp_path / "data", n_train=300, n_valid=20)
    save, max_update, interval = tmp_path / "ck", 16, 5
    args = train_args(
        data.bin_dir,
        save,
        "--chunk-sizes",
        "2",
        "--save-interval-updates",
        interval,
        arch="hrt_tiny",
        max_update=max_update,
    )
    info = tmp_path / "kill.json"
    rc, out = faults.run_logged(args, tmp_path / "killed.log", kill_point="write:3", info=info)
    assert rc == -signal.SIGKILL, out[-3000:]
    assert info.exists() and info.read_text().count(".tmp") == 1  # killed inside fairseq's .tmp write
    killed_at = max(faults.updates_logged(out))
    files = faults.dir_state(save)
    assert isinstance(files["checkpoint_last.pt"], int)  # complete, from the previous save
    rc, out2 = faults.run_logged(args, tmp_path / "resumed.log")
    assert rc == 0, out2[-3000:]
    back = faults.resumed_from(out2)
    assert back == files["checkpoint_last.pt"] and 0 <= killed_at - back <= interval
    records = {int(r["num_updates"]): r for r in parse_logs(out2)}
    assert sorted(records) == list(range(back + 1, max_update + 1))
    for t, r in records.items():
        assert r["p_k"] == pytest.approx(t / max_update, abs=6e-4), t  # logged with 3 decimals
