"""benchmarks/serve_rows.py: the pieces of the load test's rows of issue 88, against real
sockets, a real HTTP server and a real child process (the rows themselves need an exported
model and minutes: benchmarks/serve_load.py)."""

import http.server
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from benchmarks.serve_rows import (
    BIG_BODY_LINES,
    HealthPoller,
    big_body,
    cap_body,
    file_limit,
    int_list,
    json_object,
    log_stats,
    one_line_bodies,
    open_idle,
    side_summary,
    socket_outcomes,
)

REPO = Path(__file__).resolve().parents[1]


def test_big_body_is_valid_json_of_long_lines_just_under_its_size():
    sentences = ['A "quoted" man rides a bike .', "Zwei Männer stehen am Herd ."]  # escapes lengthen the JSON
    body = big_body(sentences, 0.5)
    assert len(body) <= 0.5 * 2**20
    text = json.loads(body)["text"]
    assert len(text) == BIG_BODY_LINES and len(set(text)) == 1
    assert len(body) > 0.98 * 0.5 * 2**20  # just under


def test_one_line_and_cap_bodies_carry_the_options():
    given = '{"beam": 256, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}'
    bodies = one_line_bodies(given, 3, "a line .")
    assert bodies == [{"text": ["a line ."], "beam": 256, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}] * 3
    assert cap_body(given, "a line .")["text"] == ["a line ."] * 4


def test_idle_connections_are_told_apart():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    idle = open_idle(port, 6)
    accepted = [listener.accept()[0] for _ in range(6)]
    accepted[0].sendall(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
    accepted[1].sendall(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
    accepted[2].close()
    time.sleep(0.2)
    outcome = socket_outcomes(idle)
    assert outcome["answered"] == {"503": 2}
    assert outcome["closed_without_answer"] == 1 and outcome["still_open"] == 3
    for s in idle + accepted:
        s.close()
    listener.close()


def test_connections_a_full_accept_queue_left_pending_are_told_apart():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepted: the kernel queues one or two, and drops the others' SYNs
    idle = open_idle(listener.getsockname()[1], 8)
    time.sleep(0.2)
    outcome = socket_outcomes(idle)
    assert outcome["still_connecting"] >= 1 and outcome["still_open"] + outcome["still_connecting"] == 8
    for s in idle:
        s.close()
    listener.close()


class _Health(http.server.BaseHTTPRequestHandler):
    answers = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(self.answers.pop(0) if self.answers else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_health_poller_counts_statuses_and_refusals():
    _Health.answers = [200, 503]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with HealthPoller(server.server_address[1], every=0.01) as poller:
        while sum(poller.statuses.values()) < 4:
            time.sleep(0.01)
    result = poller.result()
    assert result["statuses"]["503"] == 1 and result["statuses"]["200"] >= 3
    assert result["probes"] == sum(result["statuses"].values()) and result["max_ms"] > 0
    server.shutdown()
    server.server_close()
    with HealthPoller(server.server_address[1], every=0.01) as refused:
        while not refused.statuses:
            time.sleep(0.01)
    assert set(refused.result()["statuses"]) == {"ConnectionRefusedError"}


def test_log_stats_counts_traceback_lines():
    with tempfile.TemporaryFile() as log:
        written = b"started\nTraceback (most recent call last):\n  File x\nOSError: [Errno 24]\nTraceback (x)\n"
        log.write(written)
        assert log_stats(log) == {"log_lines": 5, "log_bytes": len(written), "log_tracebacks": 2}
        log.write(b"more\n")  # the service goes on writing at the end
        assert log_stats(log)["log_lines"] == 6


def test_file_limit_lowers_the_child_s_open_files():
    read = "import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    out = subprocess.run([sys.executable, "-c", read], preexec_fn=file_limit(100), capture_output=True, text=True)
    assert out.stdout.strip() == "100"


def test_side_summary_groups_by_status():
    side = [
        {"status": 504, "seconds": 60.1, "error": "deadline", "running_when_clients_done": True},
        {"status": 504, "seconds": 59.0, "error": "deadline", "running_when_clients_done": False},
        {"status": "TimeoutError", "seconds": 60.0, "error": "", "running_when_clients_done": False},
    ]
    summary = side_summary(side)
    assert summary.startswith("2 x 504 (slowest 60.1 s, 1 still running when the clients were done): deadline")
    assert "1 x TimeoutError (slowest 60.0 s)" in summary


@pytest.mark.parametrize("flag", [["--one-line-hostile", "{bad"], ["--one-line-hostile", "[1]"], ["--big-bodies", "6"]])
def test_bad_flags_end_in_one_line(flag, tmp_path):
    command = [sys.executable, "-m", "benchmarks.serve_load", "--folder", "x", "--input", "y", "--out", str(tmp_path)]
    out = subprocess.run(command + flag, cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("serve_load.py: error: ")
    assert flag[0] in out.stderr and not list(tmp_path.iterdir())


def test_flag_types_refuse_what_is_not_theirs():
    assert json_object('{"beam": 64}') == '{"beam": 64}'
    assert int_list("2,16") == [2, 16]
    for bad in ("2,x", "0,3", ""):
        with pytest.raises(Exception, match="integers|at least 1"):
            int_list(bad)
