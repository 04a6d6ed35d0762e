"""specserve names Triton (~1 GB, used only by the GPU kernels and by the kernel tests in its
CPU interpreter) in its dev and gpu extras only, and `make test` adds the dev extra so the
kernel tests run. (On Linux x86-64 xgrammar, a dependency, names Triton itself.)"""
from __future__ import annotations

import pathlib
import subprocess

try:
    import tomllib
except ModuleNotFoundError:   # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def planned_commands(target: str, tmp_path: pathlib.Path, *variables: str) -> str:
    """What `make -n target` would run for a fresh virtual environment."""
    done = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", *variables], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout


def test_triton_is_in_the_dev_and_gpu_extras_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("triton") for d in project["dependencies"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["dev"])
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["gpu"])


def test_make_run_installs_no_dev_extra_and_make_test_does(tmp_path):
    run = planned_commands("run", tmp_path)
    assert "install -e '.'" in run and "[dev" not in run and "specserve.generate" in run
    test = planned_commands("test", tmp_path)
    assert "install -e '.'" in test and "install -e '.[dev]'" in test and "run_suite.py" in test
    gpu_run = planned_commands("run", tmp_path, "GPU=1")
    assert "install -e '.[gpu]'" in gpu_run and "[dev" not in gpu_run
    assert "install -e '.[dev,gpu]'" in planned_commands("test", tmp_path, "GPU=1")
