#!/usr/bin/env python
"""How the WMT recipe's jobs run: in a submitit job (a local subprocess, this process, or a SLURM
task), with the task's own environment plus the recipe's additions, one log per SLURM task.

A multi-node training job under SLURM is one fairseq-train per task: fairseq's own SLURM
initialisation (``infer_init_method`` -> ``_infer_slurm_init``) reads SLURM_PROCID, SLURM_NTASKS,
SLURM_NNODES, SLURM_NTASKS_PER_NODE and SLURM_JOB_NODELIST, and meets on the first node at
``--distributed-port``; it checks ``--distributed-world-size`` against nodes x tasks per node,
so the command carries both.

On CPU fairseq 0.12's SLURM path counts GPUs: with one task per node it makes each node's rank
``node id x torch.cuda.device_count()`` (0 without a GPU) and a world of 0, and with several tasks
per node it calls ``torch.cuda.set_device(SLURM_LOCALID)``. So a CPU training job of several tasks
runs ``python examples/wmt/launch.py fairseq-train ARGS``: fairseq's parser and
``_infer_slurm_init`` give the rendezvous (tcp://<first node>:<port>); each task is then one rank,
SLURM_PROCID of SLURM_NTASKS, without a device; fairseq's ``call_main`` does the rest.
"""

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

DISTRIBUTED_PORT = 29671  # fairseq's SLURM rendezvous (any free port of the first node)
# SLURM job states in which a job may still run and leave its results
SLURM_RUNNING = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "RESIZING"}
SLURM_RUNNING |= {"SUSPENDED", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "STOPPED", "UNKNOWN"}
SLURM_REQUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}  # nothing of this run has run yet


@dataclass
class JobEnv:
    """The recipe's additions to a job's environment, applied where the job runs (a SLURM task
    keeps its SLURM_* variables and CUDA_VISIBLE_DEVICES)."""

    set: Dict[str, str] = field(default_factory=dict)  # replaced
    prepend: Dict[str, str] = field(default_factory=dict)  # put first in a path list (PATH, PYTHONPATH)
    default: Dict[str, str] = field(default_factory=dict)  # kept when the task has its own value

    def apply(self, base) -> Dict[str, str]:
        env = dict(base)
        for key, value in self.prepend.items():
            env[key] = os.pathsep.join(x for x in (value, env.get(key, "")) if x)
        env.update(self.set)
        for key, value in self.default.items():
            env.setdefault(key, value)
        return env


def slurm_task() -> Optional[Dict[str, str]]:
    """{rank, ntasks, node, job} of this process when it is a task of a submitit SLURM job."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or "SLURM_PROCID" not in os.environ:
        return None
    return dict(
        rank=os.environ["SLURM_PROCID"], ntasks=os.environ.get("SLURM_NTASKS", "1"),
        node=os.environ.get("SLURMD_NODENAME", "?"), job=os.environ.get("SLURM_JOB_ID", "?"),
    )  # fmt: skip


def rank_log(log_path: str, rank: int) -> str:
    """Where task ``rank`` (> 0) of a job logs: beside rank 0's WORK/logs/<job>.log."""
    path = Path(log_path)
    return str(path.with_name(f"{path.stem}.rank{rank}{path.suffix}"))


def run_task(command: str, log_path: str, cwd: str, job_env: JobEnv) -> str:
    """Runs one job's shell command where submitit put it, its output appended to ``log_path``
    (task N > 0 of a SLURM job: to <job>.rankN.log); raises with the log's end when it fails."""
    task = slurm_task()
    if task and int(task["ntasks"]) > 1 and int(task["rank"]) > 0:
        log_path = rank_log(log_path, int(task["rank"]))
    with open(log_path, "a") as log_file:
        if task:
            log_file.write(f"# SLURM job {task['job']}: task {task['rank']} of {task['ntasks']} on {task['node']}\n")
        log_file.write(f"$ {command}\n")
        log_file.flush()
        env = job_env.apply(os.environ)
        rc = subprocess.run(
            ["bash", "-c", command], cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT
        ).returncode
    if rc != 0:
        tail = "".join(Path(log_path).read_text(errors="replace").splitlines(keepends=True)[-25:])
        where = f" (SLURM task {task['rank']} on {task['node']})" if task else ""
        raise RuntimeError(f"exit {rc}{where}; the end of {log_path}:\n{tail}")
    return log_path


# --------------------------------------------------------------------------- the submitting side


def slurm_parameters(nodes: int, gpus: int, train: bool, threads: int, partition: Optional[str]) -> dict:
    """submitit's SLURM parameters of a job: a training job gets one task per GPU (one per node
    on CPU) on every node; any other job one task (with one GPU when the nodes have GPUs)."""
    tasks = max(1, gpus) if train else 1
    params = dict(nodes=nodes if train else 1, tasks_per_node=tasks, cpus_per_task=threads)
    node_gpus = gpus if train else min(gpus, 1)
    if node_gpus:  # a CPU cluster may have no GPU resources to ask for, even zero of them
        params["gpus_per_node"] = node_gpus
    if partition:
        params["slurm_partition"] = partition
    return params


def distributed_words(launcher: str, nodes: int, gpus: int, cpu: bool) -> List:
    """fairseq-train's options of a training job of several SLURM tasks: fairseq checks the world
    size against SLURM's nodes x tasks per node, and meets at the port on the first node."""
    tasks = max(1, gpus) * nodes
    if launcher != "slurm" or tasks == 1:
        return []
    words = ["--distributed-world-size", tasks, "--distributed-port", DISTRIBUTED_PORT]
    if cpu:  # gloo, and the reducer of docs/compatibility.md's CPU rehearsal
        words += ["--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]
    return words


def check_slurm(partition: Optional[str]) -> Optional[str]:
    """One line saying why jobs cannot go to SLURM here, or None."""
    missing = [tool for tool in ("sbatch", "srun", "sinfo") if not shutil.which(tool)]
    if missing:
        return (
            f"[recipe] --launcher slurm: no SLURM here ({', '.join(missing)} not found); run on the cluster, "
            "or start one with `bash examples/wmt/local_slurm.sh start`, or use --launcher local"
        )
    listed = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=120)
    if listed.returncode != 0:
        first = (listed.stderr.strip().splitlines() or ["no answer"])[-1]
        return f"[recipe] --launcher slurm: sinfo fails ({first}); is the cluster up? (SLURM_CONF={_conf()})"
    partitions = sorted(set(listed.stdout.split()))
    if partition and partition not in partitions:
        return (
            f"[recipe] --partition {partition}: SLURM has no such partition (it has: {', '.join(partitions)}); "
            "run the same command with one of those"
        )
    return None


def _conf() -> str:
    return os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")


def slurm_state(job_id: str) -> str:
    """SLURM's state of a job while scontrol remembers it (MinJobAge), else "GONE"."""
    done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        return "UNKNOWN"  # the controller did not answer: asked again at the next poll
    for word in done.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "GONE"


def wait_for_tasks(handle, poll_s: float = 2.0, grace_s: float = 20.0) -> List[str]:
    """Waits for every task of a submitted job and returns one failure line per task that failed
    (a multi-task job's rank 1 fails alone too). Under SLURM its state decides when the job is
    over: a task killed with its node still leaves a result (an error) while SLURM requeues the
    job and runs it again, and without accounting submitit cannot tell a job that ended without
    any result from one still running."""
    tasks = [handle.task(i) for i in range(handle.num_tasks)]
    slurm = type(handle).__name__ == "SlurmJob"
    ended_at = None
    while True:
        results = all(t.paths.result_pickle.exists() for t in tasks)
        if not slurm:
            if results or handle.done():
                break
        else:
            state = slurm_state(handle.job_id).split()[0]
            if state in SLURM_REQUEUED:  # the killed run's results (errors) are not the job's
                for task in tasks:
                    task.paths.result_pickle.unlink(missing_ok=True)
            if state in SLURM_RUNNING:
                ended_at = None
            elif results:
                break
            elif ended_at is None:
                ended_at = time.time()
            elif time.time() - ended_at > grace_s:  # a shared file system may show results late
                return [f"SLURM job {handle.job_id} ended {state} without a result"]
        time.sleep(poll_s)
    failures = []
    for i, task in enumerate(tasks):
        try:
            task.result()
        except Exception as e:  # submitit wraps the task's exception; its message has the log's end
            failures.append(f"task {i}: {e}" if len(tasks) > 1 else str(e))
    return failures


# --------------------------------------------------------------------------- in a SLURM task


def train_in_slurm_task(argv: List[str]):
    """fairseq-train ARGV as one rank of a CPU training job of several SLURM tasks."""
    from fairseq import options  # noqa: PLC0415 - the recipe imports this module, a rank needs fairseq
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf  # noqa: PLC0415
    from fairseq.distributed import utils as distributed_utils  # noqa: PLC0415
    from fairseq_cli import train  # noqa: PLC0415

    args = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    cfg = convert_namespace_to_omegaconf(args)
    d = cfg.distributed_training
    if d.distributed_init_method is None and d.distributed_world_size > 1:
        if not cfg.common.cpu:
            sys.exit("[launch] fairseq-train reads SLURM's variables itself on GPUs: run fairseq-train")
        # fairseq's SLURM init: the rendezvous on the first node of the job, its checks
        if not distributed_utils._infer_slurm_init(d, None):
            sys.exit("[launch] not a SLURM task (no SLURM_JOB_NODELIST): run it under srun or sbatch")
        # fairseq counted GPUs per node for the ranks; on CPU each task is one rank, no device
        d.distributed_rank = int(os.environ["SLURM_PROCID"])
        d.distributed_world_size = int(os.environ["SLURM_NTASKS"])
        d.device_id = 0
        d.distributed_no_spawn = True
        node = os.environ.get("SLURMD_NODENAME", "?")
        print(
            f"[launch] SLURM task {d.distributed_rank} of {d.distributed_world_size} on {node}: CPU rank "
            f"{d.distributed_rank}, world size {d.distributed_world_size}, {d.distributed_init_method}",
            file=sys.stderr,
            flush=True,
        )
    distributed_utils.call_main(cfg, train.main)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "fairseq-train":
        sys.exit("usage: python examples/wmt/launch.py fairseq-train DATA [fairseq-train options] (in a SLURM task)")
    train_in_slurm_task(argv[1:])


if __name__ == "__main__":
    main()
