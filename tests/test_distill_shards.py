"""Sharded, resumable distillation (``python -m fairseq_hrt.distill --num-shards N --shard-id I``,
``--merge``) with the tiny AT teacher of tests/conftest.py's ``trained`` fixture: the merged
shards are byte for byte the one-process output (n-best selection by sentence-BLEU included),
a killed or cut shard resumes to the same file, a merge with a missing or partial shard and a
shard restarted with other inputs are refused in one line, torchrun's RANK / WORLD_SIZE pick
the shard, and a teacher of another dictionary than ``--data`` is refused before decoding."""

import argparse
import fcntl
import shlex
import shutil
import time
from pathlib import Path

import pytest

from fairseq_hrt import distill
from fairseq_hrt.testing.tiny_runs import read_lines, run_cli, start_cli, wait_cli, write_lines

# the teacher's n-best list, decoded on one thread; small batches: several per shard
OPTIONS = ["--beam", "3", "--nbest", "3", "--cpu", "--threads", "1", "--no-progress-bar"]


def _refusal(proc) -> str:
    """The one line of a refused command (exit status 1 or 2, no traceback)."""
    assert proc.returncode != 0 and "Traceback" not in proc.stdout, proc.stdout[-3000:]
    lines = [line for line in proc.stdout.splitlines() if ": error: " in line]
    assert len(lines) == 1, proc.stdout[-3000:]
    return lines[0]


def _shard(out, i: int, n: int) -> Path:
    return Path(distill.shard_file(str(out), i, n))


def _copy_shard(src_out, dst_out, i: int, n: int, done: bool = True):
    shutil.copyfile(_shard(src_out, i, n), _shard(dst_out, i, n))
    if done:
        shutil.copyfile(f"{_shard(src_out, i, n)}.done", f"{_shard(dst_out, i, n)}.done")


def _cut_mid_record(path: Path, fraction: float = 0.5):
    """Cut a shard file 3 bytes into a record line about ``fraction`` into the file, as a kill
    during a write leaves it (the records of a batch written only in part, a half line)."""
    data = path.read_bytes()
    start = int(len(data) * fraction)
    while not data[data.index(b"\n", start) + 1 : data.index(b"\n", start) + 2].isdigit():  # a record, not a marker
        start = data.index(b"\n", start) + 1
    path.write_bytes(data[: data.index(b"\n", start) + 4])


@pytest.fixture(scope="module")
def setup(trained, tmp_path_factory):
    """The distillation's inputs (validation sources, two empty lines among them, and references
    that make sentence-BLEU pick the teacher's second hypothesis on every other line), its
    command, and the one-process output to compare the shards with."""
    data, ckpts = trained
    root = tmp_path_factory.mktemp("distill_shards")
    src = read_lines(data.raw("valid", "en"))
    src.insert(3, "")  # an empty line inside and at the end: never decoded, empty in the output
    src.append("")
    model, task = distill.load_teacher(
        argparse.Namespace(path=str(ckpts["at_tiny"]), data=str(data.bin_dir), decoder_engine="lean")
    )
    nbest = distill.translate_nbest(task, model, src, 3, 3, 60, None, 0, 200, 1.0, False, progress=False)
    # a reference equal to the second hypothesis: kept only if each line is scored against its own
    second = {i: c[1] for i, c in enumerate(nbest) if i % 2 == 0 and len(c) > 1 and c[1] != c[0]}
    assert len(second) >= 5
    ref = [second.get(i, c[0]) for i, c in enumerate(nbest)]
    src_path, ref_path = write_lines(root / "src.en", src), write_lines(root / "ref.de", ref)
    base = [
        "fairseq_hrt.distill",
        "--data",
        data.bin_dir,
        "--path",
        ckpts["at_tiny"],
        "--src",
        src_path,
        "--select-by-bleu",
        ref_path,
        "--post-process",
        "none",
        "--max-tokens",
        "60",
        *OPTIONS,
    ]
    one = root / "one.de"
    run_cli([*base, "--out", one])
    kept = read_lines(one)
    assert all(kept[i] == hyp for i, hyp in second.items())
    return {"root": root, "base": base, "one": one, "data": data, "ckpts": ckpts, "src": src_path}


@pytest.fixture(scope="module")
def two_shards(setup):
    """The distillation in two concurrent processes: shard 0 by its flags, shard 1 by
    torchrun's environment (RANK 1 of WORLD_SIZE 2; LOCAL_RANK names the GPU, none here)."""
    out = setup["root"] / "two" / "train.de"
    out.parent.mkdir()
    runs = [
        start_cli(
            [*setup["base"], "--out", out, "--num-shards", "2", "--shard-id", "0"], log_path=out.parent / "0.log"
        ),
        start_cli(
            [*setup["base"], "--out", out],
            env={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},
            log_path=out.parent / "1.log",
        ),
    ]
    for proc, cmd in runs:
        wait_cli(proc, cmd)
    return out


# ------------------------------------------------------------------ without a model


def test_torchrun_environment_picks_the_shard_and_flags_win():
    base = ["--data", "d", "--path", "p.pt", "--src", "s", "--out", "o"]
    args = distill.parse_args(base, env={})
    assert (args.shard_id, args.num_shards) == (None, 1)  # one process: today's output
    args = distill.parse_args(base, env={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"})
    assert (args.shard_id, args.num_shards) == (3, 4)
    args = distill.parse_args([*base, "--num-shards", "2", "--shard-id", "1"], env={"RANK": "3", "WORLD_SIZE": "4"})
    assert (args.shard_id, args.num_shards) == (1, 2)
    args = distill.parse_args([*base, "--shard-id", "0"], env={"RANK": "3", "WORLD_SIZE": "4"})
    assert (args.shard_id, args.num_shards) == (0, 4)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-shards", "2"], "--num-shards 2 needs --shard-id I (0..1)"),
        (["--shard-id", "1"], "--shard-id 1 needs --num-shards N"),
        (["--num-shards", "2", "--shard-id", "2"], "need 0 <= --shard-id < --num-shards"),
        (["--num-shards", "0"], "--num-shards must be at least 1, got 0"),
    ],
)
def test_incomplete_shard_flags_are_one_line(extra, message, capsys):
    with pytest.raises(SystemExit):
        distill.parse_args(["--data", "d", "--path", "p.pt", "--src", "s", "--out", "o", *extra], env={})
    assert message in capsys.readouterr().err


def test_a_shard_file_counts_its_complete_batches_only(tmp_path):
    path = tmp_path / "o.shard-0-of-2"
    header = distill.SHARD_HEADER + '{"inputs": {}}\n'
    complete = header + "4\tein Satz\n0\tzwei\n#batch\t0\t2\n7\tdrei\twith a tab\n#batch\t2\t1\n"
    path.write_text(complete + "9\tvier\n1\tha", encoding="utf-8")  # a batch cut off mid-record
    contents = distill.read_shard(str(path))
    assert contents.records == [(4, "ein Satz"), (0, "zwei"), (7, "drei\twith a tab")]
    assert contents.last_batch == 2 and contents.complete_bytes == len(complete.encode())
    assert contents.dropped_bytes == len("9\tvier\n1\tha")
    path.write_text(complete + "5\tfünf\n#batch\t4\t2\n", encoding="utf-8")  # a marker counting more lines
    assert distill.read_shard(str(path)).last_batch == 2
    path.write_text(header[:-5], encoding="utf-8")  # killed while writing the header
    assert distill.read_shard(str(path)).header is None


def test_merging_without_any_shard_says_to_run_them(tmp_path):
    proc = run_cli(["fairseq_hrt.distill", "--merge", "--out", tmp_path / "o.de", "--num-shards", "3"], check=False)
    line = _refusal(proc)
    assert "o.de.shard-0-of-3 is missing" in line and "--num-shards 3 --shard-id I, for I = 0..2" in line
    assert not (tmp_path / "o.de").exists()


# ------------------------------------------------------------------ with the teacher


@pytest.mark.slow
def test_two_concurrent_shards_merge_to_the_one_process_output(setup, two_shards):
    out = two_shards
    ids = [{i for i, _ in distill.read_shard(str(_shard(out, s, 2))).records} for s in (0, 1)]
    assert ids[0] and ids[1] and not ids[0] & ids[1]  # both shards decoded, different lines
    assert not _shard(out, 0, 3).exists()  # shard 1 took N from WORLD_SIZE
    run_cli(["fairseq_hrt.distill", "--merge", "--out", out, "--num-shards", "2"])
    assert out.read_bytes() == setup["one"].read_bytes()
    lines = out.read_text(encoding="utf-8").split("\n")
    assert lines[3] == "" and lines[-2] == "" and lines[-1] == ""  # the empty source lines
    assert not Path(f"{out}.part").exists()


@pytest.mark.slow
def test_merge_refuses_a_missing_or_partial_shard_and_names_the_command_that_finishes_it(setup, two_shards):
    out = setup["root"] / "cut" / "train.de"
    out.parent.mkdir()
    _copy_shard(two_shards, out, 0, 2)
    merge = ["fairseq_hrt.distill", "--merge", "--out", out, "--num-shards", "2"]
    line = _refusal(run_cli(merge, check=False))
    assert f"{_shard(out, 1, 2)} is missing; run shard 1 of 2" in line
    assert not out.exists()

    # shard 1 as a kill during a write leaves it: no .done, cut mid-record
    _copy_shard(two_shards, out, 1, 2, done=False)
    _cut_mid_record(_shard(out, 1, 2))
    line = _refusal(run_cli(merge, check=False))
    have = len(distill.read_shard(str(_shard(out, 1, 2))).records)
    assert f"{_shard(out, 1, 2)} is incomplete ({have} of " in line and not out.exists()

    # the command the message names continues the shard: the same file as uninterrupted
    command = shlex.split(line.split("(a rerun continues where it stopped): ", 1)[1])
    assert command[1:3] == ["-m", "fairseq_hrt.distill"] and command[-4:] == ["--num-shards", "2", "--shard-id", "1"]
    log = run_cli(command[2:]).stdout
    assert "resuming after batch" in log and "bytes of an interrupted batch" in log
    assert _shard(out, 1, 2).read_bytes() == _shard(two_shards, 1, 2).read_bytes()
    run_cli(merge)
    assert out.read_bytes() == setup["one"].read_bytes()


@pytest.mark.slow
def test_a_killed_shard_resumes_to_the_uninterrupted_output(setup, tmp_path):
    """A shard SIGKILLed after its first batches, then one more batch half-written (as a kill
    during the write leaves it), is finished by a rerun of the same command."""
    data = setup["data"]
    src = write_lines(tmp_path / "src.en", read_lines(data.raw("train", "en"))[:120])
    base = ["fairseq_hrt.distill", "--data", data.bin_dir, "--path", setup["ckpts"]["at_tiny"], "--src", src]
    base += ["--batch-size", "1", *OPTIONS[:2], *OPTIONS[4:]]  # 120 batches
    one, out = tmp_path / "one.de", tmp_path / "sharded.de"
    shard = _shard(out, 0, 1)
    proc, cmd = start_cli([*base, "--out", out, "--num-shards", "1", "--shard-id", "0"], log_path=tmp_path / "k.log")
    deadline = time.monotonic() + 300
    while not (shard.exists() and shard.read_bytes().count(b"\n#batch\t") >= 2) and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.kill()
    wait_cli(proc, cmd, check=False)
    assert not Path(f"{shard}.done").exists()
    done = distill.read_shard(str(shard))
    assert 2 <= len(done.records) < 120
    with open(shard, "ab") as f:  # the next batch's record half-written
        f.write(b"12\tEin Mann")

    merge = ["fairseq_hrt.distill", "--merge", "--out", out, "--num-shards", "1"]
    assert "is incomplete" in _refusal(run_cli(merge, check=False))
    log = run_cli([*base, "--out", out, "--num-shards", "1", "--shard-id", "0"]).stdout
    assert f"resuming after batch {done.last_batch}" in log
    run_cli(merge)
    run_cli([*base, "--out", one])
    assert out.read_bytes() == one.read_bytes()
    # a finished shard is not decoded again
    assert "is complete already" in run_cli([*base, "--out", out, "--num-shards", "1", "--shard-id", "0"]).stdout


@pytest.mark.slow
def test_a_shard_file_of_other_options_or_inputs_or_in_use_is_refused_untouched(setup, two_shards, tmp_path):
    out = tmp_path / "train.de"
    shard = _shard(out, 0, 2)
    _copy_shard(two_shards, out, 0, 2, done=False)
    _cut_mid_record(shard)
    before = shard.read_bytes()
    run = [*setup["base"], "--out", out, "--num-shards", "2", "--shard-id", "0"]

    other_beam = [*run, "--beam", "4"]  # the last --beam wins
    line = _refusal(run_cli(other_beam, check=False))
    assert f"{shard} was written with other options or inputs (beam 3 -> 4)" in line
    assert "rerun the command that started it" in line and "--beam 3 " in line and "delete" in line
    assert shard.read_bytes() == before

    src = read_lines(setup["src"])
    src[0] = src[1]
    other_src = write_lines(tmp_path / "other.en", src)
    line = _refusal(run_cli([*run, "--src", other_src], check=False))
    assert "src_sha256" in line and "beam 3 ->" not in line
    assert shard.read_bytes() == before

    with open(shard, "ab") as held:  # the same shard running in another process
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        line = _refusal(run_cli(run, check=False))
    assert f"{shard} is being written by another process" in line
    assert shard.read_bytes() == before

    _copy_shard(two_shards, out, 0, 2)  # a complete shard too: not taken for done
    line = _refusal(run_cli(other_beam, check=False))
    assert "(beam 3 -> 4)" in line


@pytest.mark.slow
def test_a_teacher_of_another_dictionary_than_data_is_one_line(setup, tmp_path):
    """Two symbols swapped (the same size: it would load and write other words), or one more
    symbol (it would fail half-way through loading)."""
    data_bin = Path(setup["data"].bin_dir)
    for name, change in (("swapped", lambda d: [d[1], d[0], *d[2:]]), ("longer", lambda d: [*d, "zzzneu 1"])):
        other = tmp_path / name
        shutil.copytree(data_bin, other)
        for lang in ("en", "de"):
            dict_file = other / f"dict.{lang}.txt"
            dict_file.write_text("\n".join(change(dict_file.read_text().splitlines())) + "\n")
        args = [a if a != data_bin else other for a in setup["base"]]
        line = _refusal(run_cli([*args, "--out", tmp_path / f"{name}.de"], check=False))
        assert f"was trained with another dictionary than --data {other}" in line, line
        assert ("fingerprint" in line) == (name == "swapped")
        assert not (tmp_path / f"{name}.de").exists()
