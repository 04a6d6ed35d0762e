"""The target's hidden states over whole token sequences, as an EAGLE head trains on them.

Training reads, for every token of a conversation (prompt + the target's answer), the
states an EAGLE drafter gets from the engine at serving time: the outputs of the EAGLE-3
layers, and the final-normed state (EAGLE-2's feature, and through the target's lm_head
the distribution the head learns to match). One EXTEND forward of our own decoder computes
them for a batch of sequences; its K/V go to a scratch pool that the next batch overwrites.

A head trains over the same conversations for many epochs, and the target's forward costs
about as much as the head's whole training step: state_store.py keeps the states of the
batches computed here, so that each is computed once.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.attention.registry import create_attention_backend
from specserve.kv.pool import KVPool, host_to_device_async
from specserve.model.hidden_capture import HiddenCapture
from specserve.model.llama import DecoderLM


@dataclass
class TargetStates:
    """Hidden states of the tokens of several sequences, concatenated in order."""
    layers: torch.Tensor | None   # (num_tokens, len(aux_layers) * hidden): the aux layers side by side
    final: torch.Tensor           # (num_tokens, hidden): final-normed, the lm_head's input


class TargetFeatureExtractor:
    def __init__(self, model: DecoderLM, aux_layers: tuple[int, ...], max_tokens: int, max_sequences: int,
                 max_sequence_len: int | None = None):
        """Batches of up to max_sequences sequences, max_tokens tokens in all, each at most
        max_sequence_len (default max_tokens) long."""
        config = model.config
        weight = model.embed_tokens.weight
        self.model, self.aux_layers, self.max_tokens = model, tuple(aux_layers), max_tokens
        self.device = weight.device
        # slot 0 is the pool's padding slot: a batch of max_tokens tokens uses slots 1..max_tokens
        self.pool = KVPool(config.num_layers, config.num_kv_heads, config.head_dim, max_tokens, max_sequences,
                           max_sequence_len or max_tokens, weight.dtype, self.device)
        backend = "triton" if self.device.type == "cuda" else "torch_native"
        self.backend = create_attention_backend(backend, config.num_heads, config.num_kv_heads, config.head_dim)

    @torch.no_grad()  # not inference_mode: the states feed a graph that autograd differentiates
    def __call__(self, sequences: list[list[int]], rows: torch.Tensor | None = None) -> TargetStates:
        """States of every token of `sequences` (or of the token rows `rows` of their concatenation)."""
        capture = HiddenCapture(layers=self.aux_layers, final=True, rows=rows)
        batch = self._extend_batch(sequences, capture)
        self.backend.plan(batch)
        self.model(batch, self.backend)
        return TargetStates(capture.concatenated() if self.aux_layers else None, capture.final_state)

    def _extend_batch(self, sequences: list[list[int]], capture: HiddenCapture) -> ForwardBatch:
        lengths = [len(ids) for ids in sequences]
        total = sum(lengths)
        if not sequences or min(lengths) == 0:
            raise ValueError("sequences must be a non-empty list of non-empty token lists")
        max_sequences, max_len = self.pool.req_to_token.shape
        if total > self.max_tokens or len(sequences) > max_sequences or max(lengths) > max_len:
            raise ValueError(f"a batch of {len(sequences)} sequences, {total} tokens, the longest {max(lengths)}, "
                             f"exceeds the extractor's max_sequences={max_sequences} / max_tokens={self.max_tokens} "
                             f"/ max_sequence_len={max_len}")
        device, lengths_host = self.device, torch.tensor(lengths)
        input_ids = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=total))
        starts = lengths_host.cumsum(0) - lengths_host
        positions = torch.arange(total) - starts.repeat_interleave(lengths_host)
        # one copy that does not wait for the device: the batch's integer inputs side by side
        parts = [input_ids, positions, torch.zeros_like(lengths_host), lengths_host, torch.tensor([total - 1])]
        input_ids, positions, prefix_lens, extend_lens, logits_indices = host_to_device_async(
            torch.cat(parts), device).split([len(part) for part in parts])
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=input_ids, positions=positions,
            out_slots=torch.arange(1, total + 1, device=device), req_rows=torch.arange(len(sequences), device=device),
            prefix_lens=prefix_lens, extend_lens=extend_lens,
            prefix_lens_host=[0] * len(sequences), extend_lens_host=lengths, kv_pool=self.pool,
            # the logits are not needed: ask for one row, the cheapest valid request
            logits_indices=logits_indices, hidden_capture=capture)
