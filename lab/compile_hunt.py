"""Which Triton kernel variants still compile while serving, after the start-up warm-up.

A suite round on an H100 (1.5B, ShareGPT second turns at 64, 2026-12-06) spent 1.4 s compiling an
`_extend_kernel` variant inside a prefill of two prompts, one the warm-up had not built. This drives
an engine on random weights through prefills the suite's chats make (prompts of many lengths, alone
and several at once, first turns and second turns whose prefix is cached), and prints every kernel
compiled after the warm-up with its cache key (TritonCompileCounter), so the warm-up can cover it.

    python -m lab.compile_hunt --shape qwen2.5-coder-1.5b [--speculative-algorithm NGRAM]
"""
from __future__ import annotations

import argparse
import json
import os
import random

from specserve.bench.random_model import SHAPES, write_model_config
from specserve.engine.kernel_cache import TritonCompileCounter

BATCH_SIZES = (1, 2, 3, 4, 5, 7, 8, 13, 16, 32)
LENGTHS = (20, 100, 500, 1500, 3000, 6000)
NEW_TURN = (8, 60, 300)   # tokens a second turn adds after the first turn's prompt and answer


def turns(engine, rng: random.Random, batch_size: int, length: int, vocab: int) -> None:
    """A first turn of `batch_size` prompts around `length` tokens, then their second turns."""
    prompts = [[rng.randrange(100, vocab) for _ in range(max(1, length + rng.randrange(-length // 4, length // 4 + 1)))]
               for _ in range(batch_size)]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    first = engine.generate(input_ids=prompts, sampling_params=params)
    second = [p + out["output_ids"] + [rng.randrange(100, vocab) for _ in range(rng.choice(NEW_TURN))]
              for p, out in zip(prompts, first)]
    engine.generate(input_ids=second, sampling_params=params)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-coder-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--speculative-algorithm", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ns = parser.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    from specserve.engine.engine import Engine
    path = write_model_config(f"/tmp/random-{ns.shape}", ns.shape)   # weights made on the device
    engine = Engine(model_path=path, load_format="dummy", device=ns.device, log_level="warning",
                    speculative_algorithm=ns.speculative_algorithm)
    vocab = SHAPES[ns.shape]["vocab_size"]
    rng, found = random.Random(0), []
    try:
        with TritonCompileCounter() as counter:
            for batch_size in ns.batch_sizes:
                for length in ns.lengths:
                    counter.reset()
                    turns(engine, rng, batch_size, length, vocab)
                    for kernel in counter.kernels:
                        row = {"batch_size": batch_size, "length": length, **kernel}
                        found.append(row)
                        print(json.dumps(row), flush=True)
    finally:
        engine.shutdown()
    with open(os.path.join(ns.out, "compile_hunt.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in found)
    print(f"{len(found)} kernels compiled after the warm-up", flush=True)


if __name__ == "__main__":
    main()
