"""speculative/model_drafters/catch_up_batch.py: a catch-up's EXTEND inputs, packed with numpy, are each request's
tokens at positions starts[i].. in its slots and row, the last row the one logits row."""
from __future__ import annotations

import torch

from specserve.attention.base import ForwardMode
from specserve.speculative.model_drafters.catch_up_batch import catch_up_batch


def test_the_batch_holds_every_request_s_rows_in_order():
    tokens = [[11, 12, 13], [21], [31, 32]]
    batch = catch_up_batch([4, 0, 7], [5, 0, 9], tokens, [50, 51, 52, 60, 70, 71], pool=None, device=torch.device("cpu"))
    assert batch.mode == ForwardMode.EXTEND
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert batch.positions.tolist() == [5, 6, 7, 0, 9, 10]
    assert batch.out_slots.tolist() == [50, 51, 52, 60, 70, 71]
    assert batch.req_rows.tolist() == [4, 0, 7]
    assert batch.prefix_lens.tolist() == [5, 0, 9] and batch.prefix_lens_host == [5, 0, 9]
    assert batch.extend_lens.tolist() == [3, 1, 2] and batch.extend_lens_host == [3, 1, 2]
    assert batch.logits_indices.tolist() == [5]
    assert all(t.dtype == torch.long for t in (batch.input_ids, batch.positions, batch.out_slots, batch.req_rows))
