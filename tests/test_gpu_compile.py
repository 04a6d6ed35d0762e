"""Triton kernels compile for an H100 without one (tests/gpu_compile_check.py, each step in a
process of its own): the attention kernels at a real model's heads in bf16, and every kernel
specialization the CPU kernel tests launch in the interpreter: recorded as they ran where this
file runs last in run_suite.py's kernel group (conftest.py), else by running them again."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def check(*args: str, interpret: bool = False) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-m", "tests.gpu_compile_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def test_the_attention_kernels_compile_for_an_h100_in_bf16():
    lines = [line for line in check("attention").splitlines() if "cubin" in line]
    assert len(lines) == 10 and all(int(line.split("cubin ")[1].split()[0]) > 0 for line in lines), lines


@pytest.mark.after_kernel_tests
def test_every_kernel_the_cpu_tests_launch_compiles_for_an_h100(tmp_path):
    from tests import gpu_compile_check   # (imports Triton: not at collection, before a kernel file sets its mode)
    specs = tmp_path / "specs.json"
    if os.environ.get("SPECSERVE_RECORD_KERNEL_SPECS") == "1" and gpu_compile_check.recorded_all():
        count = recorded = gpu_compile_check.write_recorded(str(specs))
    else:
        files = [f"tests/{name}" for name in gpu_compile_check.KERNEL_TEST_FILES]
        recorded = check("record", str(specs), *files, interpret=True)
        count = int(recorded.strip().splitlines()[-1].split()[0])
    assert count >= 20, str(recorded)[-2000:]   # decode, extend, tree groups, trees, fused ops, draft argmax, forecast, uniforms
    compiled = check("compile", str(specs))
    assert compiled.strip().splitlines()[-1] == f"compiled {count} of {count}", compiled[-3000:]
