"""examples/wmt/recipe.py --launcher slurm against a real SLURM: two nodes on this machine
(examples/wmt/local_slurm.sh: n1 and n2 on 127.0.0.1, partition debug). The CPU slice runs end
to end with every training job on 2 nodes x 1 task through fairseq's own SLURM initialisation
(gloo) and the distillation shards as SLURM jobs; each rank says which it is and where it ran; the
2-node run logs the losses of the same job on 2 torchrun ranks of one machine; the full-scale
2 x 8 commands give task 9 of 16 rank 9 and GPU 1 in fairseq's infer_init_method; a task that
fails alone is reported with its node and log; a job whose node goes down is requeued by SLURM
and waited for; a partition that does not exist and a machine without sbatch end in one line.

The module's fixture starts the cluster with the script when SLURM is installed (and stops it
after, if it started it); without the packages the tests that need them skip (.ci/run installs
them)."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fairseq import options
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.distributed import utils as distributed_utils

from fairseq_hrt.distill import read_shard
from fairseq_hrt.testing.tiny_runs import REPO, USER_DIR, cli_env, parse_logs
from tests.test_wmt_recipe import RECIPE, SHARED_DATA, recipe
from tests.tiny_data import free_port

CLUSTER = REPO / "examples" / "wmt" / "local_slurm.sh"
launch = recipe.launch

HAVE_SLURM = all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "munged", "sbatch", "srun"))
needs_slurm = pytest.mark.skipif(
    not HAVE_SLURM, reason="SLURM is not installed here (as root: apt-get install slurm-wlm munge; .ci/run does)"
)
needs_scontrol = pytest.mark.skipif(not shutil.which("scontrol"), reason="no scontrol (apt-get install slurm-client)")
needs_shared_data = pytest.mark.skipif(
    not (SHARED_DATA / "wmt16-en-ro-newstest" / "test.ro").is_file(),
    reason="the slice is cut from ../shared/data/wmt16-en-ro-newstest",
)
SLICE = ["--setup", "wmt16_en_ro", "--slice", "--slice-size", "smoke"]
SLICE += ["--slice-train-lines", "400", "--slice-test-lines", "40"]
SLICE += ["--threads", "1", "--launcher", "slurm", "--nodes", "2"]
TRAINING_JOBS = ["teacher", "at", "hrt-k2", "mp"]


def cluster(command: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CLUSTER), command], env=env, capture_output=True, text=True, timeout=300)


def run_recipe(args, env, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(RECIPE), *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"recipe.py {shlex.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return proc


# --------------------------------------------------------------------------- no daemons


@needs_scontrol
def test_full_scale_2x8_slurm_task_9_of_16_is_rank_9_on_gpu_1_for_fairseq(tmp_path, monkeypatch):
    """fairseq's own infer_init_method, on a training command of the 2 x 8 GPU recipe, in the
    environment SLURM gives task 9 of 16 (node 2, local id 1): world 16, rank 9, device 1, one
    process per task, the rendezvous on the first node. Only scontrol's hostname expansion is
    needed (a slurm.conf, no daemons)."""
    state = tmp_path / "slurm"
    written = cluster("config", env=dict(os.environ, LOCAL_SLURM_DIR=str(state)))
    assert written.returncode == 0, written.stderr
    argv = ["--setup", "wmt14_en_de", "--work", str(tmp_path / "w"), "--launcher", "slurm", "--print-commands"]
    r = recipe.Recipe(recipe.parse_args(argv + ["--nodes", "2", "--gpus", "8"]))
    teacher = r.step("teacher").jobs[0]
    words = shlex.split(teacher.command)
    assert words[0] == "fairseq-train"  # on GPUs fairseq reads SLURM's variables itself
    argv = words[1:]
    argv[argv.index("--user-dir") + 1] = USER_DIR
    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    cfg = convert_namespace_to_omegaconf(args)
    slurm_task_9 = dict(
        SLURM_CONF=str(state / "slurm.conf"), SLURM_JOB_ID="77", SLURM_PROCID="9", SLURM_LOCALID="1",
        SLURM_NODEID="1", SLURM_NTASKS="16", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="8",
        SLURM_JOB_NODELIST="n[1-2]", SLURM_STEP_NODELIST="n[1-2]", SLURMD_NODENAME="n2",
    )  # fmt: skip
    for key, value in slurm_task_9.items():
        monkeypatch.setenv(key, value)
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):  # torchrun's: not SLURM's path
        monkeypatch.delenv(key, raising=False)
    devices = []  # this machine has no GPU 1: fairseq's call is recorded, not made
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    d = cfg.distributed_training
    distributed_utils.infer_init_method(d)
    assert (d.distributed_world_size, d.distributed_rank, d.device_id) == (16, 9, 1)
    assert d.distributed_no_spawn  # one fairseq-train per SLURM task, none spawned
    assert d.distributed_init_method == f"tcp://n1:{recipe.DISTRIBUTED_PORT}"
    assert devices == [1]
    params = r.executor(r.step("teacher"), teacher)._executor.parameters
    assert (params["nodes"], params["ntasks_per_node"], params["gpus_per_node"]) == (2, 8, 8)


# --------------------------------------------------------------------------- the cluster


@pytest.fixture(scope="module")
def slurm_env():
    """The environment of a SLURM client of the cluster; starts it when it is not running and
    stops it after if it started it."""
    if not HAVE_SLURM:
        pytest.skip("SLURM is not installed here (as root: apt-get install slurm-wlm munge; .ci/run does)")
    was_running = cluster("status").returncode == 0
    started = cluster("start")
    assert started.returncode == 0, started.stdout + started.stderr
    conf = re.search(r"export SLURM_CONF=(\S+)", started.stdout).group(1)
    yield cli_env({"SLURM_CONF": conf})
    if not was_running:
        stopped = cluster("stop")
        assert stopped.returncode == 0, stopped.stderr


@pytest.fixture(scope="module")
def slice_run(slurm_env, tmp_path_factory):
    """The recipe's CPU slice on the cluster, every step: the work folder and the recipe's output."""
    if not (SHARED_DATA / "wmt16-en-ro-newstest" / "test.ro").is_file():
        pytest.skip("the slice is cut from ../shared/data/wmt16-en-ro-newstest")
    work = tmp_path_factory.mktemp("slurm") / "w"
    proc = run_recipe([*SLICE, "--work", work], slurm_env)
    return work, proc.stdout + proc.stderr


def rank_logs(work: Path, job: str):
    """{rank: log text} of a training job's tasks (rank 0: logs/<job>.log)."""
    logs = {0: (work / "logs" / f"{job}.log").read_text()}
    for path in (work / "logs").glob(f"{job}.rank*.log"):
        logs[int(path.stem.rsplit(".rank", 1)[1])] = path.read_text()
    return logs


def rank_view(text: str):
    """(SLURM task, tasks, node) from the task's own header, and fairseq's rank and rendezvous."""
    task = re.search(r"^# SLURM job (\d+): task (\d+) of (\d+) on (\S+)$", text, re.M)
    init = re.search(r"distributed init \(rank (\d+)\): (\S+)", text)
    assert task and init, text[:3000]
    return dict(job=task[1], task=int(task[2]), tasks=int(task[3]), node=task[4], rank=int(init[1]), init=init[2])


@needs_slurm
@needs_shared_data
def test_the_slice_runs_end_to_end_on_two_slurm_nodes(slice_run):
    """Every step through sbatch; each training job one SLURM job of 2 tasks, one per node, that
    trained as one run (rank 0 logs the updates, world size 2, gloo); the distillation shards two
    SLURM jobs of one task, merged after; results.md with every model's row."""
    work, out = slice_run
    slice_recipe = recipe.Recipe(recipe.parse_args([*SLICE, "--work", str(work)]))
    table = (work / "results.md").read_text()
    for row in ("teacher", "at-greedy", "hrt-k2", "mp-i10"):
        assert f"| {row} |" in table
    for job in TRAINING_JOBS:
        logs = rank_logs(work, job)
        assert sorted(logs) == [0, 1], f"{job}: one log per task"
        views = [rank_view(logs[r]) for r in (0, 1)]
        assert views[0]["job"] == views[1]["job"]  # one SLURM job of two tasks
        assert {v["node"] for v in views} == {"n1", "n2"}
        assert "'distributed_world_size': 2" in logs[0] and "'distributed_backend': 'gloo'" in logs[0]
        assert "python examples/wmt/launch.py fairseq-train" in logs[0]
        records = parse_logs(logs[0])
        assert records and records[-1]["num_updates"] == slice_recipe.training_of(job).max_update
        assert (work / job / "checkpoint_last.pt").is_file()
    shards = [rank_view_shard((work / "logs" / f"distill-shard-{i}.log").read_text()) for i in (0, 1)]
    assert len({job for job, _ in shards}) == 2 and all(n == "1" for _, n in shards)  # two jobs of one task
    shard_lines = [len(read_shard(str(work / "distill" / f"train.ro.shard-{i}-of-2")).records) for i in (0, 1)]
    source = (work / "data" / "spm" / "train.en").read_text().splitlines()
    assert min(shard_lines) > 0 and sum(shard_lines) == len(source)  # each shard its part
    assert len((work / "distill" / "train.ro").read_text().splitlines()) == len(source)  # merged
    done = [(work / "distill" / f"train.ro.shard-{i}-of-2.done").stat().st_mtime for i in (0, 1)]
    assert (work / "distill" / "train.ro").stat().st_mtime >= max(done)  # merged after both shards
    assert "srun" in next((work / "submitit" / "teacher").glob("*_submission.sh")).read_text()


def rank_view_shard(text: str):
    task = re.search(r"^# SLURM job (\d+): task 0 of (\d+) on n[12]$", text, re.M)
    assert task, text[:2000]
    return task[1], task[2]


@needs_slurm
@needs_shared_data
def test_each_rank_of_a_training_job_knows_its_rank_world_and_node(slice_run):
    """The teacher's two tasks, as logged: SLURM task r on its node is fairseq's rank r of 2,
    both meeting at the first node's port."""
    work, _ = slice_run
    logs = rank_logs(work, "teacher")
    for rank, text in logs.items():
        view = rank_view(text)
        assert (view["task"], view["tasks"], view["rank"]) == (rank, 2, rank)
        assert view["init"] == f"tcp://n1:{recipe.DISTRIBUTED_PORT}"
        launch_line = re.search(
            r"\[launch\] SLURM task (\d+) of (\d+) on (\S+): CPU rank (\d+), world size (\d+)", text
        )
        assert launch_line and launch_line.groups() == (str(rank), "2", view["node"], str(rank), "2")
        assert f"initialized host {os.uname().nodename} as rank {rank}" in text
    assert [rank_view(logs[r])["node"] for r in (0, 1)] == ["n1", "n2"]


@needs_slurm
@needs_shared_data
def test_two_nodes_log_the_losses_of_the_same_job_on_two_torchrun_ranks(slice_run, tmp_path):
    """The teacher's command, run again by torchrun as 2 CPU ranks of one machine (the ranks on
    the command line, docs/compatibility.md), from the same data and seed: the same per-update
    records as the 2-node SLURM run."""
    work, _ = slice_run
    command = (work / "logs" / "teacher.log").read_text().split("\n$ ", 1)[1].splitlines()[0]
    words = shlex.split(command)
    fairseq_args = words[words.index("fairseq-train") + 1 :]
    for option in ("--distributed-world-size", "--distributed-port"):  # torchrun gives them
        i = fairseq_args.index(option)
        del fairseq_args[i : i + 2]
    fairseq_args[fairseq_args.index("--save-dir") + 1] = str(tmp_path / "torchrun")
    ranks = 'exec "$@" --distributed-init-method env:// --distributed-world-size "$WORLD_SIZE" '
    ranks += '--distributed-rank "$RANK" --distributed-no-spawn'
    line = ["torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", free_port()]
    line += ["--no-python", "sh", "-c", ranks, "sh", "fairseq-train", *fairseq_args]
    env = dict(recipe.Recipe(recipe.parse_args([*SLICE, "--work", str(work)])).env().apply(cli_env()))
    done = subprocess.run(shlex.join(map(str, line)), shell=True, cwd=REPO, env=env, capture_output=True, text=True)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "distributed init (rank 1)" in out and "'distributed_world_size': 2" in out
    slurm = parse_logs((work / "logs" / "teacher.log").read_text())
    local = parse_logs(out)
    keys = ("epoch", "num_updates", "loss", "nll_loss", "wpb", "bsz", "lr", "gnorm")
    assert len(slurm) == len(local) > 1
    assert [{k: r[k] for k in keys} for r in slurm] == [{k: r[k] for k in keys} for r in local]


def slurm(*words) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *words], capture_output=True, text=True, timeout=60)


def wait_until(condition, what: str, timeout_s: float = 120):
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"waited {timeout_s} s for {what}"
        time.sleep(0.5)


@needs_slurm
def test_a_training_job_whose_second_task_fails_alone_is_reported(slurm_env, tmp_path, monkeypatch):
    """Rank 1 of a 2-node job fails, rank 0 succeeds: the recipe's wait names task 1, its node
    and its own log (submitit's result() would have read rank 0's alone)."""
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])
    r = recipe.Recipe(recipe.parse_args([*SLICE, "--work", str(tmp_path / "w")]))
    job = recipe.Job("one-fails", 'if [ "$SLURM_PROCID" = 1 ]; then echo broken; exit 3; fi', train=True)
    r.logs.mkdir(parents=True)
    failures = launch.wait_for_tasks(r.submit(recipe.Step("teacher", [job]), job))
    assert len(failures) == 1, failures
    assert failures[0].startswith("task 1: ") and "exit 3 (SLURM task 1 on n2)" in failures[0]
    assert str(r.logs / "one-fails.rank1.log") in failures[0] and "broken" in failures[0]


@needs_slurm
def test_a_node_that_dies_mid_job_gets_the_job_requeued_and_nothing_is_lost(slurm_env, tmp_path, monkeypatch):
    """Node n2 goes down while a 2-node job of the recipe runs: SLURM requeues the job, the
    recipe's wait does not take the killed tasks' errors for the job's end, and the job's rerun
    finishes on both nodes (each task's log holds both runs)."""
    monkeypatch.setenv("SLURM_CONF", slurm_env["SLURM_CONF"])  # submitit's sbatch, from this process
    r = recipe.Recipe(recipe.parse_args([*SLICE, "--work", str(tmp_path / "w")]))
    job = recipe.Job("two-nodes", 'echo "run ${SLURM_RESTART_COUNT:-0}"; sleep 20; echo finished', train=True)
    step = recipe.Step("teacher", [job])
    r.logs.mkdir(parents=True)
    handle = r.submit(step, job)
    logs = [r.logs / "two-nodes.log", r.logs / "two-nodes.rank1.log"]
    wait_until(lambda: all(p.is_file() and "run 0" in p.read_text() for p in logs), "both tasks to start")
    assert slurm("update", "nodename=n2", "state=down", "reason=test_slurm_cluster").returncode == 0
    try:
        wait_until(lambda: launch.slurm_state(handle.job_id) == "PENDING", "SLURM to requeue the job")
        for node in ("n1", "n2"):  # the killed tasks are gone from both nodes
            wait_until(lambda: slurm("listpids", handle.job_id, node).returncode != 0, f"the old tasks on {node}")
        # SLURM holds a requeued job two minutes before it starts again; the test waits only for
        # the node's own clean-up of the killed job (its slurmd's kill loop, KillWait=5 s)
        time.sleep(10)
        assert slurm("update", f"jobid={handle.job_id}", "StartTime=now").returncode == 0
    finally:
        slurm("update", "nodename=n2", "state=resume")  # refused when n2 came back by itself
    assert launch.wait_for_tasks(handle) == []
    for path in logs:
        text = path.read_text()
        assert "run 0" in text and re.search(r"run 1\nfinished", text), text


# --------------------------------------------------------------------------- bad input


@needs_slurm
def test_a_partition_that_does_not_exist_is_one_line(slurm_env, tmp_path):
    work = tmp_path / "w"
    proc = run_recipe([*SLICE, "--work", work, "--partition", "nope", "--steps", "download"], slurm_env, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("[recipe] --partition nope: SLURM has no such partition (it has: debug)")
    assert not work.exists()  # nothing submitted, nothing to lose


def test_no_sbatch_is_one_line(tmp_path):
    work = tmp_path / "w"
    env = cli_env({"PATH": str(Path(sys.executable).parent)})  # this Python's programs, no SLURM
    proc = run_recipe([*SLICE, "--work", work, "--steps", "download"], env, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("[recipe] --launcher slurm: no SLURM here (sbatch, srun, sinfo not found)")
    assert "examples/wmt/local_slurm.sh start" in lines[0]
    assert not work.exists()
