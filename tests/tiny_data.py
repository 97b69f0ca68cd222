"""The tests' harness: the fairseq commands of :mod:`fairseq_hrt.testing.tiny_runs` (the tiny-data
setting the tests share with the fault table) forked from one warm process, and the helpers
only tests need. tests/conftest.py imports it, so every test's commands run so.

Every fairseq command of the tests is forked from one process that has imported torch,
fairseq and the plugin already (:class:`WarmProcess`, installed as
:mod:`fairseq_hrt.testing.tiny_runs`' launcher when this module is imported): it runs exactly as
``python -m MODULE ARGS`` would, in a process of its own, without paying the 3-5 s of imports
again. ``HRT_TEST_FRESH=1`` runs every command in a fresh interpreter instead.
"""

import multiprocessing
import os
import re
import runpy
import socket
import subprocess
import sys
import tempfile
import warnings
from multiprocessing import forkserver
from typing import Dict, List, Optional

import torch

from fairseq_hrt import cli_logging
from fairseq_hrt.testing import tiny_runs
from fairseq_hrt.testing.tiny_runs import cli_env

# what every command imports first; the forked children find it imported already
WARM_MODULES = [
    "torch",
    "fairseq",
    "fairseq.models.transformer",
    "fairseq_cli.train",
    "fairseq_cli.generate",
    "fairseq_cli.interactive",
    "fairseq_cli.preprocess",
    "fairseq_hrt",
    "fairseq_hrt.testing.tiny_runs",
]
_WARM_CONTEXT = None


def _warm_context():
    global _WARM_CONTEXT
    if _WARM_CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        # the fork server imports these once, with the environment of cli_env()
        saved = dict(os.environ)
        os.environ.update(cli_env())
        try:
            ctx.set_forkserver_preload(WARM_MODULES)
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _WARM_CONTEXT = ctx
    return _WARM_CONTEXT


def _run_forked(cmd: List[str], env: Dict[str, str], cwd: str, log_path: str, input_path: Optional[str]):
    """``python -m MODULE ARGS`` / ``python -c CODE ARGS`` in a child of the warm process:
    the command's environment, working directory, standard streams and exit status."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # a child of the fork server inherits "forkserver" as its start method; a command that
    # starts worker processes (fairseq-preprocess --workers, data loaders) would then start a
    # fork server of its own that outlives it (one leaked 250 MB process per command). A
    # fresh interpreter on Linux forks its workers: so do these commands
    multiprocessing.set_start_method("fork", force=True)
    sys.stdin = open(input_path or os.devnull, encoding="utf-8")
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))
    code = 0
    try:
        if cmd[1] == "-m":
            sys.argv = [cmd[2], *cmd[3:]]
            if cmd[2].split(".")[0] in cli_logging.FAIRSEQ_COMMANDS and "--user-dir" in cmd:
                # a fresh interpreter imports the plugin by --user-dir under fairseq's command
                # line, which makes its refusals one line then (fairseq_hrt/__init__); this
                # process imported it before
                cli_logging.refusals_in_one_line()
            runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *cmd[3:]]
            exec(compile(cmd[2], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): the interpreter prints it and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: B902 - as the interpreter does: its excepthook (a traceback), exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class WarmProcess:
    """One command forked from the warm process; the ``subprocess.Popen`` subset the helpers
    use (``wait``, ``kill``, ``returncode``)."""

    def __init__(self, cmd: List[str], env: Dict[str, str], cwd: str, log_path: str, input_text: Optional[str] = None):
        self.input_path = None
        if input_text is not None:
            fd, self.input_path = tempfile.mkstemp(prefix="hrt-test-stdin-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(input_text)
        self.process = _warm_context().Process(target=_run_forked, args=(cmd, env, cwd, str(log_path), self.input_path))
        self.process.start()
        self.returncode = None

    def wait(self, timeout: Optional[float] = None):
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout)
        self.returncode = self.process.exitcode
        if self.input_path:
            os.unlink(self.input_path)
            self.input_path = None
        return self.returncode

    def kill(self):
        self.process.kill()


def _fresh() -> bool:
    return os.environ.get("HRT_TEST_FRESH") == "1"


if not _fresh():
    tiny_runs.use_launcher(WarmProcess)


def hyp_lines(output: str) -> Dict[int, str]:
    """``{sentence id: hypothesis}`` from the ``H-`` lines of fairseq-generate / interactive."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^H-(\d+)\t\S+\t?(.*)$", output, re.M)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
