"""random.py's counter-based uniforms in one Triton kernel on a GPU: for every element, the key
of its (seed, position, salt), then the index-th number of that key's stream.

The torch version is int64 ops, each logical shift two of them: hashing a key takes ~37
operations and a stream's number ~18 more, every one a kernel launch when a step samples
eagerly (a CPU census of a sampled plain step: 186 launching operations, ~90 of them the
hash), and ~2 us of launch gap each inside a graph. Here the words are uint64, whose
multiplication wraps and whose >> is logical: the same splitmix64 words as random.py's
int64 ones, bit for bit, and the same exact conversion of their top bits to a float
(tests/test_random_kernels.py, in Triton's interpreter). Imported on first CUDA use.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.verify.splitmix import FLOAT32_BITS, FLOAT64_BITS, GOLDEN, MUL1, MUL2, SHIFTS, signed

_GOLDEN = tl.constexpr(GOLDEN)
_MUL1 = tl.constexpr(MUL1)
_MUL2 = tl.constexpr(MUL2)
_SHIFT1 = tl.constexpr(SHIFTS[0])
_SHIFT2 = tl.constexpr(SHIFTS[1])
_SHIFT3 = tl.constexpr(SHIFTS[2])


@triton.jit
def _mix(x):
    x = (x ^ (x >> _SHIFT1)) * _MUL1
    x = (x ^ (x >> _SHIFT2)) * _MUL2
    return x ^ (x >> _SHIFT3)


@triton.jit
def _uniform_kernel(seeds_ptr, positions_ptr, index_ptr, index_s0, index_s1, out_ptr, k, positions_per_seed,
                    salt_word, MANTISSA: tl.constexpr, DOUBLE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < k
    seed = tl.load(seeds_ptr + row // positions_per_seed).to(tl.uint64, bitcast=True)
    position = tl.load(positions_ptr + row).to(tl.uint64, bitcast=True)
    key = _mix(seed + _GOLDEN)
    key = _mix(key ^ salt_word.to(tl.int64).to(tl.uint64, bitcast=True))   # an i32 argument where it fits
    key = _mix(key + position * _GOLDEN)
    index = tl.load(index_ptr + row * index_s0 + cols * index_s1, mask=live, other=0).to(tl.uint64, bitcast=True)
    top = _mix((key + index + 1) * _GOLDEN) >> (64 - MANTISSA)
    if DOUBLE:
        u = (top.to(tl.float64) + 0.5) * (0.5 ** MANTISSA)
    else:
        u = (top.to(tl.float32) + 0.5) * (0.5 ** MANTISSA)
    tl.store(out_ptr + row * k + cols, u, mask=live)


def uniform_at(seeds: torch.Tensor, positions: torch.Tensor, salt_word: int, index: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """random.uniform_at's numbers. salt_word: splitmix.salt_word(salt); index: positions' shape,
    or positions.shape + (k,) with leading dimensions that may broadcast (a block race's arange:
    read through a zero stride, not copied)."""
    per_position = index.dim() == positions.dim()
    index = index.unsqueeze(-1) if per_position else index
    k, rows = index.shape[-1], positions.numel()
    index = index.to(torch.int64).expand(*positions.shape, k).reshape(rows, k)
    positions_flat = positions.to(torch.int64).reshape(rows).contiguous()
    seeds = seeds.to(torch.int64).contiguous()
    out = torch.empty((rows, k), dtype=dtype, device=positions.device)
    double = dtype == torch.float64
    if rows and k:
        block = min(1024, triton.next_power_of_2(k))
        _uniform_kernel[(rows, triton.cdiv(k, block))](
            seeds, positions_flat, index, index.stride(0), index.stride(1), out, k, max(rows // seeds.numel(), 1),
            signed(salt_word), MANTISSA=FLOAT64_BITS if double else FLOAT32_BITS, DOUBLE=double, BLOCK=block)
    return out.view(positions.shape) if per_position else out.view(*positions.shape, k)
