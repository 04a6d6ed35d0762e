"""STANDALONE: a smaller model with the target's tokenizer drafts a chain of K tokens per step.

Per step: the draft cache of each request is cut to the positions the target committed
(DraftKVTable.sync: the accepted drafts keep their draft KV), the positions it lacks are
fed in one EXTEND forward (a new or resumed request: its prompt), then one chain of K draft
forwards runs for the whole batch (draft_chain.py; one CUDA graph replay per batch bucket
on a GPU) and its drafts come to the host in one copy. A request whose draft slots do not
fit in the pool, or that may commit one token only, goes without drafts this step.

Greedy requests and seeded sampling requests get argmax drafts (a seeded request is
verified with the coupled rule, which accepts a draft when it is the token plain decoding
would sample: the draft model's likeliest token is the best guess). Unseeded sampling
requests get drafts sampled from the draft model's distribution q at their temperature, and
the proposal carries q for residual rejection (min(1, p/q) acceptance, SpecInfer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.speculative.drafter import Drafter, ProposalHints
from specserve.speculative.model_drafters.draft_chain import ChainRow
from specserve.speculative.model_drafters.draft_kv import DraftKVTable
from specserve.speculative.model_drafters.model_proposals import chain_proposal, draft_temperature
from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    from specserve.request.req import Req
    from specserve.speculative.model_drafters.draft_runner import DraftModelRunner


class StandaloneDrafter(Drafter, ProposalHints):
    probe_every = 16   # a probe costs a catch-up and a chain of draft forwards for its requests
    probe_every_at_most = 128   # as EagleDrafter's: a probe costs several plain steps

    def __init__(self, runner: "DraftModelRunner"):
        self.runner = runner
        self.num_steps = runner.num_steps
        self.kv = DraftKVTable(runner.pool)

    def propose(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        chained: list[tuple[int, "Req", ChainSlots]] = []
        for index, (req, limit) in enumerate(zip(reqs, max_nodes)):
            if limit > 1:
                start = self.kv.reserve(req, self.num_steps - 1)   # d1 .. d_{K-1} are fed, d_K is not
                if start is not None:
                    chained.append((index, req, self._chain_slots(req, start)))
        roots = [r.last_token for r in reqs]
        if not chained:
            return TreeProposal.root_only(roots), [1] * len(reqs)
        try:
            drafts, probs = self._draft([(req, reserved) for _, req, reserved in chained])
        except BaseException:   # their draft cache is not what the table says: start it afresh
            for _, req, _ in chained:
                self.kv.release(req)
            raise
        return chain_proposal(max_nodes, roots, [index for index, _, _ in chained], drafts, probs, self.num_steps)

    def _draft(self, chained: list[tuple["Req", ChainSlots]]) -> tuple[list[list[int]], torch.Tensor | None]:
        """Catch-up, then the chain; the drafts on the host (the one sync) and q, if sampled."""
        self.kv.write_table()
        lagging = [(req, reserved) for req, reserved in chained if reserved.catch_up]
        # the chain feeds the prompt's last position with the root: earlier ones caught up are its prefill
        self.prompt_fed |= any(reserved.catch_up.start < len(req.prompt_ids) - 1 for req, reserved in lagging)
        if lagging:
            sequences = [self.kv.sequences[req.rid] for req, _ in lagging]
            self.runner.catch_up(
                rows=[seq.row for seq in sequences], starts=[r.catch_up.start for _, r in lagging],
                tokens=[seq.tokens[r.catch_up.start:r.catch_up.stop] for seq, (_, r) in zip(sequences, lagging)],
                slots=[s for seq, (_, r) in zip(sequences, lagging) for s in seq.slots[r.catch_up.start:r.catch_up.stop]])
        rows = [self._chain_row(req, reserved) for req, reserved in chained]
        drafts, probs = self.runner.chain(rows, sample=any(row.temperature > 0 for row in rows))
        drafts = drafts.tolist()
        for (req, _), tokens in zip(chained, drafts):
            self.kv.record_drafts(req, tokens[:-1])   # d_K is drafted, never fed
        return drafts, probs

    def _chain_slots(self, req: "Req", start: int) -> "ChainSlots":
        length = req.num_tokens
        return ChainSlots(range(start, max(start, length - 2)), self.kv.sequences[req.rid].slots[length - 2:])

    def _chain_row(self, req: "Req", reserved: ChainSlots) -> ChainRow:
        length = req.num_tokens
        seq = self.kv.sequences[req.rid]
        return ChainRow(tokens=seq.tokens[length - 2:length], slots=reserved.chain_slots,
                        req_row=seq.row, prefix_len=length - 2, seed=req.seed, temperature=draft_temperature(req))

    def probe_order(self, reqs: list["Req"]) -> list[int]:
        """Fewest rows to catch up first (DraftKVTable.cheapest_first)."""
        return self.kv.cheapest_first(reqs)

    def observe(self, req: "Req", committed: list[int]) -> None:
        """After a verify step: the rejected drafts' draft KV goes back to the pool now."""
        self.kv.sync(req)

    def observe_batch(self, reqs: list["Req"], committed: list[list[int]]) -> None:
        self.kv.sync_batch(reqs)

    def release(self, req: "Req") -> None:
        self.kv.release(req)

    def preempted(self, req: "Req") -> None:
        self.kv.release(req)   # rebuilt by the catch-up when the request runs again


@dataclass
class ChainSlots:
    """What a request's next chain feeds and where (see draft_chain.py)."""
    catch_up: range               # positions the draft model has not seen, fed before the chain
    chain_slots: list[int]        # slots of positions L-2 .. L+K-2 (L = the request's token count)
