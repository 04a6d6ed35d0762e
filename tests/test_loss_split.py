"""lab/loss_split.py: a losing cell's extra time, split by step kind against plain's run."""
from lab import loss_split


def run(config: str, duration_ms: float, prefill: tuple, plain: tuple, draft: tuple = (0, 0.0),
        round_: int = 0, accept: float | None = None) -> dict:
    """A suite row: (steps, ms) per step kind."""
    mix = {kind: {"steps": steps, "ms": ms} for kind, (steps, ms) in
           (("prefill", prefill), ("plain", plain), ("draft", draft))}
    return {"kind": "specserve", "model": "m", "workload": "sharegpt-multiturn", "turn": 1, "concurrency": 64,
            "config": config, "round": round_, "duration_s": duration_ms / 1e3, "step_mix": mix,
            "accept_length": accept}


def test_a_losing_run_splits_into_drafting_prefills_plain_steps_and_the_rest():
    plain = run("plain", 530.0, prefill=(45, 200.0), plain=(230, 310.0))
    # 20 plain steps fewer (at plain's 310/230 ms each), drafted in 12 steps of 4 ms; 2 more prefills;
    # its 210 plain steps 0.05 ms dearer each than plain's
    each = 310.0 / 230 + 0.05
    ngram = run("ngram", 590.0, prefill=(47, 215.0), plain=(210, 210 * each), draft=(12, 48.0), accept=1.1)
    parts = loss_split.split_run(ngram, plain)
    assert abs(parts["drafting"] - (48.0 - 20 * 310.0 / 230)) < 1e-9
    assert abs(parts["prefills"] - 15.0) < 1e-9 and abs(parts["plain_steps"] - 210 * 0.05) < 1e-9
    assert abs(parts["total"] - 60.0) < 1e-9
    assert abs(sum(parts[p] for p in loss_split.PARTS) - parts["total"]) < 1e-9

    [row] = loss_split.loss_rows([plain, ngram])
    assert row["config"] == "ngram" and row["runs"] == 1 and abs(row["total"] - 60.0) < 1e-9
    assert row["draft_steps"] == 12 and row["draft_ms_each"] == 4.0 and row["accept_length"] == 1.1
    assert "| m | sharegpt-multiturn | 1 | 64 | ngram | 1 | 530 | 60.0 |" in loss_split.markdown([plain, ngram])


def test_runs_appended_in_one_file_pair_in_order_and_faster_cells_are_left_out():
    """Two suite runs appended to one results file: each run's round pairs with its own plain."""
    first = [run("plain", 500.0, (40, 160.0), (230, 300.0)), run("ngram", 520.0, (40, 160.0), (230, 320.0))]
    second = [run("plain", 600.0, (40, 160.0), (230, 400.0)), run("ngram", 640.0, (40, 160.0), (230, 440.0))]
    [row] = loss_split.loss_rows(first + second)
    assert row["runs"] == 2 and abs(row["total"] - 30.0) < 1e-9 and abs(row["plain_steps"] - 30.0) < 1e-9
    faster = [run("plain", 500.0, (40, 160.0), (230, 300.0)), run("ngram", 400.0, (40, 160.0), (100, 130.0),
                                                                    draft=(20, 60.0))]
    assert loss_split.loss_rows(faster) == [] and loss_split.markdown(faster) == ""
