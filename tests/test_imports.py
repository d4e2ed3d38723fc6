"""The house rules on imports, checked two ways: by importing modules in a fresh interpreter
and looking at sys.modules (what loading really pulls in), and by the import graph built
from each product module's own import statements (parsed with ast, so imports inside
functions count too; those under `if TYPE_CHECKING:` never run and do not).

- scheduler/ imports neither torch nor ray (nor numpy, workers, cluster);
- in workers/ only the actor module imports ray;
- nothing but cluster/cli.py imports cluster.bench;
- no import cycles among product modules;
- benchmarks/ scripts import only public names of the product.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "workers", "scheduler")
CLI, BENCH = "cluster.cli", "cluster.bench"


# ---- the product's modules and their import graph --------------------------------------

def product_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the product packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Import statements anywhere in the tree except under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_names(module: str, path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) for everything `module` imports: the modules of `import a.b` and
    `from a import b`, and `a.b` itself for the latter (b may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:  # relative: resolve against this module's package
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        names.append((base, node.lineno))
        names += [(f"{base}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return names


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    """module -> {product module it imports: line of the first such import}."""
    modules = product_modules()
    edges: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges[module] = {}
        for name, line in imported_names(module, path):
            if name in modules and name != module:
                edges[module].setdefault(name, line)
    return edges


@pytest.fixture(scope="module")
def all_imports() -> dict[str, list[tuple[str, int]]]:
    return {m: imported_names(m, p) for m, p in product_modules().items()}


def _top(name: str) -> str:
    return name.split(".")[0]


def test_the_graph_sees_the_product():
    modules = product_modules()
    assert {"scheduler.scheduler", "workers.actor", "workers.runner", CLI, BENCH, "cluster.core.engine"} <= set(modules)


def test_scheduler_imports_nothing_heavy_or_of_the_other_packages(all_imports):
    bad = [f"{m}:{line} imports {n}" for m, names in all_imports.items() if _top(m) == "scheduler"
           for n, line in names if _top(n) in ("torch", "ray", "numpy", "workers", "cluster")]
    assert bad == []


def test_in_workers_only_the_actor_module_imports_ray(all_imports):
    bad = [f"{m}:{line} imports {n}" for m, names in all_imports.items() if _top(m) == "workers"
           and m != "workers.actor" for n, line in names if _top(n) == "ray"]
    assert bad == []
    assert any(_top(n) == "ray" for n, _ in all_imports["workers.actor"])  # the rule names the right module


def test_only_the_cli_imports_the_bench(graph):
    importers = sorted(m for m, targets in graph.items()
                       if not (m == BENCH or m.startswith(BENCH + ".")) and any(
                           t == BENCH or t.startswith(BENCH + ".") for t in targets))
    assert importers == [CLI]


def _in(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def test_the_engine_core_imports_neither_the_http_layer_nor_the_remote_engine(all_imports):
    bad = [f"{m}:{line} imports {n}" for m, names in all_imports.items() if _in(m, "cluster.core")
           for n, line in names if _in(n, "cluster.openai") or _in(n, "cluster.remote")]
    assert bad == []
    assert any(_in(m, "cluster.core") for m in all_imports)  # the rule looks at the right modules


def test_the_http_layer_imports_no_ray(all_imports):
    bad = [f"{m}:{line} imports {n}" for m, names in all_imports.items() if _in(m, "cluster.openai")
           for n, line in names if _top(n) == "ray"]
    assert bad == []
    assert any(_in(m, "cluster.openai") for m in all_imports)


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle_and_passes_a_chain():
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {}}) == []


def test_no_import_cycles_among_product_modules(graph):
    # each cycle as the imports inside it: "a:12 imports b"
    described = [[f"{m}:{line} imports {n}" for m in c for n, line in graph[m].items() if n in c]
                 for c in _cycles(graph)]
    assert described == []


# ---- what loading really pulls in --------------------------------------------------------

def _loaded_after_importing(modules: list[str], watch: tuple[str, ...]) -> dict[str, list[str]]:
    """For each module, imported in order in one fresh interpreter, the watched top-level
    packages that first appeared in sys.modules when it was imported."""
    code = (
        "import importlib, json, sys\n"
        f"watch = {watch!r}\n"
        "seen, out = set(), {}\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "    now = {n for n in sys.modules if n.split('.')[0] in watch or n.startswith('cluster.bench')}\n"
        "    out[m] = sorted(now - seen)\n"
        "    seen |= now\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_scheduler_pulls_in_neither_torch_nor_ray():
    modules = sorted(m for m in product_modules() if _top(m) == "scheduler")
    loaded = _loaded_after_importing(modules, ("torch", "ray", "numpy", "workers", "cluster"))
    assert {m: v for m, v in loaded.items() if v} == {}


def test_importing_workers_but_the_actor_leaves_ray_out_and_cluster_leaves_the_bench_out():
    modules = product_modules()
    workers = sorted(m for m in modules if _top(m) == "workers" and m != "workers.actor")
    rest = sorted(m for m in modules if _top(m) == "cluster" and m != CLI and not m.startswith(BENCH))
    loaded = _loaded_after_importing(workers + ["workers.actor"] + rest, ("ray",))
    assert {m: v for m, v in loaded.items() if m in workers and v} == {}
    assert "ray" in loaded["workers.actor"]  # the watch works: the actor module does import it
    bench = [f"{m}: {v}" for m, v in loaded.items() if any(n.startswith(BENCH) for n in v)]
    assert bench == []


# ---- benchmarks/ --------------------------------------------------------------------------

def test_benchmark_scripts_import_only_public_product_names():
    modules = product_modules()
    bad = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and _top(node.module or "") in PACKAGES:
                if node.module not in modules:
                    bad.append(f"{path.name}:{node.lineno} imports from {node.module}, not a product module")
                bad += [f"{path.name}:{node.lineno} imports private {node.module}.{a.name}"
                        for a in node.names if a.name.startswith("_")]
    assert bad == []
