"""Decode attention on a model's heads: the Triton backend's split-K decode kernel against
sgl_kernel's FlashAttention-3 (what SGLang decodes with on Hopper) over the same token-granular
pool, one layer, at several batch sizes and contexts:

    python -m lab.decode_attention_sweep --shape qwen2.5-7b --batch-sizes 1 8 32 64 --contexts 2304 32768

One JSON row per (batch, context, kernel): the median time of --iters launches (the Triton
backend's plan excluded, as a CUDA graph replays it; its split count is picked for the batch's
context, as an eager step's) and the largest difference from the Triton output. The question it
answers: whether an FA3 decode path would take time off the decode cells (issue 59) before one is
built with its CUDA-graph metadata.
"""
from __future__ import annotations

import argparse
import json

import torch

from lab.extend_attention_sweep import attention_shape, median_ms
from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.attention.fa3_backend import load_kernel
from specserve.attention.triton_backend import TritonBackend
from specserve.bench.random_model import SHAPES
from specserve.kv.pool import KVPool


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--heads", type=int, nargs=3, metavar=("Q", "KV", "DIM"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2304, 8192, 32768],
                        help="keys of every request, its new token included")
    parser.add_argument("--iters", type=int, default=50)
    return parser.parse_args(argv)


def decode_batch(shape: tuple[int, int, int], bs: int, context: int, device: torch.device):
    """bs requests of `context` keys each, slots shuffled over the pool, and their queries."""
    heads, kv_heads, head_dim = shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pool = KVPool(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, size=bs * context, max_requests=bs,
                  max_context=context, dtype=dtype, device=device)
    gen = torch.Generator(device).manual_seed(0)
    for buffer in pool.k_buffers + pool.v_buffers:
        buffer.normal_(generator=gen)
    slots = (torch.randperm(bs * context, generator=gen, device=device) + 1).view(bs, context)
    pool.req_to_token[:bs, :context] = slots.to(torch.int32)
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(bs, dtype=torch.long, device=device),
        positions=torch.zeros(bs, dtype=torch.long, device=device), out_slots=slots[:, -1].contiguous(),
        req_rows=torch.arange(bs, device=device), prefix_lens=torch.full((bs,), context - 1, device=device),
        extend_lens=torch.ones(bs, dtype=torch.long, device=device), prefix_lens_host=[context - 1] * bs,
        extend_lens_host=[1] * bs, kv_pool=pool, logits_indices=torch.arange(bs, device=device))
    q = torch.randn((bs, heads, head_dim), generator=gen, device=device, dtype=dtype)
    return batch, q


def sweep(ns: argparse.Namespace):
    device = torch.device("cuda")
    shape = attention_shape(ns)
    kernel, why = load_kernel(torch.bfloat16)
    for bs in ns.batch_sizes:
        for context in ns.contexts:
            yield from time_case(shape, bs, context, kernel, why, ns.iters, device)
            torch.cuda.empty_cache()


def time_case(shape, bs: int, context: int, kernel, why: str, iters: int, device: torch.device):
    batch, q = decode_batch(shape, bs, context, device)
    pool = batch.kv_pool
    triton = TritonBackend(*shape)
    triton.plan(batch)
    want = triton.forward(q, None, None, 0, batch).float()
    row = {"batch": bs, "context": context, "heads": shape}
    yield {**row, "kernel": "triton", "ms": round(median_ms(lambda: triton.forward(q, None, None, 0, batch), iters,
                                                            device), 4)}
    if kernel is None:
        yield {**row, "kernel": "fa3", "error": why}
        return
    k_cache, v_cache = pool.k_buffers[0].unsqueeze(1), pool.v_buffers[0].unsqueeze(1)
    lens = dict(page_table=pool.req_to_token[:bs],
                cache_seqlens=torch.full((bs,), context, dtype=torch.int32, device=device))

    def fa3():
        return kernel(q.unsqueeze(1), k_cache, v_cache, softmax_scale=triton.scale, causal=True, **lens)
    err = (fa3().squeeze(1).float() - want).abs().max().item()
    yield {**row, "kernel": "fa3", "ms": round(median_ms(fa3, iters, device), 4), "max_err": round(err, 4)}


def main(argv=None) -> None:
    for row in sweep(parse_args(argv)):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
