"""Compiles the attention kernels for an H100 (sm_90) through Triton's nvidia backend, down
to a cubin, on a machine with no GPU: a kernel written and tested in Triton's interpreter may
still not compile (the interpreter runs Python, not the compiler's type and layout rules).
Run in a process of its own (tests/test_gpu_compile.py): the kernels must be defined with
TRITON_INTERPRET unset, which the CPU tests set. Prints one line per compiled kernel."""
from __future__ import annotations

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from specserve.attention.kernels import decode, tree_groups

H100 = GPUTarget("cuda", 90, 32)
POINTERS = {"q_ptr": "*bf16", "k_buffer": "*bf16", "v_buffer": "*bf16", "req_to_token": "*i32", "req_rows": "*i32",
            "prefix_lens": "*i32", "out_slots": "*i64", "out_ptr": "*fp32", "lse_ptr": "*fp32", "final_ptr": "*bf16",
            "counters": "*i32", "tree_mask": "*u8", "row_owner": "*i32", "qo_indptr": "*i32", "qk_scale": "fp32"}
# a Qwen2.5-1.5B layer's heads: 12 q heads on 2 kv heads of 128 dims
SHAPE = dict(HEAD_DIM=128, GROUP=6, BLOCK_N=128, BLOCK_D=128, DOT_PRECISION="tf32", MERGE_CHUNK=8, USE_PDL=True,
             BLOCK_G=8)


def compile_for_h100(kernel, constexprs: dict) -> int:
    """Compiles `kernel` with every other argument an int32 unless POINTERS names it; the cubin's size."""
    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=H100,
                              options={"num_warps": 4, "num_stages": 2})
    return len(compiled.asm["cubin"])


def main() -> None:
    for tree in (False, True):
        for store_lse in (False, True):
            size = compile_for_h100(decode._decode_kernel, dict(SHAPE, BLOCK_H=16, TREE=tree, STORE_LSE=store_lse))
            print(f"_decode_kernel TREE={tree} STORE_LSE={store_lse}: cubin {size} bytes")
    for rows in (16, 32, 64):
        for store_lse in (False, True):
            size = compile_for_h100(tree_groups._tree_group_kernel, dict(SHAPE, BLOCK_R=rows, STORE_LSE=store_lse))
            print(f"_tree_group_kernel BLOCK_R={rows} STORE_LSE={store_lse}: cubin {size} bytes")


if __name__ == "__main__":
    main()
