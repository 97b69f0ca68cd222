"""examples/multi30k/gpu_handoff.py: a study step's command as the GPU runs it, and the trainer
state's round trip (pack there, receive here) into a checkpoint fairseq-train resumes."""

import importlib.util
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.tiny_runs import run_cli, train_args

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_handoff", REPO / "examples" / "multi30k" / "gpu_handoff.py")
handoff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(handoff)
sys.path.insert(0, str(REPO / "examples" / "multi30k"))
_spec = importlib.util.spec_from_file_location("hrt_study", REPO / "examples" / "multi30k" / "study.py")
study_py = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study_py)

STUDY = "/cache/study-small"
STUDY_CMD = (
    f"/venv/bin/python -m fairseq_cli.train {STUDY}/data/data-bin --user-dir /work/main/fairseq_hrt "
    "--task hrt_translation --arch at_small --max-tokens 4096 --stop-time-hours 12.0 "
    f"--save-dir {STUDY}/at_d2_s2 --seed 2 --num-workers 0 --cpu --cpu-autocast-bf16 --hrt-mode at "
    f"--distill-data {STUDY}/tkd/distill-bin --p-raw 0.5 "
    '--eval-bleu-args \'{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}\' --patience 10'
)


def test_gpu_command_keeps_the_study_options_and_moves_the_folders():
    cmd = handoff.gpu_command(shlex.split(STUDY_CMD), Path(STUDY), 7.0, "$W/at_d2_s2")
    assert cmd[:3] == ["python3", "-m", "fairseq_cli.train"]
    assert "--cpu" not in cmd and "--cpu-autocast-bf16" not in cmd
    assert cmd[3] == "$G/study/data/data-bin"
    assert cmd[cmd.index("--distill-data") + 1] == "$G/study/tkd/distill-bin"
    assert cmd[cmd.index("--save-dir") + 1] == "$W/at_d2_s2"
    assert cmd[cmd.index("--user-dir") + 1] == "$REPO/fairseq_hrt"
    assert float(cmd[cmd.index("--stop-time-hours") + 1]) == pytest.approx(7.0 / 60, abs=1e-4)
    # everything that decides the model is the study's: seed, batch, data mixing, patience
    for option in ("--seed", "--max-tokens", "--p-raw", "--patience", "--eval-bleu-args", "--hrt-mode"):
        assert cmd[cmd.index(option) + 1] == shlex.split(STUDY_CMD)[shlex.split(STUDY_CMD).index(option) + 1]


def test_gpu_command_refuses_what_is_not_a_training():
    with pytest.raises(SystemExit, match="not a fairseq-train command"):
        handoff.gpu_command(["python", "-m", "fairseq_cli.generate", "data"], Path(STUDY), 7.0, "$W/x")


def test_packed_state_resumes_in_fairseq_train(trained, tmp_path):
    """pack (GPU side) -> receive (here): the weights exactly, Adam's moments to bfloat16
    precision, and fairseq-train resumes the step at its update with its optimizer."""
    data, ckpts = trained
    work, out, study = tmp_path / "work", tmp_path / "out", tmp_path / "study"
    (work / "at").mkdir(parents=True)
    shutil.copy(ckpts["at_tiny"], work / "at" / "checkpoint_last.pt")
    shutil.copy(ckpts["at_tiny"], work / "at" / "checkpoint_best.pt")
    (work / "at.log").write_text("the GPU's training log\n")
    handoff.main(["pack", str(work), "at", str(out)])
    parts = sorted(out.glob("at.state.*"))
    assert parts and all(p.stat().st_size <= handoff.PART_BYTES for p in parts)

    (study / "logs").mkdir(parents=True)
    (study / "logs" / "at.log").write_text("the CPU's start\n")
    handoff.main(["receive", str(study), str(out)])
    original = torch.load(ckpts["at_tiny"], map_location="cpu", weights_only=False)
    back = torch.load(study / "at" / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    for name, weight in original["model"].items():
        assert torch.equal(weight, back["model"][name]), name
    for index, state in original["last_optimizer_state"]["state"].items():
        moment = back["last_optimizer_state"]["state"][index]["exp_avg_sq"]
        assert moment.dtype == torch.float32
        assert torch.allclose(moment, state["exp_avg_sq"], rtol=1 / 128, atol=0)
    assert (study / "at" / "checkpoint_best.pt").exists()  # the same update: a copy of last
    log = (study / "logs" / "at.log").read_text()
    assert log.startswith("the CPU's start\n") and "the GPU's training log" in log

    with pytest.raises(SystemExit, match="exists"):  # a step the study trained meanwhile
        handoff.main(["receive", str(study), str(out)])

    done = original["optimizer_history"][-1]["num_updates"]
    resumed = run_cli(train_args(data.bin_dir, study / "at", "--hrt-mode", "at", arch="at_tiny", max_update=done + 2))
    assert f"@ {done} updates" in resumed.stdout
    assert (
        torch.load(study / "at" / "checkpoint_last.pt", weights_only=False)["optimizer_history"][-1]["num_updates"]
        == done + 2
    )


def test_start_checkpoint_travels_without_optimizer_and_with_tied_weights_once(trained, tmp_path):
    """An HRT step fine-tunes from its AT student's best checkpoint: it travels with its float32
    weights alone, the tied embeddings once even where the GPU saved one copy per use."""
    _, ckpts = trained
    state = torch.load(ckpts["at_tiny"], map_location="cpu", weights_only=False)
    tied = [n for n in state["model"] if n.endswith("embed_tokens.weight") or n.endswith("output_projection.weight")]
    assert len(tied) >= 2
    for name in tied:  # as a checkpoint written on a GPU holds them
        state["model"][name] = state["model"][name].clone()
    gpu_saved = tmp_path / "gpu_best.pt"
    torch.save(state, gpu_saved)
    slim = tmp_path / "start.pt"
    handoff.slim_start(gpu_saved, slim)
    back = torch.load(slim, map_location="cpu", weights_only=False)
    assert "last_optimizer_state" not in back
    for name, weight in state["model"].items():
        assert torch.equal(weight, back["model"][name]) and back["model"][name].dtype == weight.dtype
    assert len({back["model"][n].untyped_storage().data_ptr() for n in tied}) == 1
    assert slim.stat().st_size < gpu_saved.stat().st_size


def test_prepare_carries_the_steps_inputs_and_refuses_a_started_step(trained, tmp_path):
    data, ckpts = trained
    study = tmp_path / "study"
    shutil.copytree(data.bin_dir, study / "data" / "data-bin")
    (study / "at").mkdir(parents=True)
    shutil.copy(ckpts["at_tiny"], study / "at" / "checkpoint_best.pt")
    (study / "markers").mkdir()
    cmd = (
        f"/venv/bin/python -m fairseq_cli.train {study}/data/data-bin --arch hrt_tiny --cpu "
        f"--save-dir {study}/hrt --finetune-from-model {study}/at/checkpoint_best.pt --stop-time-hours 12.0"
    )
    (study / "markers" / "hrt.cmd").write_text(cmd + "\n")
    site, dest = tmp_path / "site.tar.xz", tmp_path / "carry"
    site.write_bytes(b"packed fairseq")
    handoff.main(["prepare", str(study), "hrt", "--minutes", "5", "--dest", str(dest), "--site", str(site)])
    run_sh = (dest / "run.sh").read_text()
    assert "--finetune-from-model $G/study/at/checkpoint_best.pt" in run_sh
    assert "--save-dir $W/hrt" in run_sh and " --cpu " not in run_sh
    # each GPU run's log begins with the line by which study.py counts its hours apart
    assert f"printf '%s\\n' '{handoff.GPU_RUN} python3 -m fairseq_cli.train" in run_sh
    assert handoff.GPU_RUN == study_py.GPU_RUN
    assert sorted(p.name for p in (dest / "study" / "data" / "data-bin").iterdir()) == sorted(
        p.name for p in Path(data.bin_dir).iterdir() if not p.name.startswith("test.") and p.suffix != ".log"
    )
    assert "last_optimizer_state" not in torch.load(dest / "study" / "at" / "checkpoint_best.pt", weights_only=False)

    (study / "hrt").mkdir()
    shutil.copy(ckpts["hrt_tiny"], study / "hrt" / "checkpoint_last.pt")
    with pytest.raises(SystemExit, match="under way"):
        handoff.main(["prepare", str(study), "hrt", "--dest", str(dest), "--site", str(site)])
