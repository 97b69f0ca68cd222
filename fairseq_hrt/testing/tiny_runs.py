"""Tiny parallel data and fairseq command lines, in a checkout of the repository: the setting the
tests (their harness, tests/tiny_data.py) and the fault table (benchmarks/faults.py) share. It
imports nothing of ``benchmarks``, ``tests`` or ``examples``, so both may build on it.

* :func:`write_raw_corpus` writes a small line-aligned en-de corpus: the first lines of
  ``../shared/data/multi30k-en-de`` when that directory exists, else a deterministic synthetic
  corpus (a "translation" that maps every source word to a target word and reverses the order)
  so everything runs without the shared data.
* :func:`binarize` runs ``fairseq-preprocess`` (joined dictionary, or given dictionaries).
* :func:`make_tiny_data` does both and returns a :class:`TinyData` with every path.
* :func:`run_cli` runs ``fairseq-train`` / ``-preprocess`` / ``-generate`` / ... as a
  child process of this Python (so the active virtual environment is used), captures the
  output, and raises :class:`CLIError` carrying the output on a non-zero exit; each command
  runs exactly as ``python -m MODULE ARGS`` would, in a process of its own (a fresh
  interpreter, or the launcher installed with :func:`use_launcher`).
* :func:`parse_logs` reads the ``--log-format json`` (or ``simple``) metric lines back.
"""

import json
import os
import random
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import sentencepiece as spm

REPO = Path(__file__).resolve().parents[2]  # the checkout: fairseq_hrt/testing/ -> .
USER_DIR = str(REPO / "fairseq_hrt")
SHARED_MULTI30K = REPO.parent / "shared" / "data" / "multi30k-en-de"

SRC, TGT = "en", "de"

# fairseq command name -> module run with ``python -m``
CLI_MODULES = {
    "train": "fairseq_cli.train",
    "preprocess": "fairseq_cli.preprocess",
    "generate": "fairseq_cli.generate",
    "interactive": "fairseq_cli.interactive",
    "validate": "fairseq_cli.validate",
    "score": "fairseq_cli.score",
}


# --------------------------------------------------------------------------- subprocesses


class CLIError(RuntimeError):
    """A fairseq command exited non-zero; ``output`` holds its stdout + stderr."""

    def __init__(self, cmd: Sequence[str], returncode: int, output: str):
        self.cmd = list(cmd)
        self.returncode = returncode
        self.output = output
        tail = output[-6000:]
        super().__init__(f"command failed (exit {returncode}): {' '.join(self.cmd)}\n--- output (tail) ---\n{tail}")


def cli_env(env: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment for a fairseq subprocess: repository importable, one thread per op
    (tests may run several processes on 2 cores), no GPU, plus ``env``."""
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), out.get("PYTHONPATH", "")) if p)
    out.setdefault("OMP_NUM_THREADS", "1")
    out.setdefault("MKL_NUM_THREADS", "1")
    out["CUDA_VISIBLE_DEVICES"] = ""
    out.setdefault("PYTHONWARNINGS", "ignore")
    if env:
        out.update({k: str(v) for k, v in env.items()})
    return out


def _command(args: Sequence[str]) -> List[str]:
    args = [str(a) for a in args]
    if not args:
        raise ValueError("run_cli needs a command, e.g. ['train', DATA, '--arch', ...]")
    name = args[0]
    if name.startswith("fairseq-"):
        name = name[len("fairseq-") :]
    if name in CLI_MODULES:
        return [sys.executable, "-m", CLI_MODULES[name], *args[1:]]
    if name.startswith("fairseq_cli.") or name.startswith("fairseq_hrt."):
        return [sys.executable, "-m", name, *args[1:]]
    if name == "-c":  # ['-c', CODE, args...]: a Python snippet (e.g. a wrapped fairseq main)
        return [sys.executable, "-c", *args[1:]]
    raise ValueError(f"unknown fairseq command {args[0]!r}; one of {sorted(CLI_MODULES)}")


# how a command starts: a fresh interpreter, unless a launcher is installed (the tests' fork
# server, tests/tiny_data.py, which saves every command the 3-5 s of imports).
# ``launcher(cmd, env, cwd, log_path, input_text)`` returns a started process with ``wait``,
# ``kill`` and ``returncode``, its stdout and stderr in ``log_path``
_launcher: Optional[Callable] = None


def use_launcher(launcher: Optional[Callable]):
    """Start the commands of this module with ``launcher`` (``None``: fresh interpreters)."""
    global _launcher
    _launcher = launcher


def run_cli(
    args: Sequence[str],
    env: Optional[Dict[str, str]] = None,
    cwd=None,
    timeout: float = 600,
    check=True,
    input: Optional[str] = None,
):
    """Run a fairseq command (``['train', DATA, ...]``, ``'fairseq-train'`` also accepted),
    with ``input`` as its standard input.

    Returns a ``subprocess.CompletedProcess`` (``.stdout`` = stdout and stderr together).
    Raises :class:`CLIError` with the output when the command fails and ``check`` is true.
    """
    cmd = _command(args)
    if _launcher is None:
        proc = subprocess.run(
            cmd,
            env=cli_env(env),
            cwd=str(cwd or REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            input=input,
        )
    else:
        with tempfile.TemporaryDirectory(prefix="hrt-cli-") as tmp:
            log_path = os.path.join(tmp, "output.log")
            child = _launcher(cmd, cli_env(env), str(cwd or REPO), log_path, input)
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                raise
            with open(log_path, encoding="utf-8", errors="replace") as f:
                proc = subprocess.CompletedProcess(cmd, child.returncode, f.read())
    if check and proc.returncode != 0:
        raise CLIError(cmd, proc.returncode, proc.stdout)
    return proc


def start_cli(args: Sequence[str], env: Optional[Dict[str, str]] = None, cwd=None, log_path=None):
    """Start a fairseq command without waiting (for multi-process runs).

    Output goes to ``log_path`` (a file, so a chatty rank cannot block on a full pipe).
    Returns ``(process, cmd)``; use :func:`wait_cli` to collect it.
    """
    cmd = _command(args)
    if _launcher is None:
        log = open(log_path, "w") if log_path else subprocess.DEVNULL
        proc = subprocess.Popen(cmd, env=cli_env(env), cwd=str(cwd or REPO), stdout=log, stderr=subprocess.STDOUT)
        proc._tiny_log = (log, log_path)  # noqa: SLF001 - closed by wait_cli
        return proc, cmd
    proc = _launcher(cmd, cli_env(env), str(cwd or REPO), log_path or os.devnull)
    proc._tiny_log = (None, log_path)  # noqa: SLF001
    return proc, cmd


def wait_cli(proc, cmd, timeout: float = 600, check=True) -> str:
    """Wait for a :func:`start_cli` process; return its output, raise :class:`CLIError` on failure."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log, log_path = proc._tiny_log  # noqa: SLF001
    if log is not None and log is not subprocess.DEVNULL:
        log.close()
    output = Path(log_path).read_text(errors="replace") if log_path else ""
    if check and proc.returncode != 0:
        raise CLIError(cmd, proc.returncode, output)
    return output


def run_cli_many(
    arg_lists: Sequence[Sequence[str]],
    log_dir,
    env: Optional[Dict[str, str]] = None,
    check: bool = True,
    max_procs: int = 2,
    timeout: float = 600,
):
    """Run several independent fairseq commands, ``max_procs`` at a time (the test machine
    has 2 cores; every process uses one thread). Returns ``[(returncode, output), ...]`` in
    the order of ``arg_lists``; raises :class:`CLIError` for the first failure if ``check``."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    results: List[Optional[tuple]] = [None] * len(arg_lists)
    pending = list(enumerate(arg_lists))
    running = []
    while pending or running:
        while pending and len(running) < max_procs:
            i, args = pending.pop(0)
            proc, cmd = start_cli(args, env=env, log_path=log_dir / f"run{i}.log")
            running.append((i, proc, cmd))
        i, proc, cmd = running.pop(0)
        output = wait_cli(proc, cmd, timeout=timeout, check=False)
        results[i] = (proc.returncode, output)
    if check:
        for (rc, output), args in zip(results, arg_lists):
            if rc != 0:
                raise CLIError(_command(args), rc, output)
    return results


# --------------------------------------------------------------------------------- logs

# "... | INFO | train_inner | {...}" (fairseq's format) or "INFO:train_inner:{...}"
# (Python's default format, when something configured logging before fairseq did)
_JSON_LINE = re.compile(r"(?:\||INFO:)\s*(?P<tag>[\w./-]+)\s*[|:]\s*(?P<body>\{.*\})\s*$")
_SIMPLE_LINE = re.compile(r"(?:\|\s*INFO\s*\||INFO:)\s*(?P<tag>[\w./-]+)\s*[|:]\s*(?P<body>epoch\s+\d+.*)$")


def _number(value):
    if isinstance(value, (int, float)):
        return value
    try:
        f = float(value)
    except (TypeError, ValueError):
        return value
    return int(f) if re.fullmatch(r"-?\d+", str(value).strip()) else f


def parse_logs(output: str, tag: str = "train_inner") -> List[Dict[str, object]]:
    """Metric records that fairseq logged under ``tag`` (``train_inner``, ``train``, ``valid``).

    Understands ``--log-format json`` (one JSON object per line) and ``--log-format simple``
    (``key value | key value``); numeric strings become numbers.
    """
    records = []
    for line in output.splitlines():
        m = _JSON_LINE.search(line)
        if m and m.group("tag") == tag:
            try:
                body = json.loads(m.group("body"))
            except json.JSONDecodeError:
                continue
            records.append({k: _number(v) for k, v in body.items()})
            continue
        m = _SIMPLE_LINE.search(line)
        if m and m.group("tag") == tag:
            body = m.group("body")
            record = {}
            epoch = re.match(r"epoch\s+(\d+)", body)
            if epoch:
                record["epoch"] = int(epoch.group(1))
            if "=" in body:  # train_inner: "epoch 001:  10 / 3 loss=11.7, nll_loss=11.6, ..."
                for key, value in re.findall(r"([\w.]+)=([^,\s]+)", body):
                    record[key] = _number(value)
            else:  # end of epoch / valid: "epoch 001 | loss 11.6 | nll_loss 11.5 | ..."
                for part in body.split("|")[1:]:
                    key, _, value = part.strip().partition(" ")
                    if key:
                        record[key] = _number(value.strip())
            records.append(record)
    return records


# --------------------------------------------------------------------------------- data


def _synthetic_pairs(n: int, seed: int, vocab: int = 24, min_len: int = 3, max_len: int = 12):
    """Deterministic toy translation: source words ``w0..``, target = the mapped words
    ``W0..`` in reversed order (learnable, word-level, no unknown tokens)."""
    rng = random.Random(seed)
    src_words = [f"w{i}" for i in range(vocab)]
    pairs = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        sentence = [rng.choice(src_words) for _ in range(length)]
        target = ["W" + w[1:] for w in reversed(sentence)]
        pairs.append((" ".join(sentence), " ".join(target)))
    return pairs


def _read_lines(path: Path, n: int) -> List[str]:
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if len(lines) >= n:
                break
            # the raw Multi30k train.de has one TAB inside a sentence: whitespace-normalise
            lines.append(" ".join(line.split()))
    return lines


def corpus_source(prefer: str = "auto") -> str:
    """``'multi30k'`` when the shared data is there (and ``prefer`` allows it), else ``'synthetic'``."""
    if prefer not in ("auto", "multi30k", "synthetic"):
        raise ValueError(f"prefer must be auto, multi30k or synthetic, got {prefer!r}")
    if prefer == "synthetic":
        return "synthetic"
    have = all((SHARED_MULTI30K / f"{s}.{lang}").is_file() for s in ("train", "valid") for lang in (SRC, TGT))
    if prefer == "multi30k" and not have:
        raise FileNotFoundError(f"no Multi30k data under {SHARED_MULTI30K}")
    return "multi30k" if have else "synthetic"


def default_prefer() -> str:
    """``HRT_TEST_DATA=synthetic`` forces the synthetic corpus (to test without ../shared)."""
    return os.environ.get("HRT_TEST_DATA", "auto")


def write_raw_corpus(
    out_dir, n_train: int = 300, n_valid: int = 50, prefer: Optional[str] = None, seed: int = 1, vocab: int = 24
) -> Dict[str, Path]:
    """Write ``train.{en,de}`` and ``valid.{en,de}`` under ``out_dir``.

    ``prefer``: ``'auto'`` (Multi30k if present), ``'multi30k'``, ``'synthetic'``; default
    :func:`default_prefer`. ``vocab``/``seed`` shape the synthetic corpus.

    Returns ``{'train': prefix, 'valid': prefix, 'source': 'multi30k'|'synthetic'}`` where a
    prefix + ``.en`` / ``.de`` is a file.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = corpus_source(prefer or default_prefer())
    for split, n in (("train", n_train), ("valid", n_valid)):
        if source == "multi30k":
            src = _read_lines(SHARED_MULTI30K / f"{split}.{SRC}", n)
            tgt = _read_lines(SHARED_MULTI30K / f"{split}.{TGT}", n)
        else:
            pairs = _synthetic_pairs(n, seed=seed + (0 if split == "train" else 1000), vocab=vocab)
            src, tgt = [p[0] for p in pairs], [p[1] for p in pairs]
        assert len(src) == len(tgt) == n, (split, len(src), len(tgt))
        (out_dir / f"{split}.{SRC}").write_text("\n".join(src) + "\n", encoding="utf-8")
        (out_dir / f"{split}.{TGT}").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return {"train": out_dir / "train", "valid": out_dir / "valid", "source": source}


def write_lines(path, lines: Iterable[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line.rstrip("\n") + "\n" for line in lines), encoding="utf-8")
    return path


def read_lines(path) -> List[str]:
    return Path(path).read_text(encoding="utf-8").splitlines()


def preprocess_args(
    dest_dir,
    trainpref,
    validpref=None,
    srcdict=None,
    tgtdict=None,
    joined: bool = True,
    workers: int = 1,
    extra: Sequence[str] = (),
) -> List[str]:
    """The ``fairseq-preprocess`` command line of :func:`binarize` (for :func:`run_cli_many`)."""
    args = [
        "preprocess",
        "--source-lang",
        SRC,
        "--target-lang",
        TGT,
        "--trainpref",
        trainpref,
        "--destdir",
        dest_dir,
        "--workers",
        workers,
    ]
    if validpref is not None:
        args += ["--validpref", validpref]
    if srcdict is not None:
        args += ["--srcdict", srcdict, "--tgtdict", tgtdict or srcdict]
    elif joined:
        args += ["--joined-dictionary"]
    args += list(extra)
    return [str(a) for a in args]


def binarize(
    dest_dir,
    trainpref,
    validpref=None,
    srcdict=None,
    tgtdict=None,
    joined: bool = True,
    workers: int = 1,
    extra: Sequence[str] = (),
) -> Path:
    """``fairseq-preprocess`` ``trainpref``/``validpref`` (en -> de) into ``dest_dir``.

    Without dictionaries a joined one is built (``--joined-dictionary``); with ``srcdict``
    (and optionally ``tgtdict``, default the same file) those dictionaries are reused, which
    is how an aligned distilled copy of the training set is binarized.
    """
    run_cli(preprocess_args(dest_dir, trainpref, validpref, srcdict, tgtdict, joined, workers, extra))
    return Path(dest_dir)


@dataclass
class TinyData:
    raw_dir: Path  # train.{en,de}, valid.{en,de}
    bin_dir: Path  # fairseq-preprocess output (joined dictionary)
    source: str  # 'multi30k' or 'synthetic'

    @property
    def dict_path(self) -> Path:
        """The joined dictionary (``dict.en.txt`` == ``dict.de.txt``)."""
        return self.bin_dir / f"dict.{SRC}.txt"

    def raw(self, split: str, lang: str) -> Path:
        return self.raw_dir / f"{split}.{lang}"

    @property
    def n_train(self) -> int:
        return len(read_lines(self.raw("train", SRC)))


def make_tiny_data(
    root, n_train: int = 300, n_valid: int = 50, prefer: Optional[str] = None, seed: int = 1, vocab: int = 24
) -> TinyData:
    """Write a tiny corpus under ``root/raw`` and binarize it into ``root/bin`` (joined dict)."""
    root = Path(root)
    raw = write_raw_corpus(root / "raw", n_train=n_train, n_valid=n_valid, prefer=prefer, seed=seed, vocab=vocab)
    bin_dir = binarize(root / "bin", raw["train"], raw["valid"])
    return TinyData(raw_dir=root / "raw", bin_dir=bin_dir, source=raw["source"])


def eval_bleu_finetune_args(start) -> List[str]:
    """``fairseq-train`` options of a run fine-tuned from ``start`` that validates with greedy
    BLEU and keeps the best checkpoint by it (the converged study's runs); the caller drops
    ``train_args``' ``--disable-validation``."""
    return [
        "--eval-bleu",
        "--eval-bleu-args",
        '{"beam": 1, "max_len_a": 1.2, "max_len_b": 10}',
        "--best-checkpoint-metric",
        "bleu",
        "--maximize-best-checkpoint-metric",
        "--finetune-from-model",
        str(start),
    ]


def train_args(
    data_dir,
    save_dir,
    *extra,
    arch: str = "hrt_tiny",
    max_update: int = 20,
    lr: float = 3e-3,
    max_tokens: int = 2000,
    log_interval: int = 1,
    seed: int = 1,
) -> List[str]:
    """A ``fairseq-train`` command line for the HRT task on CPU (json logs; no validation,
    no epoch checkpoints unless ``extra`` asks for them)."""
    return [
        "train",
        data_dir,
        "--user-dir",
        USER_DIR,
        "--task",
        "hrt_translation",
        "--arch",
        arch,
        "--criterion",
        "hrt_loss",
        "--optimizer",
        "adam",
        "--lr",
        lr,
        "--max-tokens",
        max_tokens,
        "--max-update",
        max_update,
        "--save-dir",
        save_dir,
        "--no-progress-bar",
        "--log-format",
        "json",
        "--log-interval",
        log_interval,
        "--share-all-embeddings",
        "--cpu",
        "--seed",
        seed,
        "--num-workers",
        "0",
        "--disable-validation",
        "--no-epoch-checkpoints",
        *[str(e) for e in extra],
    ]


def make_tiny_spm_data(
    root, n_train: int = 300, n_valid: int = 30, vocab_size: int = 160, prefer: Optional[str] = None
) -> TinyData:
    """:func:`make_tiny_data` through a joint SentencePiece model, as the quickstart prepares
    Multi30k: ``root/spm/spm.model`` and the encoded splits, binarized into ``root/bin``
    (for ``fairseq-interactive --bpe sentencepiece`` on raw text)."""
    root = Path(root)
    raw = write_raw_corpus(root / "raw", n_train=n_train, n_valid=n_valid, prefer=prefer)
    spm_dir = root / "spm"
    spm_dir.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=f"{raw['train']}.{SRC},{raw['train']}.{TGT}",
        model_prefix=str(spm_dir / "spm"),
        vocab_size=vocab_size,
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "spm.model"))
    for split in ("train", "valid"):
        for lang in (SRC, TGT):
            lines = read_lines(root / "raw" / f"{split}.{lang}")
            write_lines(spm_dir / f"{split}.{lang}", (" ".join(p) for p in sp.encode(lines, out_type=str)))
    bin_dir = binarize(root / "bin", spm_dir / "train", spm_dir / "valid")
    return TinyData(raw_dir=root / "raw", bin_dir=bin_dir, source=raw["source"])
