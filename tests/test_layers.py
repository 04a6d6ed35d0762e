"""The product and the lab apart: `import specserve` and importing any module of the engine
loads no benchmark (`specserve.bench`) and no lab module; no module under specserve/ imports
`lab` (the top-level folder of one-investigation instruments, which pip does not install),
at module level or inside a function; the package discovery leaves lab/ out; and every lab
instrument still imports against the product as it is."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "specserve")
# `python -m specserve.bench_serving` / `bench_offline`: the benchmarks' own entry points
BENCH_ENTRY_POINTS = {"specserve.bench_serving", "specserve.bench_offline"}

LOADED_BENCH_OR_LAB = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules
                        if m == "specserve.bench" or m.startswith("specserve.bench.") or m == "lab" or m.startswith("lab."))))
"""


def module_name(path: str) -> str:
    name = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def package_files() -> list[str]:
    return sorted(os.path.join(folder, f) for folder, _, files in os.walk(PACKAGE) for f in files if f.endswith(".py"))


def is_bench(name: str) -> bool:
    return name == "specserve.bench" or name.startswith("specserve.bench.") or name in BENCH_ENTRY_POINTS


def loaded_after_importing(names: list[str]) -> list[str]:
    """The bench and lab modules in sys.modules after a fresh interpreter imports `names`."""
    done = subprocess.run([sys.executable, "-c", LOADED_BENCH_OR_LAB, json.dumps(names)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def imported_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in the tree, inside functions too, and of every
    `importlib.import_module("...")` / `__import__("...")` with a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called in ("import_module", "__import__"):
                found.append((node.lineno, node.args[0].value))
    return found


def test_import_specserve_loads_no_bench_or_lab_module():
    assert loaded_after_importing(["specserve"]) == []


def test_importing_every_product_module_loads_no_bench_or_lab_module():
    product = [name for name in map(module_name, package_files()) if not is_bench(name)]
    assert len(product) > 50 and "specserve.engine.core" in product
    assert loaded_after_importing(product) == []


def test_no_module_under_specserve_imports_lab():
    offenders = []
    for path in package_files():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        offenders += [f"{os.path.relpath(path, ROOT)}:{line} imports {name}" for line, name in imported_names(tree)
                      if name == "lab" or name.startswith("lab.")]
    assert offenders == []


def test_the_import_scan_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from lab.policy_sim import simulate\n    import importlib\n"
                     "    importlib.import_module('lab.host_phases')\n")
    assert [name for _, name in imported_names(tree)] == ["lab.policy_sim", "importlib", "lab.host_phases"]


def test_every_lab_instrument_still_imports():
    """The lab imports the product, never the other way round: a product module renamed or
    moved shows here, not when someone next runs an instrument."""
    lab = sorted("lab." + f[:-len(".py")] for f in os.listdir(os.path.join(ROOT, "lab"))
                 if f.endswith(".py") and f != "__init__.py")
    assert len(lab) >= 15
    loaded = loaded_after_importing(lab)
    assert set(lab) <= set(loaded)


def test_pip_installs_specserve_without_the_lab():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        import tomllib
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = setuptools.find_packages(ROOT, include=include)
    assert "specserve" in packages and "specserve.bench" in packages
    assert "lab" in setuptools.find_packages(ROOT, include=["lab*"])   # a package that include= leaves out
    assert not [p for p in packages if p == "lab" or p.startswith("lab.")]
