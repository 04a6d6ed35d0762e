"""lab.draft_step_host on the CPU: drafting steps over stand-in forwards, with the next step
launched ahead (as on a GPU) or synchronously. Both schedules commit the same tokens; with a
step ahead the host time between an outcome read and the next launch is a part of the
step's host time."""
from __future__ import annotations

import json

from lab import draft_step_host


def _rows(capsys, *extra: str) -> list[dict]:
    draft_step_host.main(["--batch-sizes", "1", "--configs", "8-multi", "--workloads", "code-rename",
                          "--rounds", "1", "--max-steps", "12", "--min-output", "48", *extra])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_both_schedules_commit_alike_and_ahead_exposes_part_of_the_host_time(capsys):
    [ahead] = _rows(capsys)
    [sync] = _rows(capsys, "--sync", "--no-phases")
    assert (ahead["schedule"], sync["schedule"]) == ("ahead", "sync")
    assert ahead["accept_length"] == sync["accept_length"] > 2    # the rename copies the prompt
    assert ahead["steps"] == sync["steps"] == 12
    assert 0 < ahead["exposed_us_median"] < ahead["host_us_median"]
    assert 0 < ahead["exposed_cpu_us_median"] < ahead["cpu_us_median"]
    phases = ahead["phases_us_median"]
    assert phases["propose"] > 0 and phases["launch"] > 0 and phases["wait_parse"] > 0


def test_the_adaptive_configuration_drafts_every_step_with_its_tier_choice(capsys):
    """`-adaptive` runs the default policy pinned to drafting: every timed step drafts (the
    bench prices drafting steps only), the policy's bookkeeping is a phase of its own."""
    draft_step_host.main(["--batch-sizes", "1", "--configs", "8-multi-adaptive", "--workloads", "code-rename",
                          "--rounds", "1", "--max-steps", "12", "--min-output", "48"])
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert row["steps"] == 12 and row["accept_length"] > 2
    assert row["phases_us_median"]["adaptive"] > 0
