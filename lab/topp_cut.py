"""A sort-free top-k / top-p cut for the sampling filters, timed against the sort:

    python -m lab.topp_cut --batch-sizes 1 8 64 --vocab 151936

At 64 requests x 151,936 tokens the filters' sort and its ~30 full passes took 2.2 ms of a
sampled plain step on an H100 (lab/sampling_cost.py, 2026-12-07). This is the candidate for
issue 55's sampled steps, kept here until a GPU has timed it.

The cut's definition is exact on every device: masses as integers, q = floor(p * 2**24) (int32 sums,
the same whatever their order), the tokens ranked by probability with ties by
lowest id, a row's top-k total Q, the target T = floor(top_p * Q) (at least 1; no cut where
top_p >= 1), and a rank kept where it is below top_k and the mass ranked before it is below T.
`sorted_keep` is that definition through a stable sort and an int64 cumsum (a CPU's way);
`radix_keep` finds the same cut without sorting: a program a row, a radix select over the
probabilities' float bits in 4-bit digits (8 passes of a 16-bin histogram of counts and masses),
once for the top-k total (where top_k cuts) and once for the smallest kept value, then a pass
that keeps every token above it and the first tied ones by id. The two masks must be equal
(tests/test_topp_cut.py, Triton's interpreter); the run prints whether they are on the GPU.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from lab.extend_attention_sweep import graphed_ms

SCALE = 2.0 ** 24      # q = floor(p * SCALE): p <= 1, so a row's total (<= 2**24 + V) fits in int32
DIGIT_BITS = 4
LEVELS = 32 // DIGIT_BITS
NO_CUT = 2 ** 30       # T where top_p >= 1: above any total


def quantized(probs: torch.Tensor) -> torch.Tensor:
    return torch.floor(probs.double() * SCALE).to(torch.int64)   # int32 would do; int64 sums on the CPU


def sorted_keep(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """The cut through a stable sort: (rows, V) bool."""
    rows, vocab = probs.shape
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    q = quantized(ranked)
    rank = torch.arange(vocab, device=probs.device)
    k = torch.where((top_ks <= 0) | (top_ks > vocab), vocab, top_ks).to(torch.int64).unsqueeze(1)
    in_k = rank < k
    total = torch.where(in_k, q, 0).sum(-1)
    target = torch.where(top_ps >= 1, NO_CUT, (top_ps.double() * total.double()).floor().to(torch.int64).clamp(min=1))
    before = q.cumsum(-1) - q
    keep_ranked = in_k & (before < target.unsqueeze(1))
    return torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked)


@triton.jit
def _histogram(probs_ptr, vocab, prefix, fixed, shift, BLOCK: tl.constexpr):
    """Counts and masses (16,) of the digit at `shift` over the row's tokens whose bits above it
    are `prefix` (under the mask `fixed`)."""
    digits = tl.arange(0, 16)
    counts = tl.zeros([16], tl.int32)
    masses = tl.zeros([16], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        p = tl.load(probs_ptr + cols, mask=cols < vocab, other=0.0)
        bits = p.to(tl.int32, bitcast=True)   # a probability's bits order as its values (sign bit 0)
        inside = (cols < vocab) & ((bits & fixed) == prefix)
        hit = inside[:, None] & (((bits >> shift) & 15)[:, None] == digits[None, :])
        q = (p.to(tl.float64) * 16777216.0).to(tl.int32)
        counts += tl.sum(hit.to(tl.int32), axis=0)
        masses += tl.sum(tl.where(hit, q[:, None], 0), axis=0)
    return counts, masses


@triton.jit
def _select(probs_ptr, vocab, k, target, BLOCK: tl.constexpr):
    """The smallest value v (as float bits) whose tokens strictly above number below k and weigh
    below target, and that count and mass: a radix descent into the lowest digit whose largest
    token still qualifies (the largest token of the row always does, target >= 1)."""
    digits = tl.arange(0, 16)
    above = digits[None, :] > digits[:, None]          # (D, E): E above D
    prefix = tl.zeros([], tl.int32)
    fixed = tl.zeros([], tl.int32)
    count_above = tl.zeros([], tl.int32)
    mass_above = tl.zeros([], tl.int32)
    for level in tl.static_range(8):
        shift = 28 - 4 * level
        counts, masses = _histogram(probs_ptr, vocab, prefix, fixed, shift, BLOCK)
        count_gt = tl.sum(tl.where(above, counts[None, :], 0), axis=1)
        mass_gt = tl.sum(tl.where(above, masses[None, :], 0), axis=1)
        ok = (counts > 0) & (count_above + count_gt < k) & (mass_above + mass_gt < target)
        top = tl.max(tl.where(counts > 0, digits, -1), axis=0)
        digit = tl.min(tl.where(ok, digits, 16), axis=0)
        digit = tl.where(digit == 16, top, digit)
        count_above += tl.sum(tl.where(digits == digit, count_gt, 0), axis=0)
        mass_above += tl.sum(tl.where(digits == digit, mass_gt, 0), axis=0)
        prefix = prefix | (digit << shift)
        fixed = fixed | (tl.full([], 15, tl.int32) << shift)   # the top digit's mask wraps to negative
    return prefix, count_above, mass_above


@triton.jit
def _radix_keep_kernel(probs_ptr, stride, top_ks_ptr, top_ps_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = probs_ptr + row * stride
    k = tl.load(top_ks_ptr + row).to(tl.int32)
    k = tl.where((k <= 0) | (k > vocab), vocab, k)
    top_p = tl.load(top_ps_ptr + row)
    # the top-k total: the k-th largest value v_k (its tokens by id fill the k), or every token's
    if k < vocab:
        bits_k, count_k, mass_k = _select(row_ptr, vocab, k, 1073741824, BLOCK)
        q_k = (bits_k.to(tl.float32, bitcast=True).to(tl.float64) * 16777216.0).to(tl.int32)
        total = mass_k + (k - count_k) * q_k
    else:
        total = tl.zeros([], tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p = tl.load(row_ptr + cols, mask=cols < vocab, other=0.0)
            total += tl.sum((p.to(tl.float64) * 16777216.0).to(tl.int32), axis=0)
    target = tl.maximum((top_p.to(tl.float64) * total.to(tl.float64)).to(tl.int32), 1)
    target = tl.where(top_p >= 1.0, 1073741824, target)
    bits, count_gt, mass_gt = _select(row_ptr, vocab, k, target, BLOCK)
    q = (bits.to(tl.float32, bitcast=True).to(tl.float64) * 16777216.0).to(tl.int32)
    # tied tokens kept: the j-th (by id) while count_gt + j < k and mass_gt + j * q < target
    by_mass = tl.where(q > 0, (target - mass_gt + q - 1) // tl.maximum(q, 1), vocab)
    ties_kept = tl.minimum(k - count_gt, by_mass)
    seen = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        live = cols < vocab
        p_bits = tl.load(row_ptr + cols, mask=live, other=0.0).to(tl.int32, bitcast=True)
        tie = live & (p_bits == bits)
        rank = seen + tl.cumsum(tie.to(tl.int32), axis=0) - tie.to(tl.int32)
        keep = (p_bits > bits) | (tie & (rank < ties_kept))
        tl.store(out_ptr + row * vocab + cols, keep.to(tl.int8), mask=live)
        seen += tl.sum(tie.to(tl.int32), axis=0)


def radix_keep(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The cut without sorting: (rows, V) bool. probs: float32, rows contiguous."""
    rows, vocab = probs.shape
    out = torch.empty((rows, vocab), dtype=torch.int8, device=probs.device)
    _radix_keep_kernel[(rows,)](probs, probs.stride(0), top_ks.to(torch.int64).contiguous(),
                                top_ps.to(torch.float32).contiguous(), out, vocab, BLOCK=block)
    return out.bool()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--temperature", type=float, default=0.7)
    ns = parser.parse_args(argv)
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    for bs in ns.batch_sizes:
        # logits of a trained model's spread (a few tokens stand out), a random top-p and top-k per row
        logits = torch.randn(bs, ns.vocab, generator=gen, device="cuda") * 3
        probs = torch.softmax(logits / ns.temperature, -1)
        top_ps = torch.tensor([0.95, 0.9, 0.8, 1.0] * bs, device="cuda")[:bs]
        top_ks = torch.tensor([0, 0, 50, 0] * bs, device="cuda")[:bs]
        equal = torch.equal(radix_keep(probs, top_ks, top_ps), sorted_keep(probs, top_ks, top_ps))
        row = {"batch_size": bs, "vocab": ns.vocab, "masks_equal": equal,
               "sort_ms": round(graphed_ms(lambda: sorted_keep(probs, top_ks, top_ps), 20, device, per_graph=4), 4)}
        for block in (256, 1024, 2048):
            row[f"radix_ms_block{block}"] = round(graphed_ms(lambda: radix_keep(probs, top_ks, top_ps, block), 20, device,
                                                             per_graph=4), 4)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
