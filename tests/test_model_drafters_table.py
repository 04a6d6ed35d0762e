"""bench.model_drafters' table: each run against plain decoding of its cell, and how many of
its decode steps drafted (what an adaptive engine chose), and a hybrid's proposals by source."""
from __future__ import annotations

from specserve.bench.model_drafters import write_table


def run(config: str, tok_s: float, draft_steps: int, plain_steps: int, **extra) -> dict:
    return {"kind": "specserve", "workload": "code-types", "concurrency": 8, "config": config,
            "output_tokens_per_s": tok_s, "step_mix": {"prefill": {"steps": 2}, "plain": {"steps": plain_steps},
                                                        "draft": {"steps": draft_steps}}, **extra}


def test_the_table_gives_speedup_accept_length_and_drafting_steps(tmp_path):
    rows = [run("plain", 4000.0, 0, 250), {"kind": "engine", "config": "eagle3-3"},
            run("eagle3-3-adaptive", 4320.0, 99, 61, accept_length=1.67, draft_ms_per_step=5.48),
            run("eagle3-3-pinned", 4640.0, 132, 0, accept_length=1.99),
            run("eagle3-3-hybrid-adaptive", 4800.0, 90, 40, accept_length=2.4,
                draft_sources={"ngram": 120, "head": 310})]
    path = tmp_path / "table.md"
    write_table(rows, str(path))
    lines = path.read_text().splitlines()
    assert lines[0].endswith("| drafting steps | drafts by source |") and len(lines) == 6
    assert lines[2] == "| code-types | 8 | eagle3-3-adaptive | 4320.0 | 1.08x | 1.67 | 5.48 | 99 / 160 |  |"
    assert lines[3] == ("| code-types | 8 | eagle3-3-hybrid-adaptive | 4800.0 | 1.20x | 2.40 |  | 90 / 130 "
                        "| head 310 / ngram 120 |")
    assert lines[4] == "| code-types | 8 | eagle3-3-pinned | 4640.0 | 1.16x | 1.99 |  | 132 / 132 |  |"
    assert lines[5] == "| code-types | 8 | plain | 4000.0 | 1.00x |  |  | 0 / 250 |  |"


def test_rounds_give_the_median_rounds_ratio_to_plain_of_the_same_round(tmp_path):
    rows = []
    for round_, plain_tok_s, pinned_tok_s, accept in ((0, 4000.0, 4400.0, 2.1), (1, 3000.0, 4500.0, 2.6),
                                                      (2, 4000.0, 4800.0, 2.3)):
        rows += [run("plain", plain_tok_s, 0, 250, round=round_),
                 run("eagle3-3-pinned", pinned_tok_s, 120, 0, round=round_, accept_length=accept)]
    path = tmp_path / "table.md"
    write_table(rows, str(path))
    lines = path.read_text().splitlines()
    assert len(lines) == 4   # one row per config, not per round
    # ratios 1.10, 1.50, 1.20: the median round is round 2, whose own figures stand beside it
    assert lines[2] == "| code-types | 8 | eagle3-3-pinned | 4800.0 | 1.20x (1.10-1.50) | 2.30 |  | 120 / 120 |  |"
    assert lines[3].startswith("| code-types | 8 | plain | ") and "1.00x (1.00-1.00)" in lines[3]
