"""The sampling graphs' host side (sampling/plain_graphs.py; the graphs themselves run in
tests/gpu/test_decode_launch_cuda.py): one packed buffer holds every column without overlap,
its float columns exact, and only a decode graph's logits buffer (or its first rows) is taken."""
from __future__ import annotations

import numpy as np
import torch

from specserve.sampling.plain_graphs import FLOAT_COLUMNS, INT_COLUMNS, PlainSamplingGraphs, PlainSamplingInputs


def test_the_packed_columns_hold_each_value_apart():
    bucket = 4
    inputs = PlainSamplingInputs.allocate(bucket, "cpu")
    columns = inputs.columns(bucket)
    assert set(columns) == set(FLOAT_COLUMNS) | set(INT_COLUMNS)
    values = {name: np.arange(bucket) + 10 * i + (0.25 if name in FLOAT_COLUMNS else 0)
              for i, name in enumerate(columns)}
    for name, view in columns.items():
        view.numpy()[:] = values[name]
    for name, view in inputs.columns(bucket).items():
        assert view.dtype == (torch.float32 if name in FLOAT_COLUMNS else torch.long)
        assert view.shape == (bucket,) and view.tolist() == values[name].tolist(), name
    # the packed buffer is what a single copy sends: a copy of it carries every column
    copy = PlainSamplingInputs(inputs.packed.clone())
    assert all(torch.equal(copy.columns(bucket)[name], columns[name]) for name in columns)


def test_only_a_decode_graphs_logits_are_covered():
    buffer = torch.zeros(8, 1, 32)[:, 0]   # a decode graph's (bucket, vocab) logits, a view of (bucket, 1, vocab)
    graphs = PlainSamplingGraphs([buffer], vocab_size=32)
    assert graphs.covers(buffer) and graphs.covers(buffer[:3])
    assert not graphs.covers(buffer[1:4])          # not the buffer's first rows
    assert not graphs.covers(buffer.clone())       # another tensor: the eager path samples it
    assert not graphs.covers(torch.zeros(8, 32))
