"""What a sampled plain decode step's sampling costs on the GPU, by part, against the argmax a
greedy step takes: `python -m lab.sampling_cost [--batch-sizes 1 8 64] [--vocab 151936]`.

On an H100 (1.5B, eagle-rows with temperature 0.7 / top-p 0.95) plain sampled decoding ran at
half the greedy rate at batch 1 (2.9 ms a step against 1.5 ms), every step launched ahead.
Each part here runs on device tensors of the step's shape (logits (bs, V) fp32, drawn to look
like a language model's: a few likely tokens over a long tail), timed as a CUDA graph replay
(GPU time) and eagerly (wall time, host launches included), then the engine's graphed path
(sampling/plain_graphs.py: wall time of the host's fill, copy and replay, synchronized); last a
kernel table of one verify_sampling per batch size.
Rows go to stdout and $OUT/sampling_cost.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from specserve.model.gemv import graph_time_us
from specserve.sampling.plain_graphs import PlainSamplingGraphs
from specserve.verify.filters import apply_sampling_filters, prefix_mass
from specserve.verify.random import SALT_TOKEN, exponential_race
from specserve.verify.rules import verify_sampling
from specserve.verify.tree import DraftTrees


def llm_like_logits(bs: int, vocab: int, device) -> torch.Tensor:
    """A long tail at N(0, 2) with a few tokens lifted well above it: top-p 0.95 keeps tens to
    hundreds of tokens, as on chat."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(bs, vocab, device=device, generator=generator) * 2
    lifted = torch.randint(0, vocab, (bs, 8), device=device, generator=generator)
    return logits.scatter_add(1, lifted, torch.full((bs, 8), 14.0, device=device))


def eager_us(fn, reps: int = 30) -> float:
    """Wall time per call, synchronized: host launches and GPU work."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / reps


def parts(bs: int, vocab: int, device) -> dict:
    logits = llm_like_logits(bs, vocab, device)
    full = lambda value, dtype: torch.full((bs,), value, dtype=dtype, device=device)   # noqa: E731
    temps, top_ps, min_ps = full(0.7, torch.float32), full(0.95, torch.float32), full(0.0, torch.float32)
    top_ks, seeds = full(vocab, torch.long), torch.arange(bs, device=device)
    positions = torch.full((bs,), 300, dtype=torch.long, device=device)
    roots = DraftTrees.root_only(torch.zeros(bs, dtype=torch.long, device=device))
    probs = torch.softmax(logits / 0.7, dim=-1)
    node_logits = logits.unsqueeze(1)
    graphs = PlainSamplingGraphs([logits], vocab) if device.type == "cuda" else None
    values = {"temperatures": [0.7] * bs, "top_ks": [vocab] * bs, "top_ps": [0.95] * bs, "min_ps": [0.0] * bs,
              "seeds": list(range(bs)), "positions": [300] * bs}
    return {
        "argmax": lambda: logits.argmax(-1),
        "softmax": lambda: torch.softmax(logits / 0.7, dim=-1),
        "sort": lambda: probs.sort(dim=-1, descending=True),
        "topk_1024": lambda: probs.topk(1024, dim=-1),
        "cumsum": lambda: probs.cumsum(dim=-1),                  # torch's scan along each row
        "prefix_mass": lambda: prefix_mass(probs),              # the filters' chunked scan
        "filters_top_p": lambda: apply_sampling_filters(logits, temps, top_ks, top_ps, min_ps, need_min_p=False),
        "filters_none": lambda: apply_sampling_filters(logits, temps, top_ks, top_ps, min_ps,
                                                       need_top_k_top_p=False, need_min_p=False),
        "race": lambda: exponential_race(probs, seeds, positions + 1, SALT_TOKEN),
        "verify_sampling_top_p": lambda: verify_sampling(roots, node_logits, temps, top_ks, top_ps, min_ps, seeds,
                                                         positions, need_min_p=False),
        "verify_sampling_no_filter": lambda: verify_sampling(roots, node_logits, temps, top_ks, top_ps, min_ps,
                                                             seeds, positions, need_top_k_top_p=False,
                                                             need_min_p=False),
        # the engine's graphed path (sampling/plain_graphs.py): host fill, one copy, one replay
        **({"graphed_sample_plain": lambda: graphs.sample(logits, values, True, False)} if graphs else {}),
    }


def kernel_table(fn, top: int = 15) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:90], "calls": e.count, "gpu_us": round(e.device_time_total, 1)}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["gpu_us"])[:top]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    with open(os.path.join(args.out, "sampling_cost.jsonl"), "w") as sink:
        def write(row):
            print(json.dumps(row), flush=True)
            sink.write(json.dumps(row) + "\n")
        for bs in args.batch_sizes:
            for name, fn in parts(bs, args.vocab, device).items():
                graphed = name == "graphed_sample_plain"   # a replay already: wall time only
                write({"kind": "sampling_part", "batch_size": bs, "part": name,
                       "graph_gpu_us": None if graphed else round(graph_time_us([fn] * 10, rounds=5), 1),
                       "eager_wall_us": round(eager_us(fn), 1)})
            write({"kind": "sampling_kernels", "batch_size": bs,
                   "kernels": kernel_table(parts(bs, args.vocab, device)["verify_sampling_top_p"])})


if __name__ == "__main__":
    main()
