"""Greedy identity of tensor parallelism against one device, for a GPU run:

  NCCL_NVLS_ENABLE=0 python -m lab.check_identity --model-path M --device cuda \\
      --dtype float32 --tp-size 2 [--cases plain,eager,ngram,standalone,eagle3,naive_eagle]
      [--eagle-head DIR]
      [--max-new-tokens 128]

generates greedily from the shared sample prompts with tp_size 1 (plain decoding, once) and
then, for each case, with --tp-size N, and prints one JSON line per case: the fraction of
requests and of tokens that agree, and each divergence (request, first differing position).
The cases:
  plain       no speculation, CUDA graphs on (unless --disable-cuda-graph): every rank
              replays the graphs that hold the all-reduces and the vocabulary all-gather
  eager       no speculation, --disable-cuda-graph: the broadcast eager forwards
  ngram       NGRAM (its default flags): verify trees, in graphs
  standalone  STANDALONE with the target itself as the draft model (drafts are accepted:
              multi-token commits on every rank)
  eagle3      EAGLE3 with --eagle-head, or a random head written to a temporary directory
              (drafts mostly rejected; the target states captured on rank 0 feed it)
  naive_eagle NAIVE_EAGLE with the same head: rank 0's fused verify-and-draft graphs, each
              replay announced to the workers, which replay their own verify graph
  given       the --speculative-* flags on the command line (added when they name one)
In fp32 the row-parallel all-reduces only change the order of a sum, so every case should
agree token for token; in bf16 a near-tie may flip late in a long output.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile

from specserve.args import ServerArgs
from specserve.bench.prompts import SAMPLE_PROMPTS
from specserve.cli import ArgumentParser

CASES = ("plain", "eager", "ngram", "standalone", "eagle3", "naive_eagle")
# the speculative settings at their defaults: the reference and the cases start from no speculation
PLAIN = {field.name: field.default for field in dataclasses.fields(ServerArgs) if field.name.startswith("speculative_")}


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


def write_random_eagle_head(model_path: str, directory: str, algorithm: str = "EAGLE3") -> None:
    """An untrained head shaped for the target (it borrows the target's embedding)."""
    from specserve.model.loader import read_model_config
    from specserve.speculative.heads.eagle_checkpoint import save_head
    from specserve.speculative.heads.eagle_config import EagleHeadConfig
    from specserve.speculative.heads.eagle_head import EagleHead
    save_head(EagleHead(EagleHeadConfig.for_target(read_model_config(model_path), algorithm)), directory)


def case_args(case: str, base: dict, model_path: str, eagle_head: str | None, scratch: str) -> dict:
    """The engine arguments of one case (base: the command line's, without speculation)."""
    if case == "plain":
        return base
    if case == "eager":
        return {**base, "disable_cuda_graph": True}
    if case == "ngram":
        return {**base, "speculative_algorithm": "NGRAM"}
    if case == "standalone":
        return {**base, "speculative_algorithm": "STANDALONE", "speculative_draft_model_path": model_path}
    if case in ("eagle3", "naive_eagle"):
        head = eagle_head or f"{scratch}/eagle3-head"
        if not os.path.isdir(head):
            write_random_eagle_head(model_path, head)
        return {**base, "speculative_algorithm": case.upper(), "speculative_draft_model_path": head}
    raise ValueError(f"--cases: unknown case {case!r}; the cases are {', '.join(CASES)}")


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m lab.check_identity", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--eagle-head", default=None, help="the eagle3 case's head (default: a random one)")
    ServerArgs.add_cli_args(parser)
    namespace = parser.parse_args(argv)
    args = ServerArgs.from_cli_args(namespace)
    if args.tp_size == 1:
        parser.error("--tp-size: give the tensor-parallel size to compare against tp_size 1")
    cases = [case for case in namespace.cases.split(",") if case]
    if unknown := sorted(set(cases) - set(CASES)):
        parser.error(f"--cases: unknown {', '.join(unknown)}; the cases are {', '.join(CASES)}")
    from specserve.model.loader import default_model_path, resolve_model_path
    model_path = resolve_model_path(args.model_path or default_model_path())
    given = {**vars(args), "model_path": model_path}
    base = {**given, **PLAIN}
    plan = [("given", given)] if args.speculative_algorithm else []
    reference = greedy_outputs({**base, "tp_size": 1}, namespace.max_new_tokens)
    with tempfile.TemporaryDirectory(prefix="specserve-identity-") as scratch:
        plan += [(case, case_args(case, base, model_path, namespace.eagle_head, scratch)) for case in cases]
        for case, engine_args in plan:
            candidate = greedy_outputs(engine_args, namespace.max_new_tokens)
            print(json.dumps({"case": case, "tp_size": args.tp_size, "dtype": args.dtype,
                              "speculative_algorithm": engine_args["speculative_algorithm"],
                              "cuda_graphs": not engine_args["disable_cuda_graph"],
                              **compare(reference, candidate)}), flush=True)


if __name__ == "__main__":
    main()
