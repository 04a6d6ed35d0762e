"""Plain decoding's output rate, greedy against seeded sampling with the sampling done eagerly and
through the sampling graphs (sampling/plain_graphs.py, the default; SPECSERVE_SAMPLING_GRAPHS=0 turns them off), on random
weights of a real model's shape (no checkpoint staged):

    python -m lab.sampled_decode_rate --shape qwen2.5-coder-1.5b --batch-sizes 1 8 64

Each engine serves random 300-token prompts at each concurrency (2 x concurrency requests of
--max-new-tokens tokens, ignore_eos), after a warm-up turn on other prompts of the same shape.
One JSON row per (setting, concurrency): output tokens per second and the rate over greedy's.
Sampling is temperature 0.7, top-p 0.95 (a chat default) or, with --no-top-p, temperature alone.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random

from specserve.bench.random_model import SHAPES, write_model_config

SETTINGS = {"greedy": ("0", False), "sampled eager": ("0", True), "sampled graphs": ("1", True)}


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(300)] for _ in range(count)]


def rates(engine, ns: argparse.Namespace, sampled: bool) -> dict[int, float]:
    from specserve.bench.offline import run_turn
    params = {"max_new_tokens": ns.max_new_tokens, "ignore_eos": True, "temperature": 0.0}
    if sampled:
        params |= {"temperature": 0.7, "seed": 1} | ({} if ns.no_top_p else {"top_p": 0.95})
    out = {}
    for bs in ns.batch_sizes:
        asyncio.run(run_turn(engine, prompts(bs, 100 + bs), params, bs, f"warm {bs}"))
        out[bs] = asyncio.run(run_turn(engine, prompts(2 * bs, bs), params, bs, f"{bs}"))["output_tokens_per_s"]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-top-p", action="store_true")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                        help="greedy first: the others' rates are given over it")
    parser.add_argument("--log-level", default="warning", help="info: the start-up warm-up's summary too")
    ns = parser.parse_args(argv)
    from specserve.engine.engine import Engine
    path = write_model_config(f"/tmp/random-{ns.shape}", ns.shape)   # weights: --load-format dummy
    greedy = {}
    for setting in ns.settings:
        graphs, sampled = SETTINGS[setting]
        os.environ["SPECSERVE_SAMPLING_GRAPHS"] = graphs   # read when the engine is built
        engine = Engine(model_path=path, load_format="dummy", log_level=ns.log_level, max_total_tokens=100_000)
        try:
            for bs, rate in rates(engine, ns, sampled).items():
                greedy.setdefault(bs, rate)
                print(json.dumps({"shape": ns.shape, "setting": setting, "concurrency": bs,
                                  "output_tokens_per_s": round(rate, 1), "over_greedy": round(rate / greedy[bs], 3)}),
                      flush=True)
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
