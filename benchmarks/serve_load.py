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
* ``drain``: ``--drain R,LINES``: R requests of LINES lines, SIGTERM a second later with
  ``--drain-seconds``: how many are answered 200 / 503, what ``/health`` says from a new
  connection meanwhile, and when the service exits.

Per row: requests/s, sentences/s, latency p50/p99 (ms, from sending a request to having read
its answer; the row's own clients, not the hostile ones), answers equal to the Translator's
(must be all that were answered 200), 503 and other answers, the service's peak RSS, and the
abandoned count of ``/info`` against ``/metrics``. Prints a table, writes ``serve_load.json``
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
from typing import Dict, List

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report_files import write_files  # noqa: E402
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
    """One keep-alive connection to the service."""

    def __init__(self, port: int, timeout: float = 300):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)

    def request(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
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


def start_service(folder: str, port: int, args, *extra: str) -> subprocess.Popen:
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
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
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


def rss_mib(pid: int) -> Dict[str, int]:
    """A process's resident memory now (``VmRSS``) and at its peak so far (``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        status = f.read().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) // 1024 for line in status if line.startswith(("VmRSS", "VmHWM"))}


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


def send_one(port: int, body: Dict, timeout: float) -> Dict:
    """One request on its own connection: its status (or the exception) and seconds."""
    client = Client(port, timeout)
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
        self.latencies, self.wrong, self.rejected, self.errors, self.others = [], [], 0, [], []
        self.lock = threading.Lock()

    def client(self, port: int, timeout: float, barrier: threading.Barrier, requests: List[Dict]) -> None:
        """One client: its requests back to back, from when every client is ready."""
        client = Client(port, timeout)
        mine = []
        try:
            barrier.wait()
            for item in requests:
                started = time.perf_counter()
                status, answer = client.request("POST", "/translate", item["body"])
                mine.append(time.perf_counter() - started)
                with self.lock:
                    if status == 503:
                        self.rejected += 1
                    elif status != 200:
                        self.others.append(status)
                    elif answer.get("translations") != self.expected[item["id"]]:
                        self.wrong.append((item["id"], status, answer))
        except Exception as e:  # noqa: BLE001 - counted and reported
            self.errors.append(repr(e))
        finally:
            client.close()
            with self.lock:
                self.latencies.extend(mine)


def _clients_row(work: List[List[Dict]], seconds: float, tally: _Tally, side_results, side_running) -> Dict:
    requests = sum(len(w) for w in work)
    sentences = sum(len(item["body"]["text"]) for w in work for item in w)
    latencies, wrong, rejected = tally.latencies, tally.wrong, tally.rejected
    others, errors = tally.others, tally.errors
    return {
        "clients": len(work),
        "requests": requests,
        "seconds": seconds,
        "requests_per_s": requests / seconds,
        "sentences_per_s": sentences / seconds,
        "p50_ms": 1000 * percentile(latencies, 50),
        "p99_ms": 1000 * percentile(latencies, 99),
        "max_ms": 1000 * max(latencies, default=float("nan")),
        "answers_equal": requests - len(wrong) - rejected - len(others) - len(errors),
        "wrong": len(wrong),
        "rejected_503": rejected,
        "other_statuses": sorted(set(map(str, others))),
        "errors": errors[:5],
        "first_wrong": wrong[:3],
        "side": [
            {
                "status": r["status"],
                "seconds": round(r["seconds"], 2),
                "error": (r["answer"] or {}).get("error", "")[:300],
                "running_when_clients_done": running,
            }
            for r, running in zip(side_results, side_running)
        ],
    }


def run_clients(
    port: int,
    work: List[List[Dict]],
    expected: Dict[int, List[str]],
    side: List[Dict] = (),
    timeout: float = 300,
    side_lead: float = 1.0,
) -> Dict:
    """``work[c]``: client c's requests (``{"id", "body"}``), sent back to back; all clients at once.
    ``side``: more request bodies, each sent from its own connection ``side_lead`` seconds before
    the clients start (their outcomes are reported apart from the clients' latencies, with
    whether they were still running when the clients were done)."""
    tally = _Tally(expected)
    side_results = [None] * len(side)
    barrier = threading.Barrier(len(work) + 1)

    def side_main(i):
        side_results[i] = send_one(port, side[i], timeout)

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


def read_flood(flood: List[socket.socket]) -> Dict:
    """How the flood's connections stand now: answered (and by what status), closed, still open."""
    outcome = {"answered": {}, "closed_without_answer": 0, "still_open": 0}
    for s in flood:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            outcome["still_open"] += 1
            continue
        except OSError:
            outcome["closed_without_answer"] += 1
            continue
        if not data:
            outcome["closed_without_answer"] += 1
        else:
            status = data.split(b" ", 2)[1].decode(errors="replace")
            outcome["answered"][status] = outcome["answered"].get(status, 0) + 1
    return outcome


def drain_row(port: int, proc: subprocess.Popen, bodies: List[Dict], timeout: float) -> Dict:
    """``bodies`` sent at once, SIGTERM a second later; /health polled from new connections
    while the service drains; each request's status; when the service exits."""
    results = [None] * len(bodies)

    def send(i):
        results[i] = send_one(port, bodies[i], timeout)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    time.sleep(1.0)
    started = time.perf_counter()
    proc.terminate()
    health = {}
    while proc.poll() is None and time.perf_counter() - started < 120:
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
    }


def markdown(rows: List[Dict], meta: Dict) -> str:
    lines = [
        f"`hrt-serve` load test: {meta['folder']} ({meta['kind']}), {meta['clients']} clients x "
        f"{meta['requests_per_client']} requests of {meta['lines']} sentence(s), options {meta['options']}, "
        f"service {meta['service']}; {meta['machine']}",
        "",
        "| row | clients | requests | req/s | p50 ms | p99 ms | max ms | answers equal | 503 | other | peak RSS MiB "
        "| abandoned /info, /metrics | beside them |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- |",
    ]
    for r in rows:
        if r["row"] == "drain":
            continue
        beside = "; ".join(
            f"{d['status']} in {d['seconds']} s"
            + (" (still running when the clients were done)" if d["running_when_clients_done"] else "")
            + (f" ({d['error'][:90]})" if d["error"] else "")
            for d in r["side"]
        )
        if "flood" in r:
            f = r["flood"]
            beside = (
                f"{meta['flood']} slow connections: after the clients {f['after_clients']}; after the flood wait "
                f"{f['after_wait']}"
            )
        lines.append(
            f"| {r['row']} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.1f} | {r['p50_ms']:.1f} | "
            f"{r['p99_ms']:.1f} | {r['max_ms']:.0f} | {r['answers_equal']}/{r['requests']} | {r['rejected_503']} | "
            f"{', '.join(r['other_statuses'] + r['errors'][:1]) or '-'} | {r['rss_peak_mib']} | "
            f"{r['abandoned_info']}, {r['abandoned_metrics']:g} | {beside or '-'} |"
        )
    for r in rows:
        if r["row"] == "drain":
            lines.append(
                f"\ndrain: {r['requests']} requests of {meta['drain']}, SIGTERM 1 s after they were sent "
                f"(--drain-seconds {meta['drain_seconds']}): answers {r['statuses']}; /health from new connections "
                f"while it drained: {r['health_while_draining']}; exit {r['exit']} after {r['exit_after_s']} s."
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
    p.add_argument("--flood", type=int, default=200, help="the flood row's slow connections")
    p.add_argument("--flood-wait", type=float, default=20.0, help="seconds the flood row waits before its last look")
    p.add_argument("--burst", type=int, default=400, help="the burst row's requests")
    p.add_argument("--drain", default="8,256", help="REQUESTS,LINES of the drain row")
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
        elif row in ("flood", "burst", "drain"):
            planned.append((row, None, None))
    return planned


def measure_row(a, row: str, work, side, port: int, service, items, concurrent, expected, sentences, options) -> Dict:
    """One row against the service started for it on ``port``."""
    if row == "drain":
        count, lines = (int(v) for v in a.drain.split(","))
        drain_bodies = [
            {"text": [sentences[(i * lines + j) % len(sentences)] for j in range(lines)], **options}
            for i in range(count)
        ]
        result = drain_row(port, service, drain_bodies, a.client_timeout)
        result.update(row=row, rss_peak_mib=None)
        return result
    if row == "flood":
        flood = open_flood(port, a.flood)
        result = run_clients(port, concurrent, expected, timeout=a.client_timeout)
        after_clients = read_flood(flood)
        time.sleep(a.flood_wait)
        result["flood"] = {"after_clients": after_clients, "after_wait": read_flood(flood)}
        for s in flood:
            s.close()
    elif row == "burst":
        burst = [[items[i % len(items)]] for i in range(a.burst)]
        result = run_clients(port, burst, expected, timeout=a.client_timeout)
    else:
        result = run_clients(port, work, expected, side, timeout=a.client_timeout)
    time.sleep(1.0)  # a side request's last batch may still be translated for nobody
    info = get_json(port, "/info")[1]["stats"]
    result.update(
        row=row,
        rss_peak_mib=rss_mib(service.pid)["VmHWM"],
        rss_after_mib=rss_mib(service.pid)["VmRSS"],
        batches=info["batches"],
        largest_batch=info["largest_batch"],
        abandoned_info=info.get("abandoned"),
        abandoned_metrics=metric(port, "hrt_serve_requests_total", "abandoned"),
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
        "drain": f"{a.drain.split(',')[1]} lines",
        "drain_seconds": a.drain_seconds,
        "client_timeout_s": a.client_timeout,
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
        service = start_service(a.folder, port, a)
        try:
            rows.append(measure_row(a, row, work, side, port, service, items, concurrent, expected, sentences, options))
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


ROWS = ("sequential", "concurrent", "large", "hostile", "flood", "burst", "drain")
# the requests of issue 77: every value within the documented ranges
HOSTILE = (
    '{"beam": 256, "chunk_size": 1, "min_len": 1000, "max_len_b": 100000}',
    '{"beam": 16, "chunk_size": 1, "min_len": 200}',
)


if __name__ == "__main__":
    sys.exit(main())
