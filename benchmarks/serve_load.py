#!/usr/bin/env python
"""Load test of ``hrt-serve`` on localhost: N concurrent clients x M requests against one
request at a time, every answer checked against ``Translator.translate`` of its own lines, and
the service under hostile load.

The service runs as its command line (``python -m hrt_runtime.serve FOLDER --port P ...``) in
its own process, a fresh one per row (``--service-path DIR``: the ``hrt_runtime`` of another
checkout, e.g. the version before a change, for a before/after table); the clients are threads
of this one, each with one keep-alive HTTP connection. Requests are drawn from ``--input``
(``--lines`` sentences each, in file order); every client sends its M requests back to back.
Rows (``--rows``):

* ``sequential``: one client, the same N x M requests one after another;
* ``concurrent``: N clients at once (the service gathers their requests into batches);
* ``large`` (``--large-request LINES,KB``): the concurrent row with one more request of LINES
  lines of about KB kilobytes each;
* ``hostile``: the concurrent row with the costly requests of ``--hostile`` beside it (each its
  own row: 64 lines with options such as ``beam`` 256 and ``min_len`` 1000, all in range), sent
  by a client that gives up after ``--client-timeout`` seconds, as an impatient caller does;
* ``flood``: ``--flood`` connections that send headers and part of a body and then nothing,
  opened before the concurrent row runs: what they get, and the others' latencies;
* ``burst``: ``--burst`` requests sent at once from as many connections;
* ``one-line-hostile`` (``--one-line-hostile JSON``, repeatable; ``--hostile-counts N,...``): per
  JSON and count N, the concurrent row with N requests of one line (``--hostile-line``) with
  those options (issue 88: beam 256 and ``min_len`` 1000 make 154 bytes cost 262,144 decoder
  positions), each on its own connection from an impatient client, sent a second before the
  clients;
* ``cap-request``: the concurrent row with one request at the per-request cap beside it: 4 copies
  of the line with the first ``--one-line-hostile``'s options (4 x 256 x 1,024 = 2^20 positions);
* ``big-bodies`` (``--big-bodies COUNT,MIB``): the concurrent row with COUNT valid bodies of 256
  long lines, each just under MIB MiB, sent at once on their own connections, ``/health`` polled
  every 50 ms meanwhile;
* ``idle`` (``--idle N``): the service started with its open-file limit at ``--idle-file-limit``,
  N connections opened that send nothing, then the concurrent row with ``/health`` polled: what
  the idle connections got, and what the service wrote to its log (tracebacks counted);
* ``drain``: ``--drain R,LINES``: R requests of LINES lines, SIGTERM a second later with
  ``--drain-seconds``: how many are answered 200 / 503, what ``/health`` says from a new
  connection meanwhile, and when the service exits.

The requests beside a row's clients come from another loopback address (``--side-source``), as
another client's would: the service counts its clients' shares of its work by address.

Per row: requests/s, sentences/s, latency p50/p99/max (ms, from sending a request to having read
its answer, or to giving up after ``--client-timeout``; the row's own clients, not the requests
beside them), answers equal to the Translator's (must be all that were answered 200), the other
answers by status, what each request beside the clients got (status, seconds, its error), the
service's RSS once it answers ``/health``, at its peak and after the row (its requests done and
2 s idle), the lines and tracebacks in its log, and the abandoned count of ``/info`` against
``/metrics``. Prints a table, writes ``serve_load.json``
and ``serve_load.md`` to ``--out``.

    python -m benchmarks.serve_load --folder model-onnx --input test.en --clients 16 --requests 20 --out DIR
"""

import argparse
import http.client
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_files import write_files  # noqa: E402
from benchmarks.serve_rows import (  # noqa: E402
    ONE_LINE_HOSTILE,
    HealthPoller,
    add_issue88_flags,
    file_limit,
    issue88_rows,
    log_stats,
    open_idle,
    rss_mib,
    side_summary,
    socket_outcomes,
)
from hrt_runtime import Translator  # noqa: E402
from hrt_runtime.text_input import read_lines  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, int(round(q / 100.0 * (len(ordered) - 1)))))
    return ordered[index]


class Client:
    """One keep-alive connection to the service (from the address ``source``: another client,
    to a service that tells its clients apart by address)."""

    def __init__(self, port: int, timeout: float = 300, source: Optional[str] = None):
        self.connection = http.client.HTTPConnection(
            "127.0.0.1", port, timeout=timeout, source_address=(source, 0) if source else None
        )

    def request(self, method: str, path: str, body=None):
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        self.connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        answer = self.connection.getresponse()
        text = answer.read()
        try:
            return answer.status, json.loads(text)
        except ValueError:  # an answer that is not JSON (an earlier service's plain-text errors)
            return answer.status, {"error": text.decode(errors="replace")[:200]}

    def close(self):
        self.connection.close()


def get_json(port: int, path: str, timeout: float = 10):
    client = Client(port, timeout)
    try:
        return client.request("GET", path)
    finally:
        client.close()


SERVICE_FLAGS = ("threads", "max_batch", "max_wait_ms", "max_queue", "max_request_tokens", "drain_seconds")


def start_service(folder: str, port: int, args, *extra: str, preexec_fn=None) -> subprocess.Popen:
    command = [sys.executable, "-m", "hrt_runtime.serve", folder, "--port", str(port)]
    for name in SERVICE_FLAGS:
        value = getattr(args, name)
        if value is not None:
            command += ["--" + name.replace("_", "-"), str(value)]
    command += [*args.service_args.split(), *extra]
    env = dict(os.environ)
    if args.service_path:  # another checkout's hrt_runtime first on the path
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(args.service_path), env.get("PYTHONPATH", "")])
    # its log (a line per request) to a file: a pipe nobody reads fills up and stops the service
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, preexec_fn=preexec_fn)
    proc.log = log
    deadline = time.monotonic() + 120
    while True:
        try:
            if get_json(port, "/health")[0] == 200:
                return proc
        except (ConnectionError, OSError):
            pass
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"hrt-serve exited: {log.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("hrt-serve did not answer /health within 120 s")
        time.sleep(0.1)


def stop_service(proc: subprocess.Popen, seconds: float = 60) -> Dict:
    """SIGTERM, then SIGKILL after ``seconds``: how it ended and how long it took."""
    started = time.perf_counter()
    proc.terminate()
    try:
        code = proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = f"killed after {seconds:g} s"
        proc.wait(30)
    return {"exit": code, "exit_after_s": round(time.perf_counter() - started, 1)}


def metric(port: int, name: str, label: str) -> float:
    """One sample of the service's /metrics (``name{outcome="label"}``), ``nan`` if absent."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    for line in text.splitlines():
        if line.startswith(f'{name}{{outcome="{label}"}}'):
            return float(line.split()[-1])
    return float("nan")


def send_one(port: int, body: Dict, timeout: float, source: Optional[str] = None) -> Dict:
    """One request on its own connection (from ``source``): its status (or the exception) and seconds."""
    client = Client(port, timeout, source)
    started = time.perf_counter()
    try:
        status, answer = client.request("POST", "/translate", body)
        return {"status": status, "seconds": time.perf_counter() - started, "answer": answer}
    except Exception as e:  # noqa: BLE001 - reported in the row
        return {"status": type(e).__name__, "seconds": time.perf_counter() - started, "answer": None}
    finally:
        client.close()


class _Tally:
    """The clients' outcomes, counted from their threads."""

    def __init__(self, expected: Dict[int, List[str]]):
        self.expected = expected
        self.latencies, self.wrong, self.equal, self.errors = [], [], 0, []
        self.statuses: Dict[str, int] = {}  # every answer but a 200, and every request given up on
        self.lock = threading.Lock()

    def _count(self, item: Dict, status, answer) -> None:
        with self.lock:
            if status != 200:
                self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
            elif answer.get("translations") != self.expected[item["id"]]:
                self.wrong.append((item["id"], status, answer))
            else:
                self.equal += 1

    def client(self, port: int, timeout: float, barrier: threading.Barrier, requests: List[Dict]) -> None:
        """One client: its requests back to back, from when every client is ready; one given up
        on (``timeout``) or cut off is counted by its exception, and the client goes on with its
        next request on a new connection, as a caller that retries elsewhere would."""
        client = Client(port, timeout)
        mine = []
        barrier.wait()
        for item in requests:
            started = time.perf_counter()
            try:
                status, answer = client.request("POST", "/translate", item["body"])
            except Exception as e:  # noqa: BLE001 - counted and reported
                status, answer = type(e).__name__, None
                with self.lock:
                    self.errors.append(repr(e))
                client.close()
                client = Client(port, timeout)
            mine.append(time.perf_counter() - started)
            self._count(item, status, answer)
        client.close()
        with self.lock:
            self.latencies.extend(mine)


def _side_rows(side_results, side_running) -> List[Dict]:
    return [
        {
            "status": r["status"],
            "seconds": round(r["seconds"], 2),
            "error": str((r["answer"] or {}).get("error", ""))[:200],
            "running_when_clients_done": running,
        }
        for r, running in zip(side_results, side_running)
    ]


def _clients_row(work: List[List[Dict]], seconds: float, tally: _Tally, side_results, side_running) -> Dict:
    requests = sum(len(w) for w in work)
    sentences = sum(len(item["body"]["text"]) for w in work for item in w)
    latencies, statuses = tally.latencies, tally.statuses
    return {
        "clients": len(work),
        "requests": requests,
        "seconds": seconds,
        "requests_per_s": requests / seconds,
        "sentences_per_s": sentences / seconds,
        "p50_ms": 1000 * percentile(latencies, 50),
        "p99_ms": 1000 * percentile(latencies, 99),
        "max_ms": 1000 * max(latencies, default=float("nan")),
        "answers_equal": tally.equal,
        "wrong": len(tally.wrong),
        "rejected_503": statuses.get("503", 0),
        "non_200": dict(sorted(statuses.items())),
        "other_statuses": sorted(k for k in statuses if k != "503"),
        "errors": tally.errors[:5],
        "first_wrong": tally.wrong[:3],
        "side": _side_rows(side_results, side_running),
    }


def run_clients(
    port: int,
    work: List[List[Dict]],
    expected: Dict[int, List[str]],
    side: List[Dict] = (),
    timeout: float = 300,
    side_lead: float = 1.0,
    side_source: Optional[str] = None,
) -> Dict:
    """``work[c]``: client c's requests (``{"id", "body"}``), sent back to back; all clients at once.
    ``side``: more request bodies, each sent from its own connection (from the address
    ``side_source``) ``side_lead`` seconds before the clients start (their outcomes are reported
    apart from the clients' latencies, with whether they were still running when the clients
    were done)."""
    tally = _Tally(expected)
    side_results = [None] * len(side)
    barrier = threading.Barrier(len(work) + 1)

    def side_main(i):
        side_results[i] = send_one(port, side[i], timeout, side_source)

    side_threads = [threading.Thread(target=side_main, args=(i,)) for i in range(len(side))]
    for t in side_threads:  # first, so that the clients' requests meet them at work
        t.start()
    if side:
        time.sleep(side_lead)
    threads = [threading.Thread(target=tally.client, args=(port, timeout, barrier, requests)) for requests in work]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    side_running = [t.is_alive() for t in side_threads]
    for t in side_threads:
        t.join()
    return _clients_row(work, seconds, tally, side_results, side_running)


def open_flood(port: int, count: int) -> List[socket.socket]:
    """``count`` connections that send a request's headers and part of its body, then nothing."""
    flood = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"text": ["a')
        s.setblocking(False)
        flood.append(s)
    return flood


def drain_row(port: int, proc: subprocess.Popen, bodies: List[Dict], timeout: float) -> Dict:
    """``bodies`` sent at once, SIGTERM a second later; /health polled from new connections
    while the service drains; each request's status; when the service exits; its peak RSS as
    last read before it exited."""
    results = [None] * len(bodies)

    def send(i):
        results[i] = send_one(port, bodies[i], timeout)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    time.sleep(1.0)
    peak = rss_mib(proc.pid)["VmHWM"]
    started = time.perf_counter()
    proc.terminate()
    health = {}
    while proc.poll() is None and time.perf_counter() - started < 120:
        try:
            peak = rss_mib(proc.pid)["VmHWM"]
        except (OSError, KeyError):  # it exited (or is a zombie) since the poll
            pass
        try:
            status = get_json(port, "/health", timeout=2)[0]
        except (ConnectionError, OSError):
            status = "refused"
        health[str(status)] = health.get(str(status), 0) + 1
        time.sleep(0.1)
    try:
        code = proc.wait(max(1, 120 - (time.perf_counter() - started)))
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed after 120 s"
    exited = time.perf_counter() - started
    for t in threads:
        t.join()
    statuses = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return {
        "requests": len(bodies),
        "statuses": statuses,
        "health_while_draining": health,
        "exit": code,
        "exit_after_s": round(exited, 1),
        "rss_peak_mib": peak,
    }


def _beside(r: Dict, meta: Dict) -> str:
    """The table's last column: what the requests or connections beside the clients got."""
    if "flood" in r:
        f = r["flood"]
        return (
            f"{meta['flood']} slow connections: after the clients {f['after_clients']}; after the flood wait "
            f"{f['after_wait']}"
        )
    if "idle" in r:
        return f"{meta['idle']} idle connections (file limit {meta['idle_file_limit']}): {r['idle']}"
    return side_summary(r["side"])


def markdown(rows: List[Dict], meta: Dict) -> str:
    lines = [
        f"`hrt-serve` load test: {meta['folder']} ({meta['kind']}), {meta['clients']} clients x "
        f"{meta['requests_per_client']} requests of {meta['lines']} sentence(s), options {meta['options']}, "
        f"service {meta['service']}; client timeout {meta['client_timeout_s']:g} s; {meta['machine']}",
        "",
        "| row | clients | requests | req/s | p50 ms | p99 ms | max ms | answers equal | wrong | non-200 "
        "| RSS start / peak / after MiB | /health max ms | log lines, tracebacks | abandoned /info, /metrics "
        "| beside them |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- | --- | --- |",
    ]
    for r in rows:
        if r["row"] == "drain":
            continue
        non_200 = ", ".join(f"{k} x {v}" for k, v in r["non_200"].items()) or "-"
        health = r.get("health", {}).get("max_ms")
        lines.append(
            f"| {r['row']} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.1f} | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['max_ms']:.0f} | {r['answers_equal']}/{r['requests']} | {r['wrong']} | "
            f"{non_200} | {r['rss_start_mib']} / {r['rss_peak_mib']} / {r['rss_after_mib']} | "
            f"{'-' if health is None else health} | {r['log_lines']}, {r['log_tracebacks']} | "
            f"{r['abandoned_info']}, {r['abandoned_metrics']:g} | {_beside(r, meta) or '-'} |"
        )
    for r in rows:
        if r["row"] == "drain":
            lines.append(
                f"\ndrain: {r['requests']} requests of {meta['drain']}, SIGTERM 1 s after they were sent "
                f"(--drain-seconds {meta['drain_seconds']}): answers {r['statuses']}; /health from new connections "
                f"while it drained: {r['health_while_draining']}; exit {r['exit']} after {r['exit_after_s']} s; "
                f"RSS start {r['rss_start_mib']} MiB, peak {r['rss_peak_mib']} MiB; log {r['log_lines']} lines, "
                f"{r['log_tracebacks']} tracebacks."
            )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", required=True, help="a folder written by fairseq-hrt-export")
    p.add_argument("--input", required=True, help="source sentences, one per line")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=25, help="requests per client")
    p.add_argument("--lines", type=int, default=1, help="sentences per request")
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument(
        "--max-len-a",
        type=float,
        default=0.0,
        help="> 0: each request is batched alone by the service (its length limit depends on the batch)",
    )
    p.add_argument("--max-len-b", type=int, default=200)
    p.add_argument("--rows", default="sequential,concurrent", help="comma-separated: " + ", ".join(ROWS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--max-wait-ms", type=float, default=None)
    p.add_argument("--max-queue", type=int, default=None)
    p.add_argument("--drain-seconds", type=float, default=None)
    p.add_argument("--max-request-tokens", type=int, default=None, help="hrt-serve's (to take the large request)")
    p.add_argument("--service-args", default="", help="more flags of hrt-serve, as one string")
    p.add_argument("--service-path", default=None, help="a folder holding the hrt_runtime the service runs")
    p.add_argument(
        "--large-request", default=None, help="LINES,KB: the large row's request of LINES lines of about KB kilobytes"
    )
    p.add_argument(
        "--hostile",
        action="append",
        default=None,
        help="a JSON object of options for a hostile request of 64 lines (repeat: one row each); default: "
        + " and ".join(HOSTILE),
    )
    p.add_argument("--client-timeout", type=float, default=60.0, help="seconds a client waits for an answer")
    p.add_argument(
        "--side-source",
        default="127.0.0.2",
        help="the loopback address the requests beside the clients come from (another client to the service, "
        "which counts its clients' shares by address); '': the clients' own",
    )
    p.add_argument("--flood", type=int, default=200, help="the flood row's slow connections")
    p.add_argument("--flood-wait", type=float, default=20.0, help="seconds the flood row waits before its last look")
    p.add_argument("--burst", type=int, default=400, help="the burst row's requests")
    p.add_argument("--drain", default="8,256", help="REQUESTS,LINES of the drain row")
    add_issue88_flags(p)
    p.add_argument("--out", required=True)
    return p


def request_bodies(a, sentences: List[str], options: Dict) -> List[Dict]:
    """The clients' requests: ``--lines`` sentences each, taken in turn from the input."""
    bodies = []
    for i in range(a.clients * a.requests):
        start = (i * a.lines) % (len(sentences) - a.lines + 1)
        bodies.append({"text": sentences[start : start + a.lines], **options})
    return bodies


def plan_rows(a, rows_asked: List[str], items, concurrent, sentences: List[str], options: Dict):
    """``[(row name, clients' work, side requests)]`` of the rows asked for."""
    planned = []
    for row in rows_asked:
        if row == "sequential":
            planned.append(("sequential", [items], []))
        elif row == "concurrent":
            planned.append(("concurrent", concurrent, []))
        elif row == "large" and a.large_request:
            count, kilobytes = (int(v) for v in a.large_request.split(","))
            text = " ".join(sentences)
            while len(text) < 1000 * kilobytes:
                text += " " + text
            planned.append(
                ("concurrent + large", concurrent, [{"text": [text[: 1000 * kilobytes]] * count, **options}])
            )
        elif row == "hostile":
            for given in a.hostile or HOSTILE:
                hostile = json.loads(given)
                planned.append((f"concurrent + {given}", concurrent, [{"text": sentences[:64], **hostile}]))
        elif row in ("one-line-hostile", "cap-request", "big-bodies", "idle"):
            planned += issue88_rows(a, row, concurrent, sentences)
        elif row == "flood":
            planned.append((row, concurrent, []))
        elif row in ("burst", "drain"):
            planned.append((row, None, None))
    return planned


def _run_row(a, row: str, work, side, port: int, items, expected) -> Dict:
    """A row's clients (and what goes beside them) against the service on ``port``."""
    if row == "flood":
        flood = open_flood(port, a.flood)
        result = run_clients(port, work, expected, timeout=a.client_timeout)
        after_clients = socket_outcomes(flood)
        time.sleep(a.flood_wait)
        result["flood"] = {"after_clients": after_clients, "after_wait": socket_outcomes(flood)}
        for s in flood:
            s.close()
    elif row == "burst":
        burst = [[items[i % len(items)]] for i in range(a.burst)]
        result = run_clients(port, burst, expected, timeout=a.client_timeout)
    elif row == "idle":
        idle = open_idle(port, a.idle)
        time.sleep(1.0)  # the service meets them (accepts or refuses) before the clients come
        with HealthPoller(port) as health:
            result = run_clients(port, work, expected, timeout=a.client_timeout)
        result.update(health=health.result(), idle=socket_outcomes(idle))
        for s in idle:
            s.close()
    elif row.startswith("big-bodies"):
        with HealthPoller(port) as health:
            result = run_clients(port, work, expected, side, a.client_timeout, side_source=a.side_source)
        result["health"] = health.result()
    else:
        result = run_clients(port, work, expected, side, a.client_timeout, side_source=a.side_source)
    return result


def measure_row(a, row: str, work, side, port: int, service, items, expected, sentences, options) -> Dict:
    """One row against the service started for it on ``port``."""
    if row == "drain":
        count, lines = (int(v) for v in a.drain.split(","))
        drain_bodies = [
            {"text": [sentences[(i * lines + j) % len(sentences)] for j in range(lines)], **options}
            for i in range(count)
        ]
        result = drain_row(port, service, drain_bodies, a.client_timeout)
        result.update(row=row, **log_stats(service.log))
        return result
    result = _run_row(a, row, work, side, port, items, expected)
    # "after": every request answered or given up on, then 2 s idle (a request given up on may
    # still have its last batch translated for nobody meanwhile)
    time.sleep(2.0)
    info = get_json(port, "/info")[1]["stats"]
    memory = rss_mib(service.pid)
    result.update(
        row=row,
        rss_peak_mib=memory["VmHWM"],
        rss_after_mib=memory["VmRSS"],
        batches=info["batches"],
        largest_batch=info["largest_batch"],
        abandoned_info=info.get("abandoned"),
        abandoned_metrics=metric(port, "hrt_serve_requests_total", "abandoned"),
        **log_stats(service.log),
    )
    return result


def run_meta(a, translator, options: Dict) -> Dict:
    return {
        "folder": a.folder,
        "kind": translator.model.kind,
        "clients": a.clients,
        "requests_per_client": a.requests,
        "lines": a.lines,
        "options": options,
        "service": (f"hrt_runtime from {a.service_path}" if a.service_path else "this checkout")
        + (f", flags {a.service_args}" if a.service_args else "")
        + f", --threads {a.threads}",
        "flood": a.flood,
        "one_line_hostile": a.one_line_hostile or list(ONE_LINE_HOSTILE),
        "hostile_line": a.hostile_line,
        "big_bodies": a.big_bodies,
        "idle": a.idle,
        "idle_file_limit": a.idle_file_limit,
        "drain": f"{a.drain.split(',')[1]} lines",
        "drain_seconds": a.drain_seconds,
        "client_timeout_s": a.client_timeout,
        "side_source": a.side_source,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
    }


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    rows_asked = a.rows.split(",")
    unknown = [r for r in rows_asked if r not in ROWS]
    if unknown:
        p.error(f"unknown row {', '.join(unknown)}; rows: {', '.join(ROWS)}")

    if len(a.big_bodies) != 2:
        p.error(f"--big-bodies is COUNT,MIB (e.g. 6,15), not {','.join(map(str, a.big_bodies))}")
    sentences = [line for line in read_lines(a.input) if line.strip()]
    if len(sentences) < max(a.lines, 64):
        p.error(f"--input has {len(sentences)} sentences, fewer than --lines {a.lines} or 64")
    options = {"beam": a.beam, "max_len_a": a.max_len_a, "max_len_b": a.max_len_b}
    if a.chunk_size is not None:
        options["chunk_size"] = a.chunk_size
    bodies = request_bodies(a, sentences, options)
    translator = Translator(a.folder, threads=a.threads)
    expected = {i: translator.translate(body["text"], **options) for i, body in enumerate(bodies)}
    items = [{"id": i, "body": body} for i, body in enumerate(bodies)]
    concurrent = [items[c :: a.clients] for c in range(a.clients)]

    rows = []
    for row, work, side in plan_rows(a, rows_asked, items, concurrent, sentences, options):
        port = free_port()
        limit = file_limit(a.idle_file_limit) if row == "idle" else None
        service = start_service(a.folder, port, a, preexec_fn=limit)
        rss_start = rss_mib(service.pid)["VmRSS"]
        try:
            rows.append(measure_row(a, row, work, side, port, service, items, expected, sentences, options))
            rows[-1]["rss_start_mib"] = rss_start
        finally:
            if service.poll() is None:
                result_stop = stop_service(service, seconds=a.client_timeout)
                if rows and rows[-1]["row"] == row:
                    rows[-1]["stopped"] = result_stop
        print(f"[serve_load] {row}: done", file=sys.stderr, flush=True)
    meta = run_meta(a, translator, options)
    table = markdown(rows, meta)
    print(table)
    write_files(
        a.out, {"serve_load.json": json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", "serve_load.md": table}
    )
    return 0 if all(r.get("wrong", 0) == 0 for r in rows) else 1


ROWS = (
    "sequential",
    "concurrent",
    "large",
    "hostile",
    "one-line-hostile",
    "cap-request",
    "big-bodies",
    "idle",
    "flood",
    "burst",
    "drain",
)
# the requests of issue 77: every value within the documented ranges
HOSTILE = (
    '{"beam": 256, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}',
    '{"beam": 16, "chunk_size": 1, "min_len": 200}',
)


if __name__ == "__main__":
    sys.exit(main())
