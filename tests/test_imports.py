"""Imports only go down: no cycle among the modules of fairseq_hrt/, runtime/hrt_runtime/ and
benchmarks/, counting imports inside functions too (every ``import`` statement of every file,
parsed, not only what importing a module runs), and the layer rules of docs/design.md."""

import ast
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parents[1]
# each package and the folder it sits in (hrt_runtime: its own distribution, runtime/)
PACKAGES = {"fairseq_hrt": REPO, "hrt_runtime": REPO / "runtime", "benchmarks": REPO}


def modules() -> Dict[str, Path]:
    found = {}
    for package, base in PACKAGES.items():
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
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {resolve(a.name) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out |= {resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in known else resolve(base) for a in node.names}
    out.discard(None)
    out.discard(name)
    return out


def import_graph() -> Dict[str, Set[str]]:
    known = modules()
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


def test_the_layer_rules_of_docs_design():
    graph = import_graph()

    def importers(prefix, of):
        return sorted(m for m, deps in graph.items() if m.startswith(prefix) and any(d.startswith(of) for d in deps))

    assert importers("hrt_runtime", "fairseq_hrt") == []
    assert importers("fairseq_hrt.export", "fairseq_hrt.hub") == []
    assert importers("fairseq_hrt.generation", "fairseq_hrt.tasks") == []
    assert importers("fairseq_hrt.models", "fairseq_hrt.generation") == []
    # export/ builds on the decoder pass; the modules of generation/ above it are the engines that
    # run its graphs (ONNX Runtime the exported ones, cuda-graph the captured encoder and
    # non-causal pass)
    assert importers("fairseq_hrt.generation", "fairseq_hrt.export") == [
        "fairseq_hrt.generation.cuda_graph",
        "fairseq_hrt.generation.onnx_engine",
    ]
    # the engine registry is below every engine and strategy
    assert graph["fairseq_hrt.generation.engines"] <= {"fairseq_hrt.generation.options", "hrt_runtime.search"}
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
