"""EagleHeadRunner: an EAGLE head (eagle_head.py) serving drafts, with its own one-layer KV
pool and attention backend, and its chain: the rows of the target's newly committed states
fed in one forward, then K - 1 draft steps, without a host sync in between.

Rows follow the training-time test (eagle_ttt.py): row r of a request's draft cache holds
the K/V of step 0 at r, which reads the token at position r + 1 and the target's state at
position r and sits at RoPE position r. After a verify step the rows up to R - 1 (R = the
request's tokens - 1, the root being the last token) are fed; the output of row R - 1
gives the first draft. Draft step j (j >= 1) reads draft j and step j - 1's output, sits at
row and RoPE position R - 1 + j and sees rows 0 .. R - 1 and its own chain's earlier steps.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specserve.args import ServerArgs
from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.attention.registry import create_attention_backend
from specserve.errors import ArgumentError
from specserve.kv.pool import KVPool
from specserve.model.config import ModelConfig
from specserve.model.hidden_capture import HiddenCapture
from specserve.model.rope import RotaryEmbedding
from specserve.runner.draft_chain import draft_distribution
from specserve.runner.draft_runner import chain_context
from specserve.sampling.random import SALT_DRAFT, exponential_race
from specserve.speculative.eagle_checkpoint import load_head
from specserve.speculative.eagle_head import EagleHead

logger = logging.getLogger("specserve")


def load_eagle_head(args: ServerArgs, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                    context_length: int) -> EagleHead:
    """The head in `args.speculative_draft_model_path` (SGLang / SpecForge layout), checked
    against the target and the algorithm; it borrows the target's embedding later
    (EagleHeadRunner) unless its checkpoint has one."""
    start = time.perf_counter()
    path = args.speculative_draft_model_path
    head = load_head(path, target.num_layers, device, dtype)
    config, field = head.config, "speculative_draft_model_path"
    if config.vocab_size != target.vocab_size or config.target_hidden_size != target.hidden_size:
        raise ArgumentError(f"{field}: the EAGLE head is for a target of vocabulary {config.vocab_size} and "
                            f"hidden size {config.target_hidden_size}; this target has {target.vocab_size} and "
                            f"{target.hidden_size}")
    if config.algorithm != args.speculative:
        raise ArgumentError(f"{field}: an {config.algorithm} head (it reads "
                            f"{'three target layers' if config.aux_layers else 'the final state'}), "
                            f"but speculative_algorithm is {args.speculative}")
    if max(config.aux_layers, default=0) >= target.num_layers:
        raise ArgumentError(f"{field}: the head reads target layers {list(config.aux_layers)}, "
                            f"the target has {target.num_layers}")
    head.rope = RotaryEmbedding(config.head_dim, chain_context(context_length, args.speculative_steps),
                                config.rope_theta, config.rope_scaling).to(device)
    logger.info("loaded %s head %s (draft vocabulary %d) in %.1f s", config.algorithm, path,
                config.draft_vocab_size, time.perf_counter() - start)
    return head.eval().requires_grad_(False)


def target_capture(head: EagleHead) -> HiddenCapture:
    """The target states the head reads: three layers (EAGLE-3) or the final-normed state."""
    return HiddenCapture(layers=head.config.aux_layers, final=not head.config.aux_layers)


def kv_bytes_per_token(head: EagleHead, dtype: torch.dtype) -> int:
    return KVPool.bytes_per_token(1, head.config.num_kv_heads, head.config.head_dim, dtype)


@dataclass
class EagleChainInputs:
    """One chain for a batch, on the host; `features` on the device."""
    req_rows: list[int]
    feed_starts: list[int]         # first row fed per request
    feed_tokens: list[list[int]]   # tokens of the fed rows (the token after each row's state)
    feed_slots: list[int]          # their slots, request after request
    features: torch.Tensor         # (fed rows, feature size) the target's states of the fed rows
    chain_slots: list[list[int]]   # (bs, K - 1) slots of the draft steps' rows
    seeds: list[int]
    temperatures: list[float]      # 0: argmax drafts


class EagleHeadRunner:
    def __init__(self, args: ServerArgs, head: EagleHead, target_model, target_pool: KVPool):
        config = head.config
        if head.embed_tokens is None:
            head.share_embedding(target_model.embed_tokens.weight)
        self.head, self.config = head, config
        self.device, self.dtype = target_pool.device, target_pool.dtype
        self.num_steps = args.speculative_steps
        self.vocab_size = config.vocab_size
        self.draft_vocab = head.draft_vocab()          # (draft vocab,) target ids
        self.pool = KVPool(1, config.num_kv_heads, config.head_dim, target_pool.size, target_pool.max_requests,
                           chain_context(target_pool.max_context, self.num_steps), self.dtype, self.device)
        backend = args.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch_native"
        self.backend = create_attention_backend(backend, config.num_heads, config.num_kv_heads, config.head_dim)

    @torch.inference_mode()
    def chain(self, inputs: EagleChainInputs, sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts (bs, K) target ids on the device and, for a sampling chain, q over the
        target vocabulary (bs, K + 1, V), the last node's 0 (verify's draft_probs layout)."""
        bs, device = len(inputs.req_rows), self.device
        lengths = [len(tokens) for tokens in inputs.feed_tokens]
        last_rows = [start + length - 1 for start, length in zip(inputs.feed_starts, lengths)]   # R - 1
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        seeds = as_long(inputs.seeds)
        temperatures = torch.tensor(inputs.temperatures, dtype=torch.float32, device=device)
        probs = torch.zeros((bs, self.num_steps + 1, self.vocab_size), device=device) if sample else None
        hidden = self._extend(inputs, lengths)
        rows = as_long(last_rows)
        drafts = [self._pick(hidden, rows + 2, seeds, temperatures, probs, 0)]
        chain_slots = as_long(inputs.chain_slots).view(bs, self.num_steps - 1)
        for step in range(1, self.num_steps):
            positions = rows + step
            batch = self._batch(ForwardMode.DECODE, drafts[-1], positions, chain_slots[:, step - 1], inputs.req_rows,
                                positions, [r + step for r in last_rows], [1] * bs)
            hidden = self._step(batch, hidden)
            drafts.append(self._pick(hidden, rows + 2 + step, seeds, temperatures, probs, step))
        return torch.stack(drafts, dim=1), probs

    def _extend(self, inputs: EagleChainInputs, lengths: list[int]) -> torch.Tensor:
        """Step 0 over the fed rows; the outputs (bs, hidden) of each request's last row."""
        device = self.device
        as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        positions = as_long([r for start, length in zip(inputs.feed_starts, lengths) for r in range(start, start + length)])
        tokens = as_long([t for tokens in inputs.feed_tokens for t in tokens])
        batch = self._batch(ForwardMode.EXTEND, tokens, positions, as_long(inputs.feed_slots), inputs.req_rows,
                            as_long(inputs.feed_starts), list(inputs.feed_starts), lengths)
        hidden = self._step(batch, self.head.project(inputs.features))
        return hidden[torch.tensor(lengths, device=device).cumsum(0) - 1]

    def _batch(self, mode: ForwardMode, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               req_rows: list[int], prefix_lens: torch.Tensor, prefix_host: list[int], lengths: list[int]) -> ForwardBatch:
        device = self.device
        return ForwardBatch(
            mode=mode, input_ids=tokens, positions=positions, out_slots=slots.contiguous(),
            req_rows=torch.tensor(req_rows, dtype=torch.long, device=device), prefix_lens=prefix_lens,
            extend_lens=torch.tensor(lengths, dtype=torch.long, device=device), prefix_lens_host=prefix_host,
            extend_lens_host=lengths, kv_pool=self.pool, logits_indices=torch.empty(0, dtype=torch.long, device=device))

    def _step(self, batch: ForwardBatch, features: torch.Tensor) -> torch.Tensor:
        self.backend.plan(batch)
        attend = lambda q, k, v: self.backend.forward(q, k, v, 0, batch)  # noqa: E731
        return self.head.step(batch.input_ids, features.to(self.dtype), batch.positions, attend)

    def _pick(self, hidden: torch.Tensor, positions: torch.Tensor, seeds: torch.Tensor, temperatures: torch.Tensor,
              probs: torch.Tensor | None, step: int) -> torch.Tensor:
        """The draft at `positions` (target ids): the argmax, or a sample of q kept in probs[:, step]."""
        logits = self.head.logits(hidden).float()                  # (bs, draft vocab)
        if probs is None:
            return self.draft_vocab[logits.argmax(dim=-1)]
        q = draft_distribution(logits, temperatures)
        probs[:, step].scatter_(1, self.draft_vocab.expand(len(q), -1), q)
        return self.draft_vocab[exponential_race(q, seeds, positions, SALT_DRAFT)]
