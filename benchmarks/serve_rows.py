"""The pieces of ``benchmarks/serve_load.py``'s rows of issue 88 that stand apart from its
clients: their flags and plans, the one-line hostile and cap requests, the big bodies, the idle
connections, ``/health`` polled while a row runs, the service's memory and the size of its log."""

import argparse
import http.client
import json
import resource
import socket
import threading
import time
from typing import Dict, List, Optional

# issue 88's one line: 154 bytes of request that cost 262,144 decoder positions at beam 256
HOSTILE_LINE = "Two young men are playing soccer on a green field near a big old house ."
ONE_LINE_HOSTILE = ('{"beam": 256, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}',)
CAP_LINES = 4  # lines x beam 256 x 1,024 positions = 2^20, hrt-serve's default --max-request-positions
BIG_BODY_LINES = 256  # hrt-serve's default --max-request-lines: the body is refused for its size or cost only


def rss_mib(pid: int) -> Dict[str, int]:
    """A process's resident memory now (``VmRSS``) and at its peak so far (``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        status = f.read().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) // 1024 for line in status if line.startswith(("VmRSS", "VmHWM"))}


def file_limit(soft: int):
    """A ``preexec_fn`` that lowers the service's open-file limit to ``soft`` (as ``ulimit -n``)."""

    def lower():
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return lower


def log_stats(log) -> Dict[str, int]:
    """What the service wrote to its stderr so far: lines, bytes and tracebacks (a flood of them
    is what an accept() loop at its file limit writes)."""
    log.flush()
    log.seek(0)
    data = log.read()
    log.seek(0, 2)
    return {
        "log_lines": data.count(b"\n"),
        "log_bytes": len(data),
        "log_tracebacks": sum(b"Traceback" in line for line in data.splitlines()),
    }


def one_line_bodies(given: str, count: int, line: str = HOSTILE_LINE) -> List[Dict]:
    """``count`` requests of the one line with the options of the JSON object ``given``."""
    return [{"text": [line], **json.loads(given)} for _ in range(count)]


def cap_body(given: str, line: str = HOSTILE_LINE) -> Dict:
    """The request at the per-request cap: :data:`CAP_LINES` copies of the hostile line."""
    return {"text": [line] * CAP_LINES, **json.loads(given)}


def big_body(sentences: List[str], mebibytes: float, lines: int = BIG_BODY_LINES) -> bytes:
    """A valid ``{"text": [...]}`` body of ``lines`` long lines of real sentences, just under
    ``mebibytes`` MiB: a body the size check lets through, so its cost is all in the parsing."""
    per_line = (int(mebibytes * 2**20) - 1024) // lines - 4  # 4: the quotes, comma and space around a line
    escaped = [json.dumps(sentence)[1:-1] for sentence in sentences]  # ASCII: one byte a character
    line, i = escaped[0], 1
    while len(line) < per_line:
        line += " " + escaped[i % len(escaped)]
        i += 1
    line = line[:per_line].rsplit(" ", 1)[0]  # at a space, so that no escape is cut in two
    return ('{"text": [' + ", ".join([f'"{line}"'] * lines) + "]}").encode()


def open_idle(port: int, count: int) -> List[socket.socket]:
    """``count`` connections that send nothing (a connect the service has not taken yet stays
    pending: it is not waited for, so a full accept queue cannot stall the row)."""
    idle = []
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        idle.append(s)
    return idle


def socket_outcomes(sockets: List[socket.socket]) -> Dict:
    """How connections stand now: answered (by status), closed without an answer, still open
    (taken by the service, or waiting in the kernel's accept queue: a client cannot tell them
    apart), still connecting (the accept queue was full), or failed (by error)."""
    outcome = {"answered": {}, "closed_without_answer": 0, "still_open": 0, "still_connecting": 0, "failed": {}}
    for s in sockets:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            try:
                s.getpeername()
                outcome["still_open"] += 1
            except OSError:  # ENOTCONN: its SYN is still unanswered
                outcome["still_connecting"] += 1
            continue
        except OSError as e:
            name = type(e).__name__ if e.errno is None else f"errno {e.errno}"
            outcome["failed"][name] = outcome["failed"].get(name, 0) + 1
            continue
        if not data:
            outcome["closed_without_answer"] += 1
        else:
            status = data.split(b" ", 2)[1].decode(errors="replace")
            outcome["answered"][status] = outcome["answered"].get(status, 0) + 1
    return outcome


class HealthPoller:
    """``GET /health`` from a new connection every ``every`` seconds, in a thread, while a row
    runs: the statuses and the slowest probe (one that failed counts the time until it failed)."""

    def __init__(self, port: int, every: float = 0.05, timeout: float = 30.0):
        self.port, self.every, self.timeout = port, every, timeout
        self.seconds: List[float] = []
        self.statuses: Dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _probe(self) -> str:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            connection.request("GET", "/health")
            answer = connection.getresponse()
            answer.read()
            return str(answer.status)
        except Exception as e:  # noqa: BLE001 - a refused or timed-out probe is what the row reports
            return type(e).__name__
        finally:
            connection.close()

    def _poll(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            status = self._probe()
            self.seconds.append(time.perf_counter() - started)
            self.statuses[status] = self.statuses.get(status, 0) + 1
            self.stop.wait(self.every)

    def __enter__(self) -> "HealthPoller":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def result(self) -> Dict:
        return {
            "probes": len(self.seconds),
            "max_ms": round(1000 * max(self.seconds), 1) if self.seconds else None,
            "statuses": self.statuses,
        }


def side_summary(side: List[Dict]) -> str:
    """The requests beside a row's clients in a few words: per status, how many, their slowest
    time, whether some still ran when the clients were done, and the first error."""
    groups: Dict[str, List[Dict]] = {}
    for d in side:
        groups.setdefault(str(d["status"]), []).append(d)
    parts = []
    for status, ds in groups.items():
        running = sum(d["running_when_clients_done"] for d in ds)
        error: Optional[str] = next((d["error"] for d in ds if d["error"]), None)
        parts.append(
            f"{len(ds)} x {status} (slowest {max(d['seconds'] for d in ds)} s"
            + (f", {running} still running when the clients were done" if running else "")
            + ")"
            + (f": {error[:90]}" if error else "")
        )
    return "; ".join(parts)


def json_object(text: str) -> str:
    """An argparse ``type``: ``text`` if it is a JSON object (the options of a request)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object of request options: {text}")
    return text


def int_list(text: str) -> List[int]:
    """An argparse ``type``: comma-separated positive integers."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every number must be at least 1: {text}")
    return values


def add_issue88_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the rows of issue 88."""
    p.add_argument(
        "--one-line-hostile",
        action="append",
        type=json_object,
        default=None,
        help="a JSON object of options for the one-line-hostile row's requests (repeat: rows for each); the first "
        "is the cap-request row's; default: " + " and ".join(ONE_LINE_HOSTILE),
    )
    p.add_argument(
        "--hostile-counts", type=int_list, default=[2, 16], help="N,...: a one-line-hostile row with N requests each"
    )
    p.add_argument("--hostile-line", default=HOSTILE_LINE, help="the one line of the one-line-hostile requests")
    p.add_argument(
        "--big-bodies", type=int_list, default=[6, 15], help="COUNT,MIB: the big-bodies row's bodies and their size"
    )
    p.add_argument("--idle", type=int, default=1100, help="the idle row's connections that send nothing")
    p.add_argument("--idle-file-limit", type=int, default=1024, help="the service's open-file limit in the idle row")


def issue88_rows(a, row: str, concurrent, sentences: List[str]):
    """The planned rows (``serve_load.plan_rows``: name, clients' work, requests beside them) of
    issue 88's row ``row``."""
    givens = a.one_line_hostile or list(ONE_LINE_HOSTILE)
    if row == "one-line-hostile":
        return [
            (f"one-line-hostile {count} x {given}", concurrent, one_line_bodies(given, count, a.hostile_line))
            for given in givens
            for count in a.hostile_counts
        ]
    if row == "cap-request":
        return [(f"cap-request {givens[0]}", concurrent, [cap_body(givens[0], a.hostile_line)])]
    if row == "big-bodies":
        count, mebibytes = a.big_bodies
        return [(f"big-bodies {count} x {mebibytes} MiB", concurrent, [big_body(sentences, mebibytes)] * count)]
    return [(row, concurrent, [])]  # idle
