"""Prefill attention at long prompts: specserve's extend kernel under candidate launch
configurations against torch's scaled_dot_product_attention (FlashAttention, cuDNN and
memory-efficient backends, where they take the case), for one chunk of a long prompt at
several depths, on a model's attention shape:

    python -m lab.extend_attention_sweep --shape qwen2.5-7b --chunks 2048 8192 --depths 0 6144 30720

One JSON row per (chunk, depth, kernel): the median time of --iters launches, TFLOP/s of the
causal attention (4 x heads x head_dim x the keys each new token sees), and the largest
difference from torch's math backend. The pool is contiguous slots, what a fresh server's pool
gives one long prompt. `splits` is how many parts the keys are cut into (merged after); the
product's plan picks up to (depth + chunk) / (4 x chunk) for a chunk (KEYS_PER_NEW_TOKEN).
The question it answers: how far the kernel is from a FlashAttention-class one at 8k-32k
prompts, and which configuration closes it (issue 59: time to first token at 8k and 32k).

`fa3` is sgl_kernel's FlashAttention-3 over the pool's slots through a page table, as the fa3
backend calls it (where the optional sglang-kernel package loads).
`split-flash` and `split-cudnn` attend the prefix with no mask and the chunk causally, two
calls merged by their log-sum-exps (specserve/attention/prefix_split.py says why); cuDNN gets
K/V with every query head's copy, made in the timed launch. `split-math` is the same on a CPU,
for the test.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch

from specserve.attention.kernels.extend import extend_attention, num_row_blocks
from specserve.attention.prefix_split import attend_in_two
from specserve.bench.random_model import SHAPES
from specserve.runner.cuda_graph import capture_graph

GRID = dict(BLOCK_M=(64, 128), BLOCK_N=(32, 64), num_warps=(4, 8), num_stages=(2, 3))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--heads", type=int, nargs=3, metavar=("Q", "KV", "DIM"),
                        help="attention heads, KV heads and head size instead of --shape's")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 6144, 30720],
                        help="tokens of the prompt before the chunk (its prefix in the pool)")
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--configs", nargs="+", default=None, metavar="M,N,WARPS,STAGES",
                        help="launch configurations to time (default: the whole grid)")
    parser.add_argument("--iters", type=int, default=20)
    return parser.parse_args(argv)


def attention_shape(ns: argparse.Namespace) -> tuple[int, int, int]:
    if ns.heads:
        return tuple(ns.heads)
    shape = SHAPES[ns.shape]
    heads = shape["num_attention_heads"]
    return heads, shape["num_key_value_heads"], shape.get("head_dim", shape["hidden_size"] // heads)


def configs(ns: argparse.Namespace) -> list[dict]:
    if ns.configs:
        return [dict(zip(GRID, map(int, text.split(",")))) for text in ns.configs]
    return [dict(zip(GRID, values)) for values in itertools.product(*GRID.values())]


def causal_tflop(heads: int, head_dim: int, chunk: int, depth: int) -> float:
    keys_seen = chunk * depth + chunk * (chunk + 1) // 2
    return 4 * heads * head_dim * keys_seen / 1e12


def median_ms(launch, iters: int, device: torch.device) -> float:
    launch()   # compiles
    if device.type != "cuda":
        return 0.0
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed_ms(launch, iters: int, device: torch.device, per_graph: int = 20) -> float:
    """The median time of one launch, each of `iters` timings a CUDA graph's replay of
    `per_graph` launches: what a launch costs inside a step's graph, without the host's launch
    latency that an eagerly timed launch of a few microseconds of work measures instead."""
    launch()   # compiles
    if device.type != "cuda":
        return 0.0
    graph, _ = capture_graph(lambda: [launch() for _ in range(per_graph)], None)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_graph)
    return statistics.median(times)


class Case:
    """One chunk of `chunk` new tokens after `depth` tokens of one prompt, K/V in a pool of
    contiguous slots; q in the layout the model gives (tokens, heads, head_dim)."""

    def __init__(self, shape: tuple[int, int, int], chunk: int, depth: int, device: torch.device):
        heads, kv_heads, head_dim = shape
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gen = torch.Generator(device).manual_seed(0)
        total = depth + chunk
        self.q = torch.randn((chunk, heads, head_dim), generator=gen, device=device, dtype=dtype)
        self.k = torch.randn((total, kv_heads, head_dim), generator=gen, device=device, dtype=dtype)
        self.v = torch.randn((total, kv_heads, head_dim), generator=gen, device=device, dtype=dtype)
        self.req_to_token = torch.arange(total, dtype=torch.int32, device=device)[None, :]
        self.req_rows = torch.zeros(1, dtype=torch.int32, device=device)
        self.prefix_lens = torch.tensor([depth], dtype=torch.int32, device=device)
        self.qo_indptr = torch.tensor([0, chunk], dtype=torch.int32, device=device)
        self.out_slots = torch.arange(depth, total, dtype=torch.int64, device=device)
        self.out = torch.empty_like(self.q)
        self.scale = head_dim ** -0.5
        self.chunk, self.depth, self.group = chunk, depth, heads // kv_heads

    def ours(self, config: dict, splits: int):
        partial = {}
        if splits > 1:
            chunk, heads, head_dim = self.q.shape
            partial = dict(partial_out=torch.empty((chunk, heads, splits, head_dim), dtype=torch.float32,
                                                   device=self.q.device),
                           partial_lse=torch.empty((chunk, heads, splits), dtype=torch.float32, device=self.q.device),
                           split_counts=torch.empty(chunk, dtype=torch.int32, device=self.q.device))
        row_blocks = num_row_blocks(self.chunk, self.group, config["BLOCK_M"])

        def launch():
            extend_attention(self.q, self.k, self.v, self.req_to_token, self.req_rows, self.prefix_lens,
                             self.qo_indptr, self.out_slots, self.out, self.scale, row_blocks, config=config, **partial)
        return launch

    def sdpa(self, backend):
        from torch.nn.attention import sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        q, k, v = (t.transpose(0, 1)[None] for t in (self.q, self.k, self.v))   # (1, heads, tokens, dim)
        mask = causal_lower_right(self.chunk, self.depth + self.chunk)

        def launch():
            with sdpa_kernel([backend]):
                self.out.copy_(torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)[0].transpose(0, 1))
        return launch

    def split(self, kernel: str):
        """The prefix without a mask and the chunk causally, merged (attention/prefix_split.py)."""
        q, k, v = (t.transpose(0, 1)[None] for t in (self.q, self.k, self.v))   # (1, heads, tokens, dim)

        def launch():
            self.out.copy_(attend_in_two(q, k, v, self.scale, kernel)[0].transpose(0, 1))
        return launch

    def fa3(self):
        """sgl_kernel's FA3 as attention/fa3_backend.py calls it: pages of one token."""
        from specserve.attention.fa3_backend import load_kernel
        kernel, why = load_kernel(self.q.dtype)
        if kernel is None:
            raise RuntimeError(why)
        total = self.depth + self.chunk
        lens = dict(page_table=self.req_to_token, cache_seqlens=torch.tensor([total], dtype=torch.int32,
                                                                             device=self.q.device),
                    cu_seqlens_q=self.qo_indptr, max_seqlen_q=self.chunk)

        def launch():
            self.out.copy_(kernel(self.q, self.k.unsqueeze(1), self.v.unsqueeze(1), softmax_scale=self.scale,
                                  causal=True, **lens))
        return launch

    def reference(self) -> torch.Tensor:
        from torch.nn.attention import SDPBackend
        with torch.no_grad():
            self.sdpa(SDPBackend.MATH)()
        return self.out.float().clone()


def _deferred(make):
    """A launch whose set-up errors (a kernel that does not load) surface as the row's error."""
    launch = None

    def run():
        nonlocal launch
        launch = launch or make()
        launch()
    return run


def sweep(ns: argparse.Namespace):
    from torch.nn.attention import SDPBackend
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = attention_shape(ns)
    for chunk, depth in itertools.product(ns.chunks, ns.depths):
        case = Case(shape, chunk, depth, device)
        want = case.reference()
        tflop = causal_tflop(shape[0], shape[2], chunk, depth)
        kernels = [(f"sdpa-{b.name.lower()}", case.sdpa(b), {}) for b in
                   (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)]
        kernels += [(f"split-{how}", case.split(how), {})
                    for how in (("flash", "cudnn") if device.type == "cuda" else ("math",))]
        if device.type == "cuda":
            kernels.append(("fa3", _deferred(case.fa3), {}))
        kernels += [("specserve", case.ours(config, splits), dict(config, splits=splits))
                    for config in configs(ns) for splits in ns.splits]
        for name, launch, settings in kernels:
            row = {"kernel": name, **settings, "chunk": chunk, "depth": depth, "heads": shape}
            case.out.fill_(float("nan"))   # a kernel that writes nothing is not judged by the one before
            try:
                ms = median_ms(launch, ns.iters, device)
            except Exception as error:   # a backend that does not take the case; a configuration past the shared memory
                yield {**row, "error": f"{type(error).__name__}: {str(error)[:200]}"}
                continue
            err = (case.out.float() - want).abs().max().item()
            yield {**row, "ms": round(ms, 4), "tflops": round(tflop / ms * 1e3, 1) if ms else None,
                   "max_err": round(err, 4)}


def main(argv=None) -> None:
    for row in sweep(parse_args(argv)):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
