"""The code's layers import one way (docs/DESIGN.md, "Layers").

Every import statement of suite/ and methods/ (top level or inside a function; not those under
`if TYPE_CHECKING:`, which never run) is an edge of a graph of the project's modules. The graph
must have no cycle, `methods` must never import `suite`, each suite module may import only its
own layer or lower ones, and reading stored results (suite.reports) must not load torch or any
method (tests/test_reports.py imports every reports module in a fresh interpreter).
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("suite", "methods")

# Lowest first. Each entry is a top-level module of suite/ or a whole package folder (a folder's
# modules share its layer: a folder is one unit). A module may import its own layer or a lower one.
LAYERS = [
    ["suite.metrics", "suite.results", "suite.bundled"],
    [
        "suite.env",
        "suite.check",
        "suite.reference",
        "suite.memtrack",
        "suite.timing",
        "suite.summary",
        "suite.tracking",
        "suite.lengths",
        "suite.perplexity",
        "suite.sim",
    ],
    ["suite.config"],
    ["suite.plan", "suite.budget"],
    ["suite.records"],
    ["suite.workloads"],
    ["suite.trial"],
    ["suite.executors"],
    [
        "suite.runner",
        "suite.calibrate",
        "suite.advise",
        "suite.sim_validation",
        "suite.conformance",
        "suite.flips",
        "suite.repeats",
    ],
    ["suite.cli", "suite.__main__", "suite", "suite.hydra_app"],
]
# Reports read stored rows only: the store and the column names, nothing that runs trials.
REPORTS_MAY_IMPORT = ("suite.metrics", "suite.results", "suite.reports")


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
                    anchor = anchor[: len(anchor) - node.level + 1]
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


def _within(module: str, entry: str) -> bool:
    """`module` is `entry` or lies in the package folder `entry`."""
    return module == entry or module.startswith(entry + ".")


def _layer(module: str) -> int:
    for i, entries in enumerate(LAYERS):
        if module in entries or any(module.startswith(e + ".") for e in entries if e != "suite"):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py: place it in docs/DESIGN.md's layers")


def _folders() -> set[str]:
    return {name for name, path in _modules().items() if path.name == "__init__.py"}


def test_no_import_cycle_in_suite_or_methods():
    assert _cycles(import_graph()) == []


def test_methods_never_import_suite():
    bad = {
        m: sorted(t for t in ts if t.split(".")[0] == "suite")
        for m, ts in import_graph().items()
        if m.split(".")[0] == "methods"
    }
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
    bad = [
        f"{m} -> {t}"
        for m, ts in graph.items()
        if _within(m, "suite.reports")
        for t in ts
        if not any(_within(t, p) for p in REPORTS_MAY_IMPORT)
    ]
    assert bad == []


def test_the_graph_sees_real_edges():
    """The checks above are only as good as the graph: it must contain edges known to exist."""
    graph = import_graph()
    assert "suite.plan" in graph["suite.runner"] and "suite.config" in graph["suite.plan"]
    assert "methods.kernels" in graph["methods.base"] and "suite.metrics" in graph["suite.records"]
    assert "methods.merge" in graph["methods.kernels"] and "methods.merge" in graph["methods.accumulators"]
    assert "suite.workloads.perplexity" in graph["suite.workloads"]  # a function-level import


def test_layers_name_whole_folders():
    """A layer holds top-level modules of suite/ and whole folders, never part of a folder: a
    folder whose modules sat in different layers (the simulator's executor and calibrate command
    once lived in suite/sim/, two layers above the simulator) reads as one unit but is not."""
    folders = _folders()
    for entries in LAYERS:
        for e in entries:
            parent = e.rpartition(".")[0]
            assert parent in ("", "suite"), f"{e}: name its folder {parent}, or move the module out of it"
            assert e in _modules(), f"{e} is not a module or folder of suite/"
    suite_folders = {f for f in folders if f.startswith("suite.") and f.count(".") == 1}
    placed = {e for entries in LAYERS for e in entries}
    assert suite_folders - {"suite.reports"} <= placed
