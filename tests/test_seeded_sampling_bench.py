"""lab.seeded_sampling's bookkeeping: accept length and its standard error from
the engine's accept histograms, the identity share, the table, the --configs parser."""
from __future__ import annotations

import argparse

import pytest

from lab.seeded_sampling import _config, summarize, table


def output(ids: list[int], histogram: dict[int, int]) -> dict:
    return {"output_ids": ids, "meta_info": {"spec_accept_histogram": histogram}}


def test_summarize_counts_verify_steps_and_identity() -> None:
    outputs = [output([1, 2, 3, 4, 5], {1: 2, 2: 1}), output([7, 8, 9], {2: 1}), output([5], {})]
    summary = summarize(outputs, plain=[[1, 2, 3, 4, 5], [7, 8, 0], [5]])
    assert summary["verify_steps"] == 4 and summary["output_tokens"] == 9
    assert summary["accept_length"] == pytest.approx(6 / 4)
    assert summary["identical_to_plain"] == pytest.approx(2 / 3)
    # ratio estimator: residuals c - R s = (4 - 4.5, 2 - 1.5, 0) around R = 1.5, mean steps 4/3
    spread = ((0.25 + 0.25) / 2) ** 0.5
    assert summary["accept_length_stderr"] == pytest.approx(spread / (4 / 3) / 3 ** 0.5)


def test_table_puts_the_rules_side_by_side() -> None:
    base = {"model": "m", "workload": "code-edit", "config": "ngram-8-multi", "accept_length_stderr": 0.1}
    rows = [{**base, "rule": "coupled", "accept_length": 2.0, "identical_to_plain": 1.0},
            {**base, "rule": "rejection", "accept_length": 2.1, "identical_to_plain": 0.25}]
    last = table(rows).splitlines()[-1]
    assert last == "| m | code-edit | ngram-8-multi | 2.00 ± 0.10 | 2.10 ± 0.10 | 100% | 25% |"


def test_config_parser() -> None:
    assert _config("8-multi") == (8, False, False) and _config("16-one-adaptive") == (16, True, True)
    with pytest.raises(argparse.ArgumentTypeError, match="--configs"):
        _config("8-wide")
