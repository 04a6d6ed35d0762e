"""What one decode or verify step costs, by batch size and draft size, on a real model's
shapes with random weights (no checkpoint to stage):
`python -m specserve.bench.step_cost --shape qwen2.5-coder-1.5b --batch-sizes 1 8 32 64 --sizes 1 4 8 16`.

For each (batch size, draft size) the engine's own step loop runs requests whose drafter
always proposes a full chain of that size (size 1: plain decoding, on the overlap schedule),
and the bench reports per step: the wall time, the GPU time of the same graph replayed on
its own, and the difference (host time the GPU did not hide), plus the ratio to a plain
step at the same batch size. Random weights accept almost nothing, which does not change
what a step costs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np
import torch

from specserve.bench.decode_profile import events_time_us, kernel_times
from specserve.bench.gpu_suite import set_drafter
from specserve.bench.random_model import SHAPES, write_random_model
from specserve.speculative.drafter import Drafter
from specserve.speculative.tree import TreeProposal


class ChainDrafter(Drafter):
    """Proposes a chain of `size` nodes (random tokens) for every request, within its limit."""
    proposes_ahead = True   # reads nothing the step's commit changes: the next step is launched ahead, as NGRAM's

    def __init__(self, size: int, seed: int = 0):
        self.size, self.rng = size, np.random.default_rng(seed)

    def propose(self, reqs, max_nodes):
        counts = [min(self.size, limit) for limit in max_nodes]
        n = max(counts)
        tokens = self.rng.integers(10, 4000, size=(len(reqs), n))
        tokens[:, 0] = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]
        node = np.arange(n)
        parents = np.where(node < np.asarray(counts)[:, None], node - 1, -1)
        return TreeProposal(tokens, parents, np.asarray(counts, dtype=np.int64)), counts


def time_steps(engine, bs: int, size: int, steps: int, kernels: int = 0) -> dict:
    core = engine.core
    if size == 1:
        set_drafter(engine, None)
    else:
        set_drafter(engine, size)
        core.drafter = ChainDrafter(size)
    rng = random.Random(bs * 100 + size)
    reqs = []
    for i in range(bs):
        prompt = [rng.randrange(10, 4000) for _ in range(300)]
        req = engine._make_request(prompt, {"temperature": 0, "max_new_tokens": 4 * steps + 100, "ignore_eos": True},
                                   False, 0, f"step-cost-{bs}-{size}-{i}")
        core.add_request(req)
        reqs.append(req)
    while any(r.kv_len < len(r.prompt_ids) for r in reqs):  # prefill
        core.step()
    for _ in range(10):
        core.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    graphs = core.runner.graphs
    bucket = next(b for b in graphs.buckets if b >= bs)
    replay = graphs.graphs[(bucket, size)].replay
    gpu_ms = events_time_us(replay) / 1e3
    for req in reqs:
        core.abort(req.rid)
    row = {"batch_size": bs, "draft_size": size, "wall_ms": wall_ms, "graph_gpu_ms": gpu_ms,
           "host_not_hidden_ms": wall_ms - gpu_ms}
    if kernels:
        times, counts = kernel_times(replay)
        row["kernels"] = {name: [round(us, 1), round(counts[name])] for name, us in times.most_common(kernels)}
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="*", default=["qwen2.5-coder-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8, 32, 64])
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kernels", type=int, default=0, help="also list the N slowest kernels of each step's graph")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ns = parser.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    from specserve.engine.engine import Engine
    for shape in ns.shape:
        path = write_random_model(f"/tmp/random-{shape}", shape)
        engine = Engine(model_path=path, log_level="warning", speculative_algorithm="NGRAM",
                        speculative_num_draft_tokens=max(ns.sizes), cuda_graph_max_bs=max(ns.batch_sizes),
                        max_total_tokens=200_000, skip_server_warmup=True)
        engine.shutdown()  # the step loop is driven from this thread
        for bs in ns.batch_sizes:
            plain_ms = None
            for size in sorted(ns.sizes):
                row = {"kind": "step_cost", "shape": shape, **time_steps(engine, bs, size, ns.steps, ns.kernels),
                       "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
                plain_ms = row["wall_ms"] if size == 1 else plain_ms
                row["vs_plain"] = row["wall_ms"] / plain_ms if plain_ms else None
                row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
                print(json.dumps(row), flush=True)
                with open(os.path.join(ns.out, "step_cost.jsonl"), "a") as f:
                    f.write(json.dumps(row) + "\n")
        del engine


if __name__ == "__main__":
    main()
