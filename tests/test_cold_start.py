"""lab/cold_start.py end to end on a tiny random model: a fresh engine in its own process
(NGRAM: the drafter is reset before each run), one JSON row per measurement on stdout and
in --out."""
from __future__ import annotations

import json

from spec_fixtures import make_tiny_directory
from lab import cold_start


def test_cold_start_writes_one_row_per_engine_and_shape(tmp_path, capsys):
    model = tmp_path / "tiny"
    make_tiny_directory(model, vocab_size=512)   # its tokenizer has 280 tokens
    out = tmp_path / "rows.jsonl"
    rows = cold_start.main(["--model", str(model), "--device", "cpu", "--dtype", "float32", "--context-length", "2048",
                            "--algorithms", "NGRAM", "--repeats", "1", "--max-new-tokens", "4",
                            "--log-level", "warning", "--out", str(out)])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == rows == [json.loads(line) for line in out.read_text().splitlines()]
    starts = [r for r in rows if r["kind"] == "engine_start"]
    assert [r["algorithm"] for r in starts] == ["NGRAM"]
    assert all(r["device"] == "cpu" and r["warmup_s"] is None for r in starts)  # no warm-up on a CPU
    measured = [r for r in rows if r["kind"] == "cold_start"]
    shapes = ["short-chat", "code-edit-400", "code-edit-600", "long"]
    assert [r["shape"] for r in measured] == shapes
    for row in measured:
        assert row["new_tokens"] == 4 and row["ratio"] == row["first_s"] / row["repeat_s"]
        assert row["ok"] == (row["ratio"] <= 1.5) and row["target_step_s"] is None
    lengths = {r["shape"]: r["prompt_tokens"] for r in measured}
    # the long prompt stays under the chunk size (2048) and half the context, less a margin
    assert lengths["short-chat"] < lengths["code-edit-400"] < lengths["code-edit-600"] < lengths["long"] <= 960
