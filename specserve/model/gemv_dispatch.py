"""Which kernel a matmul of 1..16 CUDA rows runs: gemv.py's one-row GEMV, gemv_rows.py's
multi-row kernel, or cuBLAS with the unfused norm / RoPE / SiLU kernels, whichever was
measured fastest for the weight shape, epilogue and row block on this GPU. layers.py and
llama.py call rows_linear; the module-level switches are the A/B of the benchmarks."""
from __future__ import annotations

import functools
import logging

import torch

from specserve.model import gemv, gemv_rows
from specserve.model.gemv import AddNorm, RopeStore
from specserve.model.gemv_tuning import candidate_times, one_row_config, unfused

logger = logging.getLogger(__name__)

__all__ = ["AddNorm", "RopeStore", "ROWS_ENABLED", "takes_rows", "rows_linear", "best_config"]

ROWS_ENABLED = True  # False: 2..16-row matmuls go to cuBLAS + the unfused kernels (bench.step_cost --rows-gemv)
TUNING_LOG: list[dict] = []  # every best_config's timings, for the benchmarks to report


def takes_rows(rows: int) -> bool:
    """Whether a CUDA matmul of `rows` rows goes through the GEMV kernels (gemv.ENABLED for
    one row, ROWS_ENABLED for 2..16)."""
    return gemv.ENABLED if rows == 1 else ROWS_ENABLED and 2 <= rows <= gemv_rows.MAX_ROWS


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul: bool = False,
                add_norm: AddNorm | None = None, rope: RopeStore | None = None,
                input_rows: torch.Tensor | None = None):
    """x @ W^T (+ bias) (then silu_mul or rope) for 1..16 CUDA rows by the fastest measured
    path; with add_norm the input is normalised first and (output, residual + x) is
    returned. input_rows: compute only these rows of x (the lm_head's logits rows)."""
    key = (tuple(weight.shape), weight.dtype, bias is not None, silu_mul, add_norm is not None,
           rope.heads if rope is not None else None)
    if x.shape[0] == 1:  # input_rows can only be [0]
        config = one_row_config(*key, weight.device)
        if config is not None:
            return gemv.gemv(x, weight, bias, silu_mul, config, add_norm, rope)
        return unfused(x, weight, bias, silu_mul, add_norm, rope)
    rows = x.shape[0] if input_rows is None else input_rows.shape[0]
    config = best_config(*key, gemv_rows.row_block(rows), weight.device)
    if config is not None:
        return gemv_rows.gemm_rows(x, weight, bias, silu_mul, config, add_norm, rope, input_rows)
    if input_rows is not None:
        x = x[input_rows]
        if add_norm is not None:
            add_norm = AddNorm(add_norm.residual[input_rows], add_norm.weight, add_norm.eps)
    return unfused(x, weight, bias, silu_mul, add_norm, rope)


@functools.lru_cache(maxsize=None)
def best_config(shape: tuple[int, int], dtype: torch.dtype, has_bias: bool, silu_mul: bool, add_norm: bool,
                rope_heads: tuple[int, int, int] | None, rows: int, device: torch.device) -> tuple | None:
    """The fastest gemv_rows config for `rows` rows (a row block, timed at its largest
    count) of this weight shape, or None when cuBLAS + the unfused kernels win."""
    gemv_rows.split_k_workspace(device)  # here, before any graph capture that may launch split-K configs
    times = candidate_times(shape, dtype, has_bias, silu_mul, add_norm, device, rope_heads, rows=rows,
                            kernel=gemv_rows.gemm_rows, configs=gemv_rows.configs_for(rows))
    epilogue = "".join(name for name, used in ((" + add_norm", add_norm), (" + silu_mul", silu_mul),
                                                (" + rope", rope_heads)) if used)
    logger.info("%d-row matmul %s%s: %s", rows, shape, epilogue,
                ", ".join(f"{'cublas' if k is None else k} {v:.1f} us" for k, v in times.items()))
    best = min(times, key=times.get)
    TUNING_LOG.append({"rows": rows, "shape": list(shape), "epilogue": epilogue.strip(" +"), "best": best,
                       "us": {"cublas" if k is None else "/".join(map(str, k)): round(v, 2) for k, v in times.items()}})
    workspace, counters = gemv_rows.split_k_workspace(device)
    workspace.zero_()  # a config that disagreed (and was dropped) may have left partial sums behind
    counters.zero_()
    return best
