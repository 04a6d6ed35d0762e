"""Correctness on the GPU, in one call: the model and engine checks of the CPU test suite
at real size on CUDA, in fp32 and bf16.

`python -m specserve.bench.gpu_checks --model M.gguf --dtype float32|bfloat16` prints one
JSON line per check: logits vs transformers, greedy vs transformers.generate, batch
invariance, NGRAM greedy identity (eager and CUDA graphs), Triton vs torch_native engines,
and KV slots after the runs. fp32 must match exactly; bf16 reports match rates.
"""
from __future__ import annotations

import argparse
import json

import torch

from specserve.bench.prompts import SAMPLE_PROMPTS

PROMPTS = SAMPLE_PROMPTS[:7] + [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over",
]


def report(name: str, **values) -> None:
    print(json.dumps({"check": name, **values}), flush=True)


def greedy_ids(engine, prompts, max_new_tokens=64):
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens})
    return [o["output_ids"] for o in outs]


def check_logits(engine, hf, prompts, dtype) -> None:
    from specserve.bench.hf_baseline import _generate
    worst = 0.0
    for ids in prompts[:4]:
        out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 1},
                              return_logprob=True, top_logprobs_num=1)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0, -1].float(), -1)
        ours = out["meta_info"]["output_token_logprobs"][0][0]
        worst = max(worst, abs(ours - ref[out["output_ids"][0]].item()))
    report("first-token logprob vs transformers", dtype=dtype, max_abs_diff=worst)
    hf_out = [_generate(hf, [ids], {"max_new_tokens": 64, "do_sample": False, "pad_token_id": 0})[0] for ids in prompts[:5]]
    ours = greedy_ids(engine, prompts[:5])
    same = [_prefix_match(a, b) for a, b in zip(ours, hf_out)]
    report("greedy vs transformers.generate (5 x 64 tokens)", dtype=dtype, identical=sum(s == 1.0 for s in same),
           mean_matching_prefix=sum(same) / len(same))


def _prefix_match(a: list[int], b: list[int]) -> float:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i / max(n, 1)
    return 1.0


def check_engine(model: str, dtype: str, backend: str, graphs: bool, hf=None) -> None:
    from specserve.engine.engine import Engine
    common = dict(model_path=model, dtype=dtype, attention_backend=backend, disable_cuda_graph=not graphs,
                  log_level="warning", max_total_tokens=200_000)
    label = f"{backend}{' + cuda graphs' if graphs else ''}"
    with Engine(**common) as engine:
        prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
        if hf is not None:
            check_logits(engine, hf, prompts, dtype)
        solo = [greedy_ids(engine, [p])[0] for p in prompts]
        batch = greedy_ids(engine, prompts)
        report("batch of 8 == solo", dtype=dtype, engine=label, identical=sum(a == b for a, b in zip(solo, batch)), of=8)
    for one_branch in (False, True):
        with Engine(**common, speculative_algorithm="NGRAM", speculative_num_draft_tokens=8,
                    speculative_one_branch=one_branch) as engine:
            spec = greedy_ids(engine, prompts)
            pool = engine.core.runner.pool
            report("NGRAM greedy == plain", dtype=dtype, engine=label, one_branch=one_branch,
                   identical=sum(a == b for a, b in zip(solo, spec)), of=8,
                   kv_slots_free=engine.core.scheduler.available_slots() == pool.size)
    return solo


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    ns = parser.parse_args(argv)
    from specserve.bench.hf_baseline import load_hf_model
    hf = load_hf_model(ns.model, ns.dtype, "cuda")
    reference = check_engine(ns.model, ns.dtype, "torch_native", graphs=False, hf=hf)
    del hf
    torch.cuda.empty_cache()
    for graphs in (False, True):
        solo = check_engine(ns.model, ns.dtype, "triton", graphs)
        report("triton greedy == torch_native greedy", dtype=ns.dtype, cuda_graphs=graphs,
               identical=sum(a == b for a, b in zip(solo, reference)), of=len(solo))


if __name__ == "__main__":
    main()
