"""Training batches for an EAGLE head: conversations grouped by length, the target's
states for their tokens, and the target's distribution the head learns to match.

The teacher is the target's own logits over the draft vocabulary (its lm_head rows of
those tokens applied to its final-normed state), kept only at the positions some draft
step predicts from: the answer, less its last token. Soft labels carry more than the one
token the target picked, and on self-generated greedy data their argmax is that token.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.speculative.eagle_data import Conversation
from specserve.speculative.eagle_ttt import ConversationBatch
from specserve.speculative.target_features import TargetFeatureExtractor


@dataclass
class TrainingBatch:
    conversations: ConversationBatch
    teacher_logits: torch.Tensor | None  # (num_rows, draft_vocab): the target's logits at the rows below
    teacher_index: torch.Tensor | None   # (B, T) row of teacher_logits for position t, -1 where none

    def teacher_for(self, step: int, rows: torch.Tensor) -> torch.Tensor:
        """The teacher of the draft at (B, T) mask `rows` of `step`: the target's logits at
        position t + 1 + step, which predict the same token t + 2 + step."""
        index = F.pad(self.teacher_index[:, 1 + step:], (0, 1 + step), value=-1)[rows]
        if bool((index < 0).any()):
            raise AssertionError("a draft row without a teacher: predicts_answer and the teacher rows disagree")
        return self.teacher_logits[index]


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

    def __call__(self, conversations: list[Conversation]) -> TrainingBatch:
        states = self.extractor([c.tokens for c in conversations])
        device = states.final.device
        lengths = torch.tensor([len(c.tokens) for c in conversations], device=device)
        prompt_lens = torch.tensor([c.prompt_len for c in conversations], device=device)
        width = int(lengths.max())
        tokens = torch.zeros((len(conversations), width), dtype=torch.long, device=device)
        positions = torch.arange(width, device=device).unsqueeze(0)
        in_sequence = positions < lengths.unsqueeze(1)                        # (B, T), row-major = extractor order
        tokens[in_sequence] = torch.tensor([t for c in conversations for t in c.tokens], device=device)
        flat = states.layers if self.uses_aux_layers else states.final
        target_states = flat.new_zeros((*tokens.shape, flat.shape[-1]))
        target_states[in_sequence] = flat
        batch = ConversationBatch(tokens, lengths, prompt_lens, target_states)
        if self.draft_lm_head is None:
            return TrainingBatch(batch, None, None)
        # positions whose logits some step learns from: from the prompt's end to the answer's second-last token
        taught = in_sequence & (positions >= prompt_lens.unsqueeze(1)) & (positions < lengths.unsqueeze(1) - 1)
        teacher_logits = states.final[taught[in_sequence]] @ self.draft_lm_head.t()
        teacher_index = torch.full(tokens.shape, -1, dtype=torch.long, device=device)
        teacher_index[taught] = torch.arange(teacher_logits.shape[0], device=device)
        return TrainingBatch(batch, teacher_logits, teacher_index)
