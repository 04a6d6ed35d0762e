"""The few-row kernel's split-K handoff, read off its sm_90 PTX: compiled ahead of time on the
CPU (Triton ships ptxas), since the interpreter runs one program, and each program as a whole
tensor at a time, so it cannot show an ordering between threads or programs.

Checked: the slices add their partial sums, every thread of a program has added (bar.sync)
before one thread counts the program in with an acq_rel atomic at GPU scope (the release of
the writes, the acquire of the other slices'), and in the last slice every read of the
workspace comes before any thread zeroes it: a row's sum of squares is read by every warp but
zeroed by one, and without a barrier between the two a late warp read 0."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

# (config, padded rows, flags): the tuned candidates that split K over 4-8 slices at 16 and
# 32 rows, with the pre-norm (the sum of squares in the workspace) before RoPE or SiLU * up
CASES = [((64, 64, 4, 4, 4), 16, {"ADD_NORM": True, "SILU_MUL": True}),
         ((128, 64, 8, 4, 3), 16, {"ADD_NORM": True, "ROPE": True}),
         ((128, 64, 4, 8, 3), 32, {"ADD_NORM": True, "SILU_MUL": True}),
         ((64, 64, 8, 4, 3), 32, {})]


def compiled_ptx(config, rows: int, flags: dict) -> str:
    """_rows_kernel's PTX for sm_90 (bf16 weights), from a process without the interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-m", "tests.test_rows_linear_ptx", json.dumps([config, rows, flags])],
                            cwd=root, env=env, capture_output=True, text=True, timeout=600, check=True)
    return result.stdout


def last_slice_instructions(ptx: str) -> tuple[list[str], list[str]]:
    """The instructions before and after the arrival counter's atomic."""
    lines = [line.strip() for line in ptx.splitlines()]
    code = [line for line in lines if line and not line.startswith(("//", ".loc"))]
    counter = next(i for i, line in enumerate(code) if re.search(r"\batom\.global\b.*\.add\.u32", line))
    return code[:counter + 1], code[counter:]


@pytest.mark.parametrize("config,rows,flags", CASES)
def test_split_handoff_orders_writes_reads_and_zeroing(config, rows, flags):
    before, after = last_slice_instructions(compiled_ptx(config, rows, flags))
    counter = after[0]
    assert ".acq_rel" in counter and ".gpu" in counter, counter
    adds = [i for i, line in enumerate(before) if re.search(r"\b(red|atom)\.global\..*add\.f32", line)]
    assert adds, "the partial sums are not added atomically"
    assert any("bar.sync" in line for line in before[adds[-1]:-1]), "no barrier between the adds and the count"
    reads = [i for i, line in enumerate(after) if "ld.global.cg" in line]
    stores = [i for i, line in enumerate(after) if re.search(r"\bst\.global\b", line)]
    assert len(reads) >= 2 and stores
    assert stores[0] > reads[-1], "the workspace is zeroed before it has all been read"
    assert any("bar.sync" in line for line in after[reads[-1]:stores[0]]), "no barrier between reads and zeroing"


def _arg_type(name: str) -> str:
    """A kernel argument's type: bf16 tensors, fp32 tables and workspace, int indices and counts."""
    special = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "ws_ptr": "*fp32", "squares_ptr": "*fp32", "scale_ptr": "*fp32",
               "positions_ptr": "*i64", "slots_ptr": "*i64", "count_ptr": "*i32", "eps": "fp32"}
    return special.get(name) or ("*bf16" if name.endswith("_ptr") else "i32")


def _compile(config, rows: int, flags: dict) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile as triton_compile

    from specserve.model import rows_linear
    block_n, block_k, split, warps, stages = config
    constants = {"HAS_BIAS": True, "SILU_MUL": False, "ADD_NORM": False, "ROPE": False, "ROW_SCALE": False, "HALF": 1,
                 "BLOCK_N": block_n, "BLOCK_K": block_k, "ROWS": rows, "SPLIT": split, "PRECISION": "tf32",
                 "USE_PDL": True, **flags}
    if constants["ROPE"]:
        constants["HALF"] = 64
    names = rows_linear._rows_kernel.arg_names
    signature = {name: "constexpr" if name in constants else _arg_type(name) for name in names}
    source = ASTSource(fn=rows_linear._rows_kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constants.items()})
    kernel = triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps,
                                                                              "num_stages": stages})
    return kernel.asm["ptx"]


if __name__ == "__main__":  # compiled_ptx's child process
    sys.stdout.write(_compile(*json.loads(sys.argv[1])))
