"""The code's layers import one way (docs/DESIGN.md, "Layers").

Every import statement of suite/ and methods/ (top level or inside a function; not those under
`if TYPE_CHECKING:`, which never run) is an edge of a graph of the project's modules. The graph
must have no cycle, `methods` must never import `suite`, each suite module may import only its
own layer or lower ones, and reading stored results (suite.reports) must not load torch or any
method (tests/test_reports.py imports every reports module in a fresh interpreter).
"""
import ast
import fnmatch
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("suite", "methods")

# Lowest first. A module may import modules of its own layer or of a lower one.
LAYERS = [
    ["suite.metrics", "suite.results"],
    ["suite.env", "suite.check", "suite.memtrack", "suite.timing", "suite.summary", "suite.tracking", "suite.lengths",
     "suite.perplexity.*", "suite.sim.topology", "suite.sim.trace", "suite.sim.engine", "suite.sim.compute",
     "suite.sim.memory",
     "suite.sim"],
    ["suite.config"],
    ["suite.plan"],
    ["suite.records"],
    ["suite.workloads", "suite.workloads.*"],
    ["suite.trial"],
    ["suite.executors", "suite.executors.*", "suite.sim.executor"],
    ["suite.runner", "suite.sim.calibrate", "suite.advise"],
    ["suite.cli", "suite.__main__", "suite", "suite.hydra_app"],
]
# Reports read stored rows only: the store and the column names, nothing that runs trials.
REPORTS_MAY_IMPORT = ("suite.metrics", "suite.results", "suite.reports", "suite.reports.*")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _runtime_imports(tree: ast.AST):
    """Import nodes that execute (skipping `if TYPE_CHECKING:` bodies)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the module pkg.sub when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a non-module attribute: its module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> int:
    for i, patterns in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: place it in docs/DESIGN.md's layers")


def test_no_import_cycle_in_suite_or_methods():
    assert _cycles(import_graph()) == []


def test_methods_never_import_suite():
    bad = {m: sorted(t for t in ts if t.split(".")[0] == "suite")
           for m, ts in import_graph().items() if m.split(".")[0] == "methods"}
    assert not {m: ts for m, ts in bad.items() if ts}


def test_suite_imports_only_downward():
    upward = []
    for mod, targets in import_graph().items():
        if not mod.startswith("suite") or mod.startswith("suite.reports"):
            continue
        for t in targets:
            if t.startswith("suite") and not t.startswith("suite.reports") and _layer(t) > _layer(mod):
                upward.append(f"{mod} -> {t}")
    assert upward == []


def test_reports_import_only_the_store_schema():
    graph = import_graph()
    bad = [f"{m} -> {t}" for m, ts in graph.items() if m.startswith("suite.reports") for t in ts
           if not any(fnmatch.fnmatchcase(t, p) for p in REPORTS_MAY_IMPORT)]
    assert bad == []


def test_the_graph_sees_real_edges():
    """The checks above are only as good as the graph: it must contain edges known to exist."""
    graph = import_graph()
    assert "suite.plan" in graph["suite.runner"] and "suite.config" in graph["suite.plan"]
    assert "methods.kernels" in graph["methods.base"] and "suite.metrics" in graph["suite.records"]
    assert "methods.merge" in graph["methods.kernels"] and "methods.merge" in graph["methods.accumulators"]
    assert "suite.workloads.perplexity" in graph["suite.workloads"]  # a function-level import
