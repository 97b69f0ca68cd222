"""Killed or failing runs: checkpoint files (atomic copies, unreadable or unwritable
checkpoints), the task's checkpointed state, a training run SIGKILLed while it writes a
checkpoint and resumed (the recipe killed and re-run: tests/test_recipe_killed.py).

The long loops (every model kind, random kill moments, full disk, ...) are in
benchmarks/fault_table.py, which prints the README's fault table (its cases are in
benchmarks/faults.py); these are their compact versions."""

import errno
import logging
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.trainer import Trainer

import fairseq_hrt  # noqa: F401  (applies compat)
from benchmarks import faults
from fairseq_hrt import compat
from fairseq_hrt.testing.tiny_runs import make_tiny_data, parse_logs, train_args
from tests.hrt_fixtures import build_task_and_model


def _save(path, value=1.0):
    torch.save({"model": {"w": torch.full((1000,), value)}, "optimizer_history": [{"num_updates": int(value)}]}, path)


# ------------------------------------------------------------------------ checkpoint files


def test_checkpoint_copies_are_atomic_and_a_failed_copy_keeps_the_old_file(tmp_path, monkeypatch):
    src, dst = tmp_path / "checkpoint_1_5.pt", tmp_path / "checkpoint_last.pt"
    _save(src, 5.0)
    _save(dst, 4.0)
    assert getattr(checkpoint_utils.PathManager, "__fairseq_hrt_compat__", False)  # fairseq's copies go through it
    assert checkpoint_utils.PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == src.read_bytes() and not (tmp_path / "checkpoint_last.pt.tmp").exists()

    _save(dst, 4.0)
    before = dst.read_bytes()

    def copy_until_the_disk_is_full(a, b, *args, **kwargs):
        Path(b).write_bytes(Path(a).read_bytes()[:100])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfile", copy_until_the_disk_is_full)
    with pytest.raises(compat.CheckpointWriteError, match="No space left on device.*complete and unchanged"):
        checkpoint_utils.PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == before  # the old checkpoint_last.pt is whole
    assert not (tmp_path / "checkpoint_last.pt.tmp").exists()  # the partial copy does not hold the space


def test_an_unreadable_checkpoint_names_the_restore_file_to_use(tmp_path):
    good_old, good_new, last = (
        tmp_path / "checkpoint_1_5.pt",
        tmp_path / "checkpoint_2_10.pt",
        tmp_path / "checkpoint_last.pt",
    )
    _save(good_old, 5.0)
    _save(good_new, 10.0)
    os.utime(good_old, (1, 1))  # older
    _save(last, 12.0)
    last.write_bytes(last.read_bytes()[:3000])  # killed half-way through a copy by fairseq alone
    with pytest.raises(compat.CheckpointReadError) as info:
        checkpoint_utils.load_checkpoint_to_cpu(str(last))
    message = str(info.value)
    assert str(last) in message and "corrupted" in message  # PyTorch's own words are kept
    assert f"--restore-file {good_new}" in message  # the newest complete one
    assert "checkpoint_2_10.pt, checkpoint_1_5.pt" in message

    with pytest.raises(FileNotFoundError):  # other errors pass unchanged
        checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "missing.pt"))
    assert compat.readable_checkpoints(str(tmp_path)) == [str(good_new), str(good_old)]


def test_a_failed_save_removes_its_partial_file_and_says_what_is_kept(tmp_path):
    last = tmp_path / "checkpoint_last.pt"
    _save(last, 4.0)

    def save_on_a_full_disk(trainer, filename, extra_state):
        Path(filename + ".tmp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    wrapped = compat._save_checkpoint_cleaning_up_on_failure(save_on_a_full_disk)
    with pytest.raises(compat.CheckpointWriteError) as info:
        wrapped(None, str(last), {})
    assert info.value.errno == errno.ENOSPC
    assert "No space left on device" in str(info.value) and "complete and unchanged" in str(info.value)
    assert not Path(str(last) + ".tmp").exists()

    assert getattr(Trainer.save_checkpoint, "__fairseq_hrt_compat__", False)


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
