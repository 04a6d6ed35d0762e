"""Triton kernels compile for an H100 without one (tests/gpu_compile_check.py, each step in a
process of its own): the attention kernels at a real model's heads in bf16, and every kernel
specialization the CPU kernel tests launch in the interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the tests whose kernels run in the interpreter (gemv and the few-row linears: test_rows_linear_ptx)
KERNEL_TESTS = ["tests/test_triton_attention.py", "tests/test_ragged_verify_attention.py", "tests/test_tree_kernels.py",
                "tests/test_fused_ops.py", "tests/test_draft_argmax.py", "tests/test_forecast_kernel.py",
                "tests/test_random_kernels.py"]


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


def test_every_kernel_the_cpu_tests_launch_compiles_for_an_h100(tmp_path):
    specs = tmp_path / "specs.json"
    recorded = check("record", str(specs), *KERNEL_TESTS, interpret=True)
    count = int(recorded.strip().splitlines()[-1].split()[0])
    assert count >= 20, recorded[-2000:]   # decode, extend, tree groups, trees, fused ops, draft argmax, forecast, uniforms
    compiled = check("compile", str(specs))
    assert compiled.strip().splitlines()[-1] == f"compiled {count} of {count}", compiled[-3000:]
