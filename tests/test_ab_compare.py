"""lab.ab_compare: both trees' rounds per cell, and a permutation p-value of their medians' difference."""
from __future__ import annotations

import json

from lab.ab_compare import compare, table


def write_rows(folder, ratios: list[float], workload: str = "sharegpt-multiturn") -> str:
    folder.mkdir()
    rows = [{"kind": "device", "name": "test"}]
    for round_, ratio in enumerate(ratios):
        base = {"kind": "specserve", "model": "m", "workload": workload, "turn": 1, "concurrency": 32,
                "round": round_}
        rows += [dict(base, config="plain", output_tokens_per_s=1000.0),
                 dict(base, config="default", output_tokens_per_s=1000.0 * ratio)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def test_a_shift_beyond_the_spread_has_a_small_p_and_noise_does_not(tmp_path):
    old = write_rows(tmp_path / "old", [0.93, 0.94, 0.95, 0.94, 0.93, 0.95])
    moved = write_rows(tmp_path / "moved", [0.99, 1.00, 1.01, 1.00, 0.99, 1.01])
    same = write_rows(tmp_path / "same", [0.95, 0.93, 0.94, 0.94, 0.95, 0.93])
    [row] = compare([old], [moved])
    assert (row["workload"], row["concurrency"], row["config"]) == ("sharegpt-multiturn", 32, "default")
    assert round(row["old"], 3) == 0.94 and round(row["new"], 3) == 1.0
    assert row["p"] < 0.02   # 12 of the 924 relabellings differ as much (the observed split, its mirror, ties)
    [row] = compare([old], [same])
    assert row["p"] == 1.0
    assert "| sharegpt-multiturn | 1 | 32 | default | 0.940 | 0.940 | 1.00 |" in table([row])


def test_cells_only_one_tree_ran_are_left_out(tmp_path):
    old = write_rows(tmp_path / "old", [0.9, 0.91])
    new = write_rows(tmp_path / "new", [0.9, 0.91], workload="code-rename")
    assert compare([old], [new]) == []
