"""Training batches for an EAGLE head: conversations grouped by length, the target's
states for their tokens, and the target's distribution the head learns to match.

The teacher is the target's own distribution over the draft vocabulary (softmax of its
lm_head rows of those tokens applied to its final-normed state), kept only at the
positions some draft step predicts from: each answer, less its last token. Soft labels
carry more than the one token the target picked, and on self-generated greedy data their
argmax is that token. On fixed text (a dataset's replies) the text is only where the
target is asked: the head learns the target's distribution there, and its accuracy is
agreement with the target's top choice, not with the text.

Everything a step indexes by (which rows run the later draft steps, which of them each
step learns from, their teacher rows and tokens) is worked out on the host from the
conversations' lengths and sent to the device at once, so a training step never waits
for the device to say which rows are which.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from specserve.kv.pool import host_to_device_async
from specserve.training.eagle_data import Conversation
from specserve.training.eagle_ttt import ConversationBatch
from specserve.training.state_store import StateStore, StoredRows
from specserve.training.target_features import TargetFeatureExtractor


@dataclass
class StepTargets:
    """What one draft step learns: at which of the unrolled rows, from which teacher rows,
    and the target's top choice there (for its accuracy)."""
    rows: torch.Tensor           # (n,) indices into the step's output (the batch's learning rows)
    teacher_rows: torch.Tensor   # (n,) rows of TrainingBatch.teacher_probs
    labels: torch.Tensor         # (n,) the draft-vocabulary index of the teacher's argmax there


@dataclass
class TrainingBatch:
    conversations: ConversationBatch
    teacher_probs: torch.Tensor | None   # (num_taught, draft_vocab) fp32: the target's distribution there
    host: ConversationBatch              # the same conversations on the host (no states): indices come from it
    teacher_index: torch.Tensor | None   # (B * T,) host: teacher row of each flat position, -1 where none
    _targets: dict[int, tuple[torch.Tensor, list[StepTargets]]] = field(default_factory=dict)

    def draft_targets(self, steps: int) -> tuple[torch.Tensor, list[StepTargets]]:
        """(learning rows (n,) flat b * T + t: where `unroll` runs the later steps; each
        step's targets among them)."""
        if steps not in self._targets:
            self._targets[steps] = self._plan(steps)
        return self._targets[steps]

    def _plan(self, steps: int) -> tuple[torch.Tensor, list[StepTargets]]:
        if self.teacher_index is None:
            raise ValueError("this batch has no teacher (built without draft_lm_head)")
        host = self.host
        learning = host.learns_from(steps).flatten()
        index_among_learning = learning.cumsum(0) - 1
        parts = [learning.nonzero().squeeze(1)]
        for step in range(steps):
            rows = host.predicts_answer(step).flatten().nonzero().squeeze(1)
            # row t at `step` predicts token t+2+step, which the target's logits at t+1+step predicted
            teacher_rows = self.teacher_index[rows + 1 + step]
            if bool((teacher_rows < 0).any()):
                raise AssertionError("a draft row without a teacher: predicts_answer and the teacher rows disagree")
            parts += [index_among_learning[rows], teacher_rows]
        sizes = [part.numel() for part in parts]
        on_device = list(host_to_device_async(torch.cat(parts), self.conversations.tokens.device).split(sizes))
        teacher_choice = self.teacher_probs.argmax(-1)
        return on_device[0], [StepTargets(rows, teacher_rows, teacher_choice[teacher_rows])
                              for rows, teacher_rows in zip(on_device[1::2], on_device[2::2])]


def learned_tokens(conversations: list[Conversation], width: int) -> torch.Tensor:
    """(B, width) bool: the tokens a draft step predicts: every answer token but each
    answer's first (at serving time prefill makes it, and drafting starts after it)."""
    spans = [(row, start + 1, end) for row, conversation in enumerate(conversations)
             for start, end in conversation.answers() if start + 1 < end]
    # +1 where a span starts, -1 where it ends: a running sum > 0 inside some span
    edges = torch.zeros((len(conversations), width + 1), dtype=torch.int32)
    if spans:
        rows, starts, ends = torch.tensor(spans).t()
        ones = torch.ones(len(spans), dtype=torch.int32)
        edges.index_put_((rows, starts), ones, accumulate=True)
        edges.index_put_((rows, ends), -ones, accumulate=True)
    return edges.cumsum(1)[:, :width] > 0


def padded_tokens(conversations: list[Conversation], width: int) -> torch.Tensor:
    """(B, width) int64: each conversation's tokens from column 0, zeros after them."""
    lengths = torch.tensor([len(c.tokens) for c in conversations])
    flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(c.tokens for c in conversations),
                                        dtype=np.int64, count=int(lengths.sum())))
    # token i of the concatenation sits at b * width + (i - the first index of its conversation)
    shift = torch.arange(len(conversations)) * width - (lengths.cumsum(0) - lengths)
    places = torch.arange(len(flat)) + shift.repeat_interleave(lengths)
    return torch.zeros(len(conversations) * width, dtype=torch.long).index_copy_(0, places, flat).view(-1, width)


def plan_batches(lengths: list[int], batch_tokens: int, seed: int) -> list[list[int]]:
    """Conversation indices grouped so that (group size x longest member) <= batch_tokens
    (similar lengths together: little padding), the groups in a seeded random order."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for index in order:
        if groups and (len(groups[-1]) + 1) * lengths[index] <= batch_tokens:
            groups[-1].append(index)
        else:
            groups.append([index])
    random.Random(seed).shuffle(groups)
    return groups


class BatchBuilder:
    def __init__(self, extractor: TargetFeatureExtractor, draft_lm_head: torch.Tensor | None, uses_aux_layers: bool):
        """draft_lm_head: (draft_vocab, hidden), the target's lm_head rows of the draft
        vocabulary; None builds batches without a teacher (evaluation)."""
        self.extractor, self.draft_lm_head, self.uses_aux_layers = extractor, draft_lm_head, uses_aux_layers

    def __call__(self, conversations: list[Conversation], keep_in: StateStore | None = None,
                 indices: list[int] | None = None) -> TrainingBatch:
        """A batch whose states the target computes now; kept in `keep_in` as its sequences
        `indices` (those of `conversations`) where it has room."""
        states = self.extractor([c.tokens for c in conversations])
        lengths = [len(c.tokens) for c in conversations]
        if keep_in is not None:
            keep_in.keep(indices, lengths, states)
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        return self._build(conversations, states.layers if self.uses_aux_layers else states.final, states.final, starts)

    def from_store(self, store: StateStore, indices: list[int], conversations: list[Conversation]) -> TrainingBatch:
        """A batch of the store's sequences `indices` (those of `conversations`)."""
        features = store.layers if self.uses_aux_layers else store.final
        return self._build(conversations, features, store.final, [store.starts[i] for i in indices])

    def _build(self, conversations: list[Conversation], features: torch.Tensor | StoredRows,
               final: torch.Tensor | StoredRows, starts: list[int]) -> TrainingBatch:
        """features, final: rows of per-token states (the head's input; the final-normed
        state); conversation i's tokens are rows starts[i]..."""
        device = self.extractor.device
        lengths = torch.tensor([len(c.tokens) for c in conversations])
        prompt_lens = torch.tensor([c.prompt_len for c in conversations])
        b, t = len(conversations), int(lengths.max())
        positions = torch.arange(t)
        tokens = padded_tokens(conversations, t)
        learned = learned_tokens(conversations, t)
        host = ConversationBatch(tokens, lengths, prompt_lens, None, learned)
        # the state of every padded position: the conversation's own rows (padding repeats its
        # last one: finite, and no row that counts attends to it)
        state_rows = torch.tensor(starts).unsqueeze(1) + torch.minimum(positions, lengths.unsqueeze(1) - 1)
        # positions whose logits some step learns from: those just before a learned token
        taught = F.pad(learned[:, 1:], (0, 1))
        taught_rows = state_rows[taught]
        parts = [tokens.flatten(), lengths, prompt_lens, learned.flatten().long()]
        tokens_d, lengths_d, prompt_lens_d, learned_d = host_to_device_async(torch.cat(parts), device).split(
            [p.numel() for p in parts])
        target_states = _gather(features, state_rows.flatten(), device).view(b, t, -1)
        batch = ConversationBatch(tokens_d.view(b, t), lengths_d, prompt_lens_d, target_states,
                                  learned_d.view(b, t).bool())
        if self.draft_lm_head is None:
            return TrainingBatch(batch, None, host, None)
        teacher_logits = _gather(final, taught_rows, device) @ self.draft_lm_head.t()
        teacher_index = torch.full((b * t,), -1, dtype=torch.long)
        teacher_index[taught.flatten()] = torch.arange(len(taught_rows))
        return TrainingBatch(batch, teacher_logits.float().softmax(-1), host, teacher_index)


def _gather(rows: torch.Tensor | StoredRows, index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """rows[index] on `device` (rows on the device, kept ones read back, or rows in host memory)."""
    if isinstance(rows, StoredRows):
        return rows.gather(host_to_device_async(index, rows.device), device)
    if rows.device.type == "cpu" and device.type == "cuda":
        return host_to_device_async(rows.index_select(0, index), device)
    return rows.index_select(0, host_to_device_async(index, rows.device))
