"""``hrt-serve``'s scheduling at the decoder pass (runtime/hrt_runtime/service/turns.py): the turns
go to the least work left first, a batch waiting for its turn stops when nobody waits for it,
a long search yields to a short request between two of its passes with the outputs unchanged,
and no batch holds more than ``--max-batch-positions``."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("aiohttp")

from hrt_runtime import Translator  # noqa: E402
from hrt_runtime.serve import BATCHER  # noqa: E402
from hrt_runtime.service import turns as turns_module  # noqa: E402
from hrt_runtime.service.turns import BatchTurns, Turns  # noqa: E402
from hrt_runtime.work import Stopped  # noqa: E402
from tests.test_runtime import _sentences  # noqa: E402
from tests.test_serve import HeldWorker, Server, _cost, _wait_for, body_options, post  # noqa: E402


@pytest.fixture(scope="module")
def translator(exported_tiny):
    return Translator(exported_tiny["hrt"])


def _asker(turns: Turns, batch: BatchTurns, order: list):
    """A thread that takes one turn for ``batch``, notes it in ``order`` and gives it back."""

    def run():
        try:
            batch.enter(1)
        except Stopped:
            order.append(("stopped", batch))
            return
        order.append(batch)
        batch.leave()
        batch.done()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_free_turn_goes_to_the_least_work_left_then_to_the_first_that_asked():
    """One turn held; three batches ask for it (10,000 positions left, then 10, then 10 again):
    when it is given back it goes to the first of the two with 10 left, then the other, and the
    long one last."""
    turns = Turns(1)
    holder = BatchTurns(turns, 5, lambda: False)
    holder.enter(1)
    long, short, second_short = (BatchTurns(turns, n, lambda: False) for n in (10_000, 10, 10))
    order = []
    threads = []
    for batch in (long, short, second_short):
        threads.append(_asker(turns, batch, order))
        _wait_for(lambda: turns.waiting == len(threads))  # each has asked before the next does
    holder.leave()
    holder.done()  # its claim on the turn goes with it
    for thread in threads:
        thread.join(30)
    assert order == [short, second_short, long]
    assert long.passes == short.passes == second_short.passes == 1 and long.left == 10_000 - 1


def test_a_batch_that_gave_its_turn_back_keeps_the_first_claim_over_longer_work(monkeypatch):
    """A short batch between two of its passes (its turn just given back) is not overtaken by a
    long batch waiting: the long one gets the turn once the short one has made its next pass and
    ended. (The claim lasts long here, so that a busy machine's pause between the two passes
    cannot end it.)"""
    monkeypatch.setattr(turns_module, "CLAIM_SECONDS", 60.0)
    turns = Turns(1)
    short = BatchTurns(turns, 100, lambda: False)
    short.enter(1)
    long = BatchTurns(turns, 10_000, lambda: False)
    order = []
    thread = _asker(turns, long, order)
    _wait_for(lambda: turns.waiting == 1)
    short.leave()
    short.enter(1)  # its next pass, as its search asks for it right after its own Python
    order.append(short)
    short.leave()
    short.done()
    thread.join(30)
    assert order == [short, long]


def test_long_batches_leave_one_worker_to_short_work_in_progress():
    """Two workers, one held by a long batch, a short batch in progress between two passes: a
    second long batch waits though a turn is free, the short batch takes that turn at once, and
    the long one gets it once no short batch is in progress."""
    turns = Turns(2)
    short = BatchTurns(turns, 100, lambda: False)
    first_long = BatchTurns(turns, 10_000, lambda: False, long=True)
    first_long.enter(1)
    second_long = BatchTurns(turns, 20_000, lambda: False, long=True)
    order = []
    thread = _asker(turns, second_long, order)
    _wait_for(lambda: turns.waiting == 1)
    short.enter(1)
    order.append(short)
    short.leave()
    assert order == [short] and turns.waiting == 1  # the second long batch still waits
    short.done()
    thread.join(30)
    assert order == [short, second_long]
    first_long.leave()
    first_long.done()


def test_a_batch_waiting_for_its_turn_stops_when_nobody_waits_for_it():
    """While the one turn is held, a waiting batch whose requests are gone raises Stopped and
    leaves the line; the next batch then gets the turn as soon as it is free."""
    turns = Turns(1)
    holder = BatchTurns(turns, 5, lambda: False)
    holder.enter(1)
    gone = threading.Event()
    waiting = BatchTurns(turns, 1, gone.is_set)
    order = []
    thread = _asker(turns, waiting, order)
    _wait_for(lambda: turns.waiting == 1)
    gone.set()
    thread.join(30)
    assert order == [("stopped", waiting)] and turns.waiting == 0
    holder.leave()
    holder.done()
    after = BatchTurns(turns, 1, lambda: False)
    thread = _asker(turns, after, order)
    thread.join(30)
    assert order[-1] is after


class PassLog:
    """The batcher's ``translate_batch`` with every decoder pass noted as ``(batch, pass)`` (a
    batch: the tuple of its first source's token ids); a batch ``hold(sources)`` chooses is held
    inside its pass ``held_pass`` (its turn taken) until ``may_go()`` is true."""

    def __init__(self, batcher, hold, held_pass: int, may_go):
        self.passes, self.hold, self.held_pass, self.may_go = [], hold, held_pass, may_go
        self.translate = batcher.translate_batch
        batcher.translate_batch = self

    def __call__(self, sources, options, gate):
        name, held = tuple(sources[0].tolist()), self.hold(sources)
        enter = gate.enter

        def noted(positions):
            enter(positions)
            self.passes.append((name, gate.passes))
            if held and gate.passes == self.held_pass:
                _wait_for(self.may_go)

        gate.enter = noted
        return self.translate(sources, options, gate)


def test_a_long_search_yields_to_a_short_request_between_two_of_its_passes(translator):
    """One worker (one pass at a time). A costly one-line request (beam 20, min_len 1000: over a
    thousand decoder passes) is held inside its fifth pass until a short request's batch waits
    for the turn: the next pass is the short request's, it is answered (the Translator's
    translation) while the long search is still in progress, and the long request then gets
    exactly the Translator's translation too."""
    server = Server(translator, workers=1)
    batcher = server.app[BATCHER]
    costly = {"text": ["w5 w6 w7"], "beam": 20, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}
    short = {"text": _sentences(2, seed=5), "beam": 5, "max_len_b": 8}
    costly_name = tuple(translator.encode(costly["text"][0]).tolist())
    log = PassLog(
        batcher,
        lambda sources: tuple(sources[0].tolist()) == costly_name,
        held_pass=4,
        may_go=lambda: batcher.turns.waiting >= 1,
    )
    try:
        assert _cost(translator, costly) <= batcher.max_batch_positions
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(post, server.url, costly)
            _wait_for(lambda: len(log.passes) >= 5)
            status, answer = post(server.url, short)
            assert (status, answer) == (200, {"translations": translator.translate(**_call(short))})
            assert not long.done() and len(batcher.running) == 1  # the long search still runs
            mine = [i for i, (name, _) in enumerate(log.passes) if name != costly_name]
            assert mine and mine[0] == 5  # the pass after the held one was the short request's
            assert long.result(120) == (200, {"translations": translator.translate(**_call(costly))})
        assert sum(1 for name, _ in log.passes if name == costly_name) > 1000
    finally:
        server.close()


def _call(body: dict) -> dict:
    return {"lines": body["text"], **body_options(body)}


def test_a_line_costing_more_than_a_batch_holds_is_refused_at_once(translator):
    """--max-batch-positions holds for every batch: a line that alone may cost more is refused
    413 with its figure, before any work; a batch of several lines is cut to fit."""
    server = Server(translator, max_batch_positions=4096)
    batcher = server.app[BATCHER]
    try:
        costly = {"text": ["w4 w5", "w6 w7 w8"], "beam": 8, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}
        cost = _cost(translator, costly) // 2
        status, answer = post(server.url, costly)
        assert status == 413 and batcher.stats["batches"] == 0
        assert f"line 1 may cost {cost} decoder positions" in answer["error"]
        assert "more than a batch holds (--max-batch-positions 4096)" in answer["error"]
        several = {"text": _sentences(12, seed=9), "beam": 4, "max_len_b": 200, "chunk_size": 1}
        assert post(server.url, several) == (200, {"translations": translator.translate(**_call(several))})
        assert 0 < batcher.stats["largest_batch_positions"] <= 4096 and batcher.stats["batches"] > 1
    finally:
        server.close()


def test_requests_of_many_shapes_at_once_get_the_translators_answers(translator):
    """Two workers, batches of every option interleaved pass by pass: each request gets exactly
    the Translator's translation of its own lines."""
    server = Server(translator, workers=2, max_batch=4, max_wait_ms=0)
    try:
        requests = [
            {
                "text": _sentences(1 + i % 5, seed=300 + i),
                "beam": 1 + i % 6,
                "chunk_size": 1 + i % 2,
                "max_len_b": 6 + 3 * (i % 4),
                **({"min_len": 60, "max_len_b": 200} if i % 7 == 0 else {}),
            }
            for i in range(40)
        ]
        expected = [(200, {"translations": translator.translate(**_call(body))}) for body in requests]
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda body: post(server.url, body), requests))
        assert answers == expected
    finally:
        server.close()


def test_the_batches_in_progress_never_hold_more_than_the_memory_bound(translator):
    """One worker, batches of at most 4,096 positions: four costly one-line requests (4,096
    positions each) sent at once run one after another (never two in progress), short requests
    still run beside them in the quarter batch kept for short work, and every answer is the
    Translator's."""
    server = Server(translator, workers=1, max_batch_positions=4096)
    batcher = server.app[BATCHER]
    held = []  # the positions in progress at every pass
    translate = batcher.translate_batch

    def noting(sources, options, gate):
        enter = gate.enter

        def noted(positions):
            enter(positions)
            held.append((batcher.running_positions, len(batcher.running)))

        gate.enter = noted
        return translate(sources, options, gate)

    batcher.translate_batch = noting
    costly = [
        {"text": [line], "beam": 4, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}
        for line in _sentences(4, seed=11)
    ]
    short = [{"text": [line], "beam": 2, "max_len_b": 8} for line in _sentences(6, seed=12)]
    try:
        assert {_cost(translator, body) for body in costly} == {4096}
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda body: post(server.url, body), costly + short))
        assert answers == [(200, {"translations": translator.translate(**_call(body))}) for body in costly + short]
        assert held and max(positions for positions, _ in held) <= 4096 + 4096 // 4
        assert batcher.stats["largest_batch_positions"] == 4096
    finally:
        server.close()


def test_a_waiting_request_that_can_no_longer_finish_is_answered_before_its_work_starts(translator):
    """A request admitted while its scale had no pace waits behind a held batch; meanwhile the
    pace of its scale becomes known (a batch of its size took ten times its timeout): when its
    turn to start comes it is answered 503 with its figures at once, and its batch never runs."""
    server = Server(translator, workers=1, max_running_batches=1)
    batcher = server.app[BATCHER]
    worker = HeldWorker(batcher)
    big = {"text": _sentences(3, seed=13), "beam": 8, "max_len_b": 100, "chunk_size": 1, "timeout": 20}
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, server.url, {"text": ["w4 w5"], "beam": 1, "max_len_b": 4})
            assert worker.started.wait(30)
            waiting = pool.submit(post, server.url, big)
            _wait_for(lambda: len(batcher.queue) == 1)
            cost = _cost(translator, {k: v for k, v in big.items() if k != "timeout"})
            server.loop.call_soon_threadsafe(batcher.pace.measured, cost, 200.0)  # as a batch that finished
            _wait_for(lambda: batcher.pace.pace_for(cost) is not None)
            worker.release.set()
            assert first.result(60)[0] == 200
            status, answer = waiting.result(60)
        assert status == 503, answer
        assert f"this request's work left, {cost} decoder positions, would need 200 s" in answer["error"]
        assert len(worker.batches) == 1 and batcher.stats["rejected_deadline"] == 1 and batcher.in_flight == 0
    finally:
        worker.release.set()
        server.close()
