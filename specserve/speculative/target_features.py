"""The target's hidden states over whole token sequences, as an EAGLE head trains on them.

Training reads, for every token of a conversation (prompt + the target's answer), the
states an EAGLE drafter gets from the engine at serving time: the outputs of the EAGLE-3
layers, and the final-normed state (EAGLE-2's feature, and through the target's lm_head
the distribution the head learns to match). One EXTEND forward of our own decoder computes
them for a batch of sequences; its K/V go to a scratch pool that the next batch overwrites.

A head trains over the same conversations for many epochs, and the target's forward costs
about as much as the head's whole training step (1.5B target, 8k tokens: ~21 TFLOP, the
head's 7-step step ~25): `StateStore` computes the states once and keeps them on the
device, as many whole batches of them as fit beside training (~12 KB a token for a 1.5B's
EAGLE-3 head); the other batches' states are computed each time they train (a host copy
would need as much host memory, pinned). On an H200 the 1.5B's 6.8M tokens took 82 GB:
stored whole or not at all, each of its training steps ran the target too (an estimated
~40% of a 32k-token step's kernel time: 100 TFLOP of the target's forward).
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


# the store stays on the GPU while it takes at most this share of the memory free for it:
# the rest is for training (a 7-step 1.5B head's 32k-token steps peaked at 70.1 GiB on an
# H200, 134 GiB free: a store of half would have left too little)
DEVICE_SHARE = 0.4


class StateStore:
    """The target's states of every token of some of a list of sequences, computed once."""

    def __init__(self, extractor: TargetFeatureExtractor, sequences: list[list[int]], groups: list[list[int]]):
        """groups: the sequence indices of each extractor call (each index at most once),
        each group within the extractor's limits (a training batch's is): the sequences stored."""
        config = extractor.model.config
        self.starts: dict[int, int] = {}     # sequence index -> its first row
        total = 0
        for index in (i for group in groups for i in group):
            self.starts[index] = total
            total += len(sequences[index])
        dtype, feature_size = extractor.model.embed_tokens.weight.dtype, len(extractor.aux_layers) * config.hidden_size
        self.device = extractor.device
        new = lambda size: torch.empty((total, size), dtype=dtype, device=self.device)  # noqa: E731
        self.final = new(config.hidden_size)
        self.layers = new(feature_size) if extractor.aux_layers else None
        for group in groups:   # the groups' sequences are stored in order: one run of rows a group
            states = extractor([sequences[i] for i in group])
            first = self.starts[group[0]]
            rows = slice(first, first + states.final.shape[0])
            self.final[rows] = states.final.to(self.device)
            if self.layers is not None:
                self.layers[rows] = states.layers.to(self.device)

    def covers(self, indices: list[int]) -> bool:
        """Whether the states of all these sequences are stored."""
        return all(i in self.starts for i in indices)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.final, self.layers) if t is not None)

    def states(self) -> TargetStates:
        """The stored sequences' states, concatenated (sequence i from starts[i])."""
        return TargetStates(self.layers, self.final)


def state_bytes(extractor: TargetFeatureExtractor, num_tokens: int) -> int:
    """What a StateStore of num_tokens tokens takes."""
    config = extractor.model.config
    feature_size = len(extractor.aux_layers) * config.hidden_size
    return num_tokens * (feature_size + config.hidden_size) * extractor.model.embed_tokens.weight.dtype.itemsize


def device_token_budget(extractor: TargetFeatureExtractor) -> int | None:
    """Tokens whose states fit DEVICE_SHARE of the GPU memory free for them (None on a CPU:
    no bound, the states are a small part of what a CPU run holds)."""
    device = extractor.device
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # PyTorch's cache is free to it
    return int(DEVICE_SHARE * free) // state_bytes(extractor, 1)


def groups_within(groups: list[list[int]], lengths: list[int], budget: int | None) -> list[list[int]]:
    """The leading groups whose tokens add up to at most `budget` (None: all of them)."""
    if budget is None:
        return list(groups)
    kept, used = [], 0
    for group in groups:
        tokens = sum(lengths[i] for i in group)
        if used + tokens > budget:
            break
        kept.append(group)
        used += tokens
    return kept
