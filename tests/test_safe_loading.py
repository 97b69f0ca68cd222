"""Checkpoints load with PyTorch's safe loading (``weights_only=True``) and the plugin's allow-list
(fairseq_hrt/compat.py), through every command that loads one; a checkpoint whose pickle would run
a command is refused in one line naming it, and the command never runs.

The checkpoints are real ones, two updates each on a tiny corpus: the plugin's HRT, AT (validated
with --eval-bleu, so its metrics hold numpy arrays), Mask-Predict, an average of the AT run's
epoch checkpoints, a slim HRT (benchmarks/slim_checkpoint.py), and stock fairseq's
``--task translation --arch transformer`` in float32 and with ``--memory-efficient-fp16``. All
hold their optimizer state but the slim one.
"""

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.distributed import utils as distributed_utils

from benchmarks import slim_checkpoint
from fairseq_hrt import compat
from fairseq_hrt.testing.tiny_runs import SRC, TGT, USER_DIR, make_tiny_data, read_lines, run_cli, run_cli_many
from fairseq_hrt.testing.tiny_runs import train_args as hrt_train_args
from hrt_runtime import Translator
from tests.tiny_data import hyp_lines

UPDATES = 2
TINY_TRANSFORMER = [
    *("--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16"),
    *("--encoder-ffn-embed-dim", "16", "--decoder-ffn-embed-dim", "16"),
    *("--encoder-attention-heads", "2", "--decoder-attention-heads", "2"),
]
# the plugin's checkpoints: (arch, fairseq-train options of the run)
PLUGIN_RUNS = {
    "hrt": ("hrt_tiny", ["--chunk-sizes", "2,3"]),
    "at": ("at_tiny", ["--hrt-mode", "at"]),
    "cmlm": ("cmlm_tiny", ["--hrt-mode", "cmlm"]),
}


def stock_train_args(data_dir, save_dir, *extra, max_update=UPDATES):
    """stock fairseq-train of ``--task translation --arch transformer`` (tiny), no --user-dir."""
    args = hrt_train_args(data_dir, save_dir, *TINY_TRANSFORMER, *extra, arch="transformer", max_update=max_update)
    del args[args.index("--user-dir") : args.index("--user-dir") + 2]
    args[args.index("hrt_translation")] = "translation"
    args[args.index("hrt_loss")] = "label_smoothed_cross_entropy"
    return args


class Checkpoint:
    """A checkpoint, how fairseq-train continues its run, and how it is decoded."""

    def __init__(self, path, train, task_options, plugin):
        self.path, self.train, self.task_options, self.plugin = str(path), train, task_options, plugin

    def train_args(self, data_dir, save_dir, *extra, max_update):
        return self.train(data_dir, save_dir, *extra, max_update=max_update)


def _plugin_train(arch, options):
    return lambda data_dir, save_dir, *extra, max_update: hrt_train_args(
        data_dir, save_dir, *options, *extra, arch=arch, max_update=max_update
    )


PLUGIN_DECODING = ["--user-dir", USER_DIR, "--task", "hrt_translation"]
STOCK_DECODING = ["--task", "translation"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``(TinyData, {name: Checkpoint})``."""
    root = tmp_path_factory.mktemp("safe_loading")
    data = make_tiny_data(root / "data", n_train=100, n_valid=12)
    runs = {name: _plugin_train(arch, options) for name, (arch, options) in PLUGIN_RUNS.items()}
    validated = [
        *("--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 10}', "--best-checkpoint-metric", "bleu"),
        "--maximize-best-checkpoint-metric",
    ]
    commands = []
    for name, train in runs.items():
        args = train(data.bin_dir, root / name, *(validated if name == "at" else ()), max_update=UPDATES)
        if name == "at":  # validated, with an epoch checkpoint per update (one batch an epoch)
            args = [a for a in args if a not in ("--disable-validation", "--no-epoch-checkpoints")]
        commands.append(args)
    fp16 = ["--memory-efficient-fp16", "--fp16-init-scale", "4"]
    commands += [stock_train_args(data.bin_dir, root / "stock"), stock_train_args(data.bin_dir, root / "fp16", *fp16)]
    run_cli_many(commands, log_dir=root / "logs")
    assert len(list((root / "at").glob("checkpoint[0-9].pt"))) == UPDATES
    run_cli(
        ["fairseq_hrt.average_checkpoints", "--inputs", root / "at", "--num-epoch-checkpoints", UPDATES]
        + ["--output", root / "averaged.pt"]
    )
    slim_checkpoint.main([str(root / "hrt" / "checkpoint_last.pt"), str(root / "slim.pt")])
    found = {name: Checkpoint(root / name / "checkpoint_last.pt", runs[name], PLUGIN_DECODING, True) for name in runs}
    found["averaged"] = Checkpoint(root / "averaged.pt", runs["at"], PLUGIN_DECODING, True)
    found["slim"] = Checkpoint(root / "slim.pt", runs["hrt"], PLUGIN_DECODING, True)
    found["stock"] = Checkpoint(root / "stock" / "checkpoint_last.pt", stock_train_args, STOCK_DECODING, False)
    found["stock_fp16"] = Checkpoint(
        root / "fp16" / "checkpoint_last.pt", lambda *a, **k: stock_train_args(*a, *fp16, **k), STOCK_DECODING, False
    )
    return data, found


def _decode_args(data, ckpt, command):
    return [command, data.bin_dir, "--path", ckpt.path, *ckpt.task_options, "--source-lang", SRC]


def test_the_allow_list_is_what_real_checkpoints_hold(checkpoints, tmp_path):
    """In a fresh interpreter without the plugin, PyTorch's safe loading refuses the types these
    checkpoints pickle, and each of them is on the plugin's allow-list; with the plugin imported
    none is refused, also once fairseq has loaded a checkpoint and pickles it again (what
    ``distributed.utils.broadcast_object`` does to share a restored state between ranks, with
    its placeholders for the tensors)."""
    _, found = checkpoints
    paths = [c.path for c in found.values()]
    scan = (
        "import json, sys, torch\n"
        "print(json.dumps(sorted({g for p in sys.argv[1:] for g in "
        "torch.serialization.get_unsafe_globals_in_checkpoint(p)})))"
    )
    done = subprocess.run([sys.executable, "-c", scan, *paths], capture_output=True, text=True, check=True)
    refused_stock = set(json.loads(done.stdout.strip().splitlines()[-1]))
    allowed = {f"{t.__module__}.{getattr(t, '__qualname__', getattr(t, '_name', ''))}" for t in compat.CHECKPOINT_TYPES}
    assert {"argparse.Namespace", "numpy.ndarray", "numpy.core.multiarray._reconstruct"} <= refused_stock
    assert refused_stock <= allowed, refused_stock - allowed
    compat.register_checkpoint_types()
    for path in paths:
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == [], path
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
        assert type(state["cfg"]).__name__ == "DictConfig"
        # what broadcast_object sends to the other ranks: the tensors apart, placeholders for them
        tensors = []
        resent = tmp_path / "resent.pt"
        torch.save(distributed_utils._split_tensors_from_obj(state, tensors), resent)
        received = distributed_utils._put_tensors_in_obj(torch.load(resent, weights_only=True), tensors)
        assert received["cfg"] == state["cfg"]


@pytest.mark.parametrize("command", ["generate", "interactive"])
def test_every_checkpoint_decodes(checkpoints, command):
    """fairseq-generate and fairseq-interactive load every checkpoint and translate every sentence."""
    data, found = checkpoints
    sources = read_lines(data.raw("valid", SRC))
    # stock fairseq drops a last batch short of --required-batch-size-multiple (docs/compatibility.md)
    extra = ["--beam", "1", "--batch-size", "4", "--required-batch-size-multiple", "1", "--cpu"]
    if command == "generate":
        extra += ["--gen-subset", "valid", "--target-lang", TGT]
    else:
        extra += ["--buffer-size", "4", "--target-lang", TGT]
    runs = [_decode_args(data, c, command) + extra for c in found.values()]
    text = "\n".join(sources) + "\n"
    results = (
        run_cli_many(runs, log_dir=data.bin_dir.parent / f"logs_{command}", check=False)
        if command == "generate"
        else [(p.returncode, p.stdout) for p in (run_cli(r, input=text, check=False) for r in runs)]
    )
    for name, (rc, out) in zip(found, results):
        assert rc == 0, (name, out[-3000:])
        assert len(hyp_lines(out)) == len(sources), (name, out[-3000:])


@pytest.mark.parametrize("how", ["--restore-file", "--finetune-from-model"])
def test_every_checkpoint_trains_on(checkpoints, tmp_path, how):
    """fairseq-train resumes every checkpoint (``--restore-file``: weights, optimizer state and
    counters; the slim one, without optimizer state, with ``--reset-optimizer``) or starts from
    its weights (``--finetune-from-model``), and trains one more update."""
    data, found = checkpoints
    runs = []
    for name, ckpt in found.items():
        extra = [how, ckpt.path] + (["--reset-optimizer"] if name == "slim" and how == "--restore-file" else [])
        updates = UPDATES + 1 if how == "--restore-file" else 1
        runs.append(ckpt.train_args(data.bin_dir, tmp_path / name, *extra, max_update=updates))
    results = run_cli_many(runs, log_dir=tmp_path / "logs", check=False)
    for name, (rc, out) in zip(found, results):
        assert rc == 0, (name, out[-3000:])
        loaded = f"Loaded checkpoint {found[name].path}" if how == "--restore-file" else "loading pretrained model from"
        assert loaded in out, (name, out[-3000:])
        assert (tmp_path / name / "checkpoint_last.pt").is_file()


_HUB = """
import sys, fairseq_hrt
bin_dir, source, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
for path in paths:
    hub = fairseq_hrt.from_pretrained(*path.rsplit("/", 1), data_name_or_path=bin_dir)
    print("translated", path, repr(hub.translate(source)))
"""


def test_every_plugin_checkpoint_loads_through_the_hub_and_distill(checkpoints, tmp_path):
    """The Python API (fairseq_hrt.hub.from_pretrained) and ``python -m fairseq_hrt.distill`` load
    every checkpoint of the plugin's task (fairseq's hub refuses the stock ones: another task)."""
    data, found = checkpoints
    plugin = {name: c for name, c in found.items() if c.plugin}
    source = read_lines(data.raw("valid", SRC))[0]
    out = run_cli(["-c", _HUB, data.bin_dir, source, *(c.path for c in plugin.values())]).stdout
    for ckpt in plugin.values():
        assert f"translated {ckpt.path} " in out, out[-3000:]
    sources = read_lines(data.raw("valid", SRC))
    runs = [
        ["fairseq_hrt.distill", "--data", data.bin_dir, "--path", c.path, "--src", data.raw("valid", SRC)]
        + ["--out", tmp_path / f"{name}.{TGT}", "--beam", "1", "--cpu", "--threads", "1", "--no-progress-bar"]
        for name, c in plugin.items()
    ]
    run_cli_many(runs, log_dir=tmp_path / "logs")
    for name in plugin:
        assert len(read_lines(tmp_path / f"{name}.{TGT}")) == len(sources)


# ------------------------------------------------------------------ a checkpoint that runs code


class _RunsACommand:
    """Pickled as ``os.system(COMMAND)``: what a malicious checkpoint hides among its objects."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.fixture(scope="module")
def malicious(checkpoints, tmp_path_factory):
    """``(folder, marker)``: the HRT checkpoint with one more object in its ``extra_state``,
    whose unpickling runs ``touch MARKER``; the folder has the data's dictionaries (the hub's)."""
    data, found = checkpoints
    folder = tmp_path_factory.mktemp("malicious")
    marker = folder / "MARKER"
    state = torch.load(found["hrt"].path, weights_only=True)
    state["extra_state"]["note"] = _RunsACommand(f"touch {shlex.quote(str(marker))}")
    torch.save(state, folder / "checkpoint_last.pt")
    for lang in (SRC, TGT):
        (folder / f"dict.{lang}.txt").write_bytes((data.bin_dir / f"dict.{lang}.txt").read_bytes())
    return folder, marker


def test_such_a_checkpoint_runs_its_command_when_loaded_unsafely(tmp_path):
    """The check of the test below: a checkpoint made as ``malicious`` is, loaded with
    ``weights_only=False``, does run its command."""
    marker = tmp_path / "PROBED"
    torch.save({"model": {}, "note": _RunsACommand(f"touch {shlex.quote(str(marker))}")}, tmp_path / "probe.pt")
    code = "import sys, torch; torch.load(sys.argv[1], weights_only=False)"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "probe.pt")], check=True, capture_output=True)
    assert marker.exists()


def _one_refusal_line(rc, out, option, path):
    lines = [line for line in out.splitlines() if "was not loaded" in line]
    assert rc != 0 and "Traceback" not in out and len(lines) == 1, out[-3000:]
    assert f"{option} {path} was not loaded: its pickle names posix.system" in lines[0]
    assert "load it only if you trust its source" in lines[0]


def test_a_checkpoint_that_would_run_a_command_is_refused(checkpoints, malicious, tmp_path):
    """fairseq-generate, fairseq-interactive, fairseq-train (``--restore-file``,
    ``--finetune-from-model``), the hub and the averaging refuse it in one line that names it
    (with the plugin's task; fairseq's own task refuses it too), and its command never runs."""
    data, found = checkpoints
    folder, marker = malicious
    path = str(folder / "checkpoint_last.pt")
    evil = Checkpoint(path, found["hrt"].train, PLUGIN_DECODING, True)
    runs = {
        "--path": [
            _decode_args(data, evil, "generate") + ["--target-lang", TGT, "--gen-subset", "valid", "--cpu"],
            _decode_args(data, evil, "interactive") + ["--target-lang", TGT, "--cpu"],
        ],
        "--restore-file": [evil.train_args(data.bin_dir, tmp_path / "restore", "--restore-file", path, max_update=3)],
        "--finetune-from-model": [
            evil.train_args(data.bin_dir, tmp_path / "finetune", "--finetune-from-model", path, max_update=1)
        ],
    }
    for option, commands in runs.items():
        for args in commands:
            proc = run_cli(args, check=False, input="w1 w2\n")
            _one_refusal_line(proc.returncode, proc.stdout, option, path)
    averaging = ["fairseq_hrt.average_checkpoints", "--inputs", path, found["hrt"].path, "--output", tmp_path / "a.pt"]
    proc = run_cli(averaging, check=False)
    _one_refusal_line(proc.returncode, proc.stdout, "--inputs", path)
    assert not (tmp_path / "a.pt").exists()
    # fairseq's own task has no check of the plugin's: PyTorch's safe loading refuses it (a traceback)
    stock = Checkpoint(path, None, STOCK_DECODING, False)
    proc = run_cli(_decode_args(data, stock, "generate") + ["--target-lang", TGT, "--cpu"], check=False)
    assert proc.returncode != 0 and "Weights only load failed" in proc.stdout, proc.stdout[-3000:]
    hub = run_cli(["-c", _HUB, data.bin_dir, "w1", path], check=False)
    assert hub.returncode != 0 and "compat.UnsafeCheckpoint: from_pretrained: " + path in hub.stdout, hub.stdout
    assert not marker.exists()


def test_a_stock_translation_checkpoint_exports_and_translates_as_fairseq(checkpoints, tmp_path):
    """fairseq-hrt-export takes a checkpoint of fairseq's own ``translation`` task (it has no
    ``<mask>`` nor ``<s_k>``: an AT model bans ``<pad>`` alone), and the runtime's greedy
    translations are fairseq-generate's, sentence for sentence."""
    data, found = checkpoints
    out = tmp_path / "stock-onnx"
    run_cli(["fairseq_hrt.export.exporter", found["stock"].path, out, "--data", data.bin_dir])
    assert json.loads((out / "config.json").read_text())["kind"] == "at"
    generated = run_cli(
        _decode_args(data, found["stock"], "generate")
        + ["--gen-subset", "valid", "--target-lang", TGT, "--beam", "1", "--batch-size", "4", "--cpu"]
        + ["--required-batch-size-multiple", "1"]
    ).stdout
    sources = read_lines(data.raw("valid", SRC))
    expected = [hyp for _, hyp in sorted(hyp_lines(generated).items())]
    assert Translator(str(out)).translate(sources, beam=1) == expected
