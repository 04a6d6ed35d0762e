"""CPU matmul dispatch for linear layers (fp32, PyTorch built with oneDNN).

Why (measured on a 2-core AMD EPYC, AVX2, one thread, SmolLM2-135M shapes): torch's F.linear,
MKL sgemm on the transposed view of W, is slow for few rows on this CPU. The 49152x576 lm_head
costs 7.9 ms at 1 row and 19 ms at 2..4 rows; the layers' matmuls cost 30-40% more than oneDNN
at 2..16 rows (speculative decoding's verify steps). oneDNN, with the weight reordered once at
load into its blocked layout (and never again per call, whatever the row count), costs 6.5 /
7.8 / 8.9 / 11.7 ms for the lm_head at 1 / 2 / 4 / 8 rows, but is the slowest for one row.
One row is fastest as x @ W^T with W^T stored contiguous, (in, out): 4.2 ms for the lm_head, as
fast as F.linear for the layers. From ~48 rows on (prefill) MKL beats oneDNN on the layers by
5-10%, but not on the lm_head, whose 113 MB stream through memory once either way.

So each linear keeps two copies of its weight, the transposed one (for 1 row and for many) and
the oneDNN-packed one (2..max_packed_rows rows); the nn.Linear's own copy is freed. A tied
lm_head lends its transposed copy to the embedding (a strided view: the lookup gathers columns,
+0.03 ms for 8 tokens, +15 ms for 2048), so tied or not, the matmul weights cost twice their size.
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

PACK_FOR_ROWS = 16     # the row count oneDNN chooses its weight layout for (a verify step's)
LAYER_PACKED_ROWS = 32  # above this MKL's sgemm is as fast as oneDNN on layer-sized weights


class CpuLinear(nn.Module):
    """y = x W^T + b: oneDNN's packed weight for 2..max_packed_rows rows, else MKL on W^T."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_packed_rows: int | None):
        super().__init__()
        self.weight_t = weight.detach().t().contiguous()   # (in_features, out_features)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
        self.bias = None if bias is None else bias.detach()
        self.max_packed_rows = max_packed_rows              # None: no limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows >= 2 and (self.max_packed_rows is None or rows <= self.max_packed_rows):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight_t.t(), self.bias)


@torch.no_grad()
def use_cpu_linears(model: nn.Module) -> None:
    """After load_weights of an fp32 DecoderLM on the CPU: every nn.Linear becomes a CpuLinear,
    and so does the lm_head (also when tied: then model.lm_head is no longer None)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child is not model.lm_head:
                setattr(module, name, CpuLinear(child.weight, child.bias, LAYER_PACKED_ROWS))
    tied = model.lm_head is None
    model.lm_head = CpuLinear(model.embed_tokens.weight if tied else model.lm_head.weight, None, None)
    if tied:  # one (in, out) copy serves both the lookup and the 1-row logits
        model.embed_tokens.weight = nn.Parameter(model.lm_head.weight_t.t(), requires_grad=False)
