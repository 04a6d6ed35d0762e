"""`python -m specserve.generate --prompt "..." [--chat] [ServerArgs flags]`: one completion,
printed with its speed."""
from __future__ import annotations

import argparse
import json
import time

from specserve.args import ServerArgs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specserve.generate", description=__doc__)
    parser.add_argument("--prompt", default="Write a short poem about speculative decoding.")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--sampling-params", type=json.loads, default=None,
                        help="a JSON dict of sampling parameters; overrides the flags above")
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    from specserve.engine.engine import Engine
    with Engine(**vars(ServerArgs.from_cli_args(ns))) as engine:
        prompt = ns.prompt
        if ns.chat:
            prompt = engine.apply_chat_template([{"role": "user", "content": prompt}])
        params = ns.sampling_params or {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature,
                                        "top_p": ns.top_p, "top_k": ns.top_k, "seed": ns.seed}
        start = time.perf_counter()
        out = engine.generate(prompt, params)
        elapsed = time.perf_counter() - start
    meta = out["meta_info"]
    print(out["text"])
    line = f"--- {meta['completion_tokens']} tokens in {elapsed:.2f} s ({meta['completion_tokens'] / elapsed:.1f} tokens/s)"
    if "spec_accept_length" in meta:
        line += f", accept length {meta['spec_accept_length']:.2f}"
    print(line)


if __name__ == "__main__":
    main()
