"""Greedy identity of tensor parallelism against one device, for a GPU run:

  python -m specserve.distributed.check_identity --model-path M --tp-size 2 [--dtype float32]
      [--speculative-algorithm NGRAM] [--max-new-tokens 128]

generates greedily from the shared sample prompts with tp_size 1 (plain) and then with
--tp-size N (plain, or with the speculative flags given), and prints one JSON line: the
fraction of requests and of tokens that agree, and each divergence (request, first differing
position). In fp32 the row-parallel all-reduces only change the order of a sum, so the two
should agree token for token; in bf16 a near-tie may flip late in a long output.
"""
from __future__ import annotations

import argparse
import json

from specserve.args import ServerArgs
from specserve.bench.prompts import SAMPLE_PROMPTS
from specserve.cli import ArgumentParser


def greedy_outputs(engine_args: dict, max_new_tokens: int) -> list[list[int]]:
    from specserve.engine.engine import Engine
    with Engine(**engine_args) as engine:
        outputs = engine.generate(SAMPLE_PROMPTS, {"temperature": 0, "max_new_tokens": max_new_tokens})
    return [output["output_ids"] for output in outputs]


def compare(reference: list[list[int]], candidate: list[list[int]]) -> dict:
    divergences, agreeing_tokens = [], 0
    for index, (want, got) in enumerate(zip(reference, candidate)):
        same = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        agreeing_tokens += same
        if want != got:
            divergences.append({"request": index, "first_difference": same, "lengths": [len(want), len(got)]})
    return {"requests_identical": 1 - len(divergences) / len(reference),
            "tokens_before_divergence": agreeing_tokens / max(1, sum(len(want) for want in reference)),
            "divergences": divergences}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m specserve.distributed.check_identity", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    ServerArgs.add_cli_args(parser)
    namespace = parser.parse_args(argv)
    args = ServerArgs.from_cli_args(namespace)
    if args.tp_size == 1:
        parser.error("--tp-size: give the tensor-parallel size to compare against tp_size 1")
    engine_args = dict(vars(args))
    plain = {**engine_args, "tp_size": 1, "speculative_algorithm": None}
    reference = greedy_outputs(plain, namespace.max_new_tokens)
    candidate = greedy_outputs(engine_args, namespace.max_new_tokens)
    report = {"tp_size": args.tp_size, "dtype": args.dtype, "speculative_algorithm": args.speculative_algorithm,
              **compare(reference, candidate)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
