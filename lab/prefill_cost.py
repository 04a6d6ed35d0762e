"""What a prefill costs, by prompt length, on a real model's shapes with random weights
(no checkpoint to stage, weights made on the device): `python -m lab.prefill_cost --shape
qwen2.5-coder-1.5b --lengths 16 100 300 1000 2000`, or at a 7B's long prompts `--shape
qwen2.5-7b --lengths 2048 8192 32000 --profile 32000 [--chunked-prefill-size 8192]`.

For each length one request of that many tokens is prefilled by the engine's own step loop
(plain decoding, CUDA graphs on for the decode steps), every chunk up to its first token; the
bench reports the median wall time of the prefill, a "fixed + per token" fit over the lengths,
and, for the lengths given
to --profile, the torch profiler's top entries by device time and by host time: where a
step of a few hundred tokens spends its time when its GPU work should take a few ms.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from lab.ttft_breakdown import fit_prefill_cost, format_prefill_cost
from specserve.attention import prefix_split
from specserve.bench.random_model import SHAPES, write_model_config
from specserve.bench.result_rows import emit_row


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill_step_ms(core, engine, length: int, rng: random.Random, tag: str) -> tuple[float, float]:
    """(wall time of the steps that prefill one request of `length` tokens, up to its first
    token: every chunk of a prompt longer than --chunked-prefill-size; of their forwards
    alone), both synchronized: the difference is the steps' host work around the model."""
    prompt = [rng.randrange(10, 4000) for _ in range(length)]
    req = engine._make_request(prompt, {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True}, False, 0, tag)
    core.add_request(req)
    forward = []
    extend = core.runner.extend

    def timed_extend(*args, **kwargs):
        synchronize()
        begin = time.perf_counter()
        out = extend(*args, **kwargs)
        synchronize()
        forward.append((time.perf_counter() - begin) * 1e3)
        return out
    core.runner.extend = timed_extend
    synchronize()
    start = time.perf_counter()
    while not req.output_ids:
        core.step()
    synchronize()
    elapsed = (time.perf_counter() - start) * 1e3
    del core.runner.extend
    while core.has_work():
        core.step()
    return elapsed, sum(forward)


def profile_table(core, engine, length: int, rng: random.Random, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        prefill_step_ms(core, engine, length, rng, f"profile-{length}")
    averages = prof.key_averages()
    return (f"--- length {length}: by device time ---\n"
            + averages.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60)
            + f"\n--- length {length}: by host time ---\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 100, 300, 1000, 2000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", type=int, nargs="*", default=[100], help="lengths to profile")
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--chunked-prefill-size", type=int, default=None, help="the engine's, if not its default")
    parser.add_argument("--prefill-attention-backend", default=None, help="the engine's, if not its default")
    parser.add_argument("--prefix-split", default=None, choices=prefix_split.KERNELS,
                        help="a prompt chunk's attention in two calls with this kernel (attention/prefix_split.py)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ns = parser.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    from specserve.engine.engine import Engine
    prefix_split.KERNEL = ns.prefix_split
    path = write_model_config(f"/tmp/random-{ns.shape}", ns.shape)   # weights made on the device
    chunking = {} if ns.chunked_prefill_size is None else {"chunked_prefill_size": ns.chunked_prefill_size}
    if ns.prefill_attention_backend is not None:
        chunking["prefill_attention_backend"] = ns.prefill_attention_backend
    engine = Engine(model_path=path, load_format="dummy", device=ns.device, log_level="warning",
                    max_total_tokens=max(200_000, 2 * max(ns.lengths)), skip_server_warmup=True, **chunking)
    engine.shutdown()  # the step loop is driven from this thread
    core, rng = engine.core, random.Random(0)
    for length in ns.lengths:   # warm: Triton compiles, allocator
        prefill_step_ms(core, engine, length, rng, f"warm-{length}")
    medians = []
    for length in ns.lengths:
        runs = [prefill_step_ms(core, engine, length, rng, f"p-{length}-{i}") for i in range(ns.repeats)]
        times = [wall for wall, _ in runs]
        medians.append(statistics.median(times))
        row = {"kind": "prefill_cost", "shape": ns.shape, "length": length,
               "chunked_prefill_size": core.runner.chunk_size,
               "prefill_attention_backend": engine.args.prefill_attention_backend, "prefix_split": ns.prefix_split,
               "attention": core.runner.attn_backend.name,
               "median_ms": round(medians[-1], 3),
               "min_ms": round(min(times), 3), "forward_median_ms": round(statistics.median(f for _, f in runs), 3),
               "device": torch.cuda.get_device_name() if ns.device == "cuda" else ns.device, "date": time.strftime("%Y-%m-%d")}
        emit_row(os.path.join(ns.out, "prefill_cost.jsonl"), row)
    print(format_prefill_cost(fit_prefill_cost([(n, ms / 1e3) for n, ms in zip(ns.lengths, medians)])), flush=True)
    for length in ns.profile:
        table = profile_table(core, engine, length, rng, ns.rows)
        print(table, flush=True)
        with open(os.path.join(ns.out, f"prefill_profile_{length}.txt"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
