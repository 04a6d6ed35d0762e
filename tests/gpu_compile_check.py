"""Compiles Triton kernels for an H100 (sm_90) through Triton's nvidia backend, down to a
cubin, on a machine with no GPU: a kernel written and tested in Triton's interpreter may
still not compile (the interpreter runs Python, not the compiler's type and layout rules).
Each command runs in a process of its own (tests/test_gpu_compile.py): kernels must be
defined with TRITON_INTERPRET unset to compile, and set to record what the CPU tests launch.

    python -m tests.gpu_compile_check attention        the attention kernels at a 1.5B's heads, bf16
    python -m tests.gpu_compile_check record OUT FILE...  (TRITON_INTERPRET=1) runs the test files and
                                                       writes each kernel specialization they launched (a
                                                       process that ran them already: start_recording)
    python -m tests.gpu_compile_check compile SPECS    compiles those; one line per failure, then a count
"""
from __future__ import annotations

import importlib
import inspect
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

H100 = GPUTarget("cuda", 90, 32)
POINTERS = {"q_ptr": "*bf16", "k_buffer": "*bf16", "v_buffer": "*bf16", "req_to_token": "*i32", "req_rows": "*i32",
            "prefix_lens": "*i32", "out_slots": "*i64", "out_ptr": "*fp32", "lse_ptr": "*fp32", "final_ptr": "*bf16",
            "counters": "*i32", "tree_mask": "*u8", "row_owner": "*i32", "qo_indptr": "*i32", "qk_scale": "fp32"}
# a Qwen2.5-1.5B layer's heads: 12 q heads on 2 kv heads of 128 dims
SHAPE = dict(HEAD_DIM=128, GROUP=6, BLOCK_N=128, BLOCK_D=128, DOT_PRECISION="tf32", MERGE_CHUNK=8, USE_PDL=True,
             BLOCK_G=8)
TENSOR_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def compile_for_h100(kernel, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 2) -> int:
    """The cubin's size of `kernel` (a JITFunction) compiled for sm_90."""
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=H100,
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return len(compiled.asm["cubin"])


def attention() -> None:
    """The decode and tree-group kernels in bf16 (the CPU tests run fp32)."""
    from specserve.attention.kernels import decode, tree_groups

    def compile_one(kernel, constexprs: dict) -> int:
        names = inspect.signature(kernel.fn).parameters
        signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in names}
        return compile_for_h100(kernel, signature, constexprs)
    for tree in (False, True):
        for store_lse in (False, True):
            size = compile_one(decode._decode_kernel, dict(SHAPE, BLOCK_H=16, TREE=tree, STORE_LSE=store_lse))
            print(f"_decode_kernel TREE={tree} STORE_LSE={store_lse}: cubin {size} bytes")
    for rows in (16, 32, 64):
        for store_lse in (False, True):
            size = compile_one(tree_groups._tree_group_kernel, dict(SHAPE, BLOCK_R=rows, STORE_LSE=store_lse))
            print(f"_tree_group_kernel BLOCK_R={rows} STORE_LSE={store_lse}: cubin {size} bytes")


def _specialization(fn, args: tuple, kwargs: dict) -> tuple[str, str, dict, dict, dict]:
    """(module, name, signature, constexprs, options) of one interpreted launch."""
    import torch
    params = inspect.signature(fn).parameters
    bound = {name: param.default for name, param in params.items()}
    bound.update(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    signature, constexprs = {}, {}
    for name, value in bound.items():
        if "constexpr" in str(params[name].annotation) or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TENSOR_TYPES[str(value.dtype).removeprefix("torch.")]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
        else:
            signature[name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return fn.__module__, fn.__name__, signature, constexprs, options


# the CPU test files whose interpreted launches are compiled (tests/test_gpu_compile.py); run_suite.py's kernel
# group runs them under the interpreter anyway, and records their launches as it goes (start_recording)
KERNEL_TEST_FILES = ("test_triton_attention.py", "test_ragged_verify_attention.py", "test_tree_kernels.py",
                     "test_fused_ops.py", "test_draft_argmax.py", "test_forecast_kernel.py", "test_random_kernels.py")
_launched: dict[str, list] = {}    # one specialization per kernel, pointer types and flags
_files_run: set[str] = set()       # the kernel test files whose launches were recorded
_current_file: list[str] = [""]    # the test file running now (conftest.py's pytest_runtest_setup)


def start_recording() -> None:
    """Records each interpreted launch of a test in KERNEL_TEST_FILES from now on, in this process: one
    per kernel, pointer types and flags (bool / str / None constexprs): sizes alone add compile time, not
    cases."""
    from triton.runtime import interpreter
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if _current_file[0] in KERNEL_TEST_FILES:
            module, name, signature, constexprs, options = _specialization(self.fn, args, kwargs)
            flags = {k: v for k, v in constexprs.items() if not isinstance(v, int) or isinstance(v, bool)}
            _launched.setdefault(json.dumps([module, name, signature, flags], sort_keys=True, default=str),
                                 [module, name, signature, constexprs, options])
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    interpreter.InterpretedFunction.run = recording_run


def test_file_started(name: str) -> None:
    _current_file[0] = name
    if name in KERNEL_TEST_FILES:
        _files_run.add(name)


def recorded_all() -> bool:
    """Whether this process recorded every file of KERNEL_TEST_FILES."""
    return _files_run >= set(KERNEL_TEST_FILES)


def write_recorded(out: str) -> int:
    with open(out, "w") as f:
        json.dump(list(_launched.values()), f, default=str)
    return len(_launched)


def record(out: str, test_files: list[str]) -> None:
    """Runs the test files under the interpreter; writes the distinct specializations they launched."""
    import pytest

    class FileTracker:
        @staticmethod
        def pytest_runtest_setup(item):
            test_file_started(item.path.name)
    start_recording()
    if pytest.main(["-q", "-p", "no:cacheprovider", *test_files], plugins=[FileTracker()]) != 0:
        raise SystemExit("the test files failed under the interpreter")
    print(f"{write_recorded(out)} specializations")


def compile_recorded(specs_path: str) -> None:
    with open(specs_path) as f:
        specs = json.load(f)
    failed = 0
    for module, name, signature, constexprs, options in specs:
        kernel = getattr(importlib.import_module(module), name)
        try:
            compile_for_h100(kernel, signature, constexprs, options.get("num_warps", 4), options.get("num_stages", 2))
        except Exception as e:   # noqa: BLE001 -- every failure is reported, then counted
            failed += 1
            print(f"FAILED {module}.{name} {json.dumps(constexprs, default=str)[:300]}: {e!r}"[:2000])
    print(f"compiled {len(specs) - failed} of {len(specs)}")


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "attention":
        attention()
    elif command == "record":
        record(sys.argv[2], sys.argv[3:])
    else:
        compile_recorded(sys.argv[2])
