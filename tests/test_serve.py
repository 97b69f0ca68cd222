"""``hrt-serve`` (runtime/hrt_runtime/serve.py) on an untrained tiny exported model: concurrent requests
are batched and each gets the Translator's answer for its own lines; a full queue answers 503;
a client that disconnects breaks nobody; bad requests get 400 with the reason; /health, /info;
the command line."""

import asyncio
import collections
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("aiohttp")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fairseq_hrt.testing.tiny_runs import REPO, cli_env  # noqa: E402
from hrt_runtime import Translator  # noqa: E402
from hrt_runtime.options import SERVICE_BY_NAME  # noqa: E402
from hrt_runtime.search import SearchConfig  # noqa: E402
from hrt_runtime.serve import BATCHER, HANDLERS, make_app, runner_of, site_of  # noqa: E402
from hrt_runtime.service.intake import BIG_BODIES, BIG_THREADS, SMALL_BODY_BYTES  # noqa: E402
from hrt_runtime.work import cut_by_positions, line_positions  # noqa: E402
from tests.test_runtime import _said, _sentences, console_script, run_with_sigint_at_import  # noqa: E402


class Server:
    """The service's application run by aiohttp in a thread of this process, on a free port."""

    def __init__(self, translator, **settings):
        self.app = make_app(translator, **settings)
        self.loop = asyncio.new_event_loop()
        self.runner = runner_of(self.app)
        self.loop.run_until_complete(self.runner.setup())
        self.site = site_of(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(self.site.start())
        self.port = self.site.bound_port
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def post(url, body, timeout=60):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + "/translate", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url, path):
    with urllib.request.urlopen(url + path, timeout=30) as answer:
        return json.loads(answer.read())


@pytest.fixture(scope="module")
def translator(exported_tiny):
    return Translator(exported_tiny["hrt"])


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(translator):
    """The worker held at a first request while the others arrive: when it is released, the
    waiting requests are gathered into batches (no timing: they are all queued by then), and
    each request gets the Translator's answer for its own lines."""
    server = Server(translator, max_batch=32, max_wait_ms=0, workers=1, max_running_batches=1)
    worker = HeldWorker(server.app[BATCHER])
    try:
        requests = [
            (_sentences(1 + i % 4, seed=100 + i), dict(beam=1 + i % 2, max_len_b=6, chunk_size=1 + i % 2))
            for i in range(48)
        ]
        expected = [translator.translate(lines, **options) for lines, options in requests]
        with ThreadPoolExecutor(len(requests)) as pool:
            first = pool.submit(post, server.url, {"text": requests[0][0], **requests[0][1]})
            assert worker.started.wait(30)
            others = [pool.submit(post, server.url, {"text": lines, **options}) for lines, options in requests[1:]]
            _wait_for(lambda: len(server.app[BATCHER].queue) == len(others))
            worker.release.set()
            answers = [first.result(60)] + [answer.result(60) for answer in others]
        assert [status for status, _ in answers] == [200] * len(requests)
        assert [a["translations"] for _, a in answers] == expected
        stats = get(server.url, "/info")["stats"]
        assert stats["requests"] == len(requests)
        assert stats["batches"] == len(worker.batches) < len(requests)  # requests were gathered
        assert 1 < stats["largest_batch"] <= 32
        assert get(server.url, "/health")["status"] == "ok"
    finally:
        worker.release.set()
        server.close()


def test_requests_with_max_len_a_are_batched_alone(translator):
    """max_len_a > 0 makes the length limit depend on the batch's width: such requests get
    batches of their own, so each answer is still the Translator's for its lines."""
    server = Server(translator, max_batch=32, max_wait_ms=20)
    try:
        requests = [_sentences(1 + i % 3, seed=200 + i, max_words=4 + 6 * (i % 2)) for i in range(12)]
        options = dict(beam=1, max_len_a=1.0, max_len_b=2, chunk_size=1)
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda lines: post(server.url, {"text": lines, **options}), requests))
        assert answers == [(200, {"translations": translator.translate(lines, **options)}) for lines in requests]
        stats = get(server.url, "/info")["stats"]
        assert stats["batches"] == stats["requests"] == len(requests)
    finally:
        server.close()


def test_info_and_bad_requests(translator):
    server = Server(translator)
    try:
        info = get(server.url, "/info")
        assert info["kind"] == "hrt" and info["trained_chunk_sizes"] == [2, 3] and "beam" in info["options"]
        assert info["batching"]["max_batch"] == 64 and info["batching"]["max_wait_ms"] == 0
        # the model's hash, and the folder's name only: the server's path is not the client's business
        config = translator.model.config
        assert info["parameters_sha256"] == config["parameters_sha256"] and len(config["parameters_sha256"]) == 64
        name = os.path.basename(os.path.normpath(translator.model.folder))
        assert info["folder"] == name and os.sep not in info["folder"]
        assert post(server.url, {"text": "w5 w6", "beam": 1, "max_len_b": 4}) == (
            200,
            {"translations": translator.translate(["w5 w6"], beam=1, max_len_b=4)},
        )
        assert post(server.url, {"text": []}) == (200, {"translations": []})
        status, answer = post(server.url, b"{not json")
        assert status == 400 and "the body must be JSON" in answer["error"]
        status, answer = post(server.url, {"text": ["w1", 3]})
        assert status == 400 and '"text" must be a list of strings' in answer["error"]
        status, answer = post(server.url, {"text": ["w1"], "beem": 2})
        assert status == 400 and "unknown option 'beem'" in answer["error"]
        status, answer = post(server.url, {"text": ["w1"], "lenpen": None})
        assert status == 400 and "lenpen must be a finite number from -10 to 10" in answer["error"]
        status, answer = post(server.url, {"text": ["w1"] * 300})
        assert status == 413 and "at most 256" in answer["error"]
    finally:
        server.close()


def test_a_full_queue_answers_503_and_loses_nothing(translator):
    """One batch held in translation, one request waiting (--max-queue 1): the next is told 503
    at once; when the batch is released, the two accepted requests get their own answers."""
    server = Server(translator, max_batch=1, max_wait_ms=0, max_queue=1, workers=1, max_running_batches=1)
    batcher = server.app[BATCHER]
    release, started = threading.Event(), threading.Event()
    translate = batcher.translate_batch

    def held(lines, options, stop):
        started.set()
        release.wait(60)
        return translate(lines, options, stop)

    batcher.translate_batch = held
    try:
        a, b = _sentences(2, seed=7), _sentences(3, seed=8)
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, server.url, {"text": a, "beam": 1, "max_len_b": 5})
            assert started.wait(30)
            second = pool.submit(post, server.url, {"text": b, "beam": 1, "max_len_b": 5})
            deadline = time.monotonic() + 30
            while not batcher.queue and time.monotonic() < deadline:
                time.sleep(0.01)
            status, answer = post(server.url, {"text": ["w1"]}, timeout=10)
            assert status == 503 and "the queue is full" in answer["error"]
            release.set()
            assert first.result(60) == (200, {"translations": translator.translate(a, beam=1, max_len_b=5)})
            assert second.result(60) == (200, {"translations": translator.translate(b, beam=1, max_len_b=5)})
        assert get(server.url, "/info")["stats"]["rejected_full"] == 1
    finally:
        release.set()
        server.close()


def test_a_client_that_disconnects_breaks_nobody(translator):
    server = Server(translator, max_batch=8, max_wait_ms=50)
    try:
        body = json.dumps({"text": _sentences(4, seed=9), "beam": 1, "max_len_b": 6}).encode()
        for _ in range(3):  # requests whose clients hang up before the answer
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(
                b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            s.close()
        s = socket.create_connection(("127.0.0.1", server.port))  # and one that sends half a request
        s.sendall(b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"text"')
        s.close()
        lines = _sentences(5, seed=11)
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(lambda i: post(server.url, {"text": lines[i:], "beam": 1, "max_len_b": 6}), range(4))
            )
        assert answers == [
            (200, {"translations": translator.translate(lines[i:], beam=1, max_len_b=6)}) for i in range(4)
        ]
        assert get(server.url, "/health")["status"] == "ok"
    finally:
        server.close()


def test_the_command_line_serves_and_refuses_clearly(exported_tiny, tmp_path):
    """--port 0: the port it got is announced, after it listens; SIGTERM ends it with rc 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hrt_runtime.serve", exported_tiny["at"], "--port", "0"],
        cwd=str(REPO),
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        banner = proc.stdout.readline().decode()
        assert " on http://127.0.0.1:" in banner, banner
        port = int(banner.split(" on http://127.0.0.1:")[1].split()[0])
        assert port > 0
        url = f"http://127.0.0.1:{port}"
        assert get(url, "/health")["status"] == "ok"  # listening when announced
        expected = Translator(exported_tiny["at"]).translate(["w4 w5", ""], beam=2, max_len_b=5)
        assert post(url, {"text": ["w4 w5", ""], "beam": 2, "max_len_b": 5}) == (200, {"translations": expected})
        with socket.create_connection(("127.0.0.1", port)):  # the port is taken: a second service says so
            taken = _serve_cli(exported_tiny["at"], "--port", str(port))
        assert taken.returncode == 1 and taken.stdout == "", taken
        # one line, but the warning logged at load (the tiny folder has no SentencePiece model: pieces)
        said = [line for line in taken.stderr.strip().splitlines() if " | WARNING | " not in line]
        assert len(said) == 1, taken.stderr
        assert (
            f"hrt-serve: error: cannot listen on 127.0.0.1:{port}" in taken.stderr and "Traceback" not in taken.stderr
        )
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    for args, message in (
        (("--port", "70000"), "--port must be an integer from 0 to 65535"),
        (("--max-wait-ms", "inf"), "--max-wait-ms must be a finite number from 0 to 60000"),
        (("--max-batch", "0"), "--max-batch must be an integer from 1 to 100000"),
        (("--drain-seconds", "nan"), "--drain-seconds must be a finite number from 0 to 3600"),
    ):
        refused = _serve_cli(exported_tiny["at"], *args)
        assert refused.returncode == 2 and f"hrt-serve: error: {message}" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and refused.stdout == ""
    bad = subprocess.run(
        [sys.executable, "-m", "hrt_runtime.serve", str(tmp_path)],
        cwd=str(REPO),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and f"hrt-serve: error: {tmp_path}: no config.json" in bad.stderr


class HeldWorker:
    """The batcher's worker held at its first batch until ``release`` is set; every batch's
    sources recorded (as tuples of token ids), in the order they are translated. It stands in
    for the batcher's :attr:`~hrt_runtime.serve.Batcher.translate_batch` and calls the one it
    replaced (``translate``)."""

    def __init__(self, batcher):
        self.release, self.started, self.batches = threading.Event(), threading.Event(), []
        self.translate = batcher.translate_batch
        batcher.translate_batch = self

    def __call__(self, sources, options, stop):
        self.batches.append([tuple(s.tolist()) for s in sources])
        self.started.set()
        self.release.wait(60)
        return self.translate(sources, options, stop)


def _wait_for(condition, seconds=30):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _send_and_hang_up(port, body: dict):
    """A request whose client leaves without reading the answer; the socket, to close."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


def test_a_client_that_hangs_up_is_not_served(translator):
    """A request whose client disconnects while it waits is dropped from the queue and counted
    as abandoned; a long request whose client disconnects while its first batch runs gets no
    further batch, so the next request waits for that batch only."""
    server = Server(translator, max_batch=2, max_wait_ms=0, workers=1, max_running_batches=1)
    batcher = server.app[BATCHER]
    worker = HeldWorker(batcher)
    options = {"beam": 1, "max_len_b": 5}
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, server.url, {"text": ["w4 w5"], **options})
            assert worker.started.wait(30)
            waiting = _send_and_hang_up(server.port, {"text": _sentences(2, seed=21), **options})
            _wait_for(lambda: len(batcher.queue) == 1)
            waiting.close()
            _wait_for(lambda: batcher.stats["abandoned"] == 1 and not batcher.queue)
            worker.release.set()
            assert first.result(60)[0] == 200
        # a long request (5 batches of 2) whose client leaves while its first batch runs
        worker.release.clear()
        worker.started.clear()
        worker.batches.clear()
        long = _send_and_hang_up(server.port, {"text": _sentences(10, seed=22), **options})
        assert worker.started.wait(30)
        long.close()
        _wait_for(lambda: batcher.stats["abandoned"] == 2)
        worker.release.set()
        lines = _sentences(3, seed=23)
        assert post(server.url, {"text": lines, **options}) == (
            200,
            {"translations": translator.translate(lines, **options)},
        )
        assert len(worker.batches) == 1 + 2  # the long request's first batch, then the next request's two
        stats = get(server.url, "/info")["stats"]
        assert stats["abandoned"] == 2 and stats["batches"] == 1 + 1 + 2
    finally:
        worker.release.set()
        server.close()


def _queued_behind_a_held_batch(pool, server, worker, long, short, options):
    """A one-line request whose batch ``worker`` holds, then ``long`` and ``short`` queued behind
    it in that order: the three answers to come."""
    batcher = server.app[BATCHER]
    blocker = pool.submit(post, server.url, {"text": ["w4"], **options})
    assert worker.started.wait(30)
    first = pool.submit(post, server.url, {"text": long, **options})
    _wait_for(lambda: len(batcher.queue) == 1)
    second = pool.submit(post, server.url, {"text": short, **options})
    _wait_for(lambda: len(batcher.queue) == 2)
    return blocker, first, second


def test_a_long_request_is_split_and_others_interleave(translator):
    """A request of 6 lines at --max-batch 2 is translated as 3 batches; a short request that
    arrives behind it is translated after its first batch, not after all of them; both get
    the Translator's answers."""
    server = Server(translator, max_batch=2, max_wait_ms=0, workers=1, max_running_batches=1)
    batcher = server.app[BATCHER]
    worker = HeldWorker(batcher)
    options = {"beam": 1, "max_len_b": 5}
    long, short = _sentences(6, seed=31), ["w7 w8 w9"]
    try:
        with ThreadPoolExecutor(3) as pool:
            blocker, first, second = _queued_behind_a_held_batch(pool, server, worker, long, short, options)
            worker.release.set()
            assert blocker.result(60)[0] == 200
            assert first.result(60) == (200, {"translations": translator.translate(long, **options)})
            assert second.result(60) == (200, {"translations": translator.translate(short, **options)})
        short_source = tuple(translator.encode(short[0]).tolist())
        order = [short_source in batch for batch in worker.batches]
        assert len(worker.batches) == 1 + 3 + 1 and order.index(True) == 2, order  # blocker, long 1, short
    finally:
        worker.release.set()
        server.close()


def test_limits_per_request_and_warnings_name_the_request(translator, caplog):
    server = Server(translator, max_request_tokens=40)
    try:
        status, answer = post(server.url, {"text": ["w4 w5 w6 w7 w8 w9"] * 8})  # 7 tokens a line
        # refused once the count passes the cap: after 6 of the 8 lines, not after all of them
        stopped = "at least 42 source tokens in one request (in its first 6 of 8 lines); at most 40 (--max-request"
        assert status == 413 and stopped in answer["error"]
        lines = ["w4\x01"] * 15 + ["w5"]
        with caplog.at_level(logging.WARNING, logger="hrt_runtime"):
            status, answer = post(server.url, {"text": lines, "beam": 1, "max_len_b": 4})
        assert status == 200 and answer["translations"] == translator.translate(lines, beam=1, max_len_b=4)
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
        named = [m for m in logged if ", line " in m]
        assert len(named) == 10 and named[0].startswith("request ") and named[0].split(": ")[0].endswith("line 1")
        assert any("15 of 16 lines were repaired" in m for m in logged), logged
    finally:
        server.close()


def test_draining_at_shutdown_is_limited(translator):
    """With a batch held and requests queued, a drain of 0.2 s answers the queued ones 503 and
    so the request whose batch was running when it ended, as it has a second batch to go (a
    request of one batch in progress then would be answered)."""
    server = Server(translator, max_batch=1, drain_seconds=0.2, workers=1, max_running_batches=1)
    batcher = server.app[BATCHER]
    worker = HeldWorker(batcher)
    options = {"beam": 1, "max_len_b": 5}
    try:
        with ThreadPoolExecutor(3) as pool:
            held = pool.submit(post, server.url, {"text": ["w4", "w5 w6"], **options})  # 2 batches
            assert worker.started.wait(30)
            queued = [pool.submit(post, server.url, {"text": [f"w{5 + i}"], **options}) for i in range(2)]
            _wait_for(lambda: len(batcher.queue) == 2)
            drained = asyncio.run_coroutine_threadsafe(batcher.drain(0.2), server.loop)
            for answer in queued:
                status, body = answer.result(60)
                assert status == 503 and "shutting down" in body["error"]
            drained.result(60)
            worker.release.set()
            status, body = held.result(60)
            assert status == 503 and "shutting down" in body["error"]
            assert len(worker.batches) == 1  # nothing was translated after the drain time
    finally:
        worker.release.set()
        server.close()


def _samples(text):
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_metrics_count_what_was_served(translator, caplog):
    pytest.importorskip("prometheus_client")
    server = Server(translator, max_batch=8, max_queue=4)
    try:
        requests = [_sentences(1 + i % 3, seed=40 + i) for i in range(24)]
        with caplog.at_level(logging.INFO, logger="hrt_runtime.serve.access"), ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(lambda lines: post(server.url, {"text": lines, "beam": 1, "max_len_b": 5}), requests)
            )
            bad = [post(server.url, {"text": ["w1"], "beam": 0}), post(server.url, {"text": ["w1"] * 300})]
        statuses = collections.Counter(str(status) for status, _ in answers + bad)
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as answer:
            assert answer.headers["Content-Type"].startswith("text/plain")
            samples = _samples(answer.read().decode())
        for outcome in ("200", "400", "413", "503"):
            assert samples[("hrt_serve_requests_total", (("outcome", outcome),))] == statuses.get(outcome, 0), outcome
        assert statuses["200"] + statuses.get("503", 0) == len(requests) and statuses["400"] == statuses["413"] == 1
        assert samples[("hrt_serve_request_seconds_count", ())] == len(requests) + len(bad)
        served = [lines for lines, (status, _) in zip(requests, answers) if status == 200]
        assert samples[("hrt_serve_sentences_total", ())] == sum(map(len, served))
        tokens = sum(translator.encode(line).size for lines in served for line in lines)
        assert samples[("hrt_serve_source_tokens_total", ())] == tokens
        stats = get(server.url, "/info")["stats"]
        assert samples[("hrt_serve_batch_sentences_count", ())] == stats["batches"]
        assert samples[("hrt_serve_batch_sentences_sum", ())] == sum(map(len, served))
        assert samples[("hrt_serve_queue_requests", ())] == 0
        access = [r.getMessage() for r in caplog.records if r.name == "hrt_runtime.serve.access"]
        translate_lines = [m for m in access if "POST /translate" in m]
        assert len(translate_lines) == len(requests) + len(bad)
        assert sum(f", {len(lines)} lines, 200, " in m for m in translate_lines for lines in served[:1]) >= 1
    finally:
        server.close()


def test_a_bug_answers_500_with_its_traceback_logged_and_a_refusal_400(translator, monkeypatch, caplog):
    """Only the runtime's refusals are a request's fault (400 with the message): a TypeError
    raised inside the runtime (here by ``Translator.options``, replaced in this process) is not
    turned into a 400 that blames the request; aiohttp answers 500 and logs its traceback."""
    server = Server(translator)

    def a_bug(**options):
        raise TypeError("a bug inside the runtime")

    try:
        status, answer = post(server.url, {"text": ["w1"], "beam": 0})
        assert status == 400 and answer["error"].startswith("beam must be an integer from 1 to 256"), answer
        monkeypatch.setattr(translator, "options", a_bug)
        with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
            request = urllib.request.Request(server.url + "/translate", data=json.dumps({"text": ["w1"]}).encode())
            with pytest.raises(urllib.error.HTTPError) as answered:
                urllib.request.urlopen(request, timeout=60)
        assert answered.value.code == 500 and "a bug inside the runtime" not in answered.value.read().decode()
        logged = [r for r in caplog.records if r.name == "aiohttp.server" and r.exc_info]
        assert len(logged) == 1 and str(logged[0].exc_info[1]) == "a bug inside the runtime"
        assert get(server.url, "/info")["stats"]["requests"] == 0  # refused or failed before admission
    finally:
        server.close()


def _serve_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "hrt_runtime.serve", *args],
        cwd=str(REPO),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


# --------------------------------------------------------- work, deadlines, slow clients, drain


def test_line_positions_count_what_the_search_may_compute():
    """The cost model against the searches' own limits: AT ``beam x (L + 1)``, HRT's stage I
    ``beam x (L / k + 1)`` plus stage II's ``b_nat x k x`` that, Mask-Predict ``l x I x L``,
    each L within the decoder's positions."""
    config = SearchConfig(beam=5, max_len_b=30)
    assert line_positions("at", 7, config, 1, 1, 10, 1, 1024) == 5 * 31
    assert line_positions("hrt", 7, config, 2, 2, 10, 1, 1024) == 5 * 16 + 2 * 2 * 16
    assert line_positions("hrt", 7, config, 1, 1, 10, 1, 1024) == 5 * 31  # AT mode
    assert line_positions("at", 7, SearchConfig(beam=2, max_len_a=1.5, max_len_b=4), 1, 1, 10, 1, 1024) == 2 * 15
    assert line_positions("at", 7, SearchConfig(beam=256, max_len_b=100000), 1, 1, 10, 1, 1024) == 256 * 1024
    assert line_positions("mask-predict", 7, config, 1, 1, 10, 3, 1024) == 3 * 10 * 30
    assert cut_by_positions([[0, 1, 2, 3], [4]], [5, 5, 20, 1, 3], 10) == [[0, 1], [2], [3], [4]]


def test_the_issue_request_is_refused_by_its_work_and_counted(translator):
    """64 lines at beam 256, min_len 1000, max_len_b 100000 (every value in range): a few
    hundred bytes, millions of decoder positions: 413 with the figure and the cap, nothing
    queued or in flight."""
    server = Server(translator)
    batcher = server.app[BATCHER]
    try:
        body = {"text": _sentences(64, seed=60), "beam": 256, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}
        status, answer = post(server.url, body)
        cap = SERVICE_BY_NAME["max_request_positions"].default
        figure = sum(
            translator.positions(translator.encode_lines(body["text"]), translator.options(**body_options(body)))
        )
        assert figure == 64 * 256 * 1024  # every line may run to the decoder's 1,024 positions
        assert status == 413 and f"may cost {figure} decoder positions" in answer["error"]
        assert f"at most {cap} (--max-request-positions)" in answer["error"]
        small = post(server.url, {"text": ["w4 w5"], "beam": 1, "max_len_b": 4})
        assert small == (200, {"translations": translator.translate(["w4 w5"], beam=1, max_len_b=4)})
        assert batcher.in_flight == 0 and not batcher.queue and batcher.stats["batches"] == 1
        samples = _scrape(server.url)
        assert samples[("hrt_serve_requests_total", (("outcome", "413"),))] == 1
    finally:
        server.close()


def body_options(body):
    return {k: v for k, v in body.items() if k != "text"}


def _scrape(url):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        return _samples(answer.read().decode())


def test_positions_caps_answer_413_and_503(translator):
    """A request above --max-request-positions: 413 naming its cost; one that would pass
    --max-positions-in-flight while another is admitted: 503 busy; the count comes back to 0."""
    one = translator.positions(translator.encode_lines(["w4 w5"]), translator.options(beam=2, max_len_b=9))[0]
    server = Server(
        translator, workers=1, max_running_batches=1, max_request_positions=4 * one, max_positions_in_flight=5 * one
    )
    batcher = server.app[BATCHER]
    worker = HeldWorker(batcher)
    options = {"beam": 2, "max_len_b": 9}
    try:
        status, answer = post(server.url, {"text": ["w4 w5"] * 5, **options})
        assert status == 413 and f"may cost {5 * one} decoder positions" in answer["error"]
        assert f"at most {4 * one} (--max-request-positions)" in answer["error"]
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(post, server.url, {"text": ["w4 w5"] * 3, **options})
            assert worker.started.wait(30)
            assert batcher.in_flight == 3 * one
            status, answer = post(server.url, {"text": ["w4 w5"] * 3, **options})
            assert status == 503 and "the service is busy" in answer["error"]
            worker.release.set()
            assert first.result(60)[0] == 200
        assert post(server.url, {"text": ["w4 w5"] * 3, **options})[0] == 200
        assert batcher.in_flight == 0 and batcher.stats["rejected_busy"] == 1
    finally:
        worker.release.set()
        server.close()


def test_a_request_past_its_deadline_is_answered_504_and_its_work_stops(translator):
    """Its first batch held past its own "timeout": it is answered 504 then, the held batch
    stops at its first decoder pass once released, its second batch never starts, and its
    positions leave the count."""
    server = Server(translator, workers=1, max_running_batches=1, max_batch=4)
    batcher = server.app[BATCHER]
    worker = HeldWorker(batcher)
    lines = _sentences(8, seed=61)
    try:
        status, answer = post(server.url, {"text": ["w1"], "timeout": 1e9})
        assert status == 400 and "timeout must be a finite number from 0.001 to 60" in answer["error"]
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(post, server.url, {"text": lines, "beam": 3, "max_len_b": 20, "timeout": 0.2})
            assert worker.started.wait(30)
            status, answer = slow.result(60)  # answered while its batch is held
            assert status == 504 and "deadline passed (0.2 s after it arrived) with 0 of 8 lines" in answer["error"]
            worker.release.set()
            _wait_for(lambda: batcher.stats["stopped_batches"] == 1)
        assert len(worker.batches) == 1 and batcher.in_flight == 0 and not batcher.queue
        assert post(server.url, {"text": ["w4"], "beam": 1, "max_len_b": 4})[0] == 200
        assert batcher.stats["deadline_passed"] == 1
        assert _scrape(server.url)[("hrt_serve_requests_total", (("outcome", "504"),))] == 1
    finally:
        worker.release.set()
        server.close()


def test_the_drain_finishes_the_least_work_first_and_health_says_503(translator):
    """SIGTERM's drain with a batch held, a long and a short request queued: while it drains,
    /health answers 503 and new requests 503 on a service still listening; the short request is
    translated before the long one's batches, and every admitted request is answered 200."""
    server = Server(translator, workers=1, max_running_batches=1, max_batch=2, max_wait_ms=0, drain_seconds=60)
    batcher = server.app[BATCHER]
    worker = HeldWorker(batcher)
    options = {"beam": 1, "max_len_b": 5}
    long, short = _sentences(6, seed=64), ["w9 w10 w11"]
    try:
        with ThreadPoolExecutor(3) as pool:
            blocker, first, second = _queued_behind_a_held_batch(pool, server, worker, long, short, options)
            drained = asyncio.run_coroutine_threadsafe(batcher.drain(60), server.loop)
            _wait_for(lambda: batcher.closing)
            with pytest.raises(urllib.error.HTTPError) as health:
                get(server.url, "/health")
            assert health.value.code == 503 and json.loads(health.value.read())["status"] == "draining"
            status, answer = post(server.url, {"text": ["w5"], **options})
            assert status == 503 and "shutting down" in answer["error"]
            worker.release.set()
            assert blocker.result(60)[0] == 200
            assert first.result(60) == (200, {"translations": translator.translate(long, **options)})
            assert second.result(60) == (200, {"translations": translator.translate(short, **options)})
            drained.result(60)
        short_source = tuple(translator.encode(short[0]).tolist())
        assert [short_source in batch for batch in worker.batches] == [False, True, False, False, False]
    finally:
        worker.release.set()
        server.close()


def _raw(port, data: bytes, seconds=30) -> bytes:
    """What the service sends back on a connection that sends ``data`` and then nothing, until
    it closes the connection."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(seconds)
        s.sendall(data)
        return _raw_rest(s)


def test_slow_and_hostile_clients_get_json_errors_and_are_cut(translator):
    server = Server(translator, body_timeout=0.3, idle_timeout=0.3)
    try:
        # a body that never arrives whole: 408, and the connection closes
        answer = _raw(server.port, b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"text"')
        assert answer.startswith(b"HTTP/1.1 408") and b'"error": "the body did not arrive within 0.3 s' in answer
        # headers that never end, and a connection that sends nothing: closed, no answer
        assert _raw(server.port, b"POST /translate HTTP/1.1\r\nHost: x\r\n") == b""
        assert _raw(server.port, b"") == b""
        status, answer = post(server.url, b"[" * 100000)
        assert status == 400 and "nested too deep" in answer["error"]
        status, answer = post(server.url, b" " * (16 * 2**20 + 1))
        assert status == 413 and "more than 16777216 bytes (16 MiB)" in answer["error"]
        status, answer = post(server.url, {"text": ["w4 w5", "w6\nw7"]})
        assert status == 400 and '"text" line 2 holds a line break' in answer["error"]
        with pytest.raises(urllib.error.HTTPError) as missing:
            get(server.url, "/nowhere")
        assert missing.value.code == 404 and "error" in json.loads(missing.value.read())
        # a client that hangs up while its batch is held: it goes unanswered, counted abandoned
        worker = HeldWorker(server.app[BATCHER])
        hung = _send_and_hang_up(server.port, {"text": _sentences(40, seed=65), "beam": 2, "max_len_b": 20})
        assert worker.started.wait(30)
        hung.close()
        _wait_for(lambda: server.app[BATCHER].stats["abandoned"] >= 1)
        worker.release.set()
        info = get(server.url, "/info")["stats"]
        samples = _scrape(server.url)
        for outcome in ("abandoned", "408", "400", "413"):
            counted = samples[("hrt_serve_requests_total", (("outcome", outcome),))]
            assert counted >= 1, outcome
        assert samples[("hrt_serve_requests_total", (("outcome", "abandoned"),))] == info["abandoned"]
    finally:
        server.close()


def _answer_of(raw: bytes):
    """A raw HTTP answer's status, headers (lower-case names) and JSON body (interim 1xx
    answers skipped, as HTTP clients skip them)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    while head.startswith(b"HTTP/1.1 1"):
        head, _, body = body.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_http_parser_errors_are_json_in_one_log_line(translator, caplog):
    """Requests aiohttp's parser refuses get the service's JSON errors, logged in one line
    without a traceback."""
    server = Server(translator)
    malformed = [
        b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n",
        b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ]
    try:
        with caplog.at_level(logging.INFO):
            for data in malformed:
                status, headers, body = _answer_of(_raw(server.port, data))
                assert status == 400 and headers["content-type"].startswith("application/json"), headers
                assert body["error"].startswith("malformed HTTP request: ")
        assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
        assert len([r for r in caplog.records if "malformed HTTP" in r.getMessage()]) == len(malformed)
        assert get(server.url, "/health")["status"] == "ok"
    finally:
        server.close()


def test_connections_beyond_the_limit_get_503_and_accept_errors_one_line(translator, caplog):
    server = Server(translator, max_connections=3)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    try:
        _wait_for(lambda: server.site.open == 3)
        status, headers, body = _answer_of(_raw(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
        assert status == 503 and headers["retry-after"] == "1" and "(--max-connections)" in body["error"]
        assert server.site.refused == 1
        idle.pop().close()
        _wait_for(lambda: server.site.open < 3)
        assert get(server.url, "/health")["status"] == "ok"
        # accept() at the file limit, as asyncio reports it for each refused accept: one line
        with caplog.at_level(logging.WARNING, logger="hrt_runtime.serve"):
            for _ in range(200):
                server.loop.call_soon_threadsafe(
                    server.loop.call_exception_handler,
                    {"message": "socket.accept() out of system resource", "exception": OSError(24, "Too many open")},
                )
            # the loop runs its callbacks in order: after this one, the 200 have run
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), server.loop).result(30)
        logged = [r.getMessage() for r in caplog.records if "accept() failed" in r.getMessage()]
        assert len(logged) == 1 and "ulimit -n" in logged[0] and not any(r.exc_info for r in caplog.records)
    finally:
        for s in idle:
            s.close()
        server.close()


class HeldBodies:
    """The service's intake held on every body above the small pool's size, until released."""

    def __init__(self, handlers):
        self.intake = handlers.intake
        self.prepare, self.started, self.release = self.intake.prepare, threading.Semaphore(0), threading.Event()
        self.intake.prepare = self.held

    def held(self, data, name):
        if len(data) > SMALL_BODY_BYTES:
            self.started.release()
            assert self.release.wait(60)
        return self.prepare(data, name)


def test_big_bodies_are_read_off_the_loop_in_a_bounded_pool(translator):
    """With the big-body pool full (its bodies held while being read), /health and a one-line
    request are answered, and one more big body is told 503; a body above the token cap is
    refused once the count passes it, before its last lines are tokenised."""
    server = Server(translator, max_request_tokens=4000)
    held = HeldBodies(server.app[HANDLERS])
    per_line = translator.max_source_tokens  # each line is truncated to it
    lines = 4000 // per_line + 3
    big = {"text": ["w4 w5 w6 " * 2000] * lines}  # more than 64 KiB, more tokens than the cap
    try:
        with ThreadPoolExecutor(BIG_BODIES) as pool:
            answers = [pool.submit(post, server.url, big) for _ in range(BIG_BODIES)]
            for _ in range(BIG_THREADS):  # every thread of the pool holds a body: none reads the others
                assert held.started.acquire(timeout=30)
            _wait_for(lambda: held.intake.big_bodies == BIG_BODIES)
            assert get(server.url, "/health")["status"] == "ok"
            options = {"beam": 1, "max_len_b": 4}
            assert post(server.url, {"text": ["w5 w6"], **options}) == (
                200,
                {"translations": translator.translate(["w5 w6"], **options)},
            )
            status, answer = post(server.url, big)
            assert status == 503 and "being read already" in answer["error"]
            held.release.set()
            for answer in answers:
                status, body = answer.result(60)
                stopped = f"(in its first {4000 // per_line + 1} of {lines} lines); at most 4000"
                assert status == 413 and stopped in body["error"], body
        _wait_for(lambda: held.intake.big_bodies == 0)
        # a big body's JSON is parsed in the parsing process: its refusals come back whole
        status, answer = post(server.url, b'{"text": [' + b",".join([b"1"] * 100000) + b"]}")
        assert status == 400 and '"text" must be a list of strings' in answer["error"]
        status, answer = post(server.url, json.dumps({"text": ["w4"] * 30000, "bem": 1}).encode())
        assert status == 413 and "30000 lines in one request" in answer["error"]
        assert held.intake._parser is not None  # they went there
    finally:
        held.release.set()
        server.close()


def test_the_drain_waits_for_a_request_still_arriving_and_a_half_close_is_answered(translator):
    """SIGTERM's drain with only a slow client's body on its way: the service keeps listening
    (/health 503) until that request is answered; a client that half-closes after a whole
    request still gets its answer and is not counted abandoned."""
    server = Server(translator, drain_seconds=60)
    batcher, handlers = server.app[BATCHER], server.app[HANDLERS]
    data = json.dumps({"text": ["w5 w6"], "beam": 1, "max_len_b": 4}).encode()
    head = b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.settimeout(30)
            s.sendall(head + data)
            s.shutdown(socket.SHUT_WR)
            status, _, body = _answer_of(_raw_rest(s))
        assert (status, body) == (200, {"translations": translator.translate(["w5 w6"], beam=1, max_len_b=4)})
        assert batcher.stats["abandoned"] == 0
        with socket.create_connection(("127.0.0.1", server.port)) as slow:
            slow.settimeout(30)
            slow.sendall(head + data[:5])
            _wait_for(lambda: handlers.arriving == 1)
            drained = asyncio.run_coroutine_threadsafe(batcher.drain(60, handlers.in_progress), server.loop)
            _wait_for(lambda: batcher.closing)
            with pytest.raises(urllib.error.HTTPError) as health:
                get(server.url, "/health")
            assert health.value.code == 503 and not drained.done()
            slow.sendall(data[5:])
            status, _, body = _answer_of(_raw_rest(slow, until=b"}"))
            assert status == 503 and "shutting down" in body["error"]
        drained.result(60)
    finally:
        server.close()


def _raw_rest(s, until=None) -> bytes:
    """What a connection receives until it closes (or until a chunk ends with ``until``)."""
    chunks = []
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        if until is not None and chunk.endswith(until):
            return b"".join(chunks)


def test_an_http_error_names_the_request_field(translator):
    """A beam the search cannot run on the model's output rows is refused naming the request's
    field and the largest beam it can run, which is then answered."""
    rows = translator.model.vocab_size
    assert 2 * 256 > rows - 1  # the tiny model: beam 256 is too large for its rows
    server = Server(translator)
    try:
        status, answer = post(server.url, {"text": ["w5 w6"], "beam": 256, "max_len_b": 2})
        largest = (rows - 1) // 2
        assert status == 400 and answer["error"].startswith(f"beam 256 is too large for the {rows} output rows")
        assert f"at most {largest}" in answer["error"] and "--beam" not in answer["error"]
        options = {"beam": largest, "max_len_b": 2}
        assert post(server.url, {"text": ["w5 w6"], **options}) == (
            200,
            {"translations": translator.translate(["w5 w6"], **options)},
        )
    finally:
        server.close()


def _cost(translator, body) -> int:
    """The decoder positions a request body may cost, as the service counts them at admission."""
    return sum(translator.positions(translator.encode_lines(body["text"]), translator.options(**body_options(body))))


def test_work_that_cannot_finish_by_its_deadline_is_refused_at_once_with_its_figures(translator):
    """Once batches of its scale have finished the service knows its pace there: a request that
    could not finish within its "timeout" even alone is answered 413 at once, one that could
    alone but not behind the work admitted ahead of it 503, each with its positions, the pace,
    the seconds it would need and its timeout; neither is queued, and small requests are still
    answered. A pace measured on short batches says nothing of long ones."""
    server = Server(translator, workers=1, max_running_batches=1)
    batcher = server.app[BATCHER]
    small = {"text": ["w4 w5"], "beam": 1, "max_len_b": 4}
    medium = {"text": _sentences(4, seed=63), "beam": 4, "max_len_b": 40}
    big = {"text": _sentences(4, seed=62), "beam": 16, "max_len_b": 200}
    try:
        assert not batcher.pace.paces  # nothing measured yet: nothing refused by pace
        for _ in range(3):
            assert post(server.url, small)[0] == 200
        assert post(server.url, medium)[0] == 200
        cost = _cost(translator, big)
        assert cost <= batcher.max_batch_positions  # one batch
        assert batcher.pace.pace_for(cost) is None  # short batches only: the big request is let in
        assert post(server.url, big)[0] == 200
        pace, batches = batcher.pace.pace_for(cost), batcher.stats["batches"]
        assert pace is not None and pace > 0
        timeout = cost / pace / 4  # it would need four times its timeout on an idle service
        assert 0.001 <= timeout <= 60, (cost, pace)
        status, answer = post(server.url, {**big, "timeout": timeout})
        assert status == 413, answer
        for figure in (
            f"may cost {cost} decoder positions",
            f"measured pace of {pace:.0f} positions a second",
            f"need {cost / pace:.3g} s even on an idle service",
            f"past its timeout of {timeout:g} s",
        ):
            assert figure in answer["error"], (figure, answer)
        assert batcher.stats["batches"] == batches and batcher.in_flight == 0 and not batcher.queue

        worker = HeldWorker(batcher)  # the medium request held: its positions are the work ahead
        ahead = _cost(translator, medium)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(post, server.url, medium)
            assert worker.started.wait(30)
            pace = batcher.pace.pace_for(ahead)  # no batch finishes while it is held
            timeout = 1.5 * ahead / pace  # enough alone, not behind the held request
            assert 0.001 <= timeout <= 60, (ahead, pace)
            status, answer = post(server.url, {**medium, "timeout": timeout})
            assert status == 503, answer
            assert f"may cost {ahead} decoder positions" in answer["error"]
            assert (
                f"behind the {ahead} positions in flight served before it, it would need {2 * ahead / pace:.3g} s"
                in (answer["error"])
            )
            assert f"past its timeout of {timeout:g} s" in answer["error"]
            worker.release.set()
            answered = translator.translate(medium["text"], **body_options(medium))
            assert first.result(60) == (200, {"translations": answered})
        assert post(server.url, small) == (200, {"translations": translator.translate(["w4 w5"], beam=1, max_len_b=4)})
        assert batcher.stats["rejected_deadline"] == 2 and batcher.in_flight == 0 and not batcher.queue
        assert get(server.url, "/info")["stats"]["rejected_deadline"] == 2
    finally:
        server.close()


def test_work_as_large_as_a_batch_stopped_unfinished_is_refused_at_once(translator):
    """A batch its deadline stopped unfinished is remembered: a request with a batch at least as
    large and a timeout no longer is answered 503 at once, with the figures, not run again."""
    server = Server(translator, workers=1, max_running_batches=1)
    batcher = server.app[BATCHER]
    body = {"text": _sentences(2, seed=64), "beam": 2, "max_len_b": 20}
    try:
        worker = HeldWorker(batcher)
        status, answer = post(server.url, {**body, "timeout": 0.2})  # expires while its batch is held
        assert status == 504, answer
        worker.release.set()
        _wait_for(lambda: batcher.stats["stopped_batches"] == 1)
        positions, seconds = batcher.pace.unfinished[-1]
        assert positions == _cost(translator, body)
        status, answer = post(server.url, {**body, "timeout": seconds})
        assert status == 503, answer
        assert f"a batch of {positions} was stopped unfinished after {seconds:.3g} s" in answer["error"]
        assert batcher.stats["rejected_deadline"] == 1 and len(worker.batches) == 1  # not run again
        assert post(server.url, body)[0] == 200  # a longer timeout is let in
    finally:
        server.close()


def _post_from(address: str, port: int, body: dict):
    """POST /translate from the local ``address`` (any of 127.0.0.0/8 on Linux's loopback)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(address, 0))
    try:
        connection.request("POST", "/translate", json.dumps(body), {"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def test_one_client_holds_at_most_its_share_of_the_positions_in_flight(translator):
    """A client holding positions in flight is refused 503 naming --max-client-share when a
    further request would pass its share, while another address is admitted, even above the
    share with its first request; the shares are released when the requests are answered."""
    options = {"beam": 2, "max_len_b": 9}
    one = _cost(translator, {"text": ["w4 w5"], **options})
    server = Server(
        translator,
        workers=1,
        max_running_batches=1,
        max_request_positions=8 * one,
        max_positions_in_flight=8 * one,
        max_client_share=0.5,
    )
    batcher = server.app[BATCHER]
    worker = HeldWorker(batcher)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_post_from, "127.0.0.1", server.port, {"text": ["w4 w5"] * 3, **options})
            assert worker.started.wait(30)
            assert batcher.held == {"127.0.0.1": 3 * one}
            status, answer = _post_from("127.0.0.1", server.port, {"text": ["w4 w5"] * 2, **options})
            assert status == 503, answer
            assert f"this client (127.0.0.1) holds {3 * one} decoder positions" in answer["error"]
            assert (
                f"--max-client-share 0.5 of --max-positions-in-flight {8 * one} ({4 * one} positions)"
                in (answer["error"])
            )
            other = pool.submit(_post_from, "127.0.0.2", server.port, {"text": ["w4 w5"] * 5, **options})
            _wait_for(lambda: batcher.held.get("127.0.0.2") == 5 * one)
            worker.release.set()
            expected = translator.translate(["w4 w5"], **options)
            assert first.result(60) == (200, {"translations": expected * 3})
            assert other.result(60) == (200, {"translations": expected * 5})
        assert batcher.held == {} and batcher.in_flight == 0
        assert _post_from("127.0.0.1", server.port, {"text": ["w4 w5"] * 2, **options})[0] == 200
        assert batcher.stats["rejected_share"] == 1 and batcher.stats["rejected_busy"] == 0
    finally:
        worker.release.set()
        server.close()


@pytest.mark.parametrize("module", ["aiohttp", "onnxruntime"])
def test_ctrl_c_while_the_service_starts_is_one_line(exported_tiny, module):
    """SIGINT while hrt-serve's console script imports its libraries (aiohttp) or loads the model
    (onnxruntime): one line, exit 130, no traceback, nothing announced."""
    proc = run_with_sigint_at_import(module, console_script("hrt-serve"), [exported_tiny["hrt"], "--port", "0"])
    err = proc.stderr.decode()
    assert proc.returncode == 130 and proc.stdout == b"", err
    assert _said(err) == ["hrt-serve: interrupted"], err
