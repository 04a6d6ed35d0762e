"""CPU matmul dispatch for linear layers (fp32, PyTorch built with oneDNN).

Why (measured on a 2-core AMD EPYC, AVX2, one thread, SmolLM2-135M's shapes, weights cold in
cache as in a real forward): torch's F.linear (MKL sgemm) is slow for few rows on this CPU.
Its 30 layers' matmuls cost 47 ms at 2 rows and 65 ms at 8 (oneDNN: 28 and 47 ms), the
49152x576 lm_head 19 ms at 2..4 rows (oneDNN: 8..9 ms). oneDNN wants the weight reordered into
its blocked layout, which we do once at load (no reorder per call then, whatever the rows).
For one row oneDNN gains nothing; MKL does, on a weight stored column-major (W^T contiguous)
if it has at least as many outputs as inputs: the layers take 22 ms instead of 27, the lm_head
4.2 ms instead of 7.9; the down projection (1536 -> 576) is faster row-major.
From ~48 rows on (prefill) MKL beats oneDNN on the layers by 5-10%, not on the lm_head.

Memory: the packed copy doubles the matmul weights (+513 MiB for SmolLM2-135M). A weight
stored column-major replaces the row-major one; a tied embedding looks tokens up in the
lm_head's column-major weight (gathering strided columns: +0.03 ms for 8 tokens, +15 ms for 2048).
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

PACK_FOR_ROWS = 16     # the row count oneDNN chooses its weight layout for (a verify step's)
LAYER_PACKED_ROWS = 32  # above this MKL's sgemm is as fast as oneDNN on layer-sized weights


class CpuLinear(nn.Module):
    """y = x W^T + b: oneDNN's packed weight for 2..max_packed_rows rows (None: no limit), else
    F.linear (MKL) on `weight`, in the memory layout given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_packed_rows: int | None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_FOR_ROWS)
        self.max_packed_rows = max_packed_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows >= 2 and (self.max_packed_rows is None or rows <= self.max_packed_rows):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _one_row_layout(weight: torch.Tensor) -> torch.Tensor:
    """weight, column-major if out_features >= in_features (see above), OVERWRITING weight's
    memory (its module is discarded): a new tensor per layer would leave ~200 MiB of heap
    holes once the old ones are freed, while each temporary here reuses the one before it."""
    if weight.shape[0] < weight.shape[1]:
        return weight
    transposed = weight.t().contiguous()
    return weight.view(-1).copy_(transposed.view(-1)).view(weight.shape[1], weight.shape[0]).t()


@torch.no_grad()
def use_cpu_linears(model: nn.Module) -> None:
    """After load_weights of an fp32 DecoderLM on the CPU: every nn.Linear becomes a CpuLinear,
    and so does the lm_head, tied or not (so model.lm_head is no longer None)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child is not model.lm_head:
                setattr(module, name, CpuLinear(_one_row_layout(child.weight), child.bias, LAYER_PACKED_ROWS))
    tied = model.lm_head is None
    head = model.embed_tokens.weight if tied else model.lm_head.weight
    model.lm_head = CpuLinear(_one_row_layout(head), None, None)
    if tied:
        model.embed_tokens.weight = model.lm_head.weight
