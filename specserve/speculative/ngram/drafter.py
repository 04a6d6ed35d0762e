"""NGRAM / LOOKAHEAD drafter: draft trees from the shared n-gram trie (model-free).

The trie is fed every prompt when it arrives and every committed token; each request is an
owner of its own stream, so its own prompt and output rank first when it is drafted for.
Indexing costs ~2-5 us per token (a batch of 64 long prompts: ~200 ms), so it runs on the
trie's writer thread (writer.py) in parallel with the step loop: `add_prompt` and
`observe_batch` queue tokens per request (cheap list appends; a request's tokens of several steps
reach the trie in one call), and `flush`, which the engine calls right after launching a
forward, hands the queue to the writer and returns. `propose` first waits until the writer
has indexed everything handed over before it (normally long done: it had the GPU's time),
so a proposal sees exactly the tokens flushed before it, whatever the timing: drafted trees
are the same from run to run and on every tensor-parallel rank. It therefore misses the
tokens committed since the last flush (at least the step just before it), which have no
continuation to offer yet anyway. Plain steps that do not probe skip the flush
(adaptive/policy.py), but once AUTO_FLUSH_TOKENS committed tokens are queued `observe` flushes
them itself: at batch 64 a probe every 32 steps would otherwise hand over ~2000 tokens
(~6 ms of indexing) that its proposal then waits for, in the open. A finished request's
stream is let go after its last queued tokens.

A probe (a plain step's proposals for a few requests, adaptive/policy.py) waits for the same
indexing, so it is put off while more than PROBE_BACKLOG_TOKENS handed-over tokens are not
indexed yet (`ready_to_probe`): the first probe after 64 multi-turn prompts arrived waited
~85 ms for them (H100, 1.5B, concurrency 64: 7% of the run), and with 2048 tokens allowed,
probing steps of 13-16 ms still stood among plain steps of 1.5-3 ms (H100, 0.5B, multi-turn
at 64: ~6% of the run). A probe only informs the policy, so it can wait a few steps for
the writer. A drafting step waits up to DRAFT_BACKLOG_TOKENS (`ready_to_draft`); beyond
that its bucket decodes plainly, on the overlap schedule, until the writer has caught up
(engine/core.py). Each millisecond a drafting step waits is one the GPU idles, where a
plain step launched ahead commits a token per request meanwhile: with 2048 tokens allowed,
drafting steps at 64 took 10-16 ms where the policy priced ~3.5-4 ms, between plain steps
held back for the backlog (H200, 0.5B, ShareGPT first turns, a prompt arriving every few
steps; the waits inferred from the policy's trace, not timed). Which step probes or drafts
then depends on the writer's timing; what is drafted from a given trie does not.

With the pure-Python trie (no C compiler) the writes run at once on the caller's thread
in `flush`: that trie holds the GIL, so a thread would gain nothing.

A small flush (at most INLINE_WRITE_TOKENS, and nothing pending on the writer) is also
indexed at once on the caller's thread: at batch 1 a step commits a few tokens (~3 us each
to index, while the GPU computes the step just launched), and handing them to the writer
costs a thread wake-up and GIL hand-overs that the next proposal's drain then waited for
(the dev CPU with its cores busy, batch 1: `drain` 2-235 us a drafting step, median; on an
H200's host a batch-1 proposal took ~240 us where the CPU bench's took ~25). Order is kept:
with nothing pending on the writer, the trie holds everything flushed before.
"""
from __future__ import annotations

import functools
import itertools
import threading
from typing import TYPE_CHECKING

import numpy as np

from specserve.speculative.drafter import Drafter, ForecastSteps, ProposalHints
from specserve.speculative.ngram.trie import NgramConfig, NgramTrie
from specserve.speculative.ngram.writer import TrieWriter
from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    from specserve.args import ServerArgs
    from specserve.request.req import Req


MATCH_KEY_CAP = 6         # suffix matches this long or longer count as one evidence class
AUTO_FLUSH_TOKENS = 256   # committed tokens queued that observe hands to the writer without waiting for a flush
# tokens per trie call under the lock (~2-5 ms at max_trie_depth 18): a job's streams share calls
# up to this many. Each call ends with the writer taking the GIL back, a hand-over the step loop
# waits for: a call per stream (a flush at batch 64: 64 streams and a prompt) cost a ~400 us step
# of Python and small torch ops ~200 us on the CPU, one call per 1024 tokens ~10 us
WRITE_BATCH_TOKENS = 1024
# handed-over tokens not indexed yet above which a probe is put off (~0.5-1.3 ms of indexing),
# and above which a drafting step decodes plainly instead (~1-2.5 ms)
PROBE_BACKLOG_TOKENS = 256
DRAFT_BACKLOG_TOKENS = 512
INLINE_WRITE_TOKENS = 32   # a flush of at most this many tokens is indexed on the caller's thread (batch 1-2 drafting)


# the largest batch whose steps are forecast (ForecastSteps): the forecast (trie.c's ngt_forecast,
# three proposals a node of each tree) must fit in a step's GPU time beside the rest of the
# host's work; 8 requests with chains of 8 / 16 nodes took 118 / 265 us on a 2-core dev VM
FORECAST_MAX_BATCH = 8
# candidates a node where --speculative-ngram-forecast is left unset, on a GPU (on a CPU a step's
# host work is not what bounds it: 0). H100, 1.5B, the suite at 1 and 8 (3 rounds, median ratio to
# plain, without -> with): code-types 6.23 -> 6.71x / 3.91 -> 3.91x, first turns 1.01 -> 1.02x /
# 1.19 -> 1.29x, multi-turn 1.19 -> 1.17x / 1.00 -> 1.02x, code-rename 4.83 -> 4.85x / 2.69 -> 2.75x
DEFAULT_FORECAST = 2


def forecast_candidates(requested: int | None, on_gpu: bool) -> int:
    """--speculative-ngram-forecast as given, or where unset (None) its default on this device."""
    if requested is not None:
        return requested
    return DEFAULT_FORECAST if on_gpu else 0


class NgramDrafter(Drafter, ProposalHints, ForecastSteps):
    proposes_ahead = True   # a proposal reads the trie as of the last flush and the committed tokens
    proposes_cheaply = True

    def __init__(self, config: NgramConfig, one_branch: bool, background: bool | None = None,
                 forecast_candidates: int = 0):
        """background: index on a writer thread (default: with the compiled trie only).
        forecast_candidates: next tokens forecast a node (0: no forecasts, ForecastSteps)."""
        self.config = config
        self.trie = NgramTrie(config)
        self.one_branch = one_branch
        self.forecast_candidates = forecast_candidates
        self.window = config.max_match_window
        self._owners: dict[str, int] = {}
        self._next_owner = itertools.count()
        # owner -> its tokens not handed to the writer yet, in order (an owner's stream must
        # be fed in order); owners in the order their oldest queued token arrived
        self._pending: dict[int, list[int]] = {}
        self._observed = 0   # committed tokens queued since the last flush
        self._released: list[int] = []   # owners finished since the last flush
        self._keys: list[int] = []
        if background is None:
            background = isinstance(self.trie, NgramTrie)
        self.writer = TrieWriter(background)
        self._backlog = 0    # tokens handed to the writer and not indexed yet
        self._backlog_lock = threading.Lock()   # the engine's thread adds, the writer's subtracts

    @classmethod
    def from_args(cls, args: "ServerArgs", on_gpu: bool = False) -> "NgramDrafter":
        config = NgramConfig(
            capacity=args.speculative_ngram_capacity,
            min_match_window=args.speculative_ngram_min_match_window_size,
            max_match_window=args.speculative_ngram_max_match_window_size,
            min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
            max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
            max_trie_depth=args.speculative_ngram_max_trie_depth,
            match_type=args.speculative_ngram_match_type)
        return cls(config, args.speculative_one_branch,
                   forecast_candidates=forecast_candidates(args.speculative_ngram_forecast, on_gpu))

    def scratch(self) -> "NgramDrafter":
        """An empty trie of the same configuration (its writer thread stops when it is closed
        or collected)."""
        return NgramDrafter(self.config, self.one_branch, self.writer.background, self.forecast_candidates)

    def add_prompt(self, req: "Req") -> None:
        self._queue(self._owner(req), req.prompt_ids)

    def propose(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        """One trie call for the whole batch (a call per request costs more than drafting)."""
        window = self.window
        contexts = [_tail(req, window) for req in reqs]
        owners = [self._owner(req) for req in reqs]
        self.writer.drain()   # everything flushed before this proposal is in: no timing in what it sees
        with self.writer.lock:
            tokens, parents, num_nodes, match_lengths = self.trie.propose_batch(
                contexts, max_nodes, self.one_branch, owners)
        self._keys = np.minimum(match_lengths, MATCH_KEY_CAP).tolist()
        n = int(num_nodes.max())
        # copies: the trie reuses its output buffers
        proposal = TreeProposal(tokens[:, :n].copy(), parents[:, :n].copy(), num_nodes.copy())
        return proposal, num_nodes.tolist()

    def forecasts(self, batch_size: int) -> bool:
        return self.forecast_candidates > 0 and batch_size <= FORECAST_MAX_BATCH

    def forecast(self, reqs: list["Req"], proposal: TreeProposal, nodes: int) -> np.ndarray:
        """The trie's forecast for the step after `proposal`'s (ngram/forecast.py), as of
        the same flushed tokens a proposal after the read would see (the step's own tokens
        are observed after the next step is launched, forecast or not): for each tree it
        proposes, the tree a proposal after the read would, had the outcome been its entry's."""
        contexts = [_tail(req, self.window) for req in reqs]
        owners = [self._owner(req) for req in reqs]
        self.writer.drain()
        with self.writer.lock:
            return self.trie.forecast(contexts, owners, proposal, nodes, self.forecast_candidates, self.one_branch,
                                      MATCH_KEY_CAP)

    def proposal_keys(self) -> list[int]:
        """The length of each proposal's matched suffix (capped): a one-token match is weak
        evidence, a long one strong."""
        return self._keys

    def observe(self, req: "Req", committed: list[int]) -> None:
        self.observe_batch([req], [committed])   # a batch of one

    def observe_batch(self, reqs: list["Req"], committed: list[list[int]]) -> None:
        """Queues each request's committed tokens, in batch order; where AUTO_FLUSH_TOKENS are
        reached mid-batch it flushes there, as a call per request did (which tokens a later
        proposal sees depends on it). One call per step (engine/core.py's _observe says why)."""
        owners, queue, observed = self._owners, self._queue, self._observed
        for req, tokens in zip(reqs, committed):
            owner = owners.get(req.rid)
            queue(self._owner(req) if owner is None else owner, tokens)
            observed += len(tokens)
            if observed >= AUTO_FLUSH_TOKENS:
                self.flush()   # zeroes self._observed
                observed = 0
        self._observed = observed

    def _queue(self, owner: int, tokens: list[int]) -> None:
        if not tokens:
            return
        queued = self._pending.get(owner)
        if queued is None:
            self._pending[owner] = list(tokens)   # a copy: the caller's list may grow (a prompt's)
        else:
            queued.extend(tokens)

    def flush(self) -> None:
        """Hands the queued tokens and finished streams to the writer (indexed in the
        background with the compiled trie, at once with the Python one). Raises if an
        earlier write failed."""
        self.writer.check()
        if not self._pending and not self._released:
            return
        queued = list(self._pending.items())
        job = functools.partial(self._write, queued, self._released)
        self._pending, self._released, self._observed = {}, [], 0
        tokens = sum(len(tokens) for _, tokens in queued)
        self._add_backlog(tokens)
        self.writer.submit(job, inline=tokens <= INLINE_WRITE_TOKENS)

    def ready_to_probe(self) -> bool:
        return self._backlog <= PROBE_BACKLOG_TOKENS

    def ready_to_draft(self) -> bool:
        return self._backlog <= DRAFT_BACKLOG_TOKENS

    def _add_backlog(self, tokens: int) -> None:
        with self._backlog_lock:
            self._backlog += tokens

    def _write(self, queued: list[tuple[int, list[int]]], released: list[int]) -> None:
        """The writer's job: the owners' tokens, several streams per trie call (the lock is
        held for one call at a time), then the finished owners' streams (after their last
        tokens, which continue them)."""
        trie, lock = self.trie, self.writer.lock
        for batch in _batches(queued, WRITE_BATCH_TOKENS):
            with lock:
                trie.insert_many(batch)
            self._add_backlog(-sum(len(tokens) for _, tokens in batch))
        for owner in released:
            with lock:
                trie.release(owner)

    def release(self, req: "Req") -> None:
        """Its stream is let go at the next flush, after its queued tokens (they continue it)."""
        owner = self._owners.pop(req.rid, None)
        if owner is not None:
            self._released.append(owner)

    def close(self) -> None:
        """Stops and joins the writer thread; the drafter proposes no more."""
        self.writer.close()

    def _owner(self, req: "Req") -> int:
        owner = self._owners.get(req.rid)
        if owner is None:
            owner = self._owners[req.rid] = next(self._next_owner)
        return owner


def _batches(queued: list[tuple[int, list[int]]], most: int):
    """(owner, tokens) pairs in order, cut into runs of about `most` tokens: a stream longer
    than that (a prompt) in pieces of its own, in order."""
    batch, size = [], 0
    for owner, tokens in queued:
        long = len(tokens) > most
        pieces = [tokens[start:start + most] for start in range(0, len(tokens), most)] if long else [tokens]
        for piece in pieces:
            if batch and size + len(piece) > most:
                yield batch
                batch, size = [], 0
            batch.append((owner, piece))
            size += len(piece)
    if batch:
        yield batch


def _tail(req: "Req", length: int) -> list[int]:
    """The last `length` tokens of prompt + output, without copying the whole history."""
    output = req.output_ids
    if len(output) >= length:
        return output[-length:]
    return req.prompt_ids[len(output) - length:] + output
