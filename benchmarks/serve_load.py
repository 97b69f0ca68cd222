#!/usr/bin/env python
"""Load test of ``hrt-serve`` on localhost: N concurrent clients x M requests against one
request at a time, every answer checked against ``Translator.translate`` of its own lines.

The service runs as its command line (``python -m hrt_runtime.serve FOLDER --port P ...``) in
its own process; the clients are threads of this one, each with one keep-alive HTTP
connection. Requests are drawn from ``--input`` (``--lines`` sentences each, in file order);
every client sends its M requests back to back. Rows:

* ``sequential``: one client, the same N x M requests one after another (what a caller that
  waits for each answer gets; every batch holds one request);
* ``concurrent``: N clients at once (the service gathers their requests into batches);
* ``concurrent + large`` (``--large-request LINES,KB``): the same, with one more request of
  LINES lines of about KB kilobytes each sent when the clients start; the latencies are the
  other requests' (the large one's own time, and the service's RSS before it, at peak and
  after, are reported beside them).

Per row: requests/s, sentences/s, latency p50/p99 (ms, from sending a request to having read
its answer), answers equal to the Translator's (must be all), 503 answers, and the service's
batch counters (``/info``). Prints a table, writes ``serve_load.json`` and ``serve_load.md``
to ``--out``.

    python -m benchmarks.serve_load --folder model-onnx --input test.en --clients 8 --requests 25 --out DIR
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

    def __init__(self, port: int):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)

    def request(self, method: str, path: str, body=None):
        data = None if body is None else json.dumps(body).encode()
        self.connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        answer = self.connection.getresponse()
        return answer.status, json.loads(answer.read())

    def close(self):
        self.connection.close()


def start_service(folder: str, port: int, args) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "hrt_runtime.serve",
        folder,
        "--port",
        str(port),
        "--threads",
        str(args.threads),
        "--max-batch",
        str(args.max_batch),
        "--max-wait-ms",
        str(args.max_wait_ms),
        "--max-queue",
        str(args.max_queue),
        *(("--max-request-tokens", str(args.max_request_tokens)) if args.max_request_tokens else ()),
    ]
    # its log (a line per request) to a file: a pipe nobody reads fills up and stops the service
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 120
    while True:
        try:
            client = Client(port)
            if client.request("GET", "/health")[0] == 200:
                client.close()
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


def rss_mib(pid: int) -> Dict[str, int]:
    """A process's resident memory now (``VmRSS``) and at its peak so far (``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        status = f.read().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) // 1024 for line in status if line.startswith(("VmRSS", "VmHWM"))}


def run_clients(port: int, work: List[List[Dict]], expected: Dict[int, List[str]], large: Dict = None) -> Dict:
    """``work[c]``: client c's requests (``{"id", "body"}``), sent back to back; all clients at once.
    ``large``: one more request's body, sent from its own connection when the clients start."""
    latencies, wrong, rejected, errors = [], [], 0, []
    large_result = {}

    def send_large():
        client = Client(port)
        try:
            started = time.perf_counter()
            status, _ = client.request("POST", "/translate", large)
            large_result.update(status=status, seconds=time.perf_counter() - started)
        except Exception as e:  # noqa: BLE001 - reported in the row
            large_result.update(status=repr(e), seconds=time.perf_counter() - started)
        finally:
            client.close()

    lock = threading.Lock()
    barrier = threading.Barrier(len(work) + 1)

    def client_main(requests):
        nonlocal rejected
        client = Client(port)
        mine = []
        try:
            barrier.wait()
            for item in requests:
                started = time.perf_counter()
                status, answer = client.request("POST", "/translate", item["body"])
                mine.append(time.perf_counter() - started)
                with lock:
                    if status == 503:
                        rejected += 1
                    elif status != 200 or answer.get("translations") != expected[item["id"]]:
                        wrong.append((item["id"], status, answer))
        except Exception as e:  # noqa: BLE001 - counted and reported
            errors.append(repr(e))
        finally:
            client.close()
            with lock:
                latencies.extend(mine)

    threads = [threading.Thread(target=client_main, args=(requests,)) for requests in work]
    for t in threads:
        t.start()
    barrier.wait()
    if large is not None:
        threads.append(threading.Thread(target=send_large))
        threads[-1].start()
    started = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    requests = sum(len(w) for w in work)
    sentences = sum(len(item["body"]["text"]) for w in work for item in w)
    return {
        "clients": len(work),
        "requests": requests,
        "seconds": seconds,
        "requests_per_s": requests / seconds,
        "sentences_per_s": sentences / seconds,
        "p50_ms": 1000 * percentile(latencies, 50),
        "p99_ms": 1000 * percentile(latencies, 99),
        "answers_equal": requests - len(wrong) - rejected - len(errors),
        "wrong": len(wrong),
        "rejected_503": rejected,
        "errors": errors[:5],
        "first_wrong": wrong[:3],
        "large_request": large_result,
    }


def service_stats(port: int) -> Dict:
    client = Client(port)
    try:
        return client.request("GET", "/info")[1]["stats"]
    finally:
        client.close()


def markdown(rows: List[Dict], meta: Dict) -> str:
    lines = [
        f"`hrt-serve` load test: {meta['folder']} ({meta['kind']}), {meta['clients']} clients x "
        f"{meta['requests_per_client']} requests of {meta['lines']} sentence(s), options {meta['options']}, "
        f"--max-batch {meta['max_batch']} --max-wait-ms {meta['max_wait_ms']} --threads {meta['threads']}; "
        f"{meta['machine']}",
        "",
        "| row | clients | requests | req/s | sentences/s | p50 ms | p99 ms | answers equal | 503 | batches "
        "| largest batch |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.1f} | "
            f"{r['sentences_per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['answers_equal']}/{r['requests']} | {r['rejected_503']} | {r['batches']} | {r['largest_batch']} |"
        )
    for r in rows:
        if r["large_request"]:
            big = r["large_request"]
            lines.append(
                f"\n{r['row']}: the large request ({meta['large_request']}) answered {big['status']} in "
                f"{big['seconds']:.1f} s; the service's RSS {big['rss_before_mib']} MiB before it, "
                f"{big['rss_peak_mib']} at peak, {big['rss_after_mib']} after; the latencies above are the others'."
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
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
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-wait-ms", type=float, default=0.0)
    p.add_argument("--max-queue", type=int, default=256)
    p.add_argument(
        "--large-request",
        default=None,
        help="LINES,KB: a third row, the concurrent one with one more request of LINES lines of about KB kilobytes",
    )
    p.add_argument("--max-request-tokens", type=int, default=None, help="hrt-serve's (to take the large request)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    sentences = [line for line in read_lines(a.input) if line.strip()]
    total = a.clients * a.requests
    if len(sentences) < a.lines:
        p.error(f"--input has {len(sentences)} sentences, fewer than --lines {a.lines}")
    options = {"beam": a.beam, "max_len_a": a.max_len_a, "max_len_b": a.max_len_b}
    if a.chunk_size is not None:
        options["chunk_size"] = a.chunk_size
    bodies = []
    for i in range(total):
        start = (i * a.lines) % (len(sentences) - a.lines + 1)
        bodies.append({"text": sentences[start : start + a.lines], **options})
    translator = Translator(a.folder, threads=a.threads)
    expected = {i: translator.translate(body["text"], **options) for i, body in enumerate(bodies)}
    items = [{"id": i, "body": body} for i, body in enumerate(bodies)]

    port = free_port()
    service = start_service(a.folder, port, a)
    rows = []
    try:
        concurrent = [items[c :: a.clients] for c in range(a.clients)]
        runs = [("sequential", [items], None), ("concurrent", concurrent, None)]
        if a.large_request:
            count, kilobytes = (int(v) for v in a.large_request.split(","))
            text = " ".join(sentences)
            while len(text) < 1000 * kilobytes:
                text += " " + text
            large = {"text": [text[: 1000 * kilobytes]] * count, **options}
            runs.append(("concurrent + large", concurrent, large))
        for row, work, large in runs:
            before = service_stats(port)
            memory = rss_mib(service.pid)
            result = run_clients(port, work, expected, large)
            after = service_stats(port)
            if large is not None:
                time.sleep(1.0)  # the large request's last batch may still be translated for nobody
                peak = rss_mib(service.pid)
                result["large_request"].update(
                    rss_before_mib=memory["VmRSS"], rss_peak_mib=peak["VmHWM"], rss_after_mib=peak["VmRSS"]
                )
            result.update(row=row, batches=after["batches"] - before["batches"], largest_batch=after["largest_batch"])
            rows.append(result)
    finally:
        service.terminate()
        service.wait(120)  # it drains what is queued (--drain-seconds) before it exits
    meta = {
        "folder": a.folder,
        "kind": translator.model.kind,
        "clients": a.clients,
        "requests_per_client": a.requests,
        "lines": a.lines,
        "options": options,
        "max_batch": a.max_batch,
        "max_wait_ms": a.max_wait_ms,
        "threads": a.threads,
        "large_request": f"{a.large_request.replace(',', ' lines x ')} KB" if a.large_request else None,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
    }
    table = markdown(rows, meta)
    print(table)
    write_files(
        a.out, {"serve_load.json": json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", "serve_load.md": table}
    )
    return 0 if all(r["wrong"] == 0 and not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
