"""python -m fairseq_hrt.average_checkpoints: fairseq's scripts/average_checkpoints.py (not in the wheel).

One tiny HRT run (12 updates, a few per epoch, --save-interval-updates 1) leaves epoch
checkpoints (checkpoint1.pt, ...) and update checkpoints (checkpoint_1_1.pt, ..., every update
that does not end an epoch); the tests average them, load and decode the result with fairseq,
and damage copies of them.
"""

import os
import re
import shutil

import pytest
import torch
from fairseq import checkpoint_utils

from fairseq_hrt.average_checkpoints import AveragingError, average_checkpoints, last_n_checkpoints
from fairseq_hrt.testing.tiny_runs import USER_DIR, make_tiny_data, run_cli, train_args
from tests.tiny_data import hyp_lines

AVERAGE = "fairseq_hrt.average_checkpoints"
EPOCH = r"checkpoint(\d+)\.pt"
UPDATE = r"checkpoint_\d+_(\d+)\.pt"
GEN = ["--user-dir", USER_DIR, "--task", "hrt_translation", "--source-lang", "en", "--target-lang", "de", "--cpu"]


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _newest(save_dir, pattern, n, upper_bound=None):
    """The ``n`` files of ``save_dir`` whose names match ``pattern`` with the highest number."""
    numbered = [(int(m.group(1)), name) for name in os.listdir(save_dir) if (m := re.fullmatch(pattern, name))]
    numbered = [(k, name) for k, name in numbered if upper_bound is None or k <= upper_bound]
    return [str(save_dir / name) for _, name in sorted(numbered, reverse=True)[:n]]


def _assert_mean(averaged, paths):
    states = [_load(p) for p in paths]
    assert averaged["model"].keys() == states[0]["model"].keys()
    differing = 0
    for key, tensor in averaged["model"].items():
        mean = torch.stack([s["model"][key].double() for s in states]).mean(0)
        torch.testing.assert_close(tensor.double(), mean, rtol=1e-6, atol=1e-7)
        differing += not torch.equal(states[0]["model"][key], states[-1]["model"][key])
    assert differing > 0  # different weights: the mean is none of them
    return states


def _one_error_line(output):
    errors = [line for line in output.splitlines() if line.startswith(f"python -m {AVERAGE}: error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output
    return errors[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``(TinyData, checkpoint directory)`` of one tiny run with epoch and update checkpoints."""
    root = tmp_path_factory.mktemp("average_checkpoints")
    data = make_tiny_data(root, n_train=60, n_valid=10)
    save_dir = root / "checkpoints"
    args = train_args(
        data.bin_dir, save_dir, "--chunk-sizes", "2,3", "--save-interval-updates", "1", max_update=12, max_tokens=300
    )
    args.remove("--no-epoch-checkpoints")  # the epoch checkpoints are averaged too
    run_cli(args)
    names = os.listdir(save_dir)
    assert len(_newest(save_dir, EPOCH, 3)) == 3 and len(_newest(save_dir, UPDATE, 3)) == 3, names
    return data, save_dir


@pytest.mark.slow  # trains a tiny model (the run fixture)
def test_average_of_the_last_update_checkpoints_is_their_mean_and_decodes(run, tmp_path):
    data, save_dir = run
    output = tmp_path / "averaged.pt"
    out = run_cli([AVERAGE, "--inputs", save_dir, "--num-update-checkpoints", "3", "--output", output]).stdout
    picked = _newest(save_dir, UPDATE, 3)
    assert f"averaging 3 checkpoint(s): {', '.join(picked)}" in out

    averaged = _load(output)
    states = _assert_mean(averaged, picked)
    # everything but the weights is the newest checkpoint's (fairseq's script keeps its first input's)
    assert averaged["cfg"] == states[0]["cfg"]
    assert averaged["optimizer_history"] == states[0]["optimizer_history"]

    # fairseq loads these very weights, and fairseq-generate decodes with them
    models, _, _ = checkpoint_utils.load_model_ensemble_and_task(
        [str(output)], arg_overrides={"data": str(data.bin_dir)}
    )
    loaded = models[0].state_dict()
    for key, tensor in averaged["model"].items():
        assert torch.equal(loaded[key], tensor), key
    generated = run_cli(
        ["generate", data.bin_dir, "--path", output, "--gen-subset", "valid", "--beam", "1", "--max-len-b", "8", *GEN]
    ).stdout
    assert sorted(hyp_lines(generated)) == list(range(10))


@pytest.mark.slow  # trains a tiny model (the run fixture)
def test_epoch_checkpoints_up_to_a_bound_and_named_files(run, tmp_path):
    _, save_dir = run
    bounded = last_n_checkpoints(str(save_dir), 2, update_based=False, upper_bound=2)
    assert bounded == _newest(save_dir, EPOCH, 2, upper_bound=2)
    assert [os.path.basename(p) for p in bounded] == ["checkpoint2.pt", "checkpoint1.pt"]
    assert last_n_checkpoints(str(save_dir), 3, update_based=False) == _newest(save_dir, EPOCH, 3)

    output = tmp_path / "epochs.pt"
    run_cli(
        [AVERAGE, "--inputs", save_dir, "--num-epoch-checkpoints", "2", "--checkpoint-upper-bound", "2"]
        + ["--output", output]
    )
    _assert_mean(_load(output), bounded)
    # files named one by one: the first one's state is kept
    named = [str(save_dir / "checkpoint1.pt"), str(save_dir / "checkpoint3.pt")]
    averaged = average_checkpoints(named)
    _assert_mean(averaged, named)
    assert averaged["optimizer_history"] == _load(named[0])["optimizer_history"]


def test_half_precision_and_integer_tensors(tmp_path):
    """fp16 weights are summed in float32 (written as float32, as fairseq does); integer
    tensors get the floor of their mean (fairseq's ``//``)."""
    paths = []
    for i, (half, count) in enumerate([([60000.0, 1.0], 3), ([60000.0, 2.0], 4)]):
        paths.append(str(tmp_path / f"checkpoint{i}.pt"))
        torch.save({"model": {"w": torch.tensor(half, dtype=torch.float16), "n": torch.tensor(count)}}, paths[-1])
    averaged = average_checkpoints(paths)["model"]
    assert averaged["w"].dtype == torch.float32
    assert averaged["w"].tolist() == [60000.0, 1.5]  # 60000 + 60000 overflows float16
    assert averaged["n"].item() == 3


@pytest.mark.slow  # trains a tiny model (the run fixture)
def test_too_few_checkpoints_is_one_line(run, tmp_path):
    _, save_dir = run
    epochs = len(_newest(save_dir, EPOCH, 1000))
    asked = ["--num-epoch-checkpoints", str(epochs + 1)]
    out = run_cli([AVERAGE, "--inputs", save_dir, *asked, "--output", tmp_path / "unused.pt"], check=False)
    assert out.returncode == 1
    line = _one_error_line(out.stdout)
    assert f"has {epochs} epoch checkpoint(s)" in line and f"fewer than --num-epoch-checkpoints {epochs + 1}" in line
    first_update = int(re.fullmatch(UPDATE, os.path.basename(_newest(save_dir, UPDATE, 1000)[-1])).group(1))
    with pytest.raises(AveragingError, match=f"up to update {first_update} .*fewer than --num-update-checkpoints 2"):
        last_n_checkpoints(str(save_dir), 2, update_based=True, upper_bound=first_update)
    assert not (tmp_path / "unused.pt").exists()


@pytest.mark.slow  # trains a tiny model (the run fixture)
def test_checkpoints_of_different_models_are_refused(run, tmp_path):
    _, save_dir = run
    first = str(save_dir / "checkpoint3.pt")
    state = _load(first)
    key = next(k for k, v in state["model"].items() if v.dim() == 2)

    other_shape = _load(first)
    other_shape["model"][key] = torch.zeros(other_shape["model"][key].shape[0] + 1, other_shape["model"][key].shape[1])
    torch.save(other_shape, tmp_path / "shape.pt")
    with pytest.raises(AveragingError, match=f"another model .*{re.escape(key)} is"):
        average_checkpoints([first, str(tmp_path / "shape.pt")])

    other_keys = _load(first)
    del other_keys["model"][key]
    torch.save(other_keys, tmp_path / "keys.pt")
    output = tmp_path / "out.pt"
    out = run_cli([AVERAGE, "--inputs", first, tmp_path / "keys.pt", "--output", output], check=False)
    assert out.returncode == 1 and not output.exists()
    assert f"lacks {key}" in _one_error_line(out.stdout)

    other_dictionary = _load(first)
    other_dictionary["extra_state"]["HRTTranslationTask"]["dictionary"] = "another"
    torch.save(other_dictionary, tmp_path / "dictionary.pt")
    with pytest.raises(AveragingError, match="another dictionary"):
        average_checkpoints([first, str(tmp_path / "dictionary.pt")])


@pytest.mark.slow  # trains a tiny model (the run fixture)
def test_bad_inputs_are_one_line(run, tmp_path):
    _, save_dir = run
    truncated = tmp_path / "checkpoint9.pt"
    data = (save_dir / "checkpoint3.pt").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(AveragingError, match="is truncated"):
        average_checkpoints([str(save_dir / "checkpoint3.pt"), str(truncated)])
    with pytest.raises(AveragingError, match="does not exist"):
        average_checkpoints([str(tmp_path / "missing.pt")])

    copy = tmp_path / "copy"
    shutil.copytree(save_dir, copy)
    for argv, expected in (
        ([copy], "is a directory: add --num-epoch-checkpoints N"),
        ([copy, "--checkpoint-upper-bound", "2"], "--checkpoint-upper-bound needs"),
        ([copy / "checkpoint1.pt", "--num-epoch-checkpoints", "1"], "pick checkpoints from one directory"),
    ):
        out = run_cli([AVERAGE, "--inputs", *argv, "--output", tmp_path / "out.pt"], check=False)
        assert out.returncode == 1 and expected in _one_error_line(out.stdout)
    assert sorted(os.listdir(copy)) == sorted(os.listdir(save_dir))  # nothing written or removed
