"""The commands of README.md, docs/*.md and the examples' READMEs, as written: every
option a command line of a ```bash block gives is one that command's ``--help`` lists (for
fairseq's commands, with the task, arch and criterion that line names), and every program
it runs exists. A ``torchrun`` line is two commands: torchrun's own options, checked against
torchrun's help, and the program it starts (with the options a ``sh -c`` wrapper appends)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_hrt.testing.tiny_runs import USER_DIR, cli_env, make_tiny_data, parse_logs, run_cli
from tests.tiny_data import free_port

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("examples/**/README.md")),
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("docs/*.md")),
]

FAIRSEQ = {"fairseq-train": "train", "fairseq-generate": "generate", "fairseq-interactive": "interactive"}
# the plugin's own programs: how to ask each for its help
MODULES = {
    "fairseq-hrt-export": "fairseq_hrt.export.exporter",
    "fairseq-hrt-shortlist": "fairseq_hrt.shortlist",
    "fairseq-hrt-comet": "fairseq_hrt.scoring.comet",
    "hrt-translate": "hrt_runtime.translator",
    "hrt-serve": "hrt_runtime.serve",
    "fairseq-preprocess": "fairseq_cli.preprocess",
}
# fairseq's commands run as modules (torchrun -m fairseq_cli.train): checked as the commands
FAIRSEQ_MODULES = {"fairseq_cli.train": "fairseq-train", "fairseq_cli.generate": "fairseq-generate"}
FAIRSEQ_MODULES["fairseq_cli.interactive"] = "fairseq-interactive"
RUNPY = "import runpy, sys; runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
# the options of a fairseq command line that add other options
SELECTING = ("--task", "--arch", "--criterion", "--optimizer", "--lr-scheduler", "--bpe", "--tokenizer", "--scoring")
OPTION = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")
# torchrun spells its options with hyphens and underscores alike (--nproc_per_node)
TORCHRUN_OPTION = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9_-]*)")
TORCHRUN_FLAGS = {"--no-python", "--no_python", "--standalone", "-m", "--module", "--run-path", "--run_path"}


def doc_commands():
    """``(file, command line)`` of every line of a bash block, continuations joined, comments
    and the commands around ``&&`` and pipes split off, the block's own shell variables filled in."""
    for name in DOCS:
        text = (REPO / name).read_text()
        for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
            assigned = {}  # a line of VAR=value words only: its values replace "$VAR" below it
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s#\s.*$", "", line)
                if re.fullmatch(r"\s*([A-Za-z_]\w*=\S+\s*)+", line):
                    assigned.update(word.split("=", 1) for word in line.split())
                    continue
                for variable, value in assigned.items():
                    line = line.replace(f'"${variable}"', value).replace(f"${variable}", value)
                for part in re.split(r"&&|\|(?!\|)|;", line):
                    if part.strip():
                        yield name, part.strip()


def command_words(command: str):
    """The words of a command line, without the ``VAR=value`` words before its program;
    ``None`` when the shell would not parse it."""
    command = re.sub(r"\$\(which ([\w.-]+)\)", r"\1", command)  # torchrun $(which fairseq-train)
    command = re.sub(r"\$\([^)]*\)", "X", command)
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the program
        words = words[1:]
    return words


def split_torchrun(words):
    """``(torchrun's own arguments, the command it starts)`` of a torchrun line. The command of
    ``--no-python sh -c 'exec "$@" OPTIONS' sh PROGRAM ARGS`` (docs/compatibility.md's ranks on
    fairseq's command line) is ``PROGRAM ARGS OPTIONS``."""
    i = 1
    while i < len(words) and words[i].startswith("-"):
        i += 1 if "=" in words[i] or words[i] in TORCHRUN_FLAGS else 2
    own, started = words[1:i], words[i:]
    if "-m" in own or "--module" in own:
        started = ["python", "-m", *started]
    elif started[:2] == ["sh", "-c"] and len(started) > 4:
        script = shlex.split(started[2])
        appended = script[script.index("$@") + 1 :] if "$@" in script else []
        started = started[4:] + appended
    return own, started


def program_and_args(command: str):
    """The program a command line runs (``fairseq-train``, ``python -m M``, ``python FILE``,
    ``bash FILE``, ``FILE.sh``; through ``torchrun``, the program torchrun starts) and its
    arguments; ``None`` for other lines (pip, cd, ...)."""
    words = command_words(command)
    if words and words[0] == "torchrun":
        words = split_torchrun(words)[1]
    if not words:
        return None
    if words[0] in ("python", "python3", ".venv/bin/python") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2 and words[2] in FAIRSEQ_MODULES:
            return ("program", FAIRSEQ_MODULES[words[2]]), words[3:]
        if words[1] == "-m" and len(words) > 2:
            return ("module", words[2]), words[3:]
        if words[1].endswith(".py"):
            return ("file", words[1]), words[2:]
        return None
    if words[0] == "bash" and len(words) > 1:
        return ("file", words[1]), words[2:]
    if words[0].endswith(".sh"):
        return ("file", words[0]), words[1:]
    if words[0] in FAIRSEQ or words[0] in MODULES:
        return ("program", words[0]), words[1:]
    return None


def help_text(program, args) -> str:
    kind, name = program
    if kind == "program" and name in FAIRSEQ:
        selected = []
        for flag in SELECTING:
            if flag in args:
                selected += [flag, args[args.index(flag) + 1]]
        # fairseq's own --help lists only its first parse's options (docs/compatibility.md)
        return run_cli(["fairseq_hrt.options_help", FAIRSEQ[name], "--user-dir", USER_DIR, *selected]).stdout
    if kind == "program":
        name = MODULES[name]
    if kind in ("program", "module") and not name.startswith("pytest"):
        if name.startswith(("fairseq_hrt.", "fairseq_cli.")):
            return run_cli([name, "--help"]).stdout
        return run_cli(["-c", RUNPY, name, "--help"]).stdout
    path = REPO / name
    assert path.exists(), f"{name} does not exist"
    runner = [sys.executable] if name.endswith(".py") else ["bash"]
    done = subprocess.run(
        [*runner, str(path), "--help"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def torchrun_help() -> set:
    return set(TORCHRUN_OPTION.findall(run_cli(["-c", RUNPY, "torch.distributed.run", "--help"]).stdout))


def test_every_documented_command_line_uses_options_its_help_lists():
    helps, checked, wrong = {}, 0, []
    for doc, command in doc_commands():
        words = command_words(command)
        if words and words[0] == "torchrun":
            if "torchrun" not in helps:
                helps["torchrun"] = torchrun_help()
            own = {a.split("=", 1)[0] for a in split_torchrun(words)[0] if a.startswith("--")}
            if own - helps["torchrun"]:
                wrong.append(
                    f"{doc}: {command}\n    not in torchrun's --help: {', '.join(sorted(own - helps['torchrun']))}"
                )
        found = program_and_args(command)
        if found is None or found[0] == ("module", "pytest"):
            continue
        program, args = found
        key = (program, tuple(a for f in SELECTING if f in args for a in (f, args[args.index(f) + 1])))
        if key not in helps:
            helps[key] = set(OPTION.findall(help_text(program, args)))
        given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
        missing = sorted(given - helps[key] - {"--help"})
        if missing:
            wrong.append(f"{doc}: {command}\n    not in its --help: {', '.join(missing)}")
        checked += 1
    assert not wrong, "\n".join(wrong)
    assert checked >= 25, checked


@pytest.mark.parametrize("line", [r"fairseq-train d --arch a \ ", "python -m fairseq_hrt.distill --x 1"])
def test_the_command_parser(line):
    assert program_and_args(line.rstrip("\\ "))[1][-1] in ("a", "1")


@pytest.mark.parametrize(
    "line, own, started",
    [
        (
            "torchrun --nproc_per_node 8 --nnodes=2 --no-python $(which fairseq-train) d --arch a",
            ["--nproc_per_node", "8", "--nnodes=2", "--no-python"],
            ["fairseq-train", "d", "--arch", "a"],
        ),
        (
            "torchrun --nproc-per-node 8 -m fairseq_cli.train d --arch a",
            ["--nproc-per-node", "8", "-m"],
            ["python", "-m", "fairseq_cli.train", "d", "--arch", "a"],
        ),
        (
            "OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 --no-python sh -c "
            '\'exec "$@" --distributed-rank "$RANK" --distributed-no-spawn\' sh fairseq-train d --cpu',
            ["--nproc_per_node", "2", "--no-python"],
            ["fairseq-train", "d", "--cpu", "--distributed-rank", "$RANK", "--distributed-no-spawn"],
        ),
    ],
)
def test_a_torchrun_line_is_torchruns_options_and_the_command_it_starts(line, own, started):
    assert split_torchrun(command_words(line)) == (own, started)
    assert program_and_args(line) == (("program", "fairseq-train"), started[started.index("d") :])


def test_the_quickstarts_variable_table_gives_the_scripts_defaults():
    """examples/multi30k/README.md's table of quickstart.sh's environment variables: each
    plain default is the script's ``${VAR:-default}``."""
    script = (REPO / "examples/multi30k/quickstart.sh").read_text()
    defaults = dict(re.findall(r'^([A-Z_]+)="\$\{\1:-([^$}"]*)\}"', script, re.M))
    readme = (REPO / "examples/multi30k/README.md").read_text()
    compared = 0
    for names, values in re.findall(r"^\| (`[A-Z_]+`(?:, `[A-Z_]+`)*) \| ([^|]*) \|", readme, re.M):
        names = re.findall(r"`([A-Z_]+)`", names)
        values = [v.strip().strip("`") for v in values.split(",")] if len(names) > 1 else [values.strip().strip("`")]
        for name, value in zip(names, values):
            if defaults.get(name) and " " not in value:
                assert value == defaults[name], (name, value, defaults[name])
                compared += 1
    assert compared >= 10


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_of_the_docs_reaches_a_file_and_heading():
    broken = []
    for name in DOCS:
        doc = REPO / name
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", doc.read_text()):
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists():
                broken.append(f"{name}: {target}")
            elif anchor and anchor not in {_anchor(h) for h in re.findall(r"^#+ (.*)$", path.read_text(), re.M)}:
                broken.append(f"{name}: {target}#{anchor}")
    assert not broken, broken


# The WMT recipes' READMEs: "The full run, step by step" shows recipe.py's own commands
WMT_SETUPS = ("wmt16_en_ro", "wmt14_en_de", "wmt22_e12d1")


def recipe_commands(setup: str):
    """``{step: [command, ...]}`` as ``recipe.py --print-commands`` prints them for the README's
    run (8 GPUs on one node, ``--fp16``), whitespace collapsed."""
    done = subprocess.run(
        [sys.executable, "examples/wmt/recipe.py", "--setup", setup, "--work", f"work/{setup}", "--fp16"]
        + ["--print-commands"],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    steps, step = {}, None
    for line in done.stdout.splitlines():
        header = re.match(r"# step \d+/\d+: (\w+)", line)
        if header:
            step = steps.setdefault(header.group(1), [])
        elif step is not None and line.strip() and not line.startswith("#"):
            step.append(" ".join(line.split()))
    return steps


def readme_step_commands(setup: str):
    """The command lines of the bash blocks of the README's "The full run, step by step"
    section, continuations joined and whitespace collapsed."""
    section = re.search(
        r"^## The full run, step by step\n(.*?)^## ", (REPO / f"examples/{setup}/README.md").read_text(), re.S | re.M
    )
    assert section, f"examples/{setup}/README.md has no 'The full run, step by step' section"
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", section.group(1), re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


@pytest.mark.parametrize("setup", WMT_SETUPS)
def test_the_wmt_readmes_steps_are_the_recipes_commands(setup):
    """Every command of the README's step-by-step section is one ``recipe.py --print-commands``
    prints, and every step that runs something shows one of its commands."""
    printed = recipe_commands(setup)
    shown = readme_step_commands(setup)
    assert set(printed) == set(STEPS_OF_THE_RECIPE)
    everything = {command for commands in printed.values() for command in commands}
    assert not [c for c in shown if c not in everything], [c for c in shown if c not in everything]
    unshown = [step for step, commands in printed.items() if commands and not set(commands) & set(shown)]
    assert not unshown, f"steps of recipe.py without a command in examples/{setup}/README.md: {unshown}"


STEPS_OF_THE_RECIPE = (
    "download prepare binarize teacher distill merge distill_bin at_student hrt mp average evaluate benchmark export"
).split()


def readme_torchrun_rehearsal() -> str:
    """examples/wmt14_en_de/README.md's torchrun line on CPU (gloo), continuations joined."""
    text = (REPO / "examples/wmt14_en_de/README.md").read_text()
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if "torchrun" in line and "--distributed-backend gloo" in line:
                return line.strip()
    raise AssertionError("examples/wmt14_en_de/README.md has no torchrun line with --distributed-backend gloo")


@pytest.mark.slow
def test_the_wmt_readmes_torchrun_rehearsal_trains_one_run_on_two_cpu_ranks(tmp_path):
    """The README's rehearsal of distributed training, run by bash as written, with ``$DATA`` a
    tiny corpus and ``$ARCH`` = ``hrt_tiny`` (the README's placeholders): one run of two ranks
    (each says so), whose batches are all-reduced (the first update holds more sentences than
    the same fairseq-train command's alone), each update logged once, by rank 0."""
    command = readme_torchrun_rehearsal()
    data = make_tiny_data(tmp_path / "data", n_train=300, n_valid=20)
    single = "fairseq-train " + command.split(" sh fairseq-train ", 1)[1]  # the same options, one process
    outputs = {}
    for name, line in (("torchrun", command), ("single", single)):
        cwd = tmp_path / name  # the README's relative --save-dir and --user-dir fairseq_hrt
        cwd.mkdir()
        (cwd / "fairseq_hrt").symlink_to(USER_DIR)
        env = {"DATA": data.bin_dir, "ARCH": "hrt_tiny", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": free_port()}
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])  # torchrun
        done = subprocess.run(
            ["bash", "-c", line], cwd=cwd, env=cli_env(env), capture_output=True, text=True, timeout=300
        )
        outputs[name] = done.stdout + done.stderr
        assert done.returncode == 0, outputs[name][-3000:]
    out = outputs["torchrun"]
    assert "distributed init (rank 0)" in out and "distributed init (rank 1)" in out
    assert "'distributed_world_size': 2" in out
    records = parse_logs(out)
    assert [int(r["num_updates"]) for r in records] == [1, 2, 3]  # each update logged once
    alone = parse_logs(outputs["single"])
    assert records[0]["bsz"] > alone[0]["bsz"]  # the first update holds both ranks' batches
    assert list((tmp_path / "torchrun").glob("work/wmt14_en_de/*/checkpoint_last.pt"))
