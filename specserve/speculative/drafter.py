"""The Drafter protocol every speculative algorithm implements (registry.py creates them by
name), and the optional capabilities a drafter may add, which the engine's step pipelines
check for (engine/draft_planner.py, engine/*_step.py).

A drafter proposes one draft tree per request (node 0 = the request's last token), is
shown every committed token (a model drafter learns there which of its drafts were
accepted, and keeps their draft KV), and forgets a request when it ends. Drafts sampled
from a distribution come with it (TreeProposal.draft_probs) for residual rejection.

Capabilities: `ProposalHints` (what the adaptive policy may ask about the proposals and the
drafter's background work), `ReadsHiddenStates` (the target's hidden states, for a head that
drafts from them), `FusedSteps` (the drafter runs the verify step itself, its next drafts
with it), `ChainedSteps` (a fused step queued before the host read the step before it) and
`ForecastSteps` (drafts for the next step, for every way this one may end, made while it runs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    import numpy as np
    import torch

    from specserve.request.req import Req
    from specserve.runner.model_runner import InFlight
    from specserve.runner.tree_step import GreedyOutcome
    from specserve.sampling.sampler import Sampler, SampledStep


class Drafter:
    # the adaptive policy probes proposals on every probe_every-th plain step: a model drafter
    # pays draft forwards (and a host sync) for a probe, a trie lookup costs microseconds
    probe_every = 1
    # ... and at most every this many plain steps once probes are timed (None: the policy's
    # MAX_PROBE_EVERY); a drafter whose probe costs several plain steps lifts the cap
    probe_every_at_most: int | None = None
    # whether propose() reads nothing but the requests' committed tokens, what observe()
    # handed over before the last flush and what observe_hidden and read_fused were given: the
    # engine then proposes (and launches, through launch_fused where the drafter fuses the
    # batch) a greedy batch's next step before showing this step's tokens (engine/draft_ahead.py)
    proposes_ahead = False
    # whether a proposal costs host time alone, about a trie lookup's (no forwards, no host
    # sync): a plain step in a drafting episode may then ask, while the GPU runs, whether the
    # next step would draft at all, and launch a plain one ahead where it would not
    # (engine/plain_step.py: a batch that runs dry)
    proposes_cheaply = False
    # how much better drafting must be expected to do than plain decoding before a plain
    # bucket of the adaptive policy drafts again (None: adaptive.SWITCH_MARGIN)
    switch_margin: float | None = None
    # ... and how far below plain decoding's rate the best tier's may be expected before a
    # drafting episode ends (1.0: it ends where plain decoding is expected to win)
    leave_margin: float = 1.0
    # whether its steps verify through the runner's ragged verify step (run_trees), whose cost
    # follows the nodes verified: the adaptive policy may then cut some requests' drafts to
    # their root alone; a fused drafter's step runs its chains whatever the cut
    ragged_verify = True

    def add_prompt(self, req: "Req") -> None:
        """A request arrived: its prompt may feed the drafter."""

    def propose(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        """One tree per request with at most max_nodes[i] nodes (root included), on the
        host. Returns the padded trees and each tree's real node count."""
        raise NotImplementedError

    def propose_probe(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        """A probe's proposal (engine/draft_planner.py): shadows only, walked down the tokens
        plain steps commit. As propose, unless the drafter says otherwise."""
        return self.propose(reqs, max_nodes)

    def observe(self, req: "Req", committed: list[int]) -> None:
        """Tokens the request just committed."""

    def observe_batch(self, reqs: list["Req"], committed: list[list[int]]) -> None:
        """A step's committed tokens (committed[i]: reqs[i]'s), called once per step: a
        drafter whose bookkeeping is cheaper for the whole batch overrides it."""
        for req, tokens in zip(reqs, committed):
            self.observe(req, tokens)

    def flush(self) -> None:
        """Deferred bookkeeping (e.g. indexing observed tokens), started in the background
        or done at once. The engine calls it right after launching a forward; on plain steps
        of the adaptive policy only before a probe."""

    def release(self, req: "Req") -> None:
        """The request finished or was aborted."""

    def preempted(self, req: "Req") -> None:
        """The request lost its KV cache (preempted; it recomputes it when it resumes): what
        the drafter keeps per position of the cache goes too. Its tokens are still its own."""

    def close(self) -> None:
        """The engine shuts down: threads the drafter started stop and are joined."""

    def scratch(self) -> "Drafter":
        """A drafter of the same kind whose learned state is thrown away afterwards (the
        warm-up's). A drafter whose state is per request only may return itself."""
        return self


class ProposalHints:
    """What the adaptive policy may ask a drafter (a drafter without this answers as here)."""

    def probe_order(self, reqs: list["Req"]) -> list[int] | None:
        """Indices of `reqs`, cheapest to propose for first, where that cost depends on the
        request (a model drafter first feeds what plain steps committed since its last
        proposal); None where every request costs alike (the policy's probes then rotate
        through the batch)."""
        return None

    def proposal_keys(self) -> list[int] | None:
        """Per request of the last `propose`: an evidence class that predicts how much of
        the draft will be accepted (for the adaptive draft length), or None."""
        return None

    def ready_to_probe(self) -> bool:
        """Whether a probe's proposals would start at once: False while the background
        bookkeeping handed over earlier (e.g. indexing a batch of new prompts) is far
        behind, which a proposal would wait for while the GPU idles."""
        return True

    def ready_to_draft(self) -> bool:
        """Whether a drafting step's proposals would start soon enough to be worth the wait
        (a looser bound than a probe's: a probe can be put off, drafting cannot)."""
        return True

    # set by a model drafter whose proposal admits a prompt; took_prefill reads it
    prompt_fed = False

    def took_prefill(self) -> bool:
        """Whether a proposal since the last call admitted a request's prompt to the drafter's
        model: fed it rows of the prompt (its own prefill: a draft model's first forward over
        it) or drew its first chain after them (an EAGLE head's, whose prompt rows the
        prefill's step fed: an unchained step with a host sync). The engine asks once a step;
        the adaptive policy leaves such a drafting step out of its episode's realized rate, as
        the target's prefill is left out of every step's."""
        fed, self.prompt_fed = self.prompt_fed, False
        return fed


NO_HINTS = ProposalHints()


def hints(drafter: Drafter) -> ProposalHints:
    """The drafter's answers to the policy's questions, or the defaults."""
    return drafter if isinstance(drafter, ProposalHints) else NO_HINTS


class ReadsHiddenStates:
    """A drafter that drafts from the target's hidden states (an EAGLE head, an MTP layer)."""

    def observe_hidden(self, reqs: list["Req"], starts: list[int], states: "torch.Tensor",
                       rows: list[list[int]], owned: bool = False) -> None:
        """The target's hidden states (when the runner keeps them: see ModelRunner's
        hidden_capture) of the tokens a step put in the KV cache: request i's tokens at
        positions starts[i], starts[i] + 1, ... have states[rows[i]]. owned: `states` is the
        caller's own copy, which nothing overwrites (else a graph's output, valid until its
        next replay)."""
        raise NotImplementedError

    def prefilled(self, reqs: list["Req"]) -> None:
        """A prefill of these requests' prompt chunks has just been queued and its states
        observed: a head may read the prompts' rows now, while the device runs the prefill (no
        step after it waits for them)."""


class FusedSteps:
    """A drafter whose next drafts come out of the verify step itself (NAIVE_EAGLE, MTP,
    EAGLE chains: the target's forward, verification and the head's next draft in one
    device function)."""

    def verify_fused(self, reqs: list["Req"], proposal: TreeProposal, slots: list[int], sampler: "Sampler",
                     while_running: "Callable[[], None] | None" = None) -> "SampledStep | None":
        """Runs the step: returns what each request commits, the accepted nodes' KV slots
        written into the target's table. slots: the nodes' KV slots, request after request.
        None: the engine verifies this batch itself (batches the fused step does not serve).
        while_running: host work to do between the launch and the outcome's read (the
        engine's deferred detokenizing)."""
        raise NotImplementedError

    def launch_fused(self, reqs: list["Req"], proposal: TreeProposal, slots: list[int],
                     kind: str = "greedy") -> "InFlight | None":
        """verify_fused's launch, without a host sync: the step's packed outcome on its way
        to the host, for read_fused; None where the engine verifies the batch itself.
        kind: the verification (runner/fused_chain.KINDS)."""
        raise NotImplementedError

    def read_fused(self, reqs: list["Req"], outcome: "torch.Tensor") -> "GreedyOutcome":
        """What each request commits in the step launch_fused queued (its outcome on the
        host), with the drafter's own bookkeeping of the next drafts."""
        raise NotImplementedError

    def samples_fused(self, reqs: list["Req"], sampling_rule: str) -> str | None:
        """The verification (runner/fused_chain.KINDS) its fused step runs for these
        requests, which sample: their steps then run launched ahead, as greedy ones do
        (engine/drafting_step.py); None where the engine verifies them with its sampler."""
        return None

    def holds_fused_rows(self) -> bool:
        """Whether the last proposal reserved rows for its own fused step: a proposal of roots
        alone that did not may run as a plain step (engine/drafting_step.py), one that did
        drafts the next step in it."""
        return True


class ChainedSteps(FusedSteps):
    """A fused drafter whose next greedy step can be queued before the host reads the step
    before it (engine/draft_ahead.py: its inputs come from that step's outcome on the device)."""

    def chain_nodes(self, reqs: list["Req"], launched: "InFlight") -> int:
        """Nodes per request of the greedy step launch_chained can queue right after the
        step `launched` (launch_fused's, not read yet) for the same requests; 0: none can."""
        raise NotImplementedError

    def launch_chained(self, reqs: list["Req"], node_slots: "np.ndarray") -> "tuple[InFlight, np.ndarray] | None":
        """Queues that step, its drafts and positions derived on the device from the step
        before, its nodes in node_slots (bs, chain_nodes) of the target's cache. Returns it
        and the slots it reserved in the drafter's own cache (adopt_chained's, once the step
        before is committed; free_chained's if it is dropped), or None if they do not fit."""
        raise NotImplementedError

    def chained_proposal(self, reqs: list["Req"]) -> tuple[TreeProposal, list[int]]:
        """What the step launch_chained queued verifies for these requests, on the host once
        the step before was read (what the adaptive policy's shadows walk)."""
        raise NotImplementedError

    def adopt_chained(self, reqs: list["Req"], reserved: "np.ndarray") -> None:
        """The step launch_chained queued goes on for these requests (those the step before
        did not end), after the step before was read and committed: its reserved slots
        (their rows of launch_chained's) become theirs."""
        raise NotImplementedError

    def free_chained(self, reserved: "np.ndarray") -> None:
        """Returns reserved slots of a chained step (rows dropped) to the drafter's cache."""
        raise NotImplementedError


class ForecastSteps:
    """A drafter whose proposals are cheap enough to make for every way a verify step may end,
    while it runs, so that the next greedy step can be queued before the host reads this one
    (runner/forecast_step.py: the outcome picks the drafts on the device; engine/draft_ahead.py)."""

    def forecasts(self, batch_size: int) -> bool:
        """Whether it forecasts for a batch of this size."""
        raise NotImplementedError

    def forecast(self, reqs: list["Req"], proposal: TreeProposal, nodes: int) -> "np.ndarray":
        """The forecast table (runner/forecast_step.py's layout) for the step after the one
        verifying `proposal` for these requests, next trees of up to `nodes` nodes."""
        raise NotImplementedError

    def forecast_held(self, reqs: list["Req"], proposal: TreeProposal, num_nodes: list[int],
                      keys: list[int]) -> None:
        """A step picked from the forecast is held for these requests (the step before it
        committed): its trees whole, their node counts and evidence classes, as a proposal's
        would be. A drafter that keeps its own record of what each step drafted adds it here."""
