"""The lab's prefill-attention sweep times what it checks: every configuration it launches
gives the attention torch's math backend gives (Triton's interpreter, tiny sizes)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from lab.extend_attention_sweep import causal_tflop, parse_args, sweep  # noqa: E402


def test_every_swept_kernel_matches_the_math_backend_or_says_why_not():
    ns = parse_args(["--heads", "4", "2", "64", "--chunks", "16", "--depths", "0", "40", "--configs", "32,16,4,1",
                     "64,32,4,2", "--splits", "1", "2", "--iters", "1"])
    rows = list(sweep(ns))
    ours = [r for r in rows if r["kernel"] == "specserve"]
    assert len(ours) == 2 * 2 * 2 and all(r["max_err"] < 1e-3 for r in ours)
    assert all("max_err" in r or "error" in r for r in rows)
    # the prefix and the chunk attended apart and merged: the same attention
    assert [r["max_err"] < 1e-4 for r in rows if r["kernel"] == "split-math"] == [True, True]


def test_causal_work_counts_the_keys_each_new_token_sees():
    # 2 new tokens after 3: they see 4 and 5 keys
    assert causal_tflop(1, 1, 2, 3) == 4 * (4 + 5) / 1e12
