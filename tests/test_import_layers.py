"""Imports run down the house: no import circle between the package's modules, and no lower
floor imports the engine (or anything above it).

The graph is read with `ast` from every .py under specserve/: imports at module level, inside
functions and under `if TYPE_CHECKING:`, relative imports, `importlib.import_module("...")`
with a literal name, and names a package re-exports lazily through its `__getattr__` (the
arrow goes from the module that asks for the name to the module that defines it).

Nor does any circle run between the package's folders (specserve/kv/, specserve/verify/,
...; a loose module at the package root counts as a folder of its own): each folder is one
floor, however its modules import one another.

Floors, top down: the entry modules (`python -m specserve.X`, the package's own
`__init__`), `server/`, `bench/` and `training/` (they run an `Engine`), then `engine/`;
every other folder and loose module is a lower floor and may import none of those."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "specserve")

# top-level modules a user runs; they may import anything
ENTRY_MODULES = {"specserve", "specserve.cli", "specserve.launch_server", "specserve.vllm_serve", "specserve.generate",
                 "specserve.bench_serving", "specserve.bench_offline", "specserve.train_eagle",
                 "specserve.build_token_map"}
# folders above the engine or the engine itself: a lower floor imports none of them
UPPER_FOLDERS = ("specserve.engine", "specserve.server", "specserve.bench", "specserve.training")


def module_name(path: str) -> str:
    name = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def package_modules(top: str = PACKAGE) -> dict[str, tuple[ast.AST, bool]]:
    """module name -> (syntax tree, is a package's __init__), for every .py under top."""
    modules = {}
    for folder, _, files in os.walk(top):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as source:
                    modules[module_name(path)] = (ast.parse(source.read(), path), f == "__init__.py")
    return modules


def in_folder(name: str, folder: str) -> bool:
    return name == folder or name.startswith(folder + ".")


def is_upper(name: str) -> bool:
    return name in ENTRY_MODULES or any(in_folder(name, folder) for folder in UPPER_FOLDERS)


def absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if node.level == 0:
        return node.module or ""
    parts = importer.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def lazy_exports(tree: ast.AST) -> dict[str, list[str]]:
    """name -> modules a package's `__getattr__` imports it from."""
    exports: dict[str, list[str]] = {}
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef) and func.name == "__getattr__":
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    for alias in node.names:
                        exports.setdefault(alias.asname or alias.name, []).append(node.module)
    return exports


def getattr_nodes(tree: ast.AST) -> set[int]:
    return {id(node) for func in ast.walk(tree) if isinstance(func, ast.FunctionDef) and func.name == "__getattr__"
            for node in ast.walk(func)}


def raw_imports(tree: ast.AST, importer: str, is_package: bool) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every import in the tree, functions included; a
    package's own `__getattr__` re-exports are left to the modules that ask for the names."""
    skip = getattr_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, absolute(node, importer, is_package), [a.name for a in node.names]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value, []))
    return found


def import_graph(modules: dict[str, tuple[ast.AST, bool]]) -> dict[str, dict[str, int]]:
    """importer -> {imported package module: first line}: `from a import b` points at the
    module a.b when there is one, else at a (or at the module a's `__getattr__` takes b from)."""
    exports = {name: lazy_exports(tree) for name, (tree, is_package) in modules.items() if is_package}
    graph: dict[str, dict[str, int]] = {}
    for name, (tree, is_package) in modules.items():
        edges = graph.setdefault(name, {})
        for line, target, names in raw_imports(tree, name, is_package):
            targets = []
            for imported in names:
                if f"{target}.{imported}" in modules:
                    targets.append(f"{target}.{imported}")
                elif imported in exports.get(target, {}):
                    targets += exports[target][imported]
                else:
                    targets.append(target)
            for found in targets or [target]:
                if found in modules and found != name:
                    edges.setdefault(found, line)
    return graph


def missing_modules(modules: dict[str, tuple[ast.AST, bool]], importers: dict[str, tuple[ast.AST, bool]]) -> list[str]:
    """Imports, by the importers, of a package module that does not exist (a module moved and
    an import left behind, which the graph above would silently drop)."""
    return sorted(f"{name}:{line} imports {target}" for name, (tree, is_package) in importers.items()
                  for line, target, _ in raw_imports(tree, name, is_package)
                  if in_folder(target, "specserve") and target not in modules)


def circles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """(component, one circle through its first module) for each strongly connected
    component of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return [(component, circle_through(graph, component)) for component in components]


def circle_through(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One shortest path from the component's first module back to itself, inside it."""
    members, start = set(component), component[0]
    previous = {start: None}
    queue = [start]
    for node in queue:
        for child in sorted(graph[node]):
            if child == start:
                path = [node]
                while previous[path[-1]] is not None:
                    path.append(previous[path[-1]])
                return path[::-1] + [start]
            if child in members and child not in previous:
                previous[child] = node
                queue.append(child)
    raise AssertionError(f"no circle through {start}")


def describe(component: list[str], circle: list[str], graph: dict[str, dict[str, int]]) -> str:
    arrows = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:]))
    return f"{len(component)} modules in one circle ({', '.join(component)}); e.g. {arrows} -> {circle[-1]}"


def folder_of(name: str) -> str:
    """The package folder a module lives in (specserve.kv for specserve.kv.pool, for
    specserve.kv.parts.x and for specserve.kv itself); a loose module is its own."""
    return ".".join(name.split(".")[:2])


def folder_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """folder -> {folder it imports: "module:line" of the first import behind the arrow}."""
    folders: dict[str, dict[str, str]] = {}
    for importer, edges in sorted(graph.items()):
        arrows = folders.setdefault(folder_of(importer), {})
        for imported, line in sorted(edges.items()):
            if folder_of(imported) != folder_of(importer):
                arrows.setdefault(folder_of(imported), f"{importer}:{line}")
                folders.setdefault(folder_of(imported), {})
    return folders


def folder_circles(graph: dict[str, dict[str, int]]) -> list[str]:
    folders = folder_graph(graph)
    return [f"{len(component)} folders in one circle ({', '.join(component)}); e.g. "
            + " -> ".join(f"{a} ({folders[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"
            for component, circle in circles(folders)]


def upward_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    return sorted(f"{importer}:{line} imports {imported}" for importer, edges in graph.items() if not is_upper(importer)
                  for imported, line in edges.items() if is_upper(imported))


def test_no_import_circle():
    graph = import_graph(package_modules())
    found = [describe(component, circle, graph) for component, circle in circles(graph)]
    assert found == [], "\n".join(found)


def test_no_import_circle_between_folders():
    found = folder_circles(import_graph(package_modules()))
    assert found == [], "\n".join(found)


def test_no_lower_floor_imports_the_engine_or_above():
    offenders = upward_imports(import_graph(package_modules()))
    assert offenders == [], "\n".join(offenders)


def test_every_package_import_names_a_module():
    """In the package, the tests and the lab, functions included."""
    modules = package_modules()
    importers = {**modules, **package_modules(os.path.join(ROOT, "tests")), **package_modules(os.path.join(ROOT, "lab"))}
    missing = missing_modules(modules, importers)
    assert missing == [], "\n".join(missing)


def test_import_specserve_loads_no_bench_or_lab_module():
    script = "import specserve, sys; print([m for m in sys.modules if '.bench' in m or 'lab' in m])"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


# the scan itself, on small made-up trees

def graph_of(sources: dict[str, str]) -> dict[str, dict[str, int]]:
    packages = ("specserve", "specserve.kv")
    return import_graph({name: (ast.parse(text), name in packages) for name, text in sources.items()})


def test_the_scan_counts_function_level_relative_and_lazy_imports():
    graph = graph_of({
        "specserve": "def __getattr__(name):\n    if name == 'Engine':\n"
                     "        from specserve.engine.engine import Engine\n        return Engine\n",
        "specserve.engine.engine": "",
        "specserve.kv": "",
        "specserve.kv.pool": "def f():\n    from .ledger import KVLedger\n",
        "specserve.kv.ledger": "from specserve import Engine\n",
        "specserve.sampling.sampler": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from specserve.kv import pool\n",
    })
    assert graph["specserve.kv.pool"] == {"specserve.kv.ledger": 2}
    assert graph["specserve.kv.ledger"] == {"specserve.engine.engine": 1}
    assert graph["specserve.sampling.sampler"] == {"specserve.kv.pool": 3}
    assert graph["specserve"] == {}
    assert upward_imports(graph) == ["specserve.kv.ledger:1 imports specserve.engine.engine"]


def test_the_scan_finds_an_import_of_a_module_that_is_gone():
    modules = {"specserve.kv.pool": (ast.parse("def f():\n    from specserve.kv.gone import x\n"), False),
               "specserve.kv.ledger": (ast.parse("from specserve.kv.pool import f\n"), False)}
    assert missing_modules(modules, modules) == ["specserve.kv.pool:2 imports specserve.kv.gone"]


def test_the_scan_finds_a_circle_between_folders_of_modules_in_none():
    graph = graph_of({
        "specserve.kv": "", "specserve.kv.pool": "from specserve.request.req import Req\n",
        "specserve.kv.ledger": "", "specserve.request.req": "",
        "specserve.request.slots": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from specserve.kv.ledger import KVLedger\n",
    })
    assert circles(graph) == []
    assert folder_circles(graph) == [
        "2 folders in one circle (specserve.kv, specserve.request); e.g. specserve.kv "
        "(specserve.kv.pool:1) -> specserve.request (specserve.request.slots:3) -> specserve.kv"]
    assert folder_of("specserve.kv") == folder_of("specserve.kv.parts.x") == "specserve.kv"
    assert folder_of("specserve.cli") == "specserve.cli"


def test_the_scan_finds_a_circle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert circles(graph) == [(["a", "b", "c"], ["a", "b", "c", "a"])]
    assert circles({"a": {"b": 1}, "b": {}}) == []
