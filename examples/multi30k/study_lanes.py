"""The converged study's steps in parallel lanes (``study.py --converged --lanes N``).

On a CPU, two one-thread runs train more updates a second together than one run of two
threads (1.82 against 1.49 on the `small` AT student, 2 cores), and most of the study's steps
are independent once the teacher's KD exists: the four AT students, and each HRT model as soon
as its own AT student is trained. A lane is a child ``study.py --only <step>`` process; this
module decides which step starts when and with how many threads, as pure functions, and runs
the loop that starts, watches and (on an interrupt) stops the children.
"""

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set


def ready_steps(order: Sequence[str], needs: Dict[str, List[str]], done: Set[str], running: Set[str]) -> List[str]:
    """The steps that may start now, in the study's order: not done, not running, and every
    step each needs done."""
    return [n for n in order if n not in done and n not in running and all(d in done for d in needs[n])]


def lane_threads(threads: int, lanes: int, free: int, ready: int, running: int) -> int:
    """Threads for the next step to start (0: none starts now).

    A step that is the only one able to run (nothing running, nothing else ready: the teacher,
    its KD) gets every thread; otherwise each lane gets an equal share, at least one. Threads a
    running step holds are not taken back, so a lane waits until enough are free."""
    if running >= lanes or free < 1:
        return 0
    if running == 0 and ready == 1:
        return threads
    share = max(1, threads // lanes)
    return share if free >= share else 0


def lane_argv(argv: Sequence[str], step: str, threads: int) -> List[str]:
    """The study's own command line for one lane: ``--lanes`` and ``--threads`` dropped (in
    either the ``--x v`` or the ``--x=v`` form), then ``--threads <threads> --only <step>``."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in ("--lanes", "--threads"):
            skip = True
            continue
        if word.startswith(("--lanes=", "--threads=")):
            continue
        out.append(word)
    return [*out, "--threads", str(threads), "--only", step]


@dataclass
class Lane:
    step: str
    threads: int
    proc: subprocess.Popen
    out_path: Path
    started: float = field(default_factory=time.time)


class LaneError(RuntimeError):
    pass


def run_lanes(
    order: Sequence[str],
    needs: Dict[str, List[str]],
    is_done: Callable[[str], bool],
    start: Callable[[str, int], Lane],
    lanes: int,
    threads: int,
    log: Callable[[str], None],
    poll_seconds: float = 10.0,
    sleep: Callable[[float], None] = time.sleep,
    at_epoch_end: Optional[Callable[[str], bool]] = None,
    exclusive: Set[str] = frozenset(),
) -> List[str]:
    """Run every step of ``order`` not yet done, at most ``lanes`` at a time, each once the
    steps it ``needs`` are done; ``start(step, threads)`` launches one. A failed step stops new
    starts; the running ones finish, then :class:`LaneError` names the failure. An interrupt
    (Ctrl-C, SIGTERM) stops every running step, which the same command resumes. Returns the
    steps run, in the order they started.

    Threads left idle (a lane with nothing ready to start, at the study's end: the last HRT
    model alone for hours) go to a running step at its next epoch's end (``at_epoch_end``: it
    has just saved ``checkpoint_last.pt``), which is stopped and started again with them: one
    run of two threads trains 1.6x the updates of one thread.

    An ``exclusive`` step (a benchmark: it times on a quiet machine) runs alone. Once it can
    start, nothing else starts; the training steps running are stopped at their epoch's end
    (``at_epoch_end``), the others finish; then it starts with every thread, and the stopped
    steps resume from their last checkpoint after it."""
    running: Dict[str, Lane] = {}
    started: List[str] = []
    failed: List[str] = []
    try:
        while True:
            for name, lane in list(running.items()):
                rc = lane.proc.poll()
                if rc is None:
                    continue
                del running[name]
                minutes = (time.time() - lane.started) / 60
                if rc == 0 and is_done(name):
                    log(f"lanes: {name} done in {minutes:.0f} min")
                else:
                    why = f"exit {rc}" if rc else "it ended without its done marker"
                    failed.append(f"{name} ({why}; see {lane.out_path})")
                    log(f"lanes: {name} failed ({why}); no new step starts")
            done = {n for n in order if is_done(n)}
            alone = next((n for n in ready_steps(order, needs, done, set(running)) if n in exclusive), None)
            if failed:
                if not running:
                    raise LaneError("failed: " + "; ".join(failed))
            elif exclusive & set(running):
                pass  # it runs alone
            elif alone:
                for name, lane in list(running.items()):
                    if at_epoch_end and at_epoch_end(name):
                        stop_lane(lane)
                        del running[name]
                        log(f"lanes: {name} stopped at its epoch's end: {alone} runs alone; {name} resumes after it")
                if not running:
                    running[alone] = start(alone, threads)
                    started.append(alone)
                    log(f"lanes: {alone} started alone ({threads} thread(s)), output in {running[alone].out_path}")
            else:
                while True:
                    ready = ready_steps(order, needs, done, set(running))
                    free = threads - sum(lane.threads for lane in running.values())
                    n = lane_threads(threads, lanes, free, len(ready), len(running)) if ready else 0
                    if not n:
                        break
                    lane = start(ready[0], n)
                    running[ready[0]] = lane
                    started.append(ready[0])
                    log(f"lanes: {ready[0]} started ({n} thread(s)), output in {lane.out_path}")
                if not running:
                    missing = [n for n in order if n not in done]
                    if not missing:
                        return started
                    raise LaneError(f"nothing can start: {', '.join(missing)} wait for steps that are not done")
                # ``ready`` and ``free`` as the loop above left them: nothing has started since
                if at_epoch_end and free >= 1 and not ready:
                    for name, lane in list(running.items()):
                        if at_epoch_end(name):
                            stop_lane(lane)
                            running[name] = start(name, lane.threads + free)
                            log(
                                f"lanes: {name} started again at its epoch's end with {lane.threads + free} "
                                f"thread(s) (was {lane.threads}): nothing else can run"
                            )
                            break
            sleep(poll_seconds)
    except BaseException:
        for lane in running.values():  # all at once, then wait for each
            lane.proc.terminate()
        for lane in running.values():
            stop_lane(lane, terminated=True)
        raise


def stop_lane(lane: Lane, terminated: bool = False):
    """SIGTERM (the study stops its fairseq run, which resumes from ``checkpoint_last.pt``),
    SIGKILL after a minute."""
    if not terminated:
        lane.proc.terminate()
    try:
        lane.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        lane.proc.kill()
        lane.proc.wait()


def start_lane(argv: Sequence[str], script: Path, python: str, env: dict, out_dir: Path, preexec_fn=None) -> Callable:
    """``start`` for :func:`run_lanes`: ``python script <argv for the lane>``, its output
    appended to ``out_dir/<step>.out``."""

    def start(step: str, threads: int) -> Lane:
        out_dir.mkdir(parents=True, exist_ok=True)
        out_path = out_dir / f"{step}.out"
        with open(out_path, "a") as out:
            proc = subprocess.Popen(
                [python, str(script), *lane_argv(argv, step, threads)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=preexec_fn,
            )
        return Lane(step, threads, proc, out_path)

    return start
