"""bench.prefill_cost's fit of a prefill step's cost into a fixed part and a per-token part."""
from __future__ import annotations

import pytest

from specserve.bench.prefill_cost import fit


def test_fit_separates_the_fixed_cost_from_the_per_token_cost():
    lengths = [16, 100, 300, 1000, 2000]
    fixed, per_token = fit(lengths, [20.0 + 0.006 * n for n in lengths])   # 20 ms + 6 us per token
    assert fixed == pytest.approx(20.0) and per_token == pytest.approx(6.0)
