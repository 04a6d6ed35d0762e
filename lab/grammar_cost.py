"""What a grammar costs and what speculation gains under it: decode speed with and without
a JSON schema, plain and with NGRAM, on a schema-constrained extraction workload (the
answer copies a record from the prompt: agentic JSON repeats what came before).

`python -m lab.grammar_cost [--model M] [--device cuda] [--batch-sizes 1 8] [ServerArgs flags]`
runs, per (algorithm, batch size), the same greedy requests with `json_schema` set and
without it (ignore_eos off: a constrained answer ends where its JSON ends, an unconstrained
one where the model stops or at --max-new-tokens), `--repeats` times after one warm-up, and
prints one JSON line each: output tokens per second (median), the grammar's cost (plain
without / plain with the schema) and NGRAM's speed-up under the schema (NGRAM / plain, both
with it). The targets of the structured-output work: the grammar costs plain decoding <= 5%,
NGRAM with the schema >= 1.5x plain with it at batch 1 (H200, 1.5B).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

RECORD = {"id": 4182, "name": "Ada Lovelace", "role": "engineer", "city": "London",
          "skills": ["analysis", "mathematics", "programming"], "active": True}
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 40}, "role": {"type": "string", "maxLength": 20},
    "city": {"type": "string", "maxLength": 20}, "skills": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                            "maxItems": 5},
    "active": {"type": "boolean"}}, "required": ["id", "name", "role", "city", "skills", "active"]}


def prompts(tokenizer, batch_size: int) -> list[str]:
    """Chat prompts asking for record i as JSON, the record shown in the prompt."""
    out = []
    for i in range(batch_size):
        record = {**RECORD, "id": RECORD["id"] + i}
        text = f"Here is a record: {json.dumps(record)}\nReturn this record as JSON, unchanged."
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True))
    return out


def measure(engine, batch: list[str], params: dict, repeats: int) -> float:
    """Median output tokens per second of the batch."""
    engine.generate(batch, params)   # warm-up (and the grammar's compile)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = engine.generate(batch, params)
        rates.append(sum(o["meta_info"]["completion_tokens"] for o in outputs) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    from specserve.engine.engine import Engine
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    args = parser.parse_args()
    base = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    constrained = {**base, "json_schema": json.dumps(SCHEMA)}
    rates = {}
    for algorithm in (None, "NGRAM"):
        spec = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": args.num_draft_tokens} \
            if algorithm else {}
        with Engine(model_path=args.model, device=args.device, dtype=args.dtype, log_level="warning", **spec) as engine:
            for bs in args.batch_sizes:
                batch = prompts(engine.tokenizer, bs)
                for name, params in (("free", base), ("schema", constrained)):
                    rates[algorithm or "plain", bs, name] = measure(engine, batch, params, args.repeats)
    for bs in args.batch_sizes:
        for algorithm in ("plain", "NGRAM"):
            free, schema = rates[algorithm, bs, "free"], rates[algorithm, bs, "schema"]
            print(json.dumps({"algorithm": algorithm, "batch_size": bs, "tok_s_free": round(free, 1),
                              "tok_s_schema": round(schema, 1), "grammar_cost": round(1 - schema / free, 3)}))
        print(json.dumps({"batch_size": bs, "ngram_speedup_under_schema":
                          round(rates["NGRAM", bs, "schema"] / rates["plain", bs, "schema"], 2)}))


if __name__ == "__main__":
    main()
