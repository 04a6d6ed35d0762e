"""`--help` of the training entry points answers without loading torch or transformers (a
cold import of them took ~16 s on a busy 2-core machine): the flags are read first, the
heavy modules only once a run starts."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HELP_WITHOUT_HEAVY_IMPORTS = """
import runpy, sys
sys.argv = ["{module}", "--help"]
try:
    runpy.run_module("{module}", run_name="__main__")
except SystemExit as exit:
    assert exit.code == 0, exit.code
heavy = sorted(name for name in ("torch", "transformers", "triton") if name in sys.modules)
assert not heavy, heavy
"""


@pytest.mark.parametrize("module, flag", [("specserve.train_eagle", "--time-budget"),
                                          ("specserve.build_token_map", "--size")])
def test_help_loads_no_torch(module, flag):
    done = subprocess.run([sys.executable, "-c", HELP_WITHOUT_HEAVY_IMPORTS.format(module=module)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert flag in done.stdout
