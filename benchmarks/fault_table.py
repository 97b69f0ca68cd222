#!/usr/bin/env python
"""The fault table: what happens to a run when things go wrong, measured, not guessed.

Every row is a run of this script on tiny models (CPU, one thread per process, minutes):

* **bad input**: a fairseq-interactive session (SentencePiece) fed invalid UTF-8, NUL and
  control characters, a line of spaces, a 100k-character line and mixed scripts/emoji; and
  ``python -m fairseq_hrt.distill`` on a source file with such lines;
* **killed training**, for each model kind (AT; HRT with its curriculum and MixDistill;
  Mask-Predict with MixDistill): ``--kills`` SIGKILLs at random moments of training (a random
  delay after the first update is logged), each followed by the same command, which resumes;
  then a SIGKILL *while a checkpoint is being written* (the launcher below writes half of the
  checkpoint's bytes to fairseq's ``.tmp`` file and SIGKILLs its own process: the exact state a
  kill at that moment leaves), and a SIGKILL while fairseq copies a checkpoint to
  ``checkpoint_last.pt``, with this plugin and with fairseq's own copy;
* a truncated ``checkpoint_last.pt`` (train and generate); a **full disk** while saving (a
  tmpfs of 1.5 checkpoints, mounted in a private user + mount namespace with ``unshare``);
  resuming with a data directory binarized with **another dictionary** (another size, and the
  same symbols in another order); a **distilled set with another line count**;
* the **deployed runtime and service** (``--cases runtime``, about 2 minutes): the bad input
  lines through ``hrt-translate``; exported folders damaged (``weights.bin`` truncated, zeroed
  at the same size, a ``config.json`` of another export, without its file list, with its
  positions edited; ``"int8": true`` added over zeroed or other weights, graph names swapped,
  a mistyped key, ``sentencepiece_model`` null, a file for the folder); ``fairseq-hrt-export``
  SIGKILLed over an earlier export; 8 threads on one ``Translator``; options out of range (a
  fraction for an integer, ``-inf``, more threads than CPUs, ``min_len`` beyond the positions,
  a full disk); ``hrt-serve`` with a full queue, clients that disconnect (also during a long
  request), bind errors, ``--port 0``, one large request (RSS before, at peak, after), SIGTERM
  with long requests queued, ``/metrics``; and bounded by the work a request asks for (issue
  77): the 64-line beam-256 request, a deadline, a client gone during costly work, nested and
  oversized bodies, a line holding a line break, slow clients, the drain. Its latest table:
  benchmarks/results/fault-table/runtime/.

Checks per killed run: the resumed run loads the newest complete checkpoint, loses at most one
save interval (``--save-interval-updates``), continues the curriculum (p_k of every update
equal to an uninterrupted run's) and reaches ``--max-update``.

Output: the table (markdown) on stdout, ``fault_table.json`` and ``fault_table.md`` in
``--out``. Exit status 1 when a row's check fails.

    python -m benchmarks.fault_table --out work/fault-table    (or python benchmarks/fault_table.py ...)

The cases themselves are in benchmarks/faults.py (shared with tests/test_reliability.py).
"""

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import List

if not __package__:  # python benchmarks/NAME.py (a file): the repository root on sys.path, as -m benchmarks.NAME has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.faults import (  # noqa: E402
    KIND_NAMES,
    KINDS,
    MAX_UPDATE,
    N_TRAIN,
    REPO,
    SAVE_INTERVAL,
    Setting,
    bad_input,
    child_main,
    full_disk,
    kill_while_copying,
    kill_while_writing,
    other_dictionary,
    random_kills,
    reference_runs,
    relative,
    runtime_and_service,
    set_report_root,
    short,
    short_distilled_set,
    truncated_checkpoint,
)
from benchmarks.report_files import write_files  # noqa: E402


class Table:
    def __init__(self):
        self.rows: List[dict] = []

    def add(self, case: str, tried: str, happens: str, lost: str, check_passed: bool, **details):
        ok = bool(check_passed)
        self.rows.append({"case": case, "tried": tried, "happens": happens, "lost": lost, "ok": ok, "details": details})
        print(f"[fault-table] {'ok  ' if ok else 'FAIL'} {case}: {short(happens, 160)}", file=sys.stderr, flush=True)

    def markdown(self) -> str:
        lines = ["| case | what was tried | what happens | what is lost | check |", "|---|---|---|---|---|"]
        for r in self.rows:
            cells = [r["case"], r["tried"], r["happens"], r["lost"], "ok" if r["ok"] else "**FAILED**"]
            lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def _add_input_rows(table: Table, work: Path) -> None:
    """Bad input lines through fairseq-interactive and distillation."""
    r = bad_input(work)
    i, d = r["interactive"], r["distill"]
    table.add(
        "bad input lines, fairseq-interactive",
        "one session (SentencePiece, stdin): invalid UTF-8, NUL + control characters, a line of spaces, a "
        "100k-character line, mixed scripts and emoji, between normal lines",
        f"exit {i['returncode']}, {len(i['translated_lines'])} of {i['input_lines']} lines translated; warnings: "
        + "; ".join(i["warnings"][:3]),
        "nothing: bad bytes become U+FFFD, NUL is removed, the 100k-character line is cut at --max-source-positions",
        i["returncode"] == 0 and i["translated_lines"] == list(range(i["input_lines"])) and not i["traceback"],
        **i,
    )
    table.add(
        "bad input lines, distillation",
        "python -m fairseq_hrt.distill on a source file with invalid UTF-8 and a NUL byte",
        f"exit {d['returncode']}, {d['output_lines']} output lines for {d['input_lines']}; warnings: "
        + "; ".join(d["warnings"]),
        "nothing (the output stays line-aligned)",
        d["returncode"] == 0 and d["output_lines"] == d["input_lines"] and len(d["warnings"]) == 2,
        **d,
    )


def _add_killed_training_rows(table: Table, s: Setting, work: Path, kind: str, ref, kills: int, rng) -> None:
    """A model kind's training SIGKILLed at random moments, and while a checkpoint is written."""
    r = random_kills(s, work, kind, ref, kills, rng)
    at = ", ".join(
        f"update {e['last_update']} -> resumed at {n['resumed_from']}" for e, n in zip(r["events"], r["events"][1:])
    )
    table.add(
        f"{KIND_NAMES[kind]}: SIGKILL at random moments",
        f"fairseq-train --max-update {MAX_UPDATE} --save-interval-updates {SAVE_INTERVAL}, SIGKILL {kills}x a "
        "random 0-2.5 s after its first update, the same command after each",
        f"{r['killed']} kills; {at}; finished at update {r['events'][-1]['last_update']}; "
        f"p_k of every update = the uninterrupted run's (max diff {r['max_p_k_difference']:.1e}), "
        f"loss max diff {r['max_loss_difference']:.3f}",
        f"{', '.join(map(str, r['lost_updates']))} updates redone (at most one save interval, {SAVE_INTERVAL})",
        r["ok"],
        **r,
    )
    w = kill_while_writing(s, work, kind, ref)
    table.add(
        f"{KIND_NAMES[kind]}: SIGKILL while a checkpoint is written",
        "SIGKILL with half of the 3rd checkpoint's bytes in "
        f"{Path(w['kill'].get('file', '?')).name}, then the same command",
        f"files left: {', '.join(f'{k}: {v}' for k, v in w['files_after_kill'].items())}; resumed at update "
        f"{w['resumed_from']} (killed at {w['last_update_before_kill']}), finished; p_k max diff "
        f"{w['max_p_k_difference']:.1e}",
        f"{w['lost_updates']} updates redone",
        w["ok"],
        **w,
    )


def _add_copy_rows(table: Table, s: Setting, work: Path, ref) -> None:
    """SIGKILL while checkpoint_last.pt is copied, with fairseq alone and with the plugin."""
    for stock in (True, False):
        c = kill_while_copying(s, work, ref, stock)
        who = "fairseq 0.12 alone (plugin's copy undone)" if stock else "with the plugin"
        if stock:
            happens = (
                f"checkpoint_last.pt truncated ({c['files_after_kill'].get('checkpoint_last.pt')}); the "
                f'same command stops: "{short(c.get("message", ""), 150)}"; following its advice '
                f"(--restore-file {Path(c.get('followed_advice', '?')).name}) resumed at update "
                f"{c.get('resumed_from')} and finished"
            )
            ok = c.get("completed", False) and "cannot read the checkpoint" in c.get("message", "")
        else:
            happens = (
                f"checkpoint_last.pt intact ({c['files_after_kill'].get('checkpoint_last.pt')}), partial "
                f"copy left in checkpoint_last.pt.tmp; the same command resumed at update "
                f"{c.get('resumed_from')} and finished"
            )
            ok = c["returncodes"][-1] == 0 and isinstance(c["files_after_kill"].get("checkpoint_last.pt"), int)
        table.add(
            f"SIGKILL while checkpoint_last.pt is copied, {who}",
            f"HRT run killed half-way through copying {Path(c['kill'].get('src', '?')).name} to "
            "checkpoint_last.pt (fault-table launcher), then the same command",
            happens,
            f"{c.get('lost_updates')} updates redone",
            ok,
            **c,
        )


def _add_truncated_row(table: Table, s: Setting, work: Path) -> None:
    t = truncated_checkpoint(s, work)
    table.add(
        "checkpoint_last.pt truncated",
        "a finished AT run's checkpoint_last.pt cut to half its bytes; fairseq-train (same save dir) and "
        "fairseq-generate --path it",
        f'train exit {t["train_returncode"]}: "{short(t["train_message"], 170)}" {short(t["advice"], 200)}; '
        f"generate exit {t['generate_returncode']}, same message; following the advice resumed at update "
        f"{t['followed_advice_resumed_from']}",
        "the updates after the last complete checkpoint",
        t["train_returncode"] != 0
        and bool(t["train_message"])
        and t["followed_advice_returncode"] == 0
        and bool(t["generate_message"]),
        **t,
    )


def _add_disk_row(table: Table, s: Setting, work: Path) -> None:
    ckpt_bytes = (work / "ref_AT" / "checkpoint_last.pt").stat().st_size if (work / "ref_AT").exists() else 1_300_000
    f = full_disk(s, work, ckpt_bytes)
    if "skipped" in f:
        table.add("full disk while saving", "not run", f["skipped"], "-", True, **f)
    else:
        table.add(
            "full disk while saving",
            f"AT run saving into a {f['tmpfs_kb']} kB tmpfs "
            "(1.5 checkpoints; private mount namespace via unshare), "
            "then the same command after the tmpfs is remounted larger",
            f'exit {f["returncodes"][0]}: "{short(f["message"], 200)}"; files left: '
            f"{', '.join(n for _, n in f['files_after_failure'])}; the same command resumed at update "
            f"{f['resumed_from']} and finished at {f['final_update']}",
            f"{f['last_update_before_failure'] - f['resumed_from']} updates redone (since the last complete save)",
            f["returncodes"] == [1, 0]
            and "could not write" in f["message"]
            and not any(n.endswith(".tmp") for _, n in f["files_after_failure"]),
            **f,
        )


def _add_dictionary_rows(table: Table, s: Setting, work: Path) -> None:
    d = other_dictionary(s, work)
    for name, r in d.items():
        table.add(
            f"resume with a data directory of another dictionary ({name})",
            "fairseq-train on checkpoint_last.pt of a run, with another data-bin",
            f'exit {r["returncode"]}: "{short(r["message"], 230)}"',
            "nothing (refused before any update)" if not r["trained_updates"] else f"trained {r['trained_updates']}",
            r["returncode"] != 0 and not r["trained_updates"],
            **r,
        )


def _add_distilled_row(table: Table, s: Setting, work: Path) -> None:
    r = short_distilled_set(s, work)
    table.add(
        "distilled set with another line count",
        f"--distill-data binarized from {N_TRAIN - 10} of {N_TRAIN} lines",
        f'exit {r["returncode"]}: "{short(r["message"], 230)}"',
        "nothing (refused before training)",
        r["returncode"] != 0 and bool(r["message"]),
        **r,
    )


def build_table(args) -> Table:
    work = Path(args.out).resolve() / "work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    rng = random.Random(args.seed)
    table = Table()
    t0 = time.time()
    cases = set(args.cases.split(","))

    if "input" in cases:
        _add_input_rows(table, work)
    kinds = [k for k in KINDS if k in cases or "training" in cases]
    s = Setting(work / "data") if (kinds or cases & {"copy", "truncated", "disk", "dictionary", "distilled"}) else None
    refs = reference_runs(s, work, sorted(set(kinds) | ({"HRT"} if "copy" in cases else set()))) if s else {}
    for kind in kinds:
        _add_killed_training_rows(table, s, work, kind, refs[kind], args.kills, rng)
    if "copy" in cases:
        _add_copy_rows(table, s, work, refs["HRT"])
    if "truncated" in cases:
        _add_truncated_row(table, s, work)
    if "disk" in cases:
        _add_disk_row(table, s, work)
    if "dictionary" in cases:
        _add_dictionary_rows(table, s, work)
    if "distilled" in cases:
        _add_distilled_row(table, s, work)
    if "runtime" in cases:
        runtime = runtime_and_service(work)
        add_runtime_rows(table, runtime)
        add_operator_rows(table, runtime)
        add_bounded_rows(table, runtime["bounded"])
    table.seconds = time.time() - t0
    return table


def _add_damaged_rows(table: Table, damaged: dict):
    """hrt-translate on each damaged exported folder."""
    what = {
        "truncated": "weights.bin cut to half its bytes",
        "zeroed": "1 MiB of weights.bin zeroed (same size)",
        "swapped": "config.json of another export (an HRT model of the same data) copied in",
        "no_file_list": "config.json's file list removed",
        "positions_edited": "config.json's max_source_positions edited to 4096",
        "int8_zeroed": 'config.json given "int8": true (which once exempted the graphs and weights.bin from the '
        "check), weights.bin zeroed",
        "int8_other_weights": 'config.json given "int8": true, weights.bin of another export of the same architecture '
        "copied in",
        "graphs_swapped": "config.json's graphs step and step_top swapped (beam 1 once worked, beam 5 failed inside "
        "ONNX Runtime)",
        "layers_string": 'config.json\'s layers written as a string ("1")',
        "spm_null": "config.json's sentencepiece_model set to null, the SentencePiece model still in the folder and "
        "its file list (raw pieces once read with exit 0)",
        "file_for_folder": "the folder's config.json given where the folder is expected",
    }
    # what each message must tell the operator to do
    advice = {"file_for_folder": "give the folder fairseq-hrt-export wrote"}
    for name, d in damaged.items():
        table.add(
            f"damaged exported folder: {name}",
            f"{what[name]}, then hrt-translate",
            d["message"],
            f"nothing translated with it; one line that says to {advice.get(name, 'export again')}",
            d["message"].startswith("exit 2")
            and advice.get(name, "export again") in d["message"]
            and d.get("stderr_lines", 1) == 1
            and not d.get("traceback", False),
            **d,
        )


def _add_service_rows(table: Table, r: dict):
    """hrt-serve with a full queue, and with clients that disconnect."""
    f = r["full_queue"]
    table.add(
        "hrt-serve: a full queue",
        f"{f['requests']} concurrent slow requests (beam 5, 4 sentences) to hrt-serve --max-queue 2 --max-batch 8",
        f'{f["rejected_503"]} answered 503 at once ("{short(f["message_503"], 120)}"), {f["answered"]} answered, '
        f"{f['answers_equal']} of them equal to the Translator's for their lines",
        "nothing silently: a refused request is told to retry",
        f["rejected_503"] > 0
        and f["rejected_503"] + f["answered"] == f["requests"]
        and f["answers_equal"] == f["answered"],
        **f,
    )
    d = r["disconnect"]
    table.add(
        "hrt-serve: clients that disconnect",
        f"{d['disconnected']} clients hang up (4 after sending a request, 1 in the middle of one), then "
        f"{d['others']} other requests",
        f"the others: {d['others_equal']} of {d['others']} answered with the Translator's strings; the service "
        f"{'keeps running' if d['service_alive'] else 'DIED'}",
        "the disconnected clients' answers only",
        d["others_equal"] == d["others"] and d["service_alive"],
        **d,
    )


def add_runtime_rows(table: Table, r: dict):
    """The deployed runtime's and the service's rows (benchmarks/faults.py: runtime_and_service)."""
    b = r["bad_input"]
    table.add(
        "bad input lines, hrt-translate",
        "the fairseq-interactive row's lines on stdin: invalid UTF-8, NUL + control characters, a line of spaces, a "
        "100k-character line, mixed scripts and emoji",
        f"exit {b['returncode']}, {b['output_lines']} of {b['input_lines']} lines translated; warnings: "
        + "; ".join(b["warnings"][:3]),
        "nothing: repaired as fairseq-interactive repairs them (one module), the long line truncated with a warning "
        "naming it",
        b["returncode"] == 0
        and b["output_lines"] == b["input_lines"]
        and not b["traceback"]
        and len(b["warnings"]) >= 2,
        **b,
    )
    _add_damaged_rows(table, r["damaged"])
    k = r["killed_export"]
    table.add(
        "fairseq-hrt-export SIGKILLed over an earlier export",
        "the export of a newer checkpoint into the folder of an older one, SIGKILLed right after its new weights.bin "
        "moved in (files move one by one, config.json last), then hrt-translate; then the same export again",
        f"moved before the kill: {', '.join(k['moved_before_kill'])}; then {k['after_kill']} (temporary folders left: "
        f"{', '.join(k['temporary_folders_left']) or 'none'});"
        f" export again: exit {k['export_again_returncode']}, then {k['after_export_again']}",
        "the interrupted export (refused at load, never translated with mixed files)",
        k["after_kill"].startswith("exit 2")
        and "export again" in k["after_kill"]
        and k["export_again_returncode"] == 0
        and k["after_export_again"].startswith("exit 0"),
        **k,
    )
    t = r["threads"]
    table.add(
        "many callers on one Translator",
        f"{t['threads']} threads, {t['calls']} translate() calls of mixed beams",
        f"{t['equal_to_serial']} of {t['calls']} answers equal to the same calls made one after another",
        "nothing",
        t["equal_to_serial"] == t["calls"],
        **t,
    )
    _add_service_rows(table, r)


def _add_option_rows(table: Table, options: dict):
    """hrt-translate's options out of range (and a full disk)."""
    before = {  # what issue 77 measured before these were one line
        "--beam 2.5": "argparse's usage and the error, 10 lines",
        "--lenpen -inf": '"expected one argument"',
        "--threads 4xCPUs": "accepted",
        "--min-len 2000": 'said "raise max_len_b" where the model\'s positions were the limit',
        "> /dev/full": "a Python traceback",
    }
    for name, o in options.items():
        expected_exit = o.get("expected_exit", 2)  # 1: the output could not be written (> /dev/full)
        table.add(
            f"hrt-translate {name}",
            f"hrt-translate --beam 2 {name} on one line" + (f". Before: {before[name]}" if name in before else ""),
            f"exit {o['returncode']}, {o['stderr_lines']} line(s): {o['last_line']}",
            "nothing: refused before anything is read" if expected_exit == 2 else "nothing: it says why and exits",
            o["returncode"] == expected_exit
            and o["stderr_lines"] == 1
            and not o["traceback"]
            and o["stdout"] == ""
            and (name != "--min-len 2000" or "target positions" in o["last_line"]),
            **o,
        )


def _add_bind_rows(table: Table, b: dict):
    """hrt-serve's bind errors, --port 0, and a request's option out of range."""
    for name in ("port in use", "--port 70000", "--max-wait-ms inf"):
        o = b[name]
        table.add(
            f"hrt-serve {name}",
            f"hrt-serve {'--port P (P served by another hrt-serve)' if name == 'port in use' else name}",
            f"exit {o['returncode']}, {o['stderr_lines']} line(s), nothing announced: {o['last_line']}",
            "nothing: it says why and exits",
            o["returncode"] != 0 and o["stderr_lines"] == 1 and not o["traceback"] and o["stdout"] == "",
            **o,
        )
    z = b["--port 0"]
    table.add(
        "hrt-serve --port 0",
        "hrt-serve --port 0, then a connection to the port its banner names",
        f"{z['banner']}; listening: {z['listening']}",
        "nothing",
        z["announced_port"] > 0 and z["listening"],
        **z,
    )
    q = b["request lenpen 400"]
    table.add(
        "hrt-serve: lenpen 400 in a request",
        'POST /translate {"text": [...], "lenpen": 400}',
        f"{q['status']}: {q['error']}",
        "nothing: the request is told its range",
        q["status"] == 400 and "from -10 to 10" in q["error"],
        **q,
    )


def add_operator_rows(table: Table, r: dict):
    """The rows of issue 40: options, binding, hang-ups, a large request, SIGTERM, /metrics."""
    _add_option_rows(table, r["options"])
    _add_bind_rows(table, r["bind"])
    h = r["hang_up"]
    table.add(
        "hrt-serve: a client hangs up during a long request",
        f"256 lines at beam 5 ({h['batches_of_long_request']}+ batches; {h['long_request_whole_s']} s when served "
        "whole), the client gone after 0.5 s, then a 2-line request",
        f"the next request answered {h['next_status']} after {h['next_waited_s']} s (the batch running, not the "
        f"request); abandoned: {h['abandoned']}",
        "the hung-up request's remaining batches are never translated",
        h["next_status"] == 200 and h["abandoned"] == 1 and h["next_waited_s"] < h["long_request_whole_s"],
        **h,
    )
    m = r["large_request"]
    table.add(
        "hrt-serve: one large request",
        f"256 lines of 20 KB ({m['body_mib']} MiB) at beam 5, max_len_b 20 (--max-request-tokens raised to take it)",
        f"answered {m['status']} in {m['seconds']} s; RSS {m['rss_before_mib']} MiB before, {m['rss_peak_mib']} at "
        f"peak, {m['rss_after_mib']} after; with the default --max-request-tokens: {m['default_limit']['status']} "
        f"({short(m['default_limit']['error'], 100)})",
        "nothing; the memory goes back after it",
        m["status"] == 200
        and m["rss_after_mib"] < m["rss_before_mib"] + (m["rss_peak_mib"] - m["rss_before_mib"]) / 2
        and m["default_limit"]["status"] == 413,
        **m,
    )
    t = r["sigterm"]
    table.add(
        "hrt-serve: SIGTERM with long requests queued",
        f"{t['requests']} requests of 256 lines at beam 5 queued, SIGTERM after 1 s, --drain-seconds "
        f"{t['drain_seconds']}",
        f"exit {t['returncode']} after {t['exit_after_s']} s; {t['answered_200']} answered 200, "
        f"{t['answered_503']} answered 503",
        "the requests not translated within the drain time (told 503, retry elsewhere)",
        t["returncode"] == 0 and t["answered_200"] + t["answered_503"] == t["requests"] and t["exit_after_s"] < 60,
        **t,
    )
    counts = ", ".join(f"{k.split('=')[1].rstrip('}')}: {int(v)}" for k, v in sorted(r["metrics"].items()) if v)
    table.add(
        "hrt-serve: GET /metrics",
        "scraped after the hang-up and large-request cases",
        f"hrt_serve_requests_total by outcome: {counts}",
        "nothing",
        r["metrics"].get("hrt_serve_requests_total{outcome=abandoned}") == 1,
        metrics=r["metrics"],
    )


def add_bounded_rows(table: Table, r: dict):
    """The rows of issue 77: hrt-serve bounded by the work a request asks for; "before" is what
    the issue measured on the service before it."""
    i = r["issue_request"]
    table.add(
        "hrt-serve: 64 lines at beam 256, min_len 1000, max_len_b 100000 (every value in range)",
        "the issue's request, then a one-line request. Before: memory 90 MiB -> 3.6 GB in 7 min and growing, "
        "the batch ran on after its client left, 12 small requests with 20 s timeouts all failed",
        f"{i['status']}: {short(i['error'], 200)}; the next request {i['next_status']}; positions in flight after: "
        f"{i['positions_in_flight_after']}",
        "nothing: refused before any work, with the figure and the cap",
        i["status"] == 413 and "decoder positions" in i["error"] and i["next_status"] == 200,
        **i,
    )
    d = r["deadline"]
    table.add(
        "hrt-serve: a costly request past its deadline",
        '192 lines at beam 16 (admitted) with "timeout": 0.5. Before: no deadline; a started batch ran to its end',
        f"{d['status']}: {short(d['error'], 160)}; batches stopped: {d['stopped_batches']}; positions in flight "
        f"after: {d['positions_in_flight_after']}; the next request {d['next_status']}",
        "the late request's translations (told 504)",
        d["status"] == 504 and d["stopped_batches"] >= 1 and d["positions_in_flight_after"] == 0,
        **d,
    )
    g = r["gone"]
    table.add(
        "hrt-serve: a client gone during costly work",
        "192 lines at beam 16, the client gone after 0.5 s, then a one-line request. Before: the batch ran on "
        "(beam 16, min_len 200: the next one-word request waited 74 s)",
        f"the next request {g['next_status']} after {g['next_waited_s']} s; batches stopped: "
        f"{g['stopped_batches']}; abandoned: {g['abandoned']}",
        "the gone client's translations",
        g["next_status"] == 200 and g["stopped_batches"] >= 2 and g["abandoned"] >= 1,
        **g,
    )
    before = {
        "100,000 nested [": "500 (RecursionError in the log)",
        "an 18 MiB body": "413 as plain text",
        "a line holding \\n": "translated as one sentence, only its first line came back",
    }
    for name, b in r["bodies"].items():
        table.add(
            f"hrt-serve: {name}",
            f"POST /translate with {name}. Before: {before[name]}",
            f"{b['status']} (JSON: {b['json']}): {short(b['error'], 140)}",
            "nothing: the client is told why",
            b["status"] in (400, 413) and b["json"],
            **b,
        )
    w = r["slow"]
    table.add(
        "hrt-serve: slow clients",
        f"{w['connections']} connections, half sending headers and part of a body, half headers never finished "
        "(--body-timeout 1 --idle-timeout 1), 3 s, then SIGTERM (--drain-seconds 5). Before: they stayed open for "
        "ever, /metrics counted 203 abandoned and /info 2, SIGTERM took 36 s",
        f"answered {w['answered']}, closed without answer {w['closed_without_answer']}; abandoned /info "
        f"{w['abandoned_info']}, /metrics {w['abandoned_metrics']:g}; exit {w['exit']} after {w['exit_after_s']} s",
        "nothing: the slow requests are told 408 or closed",
        w["answered"].get("408", 0) >= w["connections"] // 2
        and w["closed_without_answer"] >= w["connections"] // 2
        and w["abandoned_info"] == w["abandoned_metrics"]
        and w["exit"] == 0
        and w["exit_after_s"] < 10,
        **w,
    )
    n = r["drain"]
    table.add(
        "hrt-serve: SIGTERM with 8 x 256 lines at beam 5, --drain-seconds 2",
        "8 requests of 256 lines (max_len_b 30), SIGTERM after 1 s; /health polled from new connections. "
        "Before: 0 of 8 answered (batches rotated between the requests), new connections refused at once",
        f"exit {n['returncode']} after {n['exit_after_s']} s; {n['answered_200']} answered 200, "
        f"{n['answered_503']} 503; /health while draining: {n['health_while_draining']}",
        "the requests not finished within the drain time (told 503, retry elsewhere)",
        n["returncode"] == 0
        and n["answered_200"] >= 1
        and n["answered_200"] + n["answered_503"] == n["requests"]
        and n["health_while_draining"].get("503", 0) >= 1,
        **n,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "work" / "fault-table"), help="output folder (its work/ is recreated)")
    p.add_argument("--kills", type=int, default=2, help="random SIGKILLs per model kind")
    p.add_argument("--seed", type=int, default=1, help="seed of the random kill moments")
    p.add_argument(
        "--cases",
        default="input,AT,HRT,MP,copy,truncated,disk,dictionary,distilled,runtime",
        help="comma-separated subset of: input, AT, HRT, MP (or training = all three), copy, truncated, "
        "disk, dictionary, distilled, runtime (hrt-translate, Translator and hrt-serve)",
    )
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        sep = argv.index("--")
        return child_main(argv[1], argv[sep + 1 :])
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    set_report_root(args.out)
    table = build_table(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = table.markdown()
    report = {
        "rows": table.rows,
        "seconds": round(table.seconds, 1),
        "save_interval_updates": SAVE_INTERVAL,
        "max_update": MAX_UPDATE,
        "kills_per_kind": args.kills,
        "seed": args.seed,
    }
    text = json.dumps(report, indent=1, default=str)
    write_files(str(out), {"fault_table.md": relative(md) + "\n", "fault_table.json": relative(text) + "\n"})
    print(relative(md))
    print(f"\n{sum(r['ok'] for r in table.rows)} of {len(table.rows)} rows ok, {table.seconds:.0f} s")
    return 0 if all(r["ok"] for r in table.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
