"""PolicyTrace: what the adaptive draft-length policy believed and what happened, step by
step, during one benchmark run.

The GPU suite's step mix says how many steps drafted and what they cost, not why: at
concurrency 32/64 on ShareGPT first turns an H100 run drafted 126-128 steps at accept 1.6
(5.9-8.5 ms each against 2.1-2.7 ms plain steps), and neither the hold schedule nor the
losing-episode budget explained them. The trace records, per event:

- `rates`: each tier's expected tokens per second as the policy computed them (a drafting
  step's choice, `measure`, or a probe's), with the batch size, the requests sampled and
  how many of them had a draft; a probe's also with the switch margin drafting had to beat
  (`margin`) and the bucket's records that raised it (`overshoot`, `optimism`);
- `switch`: a probe switching a plain bucket to drafting, whether it bypassed a hold, and the
  stale tier it switched to re-price (`reprices`; None: a switch rated at prices or floors);
- `episode`: a drafting episode's end, its realized rate against the bucket's plain rate;
- `probe`: a probe's host ms; the plain step it followed is the next `step`, marked `probe`;
- `step`: every decode step's batch size, tier, wall ms, committed tokens and mode; `steady`
  False on a plain step that plain mode would not run so: it probed where most plain steps
  do not (`probe`), or it was not launched ahead of the step before it (what the adaptive
  engine's plain steps lose against plain's);
- `source` (a hybrid drafter's, speculative/hybrid/source_choice.py): each step's choice
  between the trie's drafts and the head's (`choose`), or a chained head step's
  counterfactual (`counterfactual`: whether the trie's would have broken the chain): how many
  requests had trie drafts, preferred them and took them, the trie's expected gain and the
  head's expected tokens.

`summary()` condenses them per bucket: switches and bypasses, episodes won and lost,
drafting steps, and how far the rate expected at the chosen tier was from the realized
one (the model's optimism). It listens to the policy (adaptive/listener.py) until `close()`.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict

from specserve.speculative.adaptive.listener import PolicyListener
from specserve.speculative.hybrid.source_choice import SourceChoice


class PolicyTrace(PolicyListener):
    def __init__(self, policy, choice: SourceChoice | None = None):
        """choice: a hybrid drafter's source choice, whose decisions are traced too."""
        self.policy, self.choice = policy, choice
        self.events: list[dict] = []
        self._probed = False   # the next recorded step is the plain step whose probe was just recorded
        policy.listen(self)
        if choice is not None:
            choice.listener = self.events.append

    def close(self) -> None:
        self.policy.listen(None)
        if self.choice is not None:
            self.choice.listener = None

    def dump(self, path: str, run: str) -> None:
        """Appends the events to `path`, each tagged with the run's name (one file holds a
        whole suite's runs: the GPU machine sends back a limited number of files)."""
        with open(path, "a") as f:
            for event in self.events:
                f.write(json.dumps({"run": run, **event}) + "\n")

    # --- the policy's events ---
    def rated(self, bucket, batch_size, rids, num_nodes, keys, choosing, choice, rates):
        drafted = sum(n > 1 for n in num_nodes) if choice.drafted is None else sum(
            n > 1 and choice.drafts(c) for n, c in zip(num_nodes, keys if keys is not None else rids))
        self.events.append({"e": "rates", "bucket": bucket, "bs": batch_size, "sampled": len(rids),
                            "with_draft": sum(n > 1 for n in num_nodes), "choose": choosing, "choice": choice.tier,
                            "level": choice.level, "drafted": drafted,
                            "rates": {t: round(r) for t, r in rates.items()}})
        if not choosing:   # a probe: what drafting had to beat, and what raised it
            self.events[-1].update(margin=round(self.policy.switch_margin_at(bucket), 3),
                                   overshoot=self.policy.modes.episode_overshoot.get(bucket),
                                   optimism=self.policy.optimism.get(bucket))

    def step_recorded(self, bucket, batch_size, tree_size, seconds, tokens, steady, nodes, expected, prefill):
        rate = expected[0] / expected[1] if expected is not None and expected[1] > 0 else None   # its choice's tok/s
        self.events.append({"e": "step", "bucket": bucket, "bs": batch_size, "tree": tree_size,
                            "ms": round(seconds * 1e3, 3), "tokens": tokens,
                            "plain": bucket in self.policy.modes.plain,
                            "expected": rate if tree_size > 1 else None, "steady": steady,
                            "probe": self._probed, "nodes": nodes, "prefill": prefill})
        self._probed = False

    def probe_recorded(self, bucket, batch_size, seconds):
        self.events.append({"e": "probe", "bucket": bucket, "bs": batch_size, "ms": round(seconds * 1e3, 3)})
        self._probed = True   # the engine prices the step right after its probe (_after_plain_step)

    def switch_requested(self, bucket, expected_gain):
        held = self.policy.costs.steps(bucket) < self.policy.modes.plain_until.get(bucket, 0)
        reprices = self.policy.repricing(bucket)   # None: a rated switch, or one rated at a floor price
        self.events.append({"e": "switch", "bucket": bucket, "bypass": held, "reprices": reprices,
                            "expected_gain": None if expected_gain is None else round(expected_gain, 3)})

    def episode_ended(self, bucket, episode, plain_rate, reopened):
        self.events.append({"e": "episode", "bucket": bucket, "steps": episode.steps, "tokens": episode.tokens,
                            "ms": round(episode.seconds * 1e3, 3), "rate": round(episode.rate()),
                            "plain_rate": None if plain_rate is None else round(plain_rate),
                            "reopened": reopened})

    # --- the condensed view ---
    def summary(self) -> dict:
        per_bucket: dict[int, dict] = defaultdict(lambda: {
            "switches": 0, "bypasses": 0, "episodes": 0, "episodes_lost": 0, "draft_steps": 0, "plain_steps": 0,
            "_optimism": []})
        for event in self.events:
            if event["e"] == "source":
                continue
            row = per_bucket[event["bucket"]]
            if event["e"] == "switch":
                row["switches"] += 1
                row["bypasses"] += event["bypass"]
            elif event["e"] == "episode":
                row["episodes"] += 1
                row["episodes_lost"] += event["plain_rate"] is not None and event["rate"] < event["plain_rate"]
            elif event["e"] == "step":
                row["draft_steps" if event["tree"] > 1 else "plain_steps"] += 1
                if event["expected"] and event["tokens"] and event["ms"] > 0:
                    row["_optimism"].append(event["expected"] / (event["tokens"] / event["ms"] * 1e3))
        out = {}
        for bucket, row in sorted(per_bucket.items()):
            optimism = row.pop("_optimism")
            row["expected_over_realized"] = round(statistics.median(optimism), 2) if optimism else None
            out[bucket] = row
        return out
