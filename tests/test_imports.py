"""Imports only go down: no cycle among the modules of fairseq_hrt/, runtime/hrt_runtime/ and
benchmarks/, counting imports inside functions too (every ``import`` statement of every file,
parsed, not only what importing a module runs), what a package's ``__init__`` imports (importing
``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first), a module's import of its own package
root (``from fairseq_hrt import X`` inside fairseq_hrt/ runs the root's ``__init__``, whose
imports may lead back to the module), and the layer rules of docs/design.md. A second test
imports every module of fairseq_hrt/ and hrt_runtime/ in a fresh interpreter, records each
import as it happens (``__import__`` and ``importlib.import_module``, whoever calls them) and
checks the observed edges for cycles too. The last ones check that importing the plugin (as
Python and as fairseq's ``--user-dir`` do) loads its task, models and criterion and none of the
decoding engines, export or ONNX, which a run loads when it asks for them."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Set

REPO = Path(__file__).resolve().parents[1]
# each package and the folder it sits in (hrt_runtime: its own distribution, runtime/)
PACKAGES = {"fairseq_hrt": REPO, "hrt_runtime": REPO / "runtime", "benchmarks": REPO}


def modules(packages: Dict[str, Path] = PACKAGES) -> Dict[str, Path]:
    found = {}
    for package, base in packages.items():
        for path in sorted((base / package).rglob("*.py")):
            if "results" in path.relative_to(base).parts:
                continue
            name = ".".join(path.relative_to(base).with_suffix("").parts)
            found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def imports_of(name: str, path: Path, known) -> Set[str]:
    """The modules of ``known`` that the file imports anywhere (``from a import b``: ``a.b``
    when that is a module, else ``a``; relative imports resolved)."""

    def resolve(target: str):
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out |= {resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in known else resolve(base) for a in node.names}
    if path.name == "__init__.py" and imports_its_modules_by_importlib(tree):
        out |= {m for m in known if m.rpartition(".")[0] == name}
    out.discard(None)
    return with_packages(name, out, known)


def imports_its_modules_by_importlib(tree: ast.AST) -> bool:
    """Whether a package's ``__init__`` imports modules named ``f"{__name__}.<..>"`` by
    ``importlib.import_module`` (``generation/__init__``: every module of the package)."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.JoinedStr)
            and any(
                isinstance(v, ast.FormattedValue) and getattr(v.value, "id", "") == "__name__"
                for v in node.args[0].values
            )
        ):
            return True
    return False


def with_packages(name: str, targets: Iterable[str], known) -> Set[str]:
    """``targets`` and the packages above each (importing ``a.b.c`` runs ``a.b``'s ``__init__``
    first), less ``name`` and the packages above ``name`` that only this implicit rule adds (a
    module's own packages are being imported when it is). A target that is one of ``name``'s own
    packages stays: ``from fairseq_hrt import X`` (``X`` not a module) inside ``fairseq_hrt``
    runs the root's ``__init__`` and whatever it imports, which may lead back to ``name``."""
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    out = set()
    for target in targets:
        parts = target.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts))} - own
        out.add(target)
    return {m for m in out if m in known and m != name}


def import_graph(packages: Dict[str, Path] = PACKAGES) -> Dict[str, Set[str]]:
    known = modules(packages)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_function_level_imports_included():
    assert cycles(import_graph()) == []


# Run in a fresh interpreter: imports every module named on stdin, recording each import as it
# happens (the importer: the caller's module, whether it is running at the top level or in a
# function), and prints the edges among the modules of fairseq_hrt and hrt_runtime as JSON.
RECORDER = r"""
import builtins, importlib, json, sys

OURS = ("fairseq_hrt", "hrt_runtime")
edges = set()


def record(importer, target):
    if importer and target and importer.split(".")[0] in OURS and target.split(".")[0] in OURS:
        edges.add((importer, target))


def absolute(name, globals_, level):
    if not level:
        return name
    package = (globals_ or {}).get("__package__") or ""
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{name}" if name else base


real_import = builtins.__import__


def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    module = real_import(name, globals, locals, fromlist, level)
    importer = (globals or {}).get("__name__")
    target = absolute(name, globals, level)
    submodules = [f"{target}.{item}" for item in fromlist or () if f"{target}.{item}" in sys.modules]
    # "from pkg import submodule" needs the submodule; "import pkg" or "from pkg import name"
    # needs what pkg's __init__ makes
    if len(submodules) < len(fromlist or ()) or not fromlist:
        record(importer, target)
    for submodule in submodules:
        record(importer, submodule)
    return module


real_import_module = importlib.import_module


def recording_import_module(name, package=None):
    module = real_import_module(name, package)
    record(sys._getframe(1).f_globals.get("__name__"), module.__name__)
    return module


builtins.__import__ = recording_import
importlib.import_module = recording_import_module
for name in sys.stdin.read().split():
    importlib.import_module(name)
print(json.dumps(sorted(edges)))
"""


def _python(code: str, *args: str, stdin: str = "", pythonpath=(os.environ.get("PYTHONPATH", ""),)):
    """``code`` run by a fresh interpreter seeing the repository and the runtime (and ``pythonpath``);
    it must succeed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "runtime"), *pythonpath]))
    done = subprocess.run(
        [sys.executable, "-c", code, *args], input=stdin, capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def observed_import_graph(names: List[str]) -> Dict[str, Set[str]]:
    """The import edges seen while a fresh interpreter imports ``names``, with the packages
    above each imported module (:func:`with_packages`)."""
    done = _python(RECORDER, stdin=" ".join(names))
    known = modules()
    graph: Dict[str, Set[str]] = {name: set() for name in known}
    for importer, target in json.loads(done.stdout.strip().splitlines()[-1]):
        if importer in graph:
            graph[importer] |= with_packages(importer, [target], known)
    return graph


def test_no_import_cycle_among_the_imports_that_happen():
    """What static parsing cannot see (an import by importlib, a package's ``__init__`` run by
    importing one of its modules) is seen here: importing every module of fairseq_hrt/ and
    hrt_runtime/ makes no cycle."""
    names = [m for m in modules() if not m.startswith("benchmarks") and not m.endswith("__main__")]
    graph = observed_import_graph(names)
    assert graph["fairseq_hrt.generation"] == set()  # the registries import engines and strategies on use
    assert "fairseq_hrt.export.exporter" in graph["fairseq_hrt.generation.onnx_engine"]
    assert cycles(graph) == []


def test_a_loop_through_a_package_root_is_a_cycle(tmp_path):
    """``pkg/__init__`` imports ``pkg.tasks``, which imports ``pkg.engines.engine``, which takes
    a name from ``pkg`` itself (as the exporter once imported the plugin's root): a cycle,
    though ``pkg`` is the engine's own package. Taking a submodule from the root is none."""
    files = {
        "pkg/__init__.py": "from pkg import tasks\nVERSION = '1'\n",
        "pkg/tasks.py": "from pkg.engines import engine\n",
        "pkg/engines/__init__.py": "",
        "pkg/engines/engine.py": "from pkg import VERSION\n",
        "pkg/engines/other.py": "from pkg import tasks\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph({"pkg": tmp_path})
    assert "pkg" in graph["pkg.engines.engine"] and "pkg" not in graph["pkg.engines.other"]
    assert cycles(graph) == [["pkg", "pkg.engines.engine", "pkg.tasks"]]


def test_the_layer_rules_of_docs_design():
    graph = import_graph()

    def importers(prefix, of):
        return sorted(m for m, deps in graph.items() if m.startswith(prefix) and any(d.startswith(of) for d in deps))

    assert importers("hrt_runtime", "fairseq_hrt") == []
    assert importers("fairseq_hrt.export", "fairseq_hrt.hub") == []
    assert importers("fairseq_hrt.generation", "fairseq_hrt.tasks") == []
    assert importers("fairseq_hrt.models", "fairseq_hrt.generation") == []
    # export/ builds on the decoder pass; of generation/, only engines that run its graphs may
    # import it (ONNX Runtime the exported ones)
    assert set(importers("fairseq_hrt.generation", "fairseq_hrt.export")) <= {
        "fairseq_hrt.generation.cuda_graph",
        "fairseq_hrt.generation.onnx_engine",
    }
    # the engine registry is below every engine and strategy
    assert graph["fairseq_hrt.generation.engines"] <= {
        "fairseq_hrt.generation.options",
        "fairseq_hrt.generation.registry",
        "fairseq_hrt.cli_logging",  # RefusedOptions
        "hrt_runtime.search",
        "hrt_runtime",
    }
    # export/ builds on passes/ (the decoder pass, the search rules), never on generation/, whose
    # engines import export/
    assert importers("fairseq_hrt.export", "fairseq_hrt.generation") == []
    assert importers("fairseq_hrt.passes", "fairseq_hrt.generation") == []
    assert importers("fairseq_hrt.passes", "fairseq_hrt.export") == []
    assert importers("fairseq_hrt", "benchmarks") == [] and importers("hrt_runtime", "benchmarks") == []
    # the runtime's search and its ONNX Runtime backend meet at the backend contract only
    assert "hrt_runtime.model" not in graph["hrt_runtime.search"]
    assert "hrt_runtime.search" not in graph["hrt_runtime.model"]


def test_benchmarks_import_nothing_of_the_tests():
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n == "tests" or n.startswith("tests.") or n == "tiny_data" for n in names), path
    assert not (REPO / "benchmarks" / "tiny_data.py").exists()  # the tests' harness is tests/tiny_data.py


def _imported_roots(path: Path) -> Set[str]:
    """The top-level names every ``import`` statement of the file names (function level too)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _names_an_example(path: Path) -> bool:
    """Whether the file's code (docstrings aside) makes a path into examples/, as running one of
    its scripts does: ``REPO / "examples" / ...``, ``os.path.join(..., "examples", ...)`` or a
    string ``"examples/..."``."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }

    def is_examples(node) -> bool:
        return isinstance(node, ast.Constant) and node.value == "examples"

    for node in ast.walk(tree):
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and (is_examples(node.left) or is_examples(node.right))
        ):
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "join" and any(map(is_examples, node.args)):
            return True
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and node.value.startswith("examples/")
        ):
            return True
    return False


def test_imports_go_one_way_between_the_plugin_benchmarks_tests_and_examples():
    """examples/ may run benchmarks, tests may import benchmarks and the shared harness
    (fairseq_hrt/testing/), never the other way round: no module of benchmarks/ imports tests/
    or examples/ or runs an example, and the plugin and the runtime import none of the three."""
    checkout_only = {"benchmarks", "tests", "examples", "tiny_data"}
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        if "results" in path.relative_to(REPO).parts:
            continue
        assert not _imported_roots(path) & {"tests", "examples", "tiny_data"}, path
        assert not _names_an_example(path), f"{path} runs a script of examples/"
    for base in (REPO / "fairseq_hrt", REPO / "runtime" / "hrt_runtime"):
        for path in sorted(base.rglob("*.py")):
            assert not _imported_roots(path) & checkout_only, path
            assert not _names_an_example(path), f"{path} runs a script of examples/"
    assert not (REPO / "benchmarks" / "tiny_runs.py").exists()  # the shared harness: fairseq_hrt/testing/
    # among the tests, only the examples' own (and the documented commands', which include the
    # examples' READMEs) run or load examples/ code
    runs_examples = {
        p.name for p in (REPO / "tests").rglob("*.py") if p.name != Path(__file__).name and _names_an_example(p)
    }
    assert runs_examples <= EXAMPLE_TESTS, sorted(runs_examples - EXAMPLE_TESTS)


EXAMPLE_TESTS = {
    "test_recipe.py",
    "test_recipe_end_to_end.py",
    "test_recipe_killed.py",
    "test_quickstart.py",
    "test_docs_commands.py",
    "test_wmt_download.py",
    "test_wmt_recipe.py",
    "test_wmt_prepare.py",
    "test_wmt_recipe_steps.py",
    "test_wmt_slice.py",
    "test_slurm_cluster.py",
}


# Run in a fresh interpreter: load the plugin as argv[1] says ("import": ``import fairseq_hrt``;
# "user-dir": fairseq's --user-dir loading of argv[2]; "lean": the import, then the lean engine as
# a run asks for it; "decode": a decoding with fairseq-generate's defaults) and print what is
# loaded and registered.
LOADER = r"""
import json, sys
from argparse import Namespace

how = sys.argv[1]
if how == "user-dir":
    from fairseq import utils
    utils.import_user_module(Namespace(user_dir=sys.argv[2]))
else:
    import fairseq_hrt
if how == "lean":
    from fairseq_hrt.generation.engines import get_engine
    get_engine("lean")
if how == "decode":  # fairseq-generate's defaults (--decoding auto, lean) on an HRT model
    import tempfile
    from tests.hrt_fixtures import build_generator, build_task_and_model, make_sample
    with tempfile.TemporaryDirectory() as data_dir:
        task, model = build_task_and_model(data_dir)
        _, generator = build_generator(data_dir, model, "--max-len-b", "4")
        task.inference_step(generator, [model], make_sample(task, [[1, 2, 3]]))
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY
from torch.optim import optimizer
print(json.dumps({
    "modules": sorted(sys.modules),
    "optimizer_hooks": len(optimizer._global_optimizer_pre_hooks) + len(optimizer._global_optimizer_post_hooks),
    "excepthook": sys.excepthook is sys.__excepthook__,
    "task": "hrt_translation" in TASK_REGISTRY,
    "criterion": "hrt_loss" in CRITERION_REGISTRY,
    "archs": sorted(a for a in ARCH_MODEL_REGISTRY if a.split("_")[0] in ("hrt", "at", "cmlm")),
}))
"""

# what a run loads when it asks for it, never importing the plugin: the engines, the strategies,
# export and ONNX (Runtime), the Python API
LOADED_ON_USE = (
    "onnx",
    "onnxruntime",
    "fairseq_hrt.export",
    "fairseq_hrt.generation.cuda_graph",
    "fairseq_hrt.generation.onnx_engine",
    "fairseq_hrt.generation.lean",
    "fairseq_hrt.generation.fairseq_engine",
    "fairseq_hrt.generation.hrt_generator",
    "fairseq_hrt.generation.jacobi",
    "fairseq_hrt.generation.mask_predict",
    "fairseq_hrt.hub",
)


def _loaded(how: str) -> dict:
    done = _python(LOADER, how, str(REPO / "fairseq_hrt"), pythonpath=())
    return json.loads(done.stdout.strip().splitlines()[-1])


def _of(modules: List[str], names) -> List[str]:
    return [m for m in modules if any(m == n or m.startswith(n + ".") for n in names)]


def test_importing_the_plugin_registers_its_components_and_loads_no_engine_export_or_onnx():
    """... and adds no global optimizer hook (the task counts its own steps) and, outside a
    fairseq command line, leaves ``sys.excepthook`` alone."""
    for how in ("import", "user-dir"):
        loaded = _loaded(how)
        assert loaded["task"] and loaded["criterion"], how
        archs = {"hrt_tiny", "at_tiny", "cmlm_tiny", "hrt_e12d1", "at_e12d1"}
        assert archs <= set(loaded["archs"]), (how, loaded["archs"])
        assert _of(loaded["modules"], LOADED_ON_USE) == [], how
        assert loaded["optimizer_hooks"] == 0 and loaded["excepthook"], how


def test_a_run_that_asks_for_an_engine_loads_that_one():
    modules = _loaded("lean")["modules"]
    assert _of(modules, LOADED_ON_USE) == ["fairseq_hrt.generation.lean"]
    # --decoding auto asks every strategy whether it claims the model; no other engine, no export
    modules = _loaded("decode")["modules"]
    assert _of(modules, LOADED_ON_USE) == [
        "fairseq_hrt.generation.hrt_generator",
        "fairseq_hrt.generation.jacobi",
        "fairseq_hrt.generation.lean",
        "fairseq_hrt.generation.mask_predict",
    ]
