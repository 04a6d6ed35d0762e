"""Where a batch-1 decode step of a real-size model spends its time on the GPU, without
staging a checkpoint: `python -m lab.decode_profile --shape qwen2.5-coder-1.5b`.

Prints (and writes to $OUT/decode_profile.jsonl): the copy bandwidth; each linear layer's
one-row matmul time and bandwidth, cuBLAS against the Triton GEMV at several tile sizes
(timed inside a CUDA graph, so launch cost is not counted); the engine's per-step wall
time and forward GPU time; the GPU time per kernel name inside one decode step; and
end-to-end batch-1 tok/s on 4 random prompts x 128 tokens against the roofline.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random

import torch

from specserve.bench.gpu_suite import measure_copy_bandwidth, weight_bytes
from specserve.bench.random_model import SHAPES, write_model_config
from specserve.bench.result_rows import emit_row

def events_time_us(fn, reps: int = 50) -> float:
    """GPU time per fn() call for work that is already a graph replay."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def bench_linears(config: dict, write) -> None:
    """One-row matmul time per weight shape, read from HBM: cuBLAS vs each GEMV config."""
    from specserve.model.gemv import candidate_times
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    num_q, num_kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // num_q
    kv = num_kv * head_dim
    # name: (weight shape, bias, silu_mul, add_norm, rope heads), as a batch-1 decode step runs them
    shapes = {"add_norm+qkv+rope": ((hidden + 2 * kv, hidden), True, False, True, (num_q, num_kv, head_dim)),
              "o": ((hidden, hidden), False, False, False, None),
              "add_norm+gate_up+silu_mul": ((2 * inter, hidden), False, True, True, None),
              "down": ((hidden, inter), False, False, False, None),
              "add_norm+lm_head": ((vocab, hidden), False, False, True, None)}
    for name, (shape, bias, silu_mul, add_norm, rope) in shapes.items():
        times = candidate_times(shape, torch.bfloat16, bias, silu_mul, add_norm, torch.device("cuda"), rope)
        mb = shape[0] * shape[1] * 2 / 1e6
        write({"kind": "linear", "name": name, "MB": mb, **{("cublas" if k is None else "gemv_%dx%dw%ds%d" % k) + "_us": v
                                                           for k, v in times.items()},
               "cublas_GBps": mb * 1e3 / times[None], "best_GBps": mb * 1e3 / min(times.values())})


def step_profile(engine, write) -> None:
    """Wall time per step, forward GPU time, and GPU time per kernel name of decode steps."""
    import time
    core = engine.core
    prompt = [random.Random(0).randrange(10, 4000) for _ in range(300)]
    req = engine._make_request(prompt, {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}, False, 0, None)
    core.add_request(req)
    for _ in range(20):
        core.step()
    torch.cuda.synchronize()
    steps = 200
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    graphs = core.runner.graphs
    key = (1, 1)
    gpu_us = events_time_us(lambda: graphs.graphs[key].replay())
    kernels, counts = kernel_times(core.step)
    write({"kind": "step", "wall_ms": wall_ms, "graph_gpu_ms": gpu_us / 1e3, "host_ms": wall_ms - gpu_us / 1e3,
           "kernels_per_step": sum(counts.values())})
    for name, us in kernels.most_common(25):
        write({"kind": "kernel", "name": name, "us_per_step": round(us, 2), "calls_per_step": round(counts[name], 1)})
    core.abort(req.rid)


def kernel_times(fn, reps: int = 10) -> tuple[collections.Counter, collections.Counter]:
    """GPU microseconds and launches per fn() call, by kernel name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels, counts = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:80]] += event.device_time_total / reps
            counts[event.name[:80]] += 1 / reps
    return kernels, counts


def end_to_end(engine, roofline: float, write) -> None:
    from specserve.bench.offline import run_turn
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 4000) for _ in range(300)] for _ in range(4)]
    params = {"temperature": 0, "max_new_tokens": 128, "ignore_eos": True}
    engine.generate(input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 8})
    for label in ("plain bs1 #1", "plain bs1 #2"):
        summary = asyncio.run(run_turn(engine, prompts, params, 1, label))
        write({"kind": "e2e", **summary, "roofline_fraction": summary["output_tokens_per_s"] / roofline})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--skip-linears", action="store_true")
    ns = parser.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)

    def write(row: dict) -> None:
        row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        emit_row(os.path.join(ns.out, "decode_profile.jsonl"), row)

    bandwidth = measure_copy_bandwidth("cuda")
    write({"kind": "device", "name": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9})
    if not ns.skip_linears:
        bench_linears(SHAPES[ns.shape], write)
    from specserve.engine.engine import Engine
    from specserve.model import gemv
    path = write_model_config(f"/tmp/random-{ns.shape}", ns.shape)   # weights: --load-format dummy
    # cuBLAS, no overlap (the previous engine) -> + one-row GEMV kernels -> + the overlap schedule
    for use_gemv, overlap in ((False, False), (True, False), (True, True)):
        gemv.ENABLED = use_gemv
        engine = Engine(model_path=path, load_format="dummy", log_level="warning", cuda_graph_max_bs=8,
                        max_total_tokens=100_000, disable_overlap_schedule=not overlap)
        roofline = bandwidth / weight_bytes(engine)
        write({"kind": "roofline", "gemv": use_gemv, "overlap": overlap, "weight_bytes": weight_bytes(engine),
               "roofline_tok_s_bs1": roofline})
        end_to_end(engine, roofline, write)
        engine.shutdown()  # drive the core from this thread for the step profile
        step_profile(engine, write)
        del engine


if __name__ == "__main__":
    main()
