"""The decode and tree-group attention kernels compile for an H100 without one
(tests/gpu_compile_check.py, in a process of its own: its kernels are defined with
TRITON_INTERPRET unset)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_attention_kernels_compile_for_an_h100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.gpu_compile_check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "cubin" in line]
    assert len(lines) == 10 and all(int(line.split("cubin ")[1].split()[0]) > 0 for line in lines), done.stdout
