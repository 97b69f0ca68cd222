"""``hrt-serve`` (hrt_runtime/serve.py) on an untrained tiny exported model: concurrent requests
are batched and each gets the Translator's answer for its own lines; a full queue answers 503;
a client that disconnects breaks nobody; bad requests get 400 with the reason; /health, /info;
the command line."""

import asyncio
import json
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

from aiohttp import web  # noqa: E402

from benchmarks.tiny_runs import REPO, cli_env  # noqa: E402
from hrt_runtime import Translator  # noqa: E402
from hrt_runtime.serve import BATCHER, make_app  # noqa: E402
from tests.test_runtime import _sentences  # noqa: E402


class Server:
    """The service's application run by aiohttp in a thread of this process, on a free port."""

    def __init__(self, translator, **settings):
        self.app = make_app(translator, **settings)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(self.app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
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
    server = Server(translator, max_batch=32, max_wait_ms=20)
    try:
        requests = [
            (_sentences(1 + i % 4, seed=100 + i), dict(beam=1 + i % 2, max_len_b=6, chunk_size=1 + i % 2))
            for i in range(48)
        ]
        expected = [translator.translate(lines, **options) for lines, options in requests]
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda r: post(server.url, {"text": r[0], **r[1]}), requests))
        assert [status for status, _ in answers] == [200] * len(requests)
        assert [a["translations"] for _, a in answers] == expected
        stats = get(server.url, "/info")["stats"]
        assert stats["requests"] == len(requests)
        assert stats["batches"] < len(requests)  # requests were gathered
        assert 1 < stats["largest_batch"] <= 32
        assert get(server.url, "/health")["status"] == "ok"
    finally:
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
        assert status == 400 and "lenpen must be a number" in answer["error"]
        status, answer = post(server.url, {"text": ["w1"] * 300})
        assert status == 413 and "at most 256" in answer["error"]
    finally:
        server.close()


def test_a_full_queue_answers_503_and_loses_nothing(translator):
    """One batch held in translation, one request waiting (--max-queue 1): the next is told 503
    at once; when the batch is released, the two accepted requests get their own answers."""
    server = Server(translator, max_batch=1, max_wait_ms=0, max_queue=1)
    batcher = server.app[BATCHER]
    release, started = threading.Event(), threading.Event()
    translate = batcher._translate

    def held(lines, options):
        started.set()
        release.wait(60)
        return translate(lines, options)

    batcher._translate = held
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hrt_runtime.serve", exported_tiny["at"], "--port", str(port)],
        cwd=str(REPO),
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert b"on http://127.0.0.1:" in proc.stdout.readline()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                assert get(url, "/health")["status"] == "ok"
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        expected = Translator(exported_tiny["at"]).translate(["w4 w5", ""], beam=2, max_len_b=5)
        assert post(url, {"text": ["w4 w5", ""], "beam": 2, "max_len_b": 5}) == (200, {"translations": expected})
    finally:
        proc.terminate()
        proc.wait(30)
    bad = subprocess.run(
        [sys.executable, "-m", "hrt_runtime.serve", str(tmp_path)],
        cwd=str(REPO),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and f"hrt-serve: error: {tmp_path}: no config.json" in bad.stderr
