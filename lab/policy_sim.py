"""The adaptive draft-length policy on a simulated server: no model, no drafter, no GPU.

Requests arrive into a fixed number of slots (a prefill step admits every waiting request
that fits), decode steps follow the engine's call sequence (engine/core.py: should_draft,
on plain steps probe_due / would_draft / the probe after the commit, on drafting steps
choose, then observe and record_step), and a step costs what a cost model says, close to
the H100 figures of Qwen2.5-Coder-1.5B (BENCHMARKS.md: at batch 64 a plain step 2.6 ms, a
drafting step 7.3 ms; at batch 1 about 1.5 and 3.4 ms).

Each request has a future token stream; a proposal is a chain of draft nodes of which the
first `matched` are that stream and the rest are not, with an evidence class (`key`), so
the policy's shadows resolve exactly as they would on the real tokens. What a request's
drafts match comes from its `Profile`:

- `chat` (ShareGPT first turns): the first ECHO_STEPS proposals of a new request match in
  full with a long suffix (class 5: an answer that opens by restating the question), later
  ones rarely (class 1: at most one node, one time in three). The policy's evidence thus
  says that class-5 drafts pay, and a probe that samples new requests expects a win, while
  a drafting step of a busy batch, mostly older requests, commits ~1.3-1.6 tokens each.
- `repeat` (the repeated turn, code-rename): every proposal matches in full (class 5).
- `miss` (a chat whose drafts all fail, in a class the policy has not seen: its prior
  expects every node accepted, so the policy tries it and loses).
- `edit` (an answer that copies the prompt with an edit every EDIT_EVERY tokens, as
  code-types does): drafts follow the copy up to the next edit, then miss for the
  EDIT_TOKENS of new text after it (class 1), then match again.

`python -m lab.policy_sim` prints one JSON line per scenario: decode steps,
drafting steps and their fraction, accept length, and the simulated time against a plain
server's (`vs_plain`).
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field

from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.verify.tree import TreeProposal

TIERS = [1, 4, 8, 16]
ECHO_STEPS = 3           # a chat's first proposals that match in full
EDIT_EVERY = 40          # an `edit` answer's tokens from one edit to the next
EDIT_TOKENS = 4          # ... of which its drafts miss this many, the new text after each edit
PREFILL_SECONDS = 0.017  # one prefill step (not part of the policy's clock)
VOCAB = 1000


def plain_seconds(batch_size: int) -> float:
    return 1.4e-3 + 1.9e-5 * batch_size


def drafting_seconds(nodes: int) -> float:
    """Verify steps pay fixed host work and per-node work: `nodes` verified in all (a batch's
    requests times the tier where every draft is cut to it; fewer in a ragged step)."""
    return 3.2e-3 + 6.4e-5 * nodes / 8


@dataclass
class Profile:
    name: str                 # chat | repeat | miss | edit
    length: int               # tokens the request generates

    def proposal(self, drafted: int, committed: int, rng: random.Random, nodes: int) -> tuple[int, int]:
        """(draft nodes matching the future, evidence class) of the request's next proposal;
        `drafted`: the proposals made for it so far, `committed`: its tokens so far."""
        if self.name == "repeat" or (self.name == "chat" and drafted < ECHO_STEPS):
            return nodes - 1, 5
        if self.name == "miss":
            return 0, 3
        if self.name == "edit":
            offset = committed % EDIT_EVERY
            return (0, 1) if offset < EDIT_TOKENS else (min(nodes - 1, EDIT_EVERY - offset), 5)
        return (1 if rng.random() < 1 / 3 else 0), 1


@dataclass
class SimRequest:
    rid: str
    profile: Profile
    future: list[int]
    committed: int = 0
    drafted: int = 0          # proposals made for it so far
    matched: int = 0          # draft nodes of its latest proposal that match its future

    @property
    def finished(self) -> bool:
        return self.committed >= self.profile.length


@dataclass
class SimResult:
    decode_steps: int = 0
    drafting_steps: int = 0
    prefill_steps: int = 0    # a drafting step that ends requests apart splits the prefills of the next ones
    tokens: int = 0
    seconds: float = 0.0
    drafting_by_request: dict[str, int] = field(default_factory=dict)   # drafting steps each took part in
    steps_by_request: dict[str, int] = field(default_factory=dict)

    @property
    def drafting_fraction(self) -> float:
        return self.drafting_steps / max(1, self.decode_steps)

    @property
    def accept_length(self) -> float:
        return self.tokens / max(1, sum(self.steps_by_request.values()))


class PolicySim:
    def __init__(self, profiles: list[Profile], concurrency: int, adaptive: AdaptiveDraftLength | None,
                 nodes: int = 8, seed: int = 0):
        """adaptive: the policy (None: a plain server); a ragged one verifies the nodes its
        choice keeps of each proposal, and a step costs those (drafting_seconds)."""
        self.rng = random.Random(seed)
        self.waiting = [SimRequest(f"r{i}", p, [self.rng.randrange(VOCAB) for _ in range(p.length + nodes + 1)])
                        for i, p in enumerate(profiles)]
        self.concurrency, self.adaptive, self.nodes = concurrency, adaptive, nodes
        self.batch: list[SimRequest] = []
        self.result = SimResult()

    def run(self) -> SimResult:
        while self.waiting or self.batch:
            if self.waiting and len(self.batch) < self.concurrency:
                self._prefill()
            else:
                self._decode()
        return self.result

    def _prefill(self) -> None:
        """Admits what fits; the prefill commits each request's first token."""
        admitted = self.waiting[:self.concurrency - len(self.batch)]
        del self.waiting[:len(admitted)]
        for req in admitted:
            self._commit(req, 1)
        self.batch += [req for req in admitted if not req.finished]
        self.result.seconds += PREFILL_SECONDS
        self.result.prefill_steps += 1
        if self.adaptive is not None:
            self.adaptive.admit()

    def _decode(self) -> None:
        reqs, result = self.batch, self.result
        draft = self.adaptive is not None and self.adaptive.should_draft(len(reqs))
        result.decode_steps += 1
        for req in reqs:
            result.steps_by_request[req.rid] = result.steps_by_request.get(req.rid, 0) + 1
        if draft:
            seconds, tokens, slots, nodes = self._drafting_step(reqs)
        else:
            seconds, tokens, slots, nodes = self._plain_step(reqs)
        result.seconds += seconds
        result.tokens += tokens
        if self.adaptive is not None:
            self.adaptive.record_step(len(reqs), slots, seconds, tokens, nodes=nodes)
        for req in reqs:
            if req.finished and self.adaptive is not None:
                self.adaptive.release(req.rid)
        self.batch = [req for req in reqs if not req.finished]

    def _plain_step(self, reqs: list[SimRequest]) -> tuple[float, int, int, int]:
        adaptive = self.adaptive
        probing = adaptive is not None and adaptive.probe_due(len(reqs))
        if adaptive is not None:
            adaptive.would_draft(len(reqs))   # the engine asks before launching the next step ahead
        for req in reqs:
            self._commit(req, 1)
        if probing:
            window = adaptive.probe_requests(len(reqs))
            sample = [reqs[i % len(reqs)] for i in window if not reqs[i % len(reqs)].finished]
            if sample:
                rids, proposal, num_nodes, keys = self._propose(sample)
                adaptive.record_proposals(rids, proposal, num_nodes, keys)
                adaptive.probe(len(reqs), rids, num_nodes, keys)
            adaptive.record_probe(len(reqs), 0.005 * plain_seconds(len(reqs)))
        return plain_seconds(len(reqs)), len(reqs), 1, len(reqs)

    def _drafting_step(self, reqs: list[SimRequest]) -> tuple[float, int, int, int]:
        """(seconds, tokens committed, the largest tree verified, nodes verified in all)."""
        rids, proposal, num_nodes, keys = self._propose(reqs)
        matched = [req.matched for req in reqs]
        self.adaptive.record_proposals(rids, proposal, num_nodes, keys)
        kept = self.adaptive.choose_nodes(rids, num_nodes, keys)
        slots = max(kept)
        tokens = 0
        for req, match, nodes in zip(reqs, matched, kept):
            count = min(match, nodes - 1, req.profile.length - req.committed - 1) + 1
            self._commit(req, count)
            tokens += count
        if slots == 1:
            return plain_seconds(len(reqs)), tokens, 1, len(reqs)
        self.result.drafting_steps += 1
        for req, nodes in zip(reqs, kept):
            if nodes > 1:
                self.result.drafting_by_request[req.rid] = self.result.drafting_by_request.get(req.rid, 0) + 1
        # a step that is not ragged verifies every request padded to the largest tree
        verified = sum(kept) if self.adaptive.ragged else len(reqs) * slots
        return drafting_seconds(verified), tokens, slots, verified

    def _propose(self, reqs: list[SimRequest]) -> tuple[list[str], TreeProposal, list[int], list[int]]:
        """One chain per request: the last committed token, then `matched` tokens of its
        future and tokens that are not. Sets each request's `matched` for a verify."""
        rows, keys = [], []
        for req in reqs:
            nodes = max(1, min(self.nodes, req.profile.length - req.committed))
            match, key = req.profile.proposal(req.drafted, req.committed, self.rng, nodes)
            req.drafted += 1
            req.matched = match
            ahead = req.future[req.committed:req.committed + nodes - 1]
            drafts = ahead[:match] + [(token + 1) % VOCAB for token in ahead[match:]]
            rows.append(([req.future[req.committed - 1]] + drafts, list(range(-1, nodes - 1))))
            keys.append(key)
        return [r.rid for r in reqs], TreeProposal.from_lists(rows), [len(r[0]) for r in rows], keys

    def _commit(self, req: SimRequest, count: int) -> None:
        tokens = req.future[req.committed:req.committed + count]
        req.committed += count
        if self.adaptive is not None and not req.finished:
            self.adaptive.observe(req.rid, tokens)


def simulate(profiles: list[Profile], concurrency: int, seed: int = 0,
             ragged: bool = False) -> tuple[SimResult, float, SimResult]:
    """The adaptive policy's run, its time against a plain server's on the same requests,
    and the plain server's run (ragged: the policy of a ragged verify step, whose steps cost
    the nodes they keep)."""
    adaptive = PolicySim(profiles, concurrency, AdaptiveDraftLength(TIERS, ragged=ragged), seed=seed).run()
    plain = PolicySim(profiles, concurrency, None, seed=seed).run()
    return adaptive, plain.seconds / adaptive.seconds, plain


def chat_first_turns(count: int, seed: int = 0) -> list[Profile]:
    """ShareGPT-like first turns: many answers end well before the 128-token cap."""
    rng = random.Random(seed)
    return [Profile("chat", rng.choice([rng.randrange(20, 128), 128])) for _ in range(count)]


# name -> (the requests for a seed, concurrency)
SCENARIOS = {
    "chat first turns, concurrency 64": (lambda seed: chat_first_turns(128, seed), 64),
    "chat first turns, concurrency 32": (lambda seed: chat_first_turns(64, seed), 32),
    "chat first turns, concurrency 8": (lambda seed: chat_first_turns(48, seed), 8),
    "chat first turns, batch 1": (lambda seed: chat_first_turns(24, seed), 1),
    "repeated turn, concurrency 64": (lambda seed: [Profile("repeat", 128)] * 128, 64),
    "repeated turn, concurrency 32": (lambda seed: [Profile("repeat", 128)] * 64, 32),
    "batch 1: a chat that misses, then repeated turns": (
        lambda seed: [Profile("miss", 128)] + [Profile("repeat", 128)] * 3, 1),
    "batch 1: copies with edits": (lambda seed: [Profile("edit", 256)] * 4, 1),
    "copies with edits, concurrency 8": (lambda seed: [Profile("edit", 256)] * 16, 8),
    "copies with edits, concurrency 64": (lambda seed: [Profile("edit", 256)] * 128, 64),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ragged", action="store_true", help="the policy of a ragged verify step (see simulate)")
    ns = parser.parse_args()
    for name, (profiles, concurrency) in SCENARIOS.items():
        for seed in range(ns.seeds):
            result, vs_plain, plain = simulate(profiles(seed), concurrency, seed, ns.ragged)
            print(json.dumps({"scenario": name, "ragged": ns.ragged, "seed": seed, "decode_steps": result.decode_steps,
                              "drafting_steps": result.drafting_steps,
                              "prefill_steps": result.prefill_steps, "plain_prefill_steps": plain.prefill_steps,
                              "drafting_fraction": round(result.drafting_fraction, 3),
                              "accept_length": round(result.accept_length, 2),
                              "vs_plain": round(vs_plain, 3)}))


if __name__ == "__main__":
    main()
