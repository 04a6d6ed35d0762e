"""The forecast's selection kernel (runner/forecast_kernel.py) compiles once for an engine:
steps of every width after steps of every width, at any batch size, in input buffers of any
shape, reuse that variant (a new one was a compile in the middle of serving)."""
from __future__ import annotations

import torch

from specserve.engine.kernel_cache import TritonCompileCounter
from specserve.kv.pool import PADDING_SLOT
from specserve.runner import forecast_kernel
from specserve.runner.tree_step import TreeStepInputs

from tests.forecast_fixtures import random_case

N = 16   # the table's trees: an engine's num_draft_tokens


def _select(bs: int, rows: int, nodes: int) -> None:
    table, outcome = random_case(bs + rows + nodes, bs, rows, 2, N, rows)
    # inputs as wide as the step (each part of the packed buffer then starts at its own alignment)
    inputs = TreeStepInputs.allocate(bs + 1, nodes, torch.device("cuda"))
    node_slots = torch.arange(bs * nodes, device="cuda").view(bs, nodes)
    forecast_kernel.select(inputs.tokens, inputs.parents, inputs.out_slots, inputs.num_nodes, inputs.prefix_lens,
                           torch.from_numpy(outcome).cuda(), torch.from_numpy(table).cuda(), node_slots,
                           PADDING_SLOT)


def test_one_variant_serves_every_width_and_batch():
    _select(1, 4, 4)
    torch.cuda.synchronize()
    with TritonCompileCounter() as compiles:
        for bs, rows, nodes in [(1, 16, 16), (8, 2, 2), (3, 16, 5), (8, 16, 16), (2, 7, 8), (1, 1, 3)]:
            _select(bs, rows, nodes)
        torch.cuda.synchronize()
    assert compiles.compiles == 0
