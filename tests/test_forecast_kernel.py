"""forecast_step.select_on_device's Triton kernel (runner/forecast_kernel.py) writes exactly
what its torch version does (Triton's interpreter on the CPU; compiled on a GPU)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel is defined; 0 on a GPU

import pytest
import torch

from specserve.kv.pool import PADDING_SLOT
from specserve.runner import forecast_kernel
from specserve.runner.forecast_step import select_with_torch
from specserve.runner.tree_step import TreeStepInputs

from tests.forecast_fixtures import picked_by_host, random_case

DEVICE = torch.device("cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda")


@pytest.mark.parametrize("bs,rows,candidates,n,m,nodes,width", [(5, 3, 2, 4, 3, 4, 6), (1, 8, 3, 8, 8, 8, 8),
                                                               (8, 2, 1, 2, 2, 2, 2), (6, 4, 2, 8, 4, 3, 4)])
def test_the_kernel_writes_what_torch_does(bs, rows, candidates, n, m, nodes, width):
    """Trees of the table's n nodes, a step of `nodes` (their first), in a buffer `width` wide."""
    table, outcome = random_case(bs * 7 + n, bs, rows, candidates, n, m)
    node_slots = torch.arange(bs * nodes).view(bs, nodes) + 1000
    results = []
    for use_kernel in (False, True):
        inputs = TreeStepInputs.allocate(bs + 3, width, DEVICE)   # padding rows after the batch
        inputs.tokens.fill_(7)
        inputs.parents.fill_(-1)
        inputs.out_slots.fill_(PADDING_SLOT)
        inputs.prefix_lens.copy_(torch.arange(bs + 3) * 10)
        args = (torch.from_numpy(outcome).to(DEVICE), torch.from_numpy(table).to(DEVICE), node_slots.to(DEVICE))
        if use_kernel:
            forecast_kernel.select(inputs.tokens, inputs.parents, inputs.out_slots, inputs.num_nodes,
                                   inputs.prefix_lens, *args, PADDING_SLOT)
        else:
            select_with_torch(inputs, *args)
        results.append(inputs.packed.cpu())
    assert torch.equal(results[0], results[1])
    assert 0 < picked_by_host(table, outcome).found.sum() < bs or bs == 1   # both ways tried, where there are two
