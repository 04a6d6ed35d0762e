"""Per-matrix GPU times of the few-row linear kernel (rows_linear.py) against cuBLAS with the
separate norm / SiLU / RoPE kernels, and of one row's GEMV, for a model shape's matrices at
several row counts; plus an exactness check of every config at real sizes in bf16 (split-K
configs called repeatedly: their workspace hand-over must never race).

`python lab/rows_linear_times.py --shape qwen2.5-coder-1.5b qwen2.5-7b --rows 4 8 16 32`
prints one JSON row per (shape, matrix, rows). `--sweep` also times the tile configs of SWEEP
(beyond the kernel's own candidates) and every config on the bare matrix (no norm, bias,
SiLU or RoPE: what the fused prologue and epilogues cost), with each time's bandwidth as a
share of the measured copy bandwidth."""
from __future__ import annotations

import argparse
import json

import torch

from specserve.bench.gpu_suite import measure_copy_bandwidth
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


# (BLOCK_N, BLOCK_K, SPLIT, num_warps, num_stages) beyond rows_linear's candidates: longer K tiles and
# deeper pipelines (more weight bytes in flight a program), wider lane blocks with 8 warps, narrow
# blocks with few splits (more programs without the workspace's atomics)
SWEEP = ((64, 128, 2, 4, 4), (64, 256, 1, 4, 3), (64, 256, 2, 8, 3), (128, 128, 1, 8, 3), (128, 128, 2, 8, 4),
         (128, 256, 1, 8, 3), (256, 64, 1, 8, 4), (256, 128, 1, 8, 3), (32, 128, 4, 4, 4), (32, 256, 2, 4, 3),
         (64, 128, 1, 4, 5), (128, 64, 2, 4, 5), (16, 256, 4, 4, 3), (32, 128, 1, 2, 4), (64, 64, 1, 2, 6),
         (32, 64, 1, 4, 6), (16, 128, 1, 2, 4), (64, 128, 4, 8, 4))


def config_times(shape: tuple[int, int], flags: dict, rows: int, configs, prenormed: bool = False) -> dict:
    """GPU us per call of rows_gemm at each config (failed configs left out), weights from HBM."""
    device = torch.device("cuda")
    weights, bias, x, norm, rope = gemv.timing_inputs(shape, torch.bfloat16, flags["has_bias"], flags["add_norm"],
                                                      device, flags["rope_heads"], rows)
    times = {}
    for config in configs:
        try:
            times[config] = gemv.graph_time_us([lambda w=w: rows_linear.rows_gemm(x, w, bias, flags["silu_mul"], config,
                                                                                   norm, rope, prenormed)
                                               for w in weights])
        except Exception as error:   # e.g. more shared memory than this GPU has
            print(json.dumps({"config": str(config), "shape": shape, "failed": str(error)[:200]}), flush=True)
    return times


def sweep_rows(base: dict, shape: tuple[int, int], flags: dict, rows: int, bandwidth: float) -> list[dict]:
    """The matrix with its epilogues (the norm in the loop, and prenormed) and bare, over the
    kernel's candidates and SWEEP: best configs and their share of the copy bandwidth."""
    padded = rows_linear.padded_rows(rows)
    configs = list(dict.fromkeys(list(rows_linear.candidates_for(shape[0], padded)) + list(SWEEP)))
    bare = dict(has_bias=False, silu_mul=False, add_norm=False, rope_heads=None)
    kinds = [("fused", flags, False)] + ([("prenormed", flags, True)] if flags["add_norm"] else [])
    out = []
    for kind, kind_flags, prenormed in kinds + [("bare", bare, False)]:
        times = config_times(shape, kind_flags, padded, configs, prenormed)
        if kind == kinds[-1][0]:   # bare: the last kind's six best configs (compiles are slow)
            configs = sorted(times, key=times.get)[:6]
        ranked = sorted(times.items(), key=lambda kv: kv[1])
        seconds = ranked[0][1] * 1e-6
        out.append({**base, "rows": rows, "kind": kind, "best_us": round(ranked[0][1], 2), "best": str(ranked[0][0]),
                    "share_of_copy_bw": round(base["weight_mb"] * 1e6 / seconds / bandwidth, 3),
                    "best_is_new": ranked[0][0] in SWEEP and ranked[0][0] not in rows_linear.CANDIDATES,
                    "top5": [[str(c), round(t, 2)] for c, t in ranked[:5]]})
    return out


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
    parser.add_argument("--matrices", nargs="*", default=None, help="only these (names as in matrices())")
    parser.add_argument("--sweep", action="store_true", help="also SWEEP's configs, fused and bare")
    ns = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = measure_copy_bandwidth("cuda") if ns.sweep else None
    for shape_name in ns.shape:
        for name, (shape, flags) in matrices(SHAPES[shape_name]).items():
            if ns.matrices and name not in ns.matrices:
                continue
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
                if ns.sweep:
                    for sweep_row in sweep_rows(base, shape, flags, rows, bandwidth):
                        print(json.dumps(sweep_row), flush=True)


if __name__ == "__main__":
    main()
