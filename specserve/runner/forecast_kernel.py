"""forecast_step.select_on_device as one Triton kernel: the torch version launches ~25 small
kernels, each 5-10 us of host dispatch on the launch path of a step queued ahead (the host
work a forecast step must fit beside the GPU's). One program per request; the torch code
stays the reference and runs on CPUs, and this kernel writes the same values
(tests/test_ngram_forecast.py, Triton's interpreter). Imported on first CUDA use: CPU-only
installs never import Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


# No argument is specialised on (Triton compiles a variant per integer that is 1 or a multiple
# of 16, and per pointer that is 16-byte aligned or not: the step inputs are slices of one packed
# buffer at offsets that follow its shape): the table's strides follow the width of the step
# before, the tier the width of this one, so each new combination was a compile of ~0.1 s in the
# middle of serving. BLOCK follows the table's width, fixed for an engine: one variant, compiled
# at warm-up.
_ARGS = ("outcome_ptr", "outcome_s0", "table_ptr", "table_s0", "table_s1", "table_s2", "slots_ptr", "slots_s0",
         "tokens_ptr", "parents_ptr", "out_slots_ptr", "inputs_s0", "num_nodes_ptr", "prefix_ptr",
         "m", "n", "nodes", "candidates", "padding_slot")


@triton.jit(do_not_specialize=list(_ARGS), do_not_specialize_on_alignment=[a for a in _ARGS if a.endswith("_ptr")])
def _select_kernel(outcome_ptr, outcome_s0, table_ptr, table_s0, table_s1, table_s2, slots_ptr, slots_s0,
                   tokens_ptr, parents_ptr, out_slots_ptr, inputs_s0, num_nodes_ptr, prefix_ptr,
                   m, n, nodes, candidates, padding_slot, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    row = outcome_ptr + b * outcome_s0
    accepted = tl.load(row)                                    # N's accepted nodes = committed tokens
    last = tl.maximum(accepted - 1, 0)
    bonus = tl.load(row + 1 + m + last)
    last_node = tl.maximum(tl.load(row + 1 + last), 0)
    entries = table_ptr + b * table_s0 + last_node * table_s1
    # the first candidate whose token is the bonus (none: -1)
    hit = -1
    for c in range(candidates):
        token = tl.load(entries + c * table_s2)
        hit = tl.where((hit < 0) & (token == bonus), c, hit)
    entry = entries + tl.maximum(hit, 0) * table_s2
    count = tl.minimum(tl.where(hit >= 0, tl.load(entry + 2 * n - 1), 1), nodes)   # its first `nodes` nodes
    node = tl.arange(0, BLOCK)
    real = node < count
    is_draft = (node > 0) & (node < nodes)
    drafts = tl.load(entry + node, mask=is_draft & real, other=0)
    parents = tl.load(entry + n - 1 + node, mask=is_draft & real, other=-1)
    tokens = tl.where(node == 0, bonus, drafts)
    inside = node < nodes
    slots = tl.load(slots_ptr + b * slots_s0 + node, mask=inside, other=padding_slot)
    tl.store(tokens_ptr + b * inputs_s0 + node, tokens, mask=inside)
    tl.store(parents_ptr + b * inputs_s0 + node, tl.where(node == 0, -1, parents), mask=inside)
    tl.store(out_slots_ptr + b * inputs_s0 + node, tl.where(real, slots, padding_slot), mask=inside)
    tl.store(num_nodes_ptr + b, count)
    tl.store(prefix_ptr + b, tl.load(prefix_ptr + b) + accepted)


def select(tokens: torch.Tensor, parents: torch.Tensor, out_slots: torch.Tensor, num_nodes: torch.Tensor,
           prefix_lens: torch.Tensor, outcome: torch.Tensor, table: torch.Tensor, node_slots: torch.Tensor,
           padding_slot: int) -> None:
    """select_on_device's writes (its docstring): tokens, parents, out_slots (>= bs, >= n, one
    row stride, the last dim contiguous) and num_nodes, prefix_lens (contiguous) of a step's
    inputs; outcome (bs, 1 + 2m), table (bs, R, C, 2n + 1) and node_slots (bs, nodes <= n),
    each row's last dim contiguous."""
    bs, _, candidates, width = table.shape
    n, nodes = (width - 1) // 2, node_slots.shape[1]
    m = (outcome.shape[1] - 1) // 2
    assert tokens.stride() == parents.stride() == out_slots.stride() and tokens.stride(1) == 1
    _select_kernel[(bs,)](outcome, outcome.stride(0), table, table.stride(0), table.stride(1), table.stride(2),
                          node_slots, node_slots.stride(0), tokens, parents, out_slots, tokens.stride(0),
                          num_nodes, prefix_lens, m, n, nodes, candidates, padding_slot,
                          BLOCK=max(2, triton.next_power_of_2(n)), num_warps=1)
