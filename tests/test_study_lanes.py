"""study.py --lanes: which step starts when, with how many threads, and what a failure or an
interrupt does to the others (fake child processes; the study's own step graph)."""

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "multi30k"))
import study_lanes  # noqa: E402

_spec = importlib.util.spec_from_file_location("hrt_study_for_lanes", REPO / "examples" / "multi30k" / "study.py")
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def test_ready_steps_wait_for_what_they_need_in_the_studys_order():
    needs = {"t": [], "kd": ["t"], "a1": ["kd"], "a2": ["kd"], "h1": ["a1"]}
    order = list(needs)
    assert study_lanes.ready_steps(order, needs, set(), set()) == ["t"]
    assert study_lanes.ready_steps(order, needs, {"t"}, set()) == ["kd"]
    assert study_lanes.ready_steps(order, needs, {"t", "kd"}, {"a1"}) == ["a2"]
    assert study_lanes.ready_steps(order, needs, {"t", "kd", "a1"}, {"a2"}) == ["h1"]
    assert study_lanes.ready_steps(order, needs, set(order), set()) == []


def test_a_lone_step_gets_every_thread_and_parallel_steps_an_equal_share():
    # the teacher: nothing running, nothing else ready
    assert study_lanes.lane_threads(threads=2, lanes=2, free=2, ready=1, running=0) == 2
    # four AT students ready: one thread each
    assert study_lanes.lane_threads(threads=2, lanes=2, free=2, ready=4, running=0) == 1
    assert study_lanes.lane_threads(threads=2, lanes=2, free=1, ready=3, running=1) == 1
    # every lane busy, or the lone step holds every thread: nothing starts
    assert study_lanes.lane_threads(threads=2, lanes=2, free=0, ready=2, running=1) == 0
    assert study_lanes.lane_threads(threads=2, lanes=2, free=1, ready=2, running=2) == 0
    # more lanes than threads: one thread each, as many as there are threads
    assert study_lanes.lane_threads(threads=2, lanes=4, free=0, ready=3, running=2) == 0
    assert study_lanes.lane_threads(threads=8, lanes=2, free=8, ready=2, running=0) == 4


def test_a_lane_is_the_same_command_with_its_threads_and_one_step():
    argv = ["--profile", "small", "--converged", "--lanes", "2", "--threads=2", "--cpu-bf16", "--lanes=3"]
    assert study_lanes.lane_argv(argv, "at_d2_s1", 1) == [
        "--profile",
        "small",
        "--converged",
        "--cpu-bf16",
        "--threads",
        "1",
        "--only",
        "at_d2_s1",
    ]


class FakeProc:
    """A child that ends after ``polls`` polls with ``rc``, marking its step done on success."""

    def __init__(self, step, done, polls, rc, events):
        self.step, self.done, self.left, self.rc, self.events = step, done, polls, rc, events
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            self.left -= 1
            if self.left <= 0:
                self.returncode = self.rc
                if self.rc == 0:
                    self.done.add(self.step)
        return self.returncode

    def terminate(self):
        self.events.append(("terminate", self.step))
        self.returncode = -15

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        self.returncode = -9


def _run(needs, polls, rc=None, done=None, lanes=2, threads=2, sleep=lambda s: None, events=None, at_epoch_end=None):
    done = done if done is not None else set()
    events = events if events is not None else []

    def start(step, n):
        events.append(("start", step, n))
        return study_lanes.Lane(step, n, FakeProc(step, done, polls[step], (rc or {}).get(step, 0), events), Path(step))

    quiet = lambda m: None  # noqa: E731
    started = study_lanes.run_lanes(
        list(needs), needs, done.__contains__, start, lanes, threads, quiet, 0, sleep, at_epoch_end=at_epoch_end
    )
    return started, events, done


NEEDS = {
    "teacher": [],
    "tkd": ["teacher"],
    "at_d2_s1": ["tkd"],
    "hrt_d2_s1": ["at_d2_s1"],
    "at_d1_s1": ["tkd"],
    "hrt_d1_s1": ["at_d1_s1"],
    "quality_hrt_d2_s1": ["hrt_d2_s1"],
    "quality_hrt_d1_s1": ["hrt_d1_s1"],
}


def test_the_lanes_run_every_step_once_each_after_what_it_needs():
    polls = {"teacher": 3, "tkd": 1, "at_d2_s1": 5, "at_d1_s1": 2, "hrt_d2_s1": 6, "hrt_d1_s1": 2}
    polls.update({"quality_hrt_d2_s1": 1, "quality_hrt_d1_s1": 1})
    started, events, done = _run(NEEDS, polls)
    assert done == set(NEEDS)
    assert sorted(started) == sorted(NEEDS)
    starts = [e for e in events if e[0] == "start"]
    # alone, the teacher and its KD take both threads; then the students one each
    assert starts[:4] == [
        ("start", "teacher", 2),
        ("start", "tkd", 2),
        ("start", "at_d2_s1", 1),
        ("start", "at_d1_s1", 1),
    ]
    # the one-layer pair finishes first: its HRT starts while the two-layer AT trains
    assert starts[4] == ("start", "hrt_d1_s1", 1)
    for step in started:
        assert all(started.index(need) < started.index(step) for need in NEEDS[step])


def test_steps_done_earlier_are_not_run_again():
    polls = dict.fromkeys(NEEDS, 1)
    started, _, _ = _run(NEEDS, polls, done={"teacher", "tkd", "at_d2_s1", "hrt_d2_s1", "quality_hrt_d2_s1"})
    assert started == ["at_d1_s1", "hrt_d1_s1", "quality_hrt_d1_s1"]


def test_a_failed_step_lets_the_running_one_finish_and_starts_nothing_new():
    polls = dict.fromkeys(NEEDS, 1) | {"at_d2_s1": 4}
    done, events = set(), []
    with pytest.raises(study_lanes.LaneError, match=r"at_d1_s1 \(exit 1"):
        _run(NEEDS, polls, rc={"at_d1_s1": 1}, done=done, events=events)
    assert done == {"teacher", "tkd", "at_d2_s1"}
    assert [e[1] for e in events if e[0] == "start"] == ["teacher", "tkd", "at_d2_s1", "at_d1_s1"]
    assert not [e for e in events if e[0] == "terminate"]


def test_a_step_that_ends_without_its_marker_is_a_failure_not_a_loop():
    needs = {"teacher": [], "tkd": ["teacher"]}
    done = set()
    events = []

    def start(step, n):
        proc = FakeProc(step, set(), 1, 0, events)  # exits 0 but never marks the step done
        return study_lanes.Lane(step, n, proc, Path(step))

    with pytest.raises(study_lanes.LaneError, match="without its done marker"):
        study_lanes.run_lanes(list(needs), needs, done.__contains__, start, 2, 2, lambda m: None, 0, lambda s: None)


def test_an_interrupt_stops_every_running_lane():
    polls = dict.fromkeys(NEEDS, 100)
    polls.update(teacher=1, tkd=1)
    calls = []

    def sleep(_):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt

    events = []
    with pytest.raises(KeyboardInterrupt):
        _run(NEEDS, polls, sleep=sleep, events=events)
    assert [e for e in events if e[0] == "terminate"] == [("terminate", "at_d2_s1"), ("terminate", "at_d1_s1")]


def test_idle_threads_go_to_the_last_running_step_at_its_epochs_end():
    needs = {"tkd": [], "at_a": ["tkd"], "at_b": ["tkd"], "hrt_a": ["at_a"]}
    polls = {"tkd": 1, "at_a": 2, "at_b": 9, "hrt_a": 1}
    boundary = {"at_b": [False, True]}  # at_b saves its checkpoint at the second look
    looked = []

    def at_epoch_end(step):
        looked.append(step)
        return boundary.get(step, [False]).pop(0) if boundary.get(step) else False

    events = []
    started, events, done = _run(needs, polls, events=events, at_epoch_end=at_epoch_end)
    assert done == set(needs)
    starts = [(e[1], e[2]) for e in events if e[0] == "start"]
    # at_a ends, hrt_a takes its lane; hrt_a ends and nothing is left to start: at_b, on one
    # thread, is stopped at its epoch's end and started again with both
    assert starts == [("tkd", 2), ("at_a", 1), ("at_b", 1), ("hrt_a", 1), ("at_b", 2)]
    assert ("terminate", "at_b") in events
    # no step is looked at while another could start or every thread is in use
    assert set(looked) == {"at_b"}


def test_a_step_is_at_its_epochs_end_just_after_saving_its_last_checkpoint(tmp_path):
    s = study.ConvergedStudy(study.parse_args(["--profile", "small", "--converged", "--out", str(tmp_path)]))
    last = tmp_path / "at_d2_s1" / "checkpoint_last.pt"
    assert not s.lane_at_epoch_end("at_d2_s1")
    last.parent.mkdir()
    last.write_bytes(b"x")
    for age, expected in ((1, False), (20, True), (300, False)):
        os.utime(last, (time.time() - age, time.time() - age))
        assert s.lane_at_epoch_end("at_d2_s1") is expected, age
    (tmp_path / "tkd").mkdir()
    (tmp_path / "tkd" / "checkpoint_last.pt").write_bytes(b"x")
    os.utime(tmp_path / "tkd" / "checkpoint_last.pt", (time.time() - 20, time.time() - 20))
    assert not s.lane_at_epoch_end("tkd")


def test_the_converged_studys_step_graph(tmp_path):
    s = study.ConvergedStudy(
        study.parse_args(
            ["--profile", "small", "--converged", "--out", str(tmp_path), "--threads", "2", "--also-from-teacher"]
        )
    )
    needs = s.lane_steps()
    assert list(needs)[:4] == ["teacher", "tkd", "at_d2_s1", "hrt_d2_s1"]
    assert needs["tkd"] == ["teacher"]
    assert needs["at_d1_s2"] == ["tkd"]
    assert needs["hrt_d1_s2"] == ["at_d1_s2"]
    assert needs["hrt_d2_s1_from_teacher"] == ["tkd"]
    assert needs["quality_hrt_d2_s1_from_teacher"] == ["hrt_d2_s1_from_teacher"]
    # each HRT model's test2016 reading comes right after it, before the next training step
    names = list(needs)
    hrt = [n for n in names if n.startswith("hrt_")]
    assert len(hrt) == 5 and all(names[names.index(n) + 1] == f"quality_{n}" for n in hrt)
    assert names.index("quality_hrt_d2_s1") < names.index("at_d1_s1")
    # --train-only keeps them: they are readings of trained models, not the benchmark
    s.args.train_only = True
    assert s.lane_steps() == needs
    # done markers: the KD by its binarised set, an HRT model by its phase at p_k = 1
    s.markers.mkdir(parents=True)
    (s.markers / "tkd_distill.done").write_text("x")
    (s.markers / "hrt_d2_s1.done").write_text("x")
    assert not s.lane_step_done("tkd") and not s.lane_step_done("hrt_d2_s1")
    (s.markers / "tkd_bin.done").write_text("x")
    (s.markers / "hrt_d2_s1_more.done").write_text("x")
    assert s.lane_step_done("tkd") and s.lane_step_done("hrt_d2_s1")


def test_lanes_are_refused_with_only_and_below_one(capsys):
    for argv in (
        ["--profile", "small", "--converged", "--lanes", "2", "--only", "teacher"],
        ["--profile", "small", "--lanes", "2"],
        ["--profile", "small", "--converged", "--lanes", "0"],
    ):
        with pytest.raises(SystemExit):
            study.parse_args(argv)
    assert "--lanes" in capsys.readouterr().err


def test_an_exclusive_step_waits_for_a_quiet_machine_and_the_stopped_steps_resume_after_it():
    """The interim benchmark: once it can start, nothing else starts, a training step running is
    stopped at its epoch's end, and the benchmark runs alone with every thread; the stopped
    step starts again after it."""
    needs = {"tkd": [], "at_a": ["tkd"], "at_b": ["tkd"], "hrt_a": ["at_a"], "bench": ["hrt_a"], "hrt_b": ["at_b"]}
    polls = {"tkd": 1, "at_a": 2, "at_b": 50, "hrt_a": 2, "bench": 3, "hrt_b": 1}
    ends = iter([False, False, True])  # at_b's epoch ends at the third look
    looked, events, log = [], [], []

    def at_epoch_end(step):
        looked.append(step)
        return next(ends, False) if step == "at_b" else False

    def start(step, n):
        events.append(("start", step, n))
        if step == "at_b" and sum(e[:2] == ("start", "at_b") for e in events) == 2:
            polls["at_b"] = 1  # resumed after the benchmark: it finishes
        return study_lanes.Lane(step, n, FakeProc(step, done, polls[step], 0, events), Path(step))

    done = set()
    study_lanes.run_lanes(
        list(needs), needs, done.__contains__, start, 2, 2, log.append, 0, lambda s: None,
        at_epoch_end=at_epoch_end, exclusive={"bench"},
    )  # fmt: skip
    assert done == set(needs)
    starts = [(e[1], e[2]) for e in events if e[0] == "start"]
    assert starts == [("tkd", 2), ("at_a", 1), ("at_b", 1), ("hrt_a", 1), ("bench", 2), ("at_b", 2), ("hrt_b", 2)]
    # at_b was stopped for it, not before hrt_a ended; while the benchmark ran nothing was looked at
    i = events.index(("terminate", "at_b"))
    assert events.index(("start", "hrt_a", 1)) < i < events.index(("start", "bench", 2))
    assert looked == ["at_b"] * 3
    assert any("bench runs alone" in m for m in log)


def test_the_interim_benchmark_in_the_step_graph(tmp_path):
    s = study.ConvergedStudy(
        study.parse_args(
            ["--profile", "small", "--converged", "--out", str(tmp_path), "--threads", "2", "--interim-benchmark"]
        )
    )
    needs = s.lane_steps()
    names = list(needs)
    # right after the first seed's last reading, before the second seed's first student
    assert names[names.index("quality_hrt_d1_s1") + 1] == "benchmark_s1"
    assert names[names.index("benchmark_s1") + 1] == "at_d2_s2"
    assert needs["benchmark_s1"] == [
        "at_d2_s1", "hrt_d2_s1", "at_d1_s1", "hrt_d1_s1", "quality_hrt_d2_s1", "quality_hrt_d1_s1",
    ]  # fmt: skip
    assert not s.lane_step_done("benchmark_s1") and not s.lane_at_epoch_end("benchmark_s1")
    assert s.status()[-1]["step"] == "benchmark_s1" and s.status()[-1]["state"] == "waiting"
    s.logs.mkdir(parents=True)
    (s.logs / "bound_hrt_d2_s1.log").write_text("measuring\n")  # its bounds run first
    assert s.status()[-1]["state"] == "running"
    s.markers.mkdir(parents=True)
    (s.markers / "benchmark_s1.done").write_text("x")
    assert s.lane_step_done("benchmark_s1") and s.status()[-1]["state"] == "done"
    # without the option, the graph has no such step
    s.args.interim_benchmark = False
    assert "benchmark_s1" not in s.lane_steps()
