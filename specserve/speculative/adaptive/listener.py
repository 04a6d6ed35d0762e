"""PolicyListener: what an instrument hears of the adaptive policy's decisions and the steps
they led to (bench/policy_trace.py), set with AdaptiveDraftLength.listen; unset, an event is a test."""
from __future__ import annotations


class PolicyListener:
    """Every event a no-op here, so a listener overrides what it needs (`bucket`: costs.batch_bucket)."""

    def rated(self, bucket: int, batch_size: int, rids: list[str], num_nodes: list[int], keys: list[int] | None,
              choosing: bool, choice, rates: dict[int, float]) -> None:
        """A drafting step's choice (`choosing`) or a probe rated each tier's cut of the proposals:
        `rates` in tokens a second (empty while a tier is unpriced); `choice`: the DraftCut it runs."""

    def step_recorded(self, bucket: int, batch_size: int, tree_size: int, seconds: float, tokens: int | None,
                      steady: bool, nodes: int | None, expected: tuple[float, float] | None, prefill: bool) -> None:
        """record_step's step, before it counts; `expected`: the (tokens, seconds) its drafting choice
        expected; `prefill`: its proposals fed the drafter a prompt."""

    def probe_recorded(self, bucket: int, batch_size: int, seconds: float) -> None:
        """A probe's host time (the plain step it followed is recorded next)."""

    def switch_requested(self, bucket: int, expected_gain: float | None) -> None:
        """A probe switches the plain bucket to drafting."""

    def episode_ended(self, bucket: int, episode, plain_rate: float | None, reopened: bool) -> None:
        """A drafting episode (modes.Episode) ended, judged against `plain_rate` (BucketModes.go_plain)."""
