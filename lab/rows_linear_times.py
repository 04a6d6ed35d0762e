"""Per-matrix GPU times of the few-row linear kernel (rows_linear.py) against cuBLAS with the
separate norm / SiLU / RoPE kernels, and of one row's GEMV, for a model shape's matrices at
several row counts; plus an exactness check of every config at real sizes in bf16 (split-K
configs called repeatedly: their workspace hand-over must never race).

`python lab/rows_linear_times.py --shape qwen2.5-coder-1.5b qwen2.5-7b --rows 4 8 16 32`
prints one JSON row per (shape, matrix, rows)."""
from __future__ import annotations

import argparse
import json

import torch

from specserve.bench.random_model import SHAPES
from specserve.model import gemv, rows_linear


def matrices(c: dict) -> dict[str, tuple[tuple[int, int], dict]]:
    """name -> (weight shape, epilogue flags) of one decoder layer and the lm_head."""
    hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = hidden // heads
    bias = c["model_type"] == "qwen2"
    return {
        "qkv+norm+rope": (((heads + 2 * kv_heads) * head_dim, hidden),
                          dict(has_bias=bias, silu_mul=False, add_norm=True, rope_heads=(heads, kv_heads, head_dim))),
        "o_proj": ((hidden, hidden), dict(has_bias=False, silu_mul=False, add_norm=False, rope_heads=None)),
        "gate_up+norm+silu": ((2 * c["intermediate_size"], hidden),
                              dict(has_bias=False, silu_mul=True, add_norm=True, rope_heads=None)),
        "down_proj": ((hidden, c["intermediate_size"]), dict(has_bias=False, silu_mul=False, add_norm=False,
                                                             rope_heads=None)),
        "lm_head+norm": ((c["vocab_size"], hidden), dict(has_bias=False, silu_mul=False, add_norm=True,
                                                         rope_heads=None)),
    }


def exactness(shape: tuple[int, int], flags: dict, rows: int, config, repeats: int = 20) -> float:
    """Largest |kernel - reference| / max|reference| over `repeats` calls, bf16, no epilogue
    but the norm (the arithmetic the configs differ in)."""
    w = torch.randn(shape, dtype=torch.bfloat16, device="cuda") * 0.02
    x = torch.randn((rows, shape[1]), dtype=torch.bfloat16, device="cuda")
    norm = gemv.AddNorm(torch.randn_like(x), torch.rand(shape[1], dtype=torch.bfloat16, device="cuda"), 1e-6) \
        if flags["add_norm"] else None
    expected = gemv.reference(x, w, None, False, add_norm=norm)
    expected = expected[0] if norm else expected
    worst = 0.0
    for _ in range(repeats):
        got = rows_linear.rows_gemm(x, w, None, False, config, add_norm=norm)
        got = got[0] if norm else got
        worst = max(worst, ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", nargs="*", default=["qwen2.5-coder-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, nargs="*", default=[4, 8, 16, 32])
    parser.add_argument("--check", action="store_true", help="also the exactness of every config")
    ns = parser.parse_args()
    device = torch.device("cuda")
    for shape_name in ns.shape:
        for name, (shape, flags) in matrices(SHAPES[shape_name]).items():
            one = gemv.candidate_times(shape, torch.bfloat16, flags["has_bias"], flags["silu_mul"], flags["add_norm"],
                                       device, flags["rope_heads"])
            base = {"shape": shape_name, "matrix": name, "weight_mb": shape[0] * shape[1] * 2 / 1e6}
            print(json.dumps({**base, "rows": 1, "cublas_us": one[None],
                              "best_us": min(one.values()), "best": str(min(one, key=one.get))}), flush=True)
            for rows in ns.rows:
                padded = rows_linear.padded_rows(rows)
                times = rows_linear.candidate_times(shape, torch.bfloat16, flags["has_bias"], flags["silu_mul"],
                                                    flags["add_norm"], device, flags["rope_heads"], padded)
                kernel = {c: t for c, t in times.items() if c is not None} or {None: times[None]}
                best = min(kernel, key=kernel.get)
                row = {**base, "rows": rows, "cublas_us": times[None], "best_us": kernel[best], "best": str(best),
                       "times": {str(c): round(t, 2) for c, t in kernel.items()}}
                if ns.check and rows == ns.rows[0]:
                    row["max_rel_error"] = {str(c): exactness(shape, flags, rows, c)
                                            for c in rows_linear.candidates_for(shape[0], padded)}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
