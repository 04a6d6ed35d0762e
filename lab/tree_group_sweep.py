"""Verify attention through tree_groups.py under candidate launch configurations and key splits,
against the decode kernel's plain step over the same keys, on a model's attention shape:

    python -m lab.tree_group_sweep --shape qwen2.5-coder-1.5b --batch-sizes 64 --nodes 4 --contexts 384 2048

One JSON row per (batch, nodes, context, kernel, configuration): the median time of a launch over --iters timings
(`ms`: launched eagerly, the host's launch latency included, which at these sizes it is mostly; `graphed_ms`:
replayed in a CUDA graph of 20, as in a step) and the largest difference from the default configuration's output. At 64 requests x 4 nodes (H100, 1.5B, 300-token
prompts, lab.step_cost) a layer's tree-group attention took ~30 us where the plain step's decode attention took
~17: the question is whether a launch configuration or split count closes part of that before the kernel
itself changes. `splits` is the key split (TritonBackend._tree_group_splits: about 2 programs per SM, rounded down;
2 at 64 requests and 2 kv heads on an H100, where the decode kernel's rule gave 5, the slowest but one there).
Graphed, 64 x 4 nodes on an H100 (2026-12-07): decode 10.6 us on 384 keys and 56.4 on 2048; tree groups 20.4 and
65.4 at 2 splits, 15.3 and 75.2 at 1 split with 8 warps.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from lab.decode_attention_sweep import decode_batch
from lab.extend_attention_sweep import attention_shape, graphed_ms, median_ms
from specserve.attention.kernels.tree_groups import tree_group_attention
from specserve.attention.triton_backend import TritonBackend
from specserve.bench.random_model import SHAPES

GRID = dict(BLOCK_N=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--heads", type=int, nargs=3, metavar=("Q", "KV", "DIM"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[384, 2048],
                        help="keys of every request, its tree's nodes included")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--device", default="cuda")
    return parser.parse_args(argv)


def tree_inputs(shape, bs: int, nodes: int, context: int, device: torch.device) -> dict:
    """bs requests of `context` keys, the last `nodes` of them a chain of new tokens, and their queries."""
    batch, _ = decode_batch(shape, bs, context, device)
    pool = batch.kv_pool
    heads, kv_heads, head_dim = shape
    gen = torch.Generator(device).manual_seed(1)
    slots = pool.req_to_token[:bs, context - nodes:context].reshape(-1).to(torch.long)
    return dict(q=torch.randn((bs * nodes, heads, head_dim), generator=gen, device=device, dtype=pool.k_buffers[0].dtype),
                k_buffer=pool.k_buffers[0], v_buffer=pool.v_buffers[0], req_to_token=pool.req_to_token,
                req_rows=torch.arange(bs, dtype=torch.int32, device=device),
                prefix_lens=torch.full((bs,), context - nodes, dtype=torch.int32, device=device), out_slots=slots,
                qo_indptr=(torch.arange(bs + 1, device=device) * nodes).to(torch.int32),
                tree_mask=torch.ones(nodes, nodes, dtype=torch.uint8, device=device).tril().expand(bs, -1, -1)
                .contiguous()), batch


def launcher(inputs: dict, splits: int, launch: dict | None, scale: float):
    """A launch of the kernel over buffers made once (the split counters return to zero after each),
    and its output."""
    q = inputs["q"]
    out = torch.empty_like(q)
    partial = {}
    if splits > 1:
        kv_heads = inputs["k_buffer"].shape[1]
        partial = dict(partial_out=torch.empty((*q.shape[:2], splits, q.shape[2]), dtype=torch.float32, device=q.device),
                       partial_lse=torch.empty((*q.shape[:2], splits), dtype=torch.float32, device=q.device),
                       split_counters=torch.zeros(inputs["req_rows"].numel() * kv_heads, dtype=torch.int32,
                                                  device=q.device))
    return lambda: tree_group_attention(**inputs, out=out, scale=scale, launch=launch, **partial), out


def sweep(ns: argparse.Namespace):
    device = torch.device(ns.device)
    shape = attention_shape(ns)
    backend = TritonBackend(*shape)
    for bs, nodes, context in itertools.product(ns.batch_sizes, ns.nodes, ns.contexts):
        inputs, plain = tree_inputs(shape, bs, nodes, context, device)
        row = {"batch": bs, "nodes": nodes, "context": context, "heads": shape}
        backend.plan(plain)
        q_plain = inputs["q"][::nodes].contiguous()
        decode = lambda: backend.forward(q_plain, None, None, 0, plain)   # noqa: E731
        yield {**row, "kernel": "decode (plain step)", "ms": round(median_ms(decode, ns.iters, device), 4),
               "graphed_ms": round(graphed_ms(decode, ns.iters, device), 4)}
        default, want = launcher(inputs, 1, None, backend.scale)
        default()
        for splits in ns.splits:
            for values in itertools.product(*GRID.values()):
                launch = dict(zip(GRID, values))
                go, got = launcher(inputs, splits, launch, backend.scale)
                ms = median_ms(go, ns.iters, device)   # its first launch compiles, and fills `got`
                yield {**row, "kernel": "tree_groups", "splits": splits, **launch, "ms": round(ms, 4),
                       "graphed_ms": round(graphed_ms(go, ns.iters, device), 4),
                       "max_err": round((got.float() - want.float()).abs().max().item(), 4)}
        del inputs, plain
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> None:
    for row in sweep(parse_args(argv)):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
