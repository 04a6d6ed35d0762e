"""Training an EAGLE head on the target's states with the training-time test.

Each batch unrolls `ttt_steps` draft steps (eagle_ttt.py); step k's loss is the soft
cross-entropy between the head's draft-vocabulary distribution and the target's, weighted
0.8^k as in EAGLE-3 (later steps matter only when the earlier ones were right). AdamW,
linear warm-up then cosine decay, where progress is the larger of steps done and time
spent (so a --max-train-seconds budget ends on a decayed learning rate). Checkpoints are
the head in SGLang's layout plus the optimizer state; a resumed run continues the same
seeded batch order where it stopped. The target's states of a batch are computed the
first time it trains and kept (state_store.py: the batches are the same groups every
epoch, in another order), for as many batches as fit on the device beside training, then
(on a GPU) as many more as fit in the host's memory; the other batches' states are computed
each time they train.

With an `evaluate` callable (the held-out accept length) the trainer scores the head every
`eval_every` steps and at the end, and keeps the best head it saw: a head that starts to
memorize its data is not the one that comes out.

A step waits for the device once, to read its loss and accuracies: every row index it
needs was worked out on the host (eagle_batches.py).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.model.llama import DecoderLM
from specserve.speculative.heads.eagle_checkpoint import load_head, load_head_state, read_weights, save_head
from specserve.speculative.heads.eagle_config import EagleHeadConfig
from specserve.speculative.heads.eagle_head import EagleHead
from specserve.training.eagle_batches import BatchBuilder, TrainingBatch, plan_batches
from specserve.training.eagle_data import Conversation
from specserve.training.eagle_ttt import unroll
from specserve.training.state_store import DEVICE_SHARE, HOST_SHARE, make_host_state_store, make_state_store

TRAINER_STATE_FILE = "trainer_state.pt"


@dataclass(frozen=True)
class TrainSettings:
    ttt_steps: int = 7
    epochs: int = 2
    batch_tokens: int = 4096            # padded tokens per batch (conversations x longest)
    lr: float = 3e-4
    warmup_fraction: float = 0.05
    final_lr_fraction: float = 0.1
    max_seconds: float | None = None    # stop training after this long, whatever the epochs
    grad_clip: float = 0.5
    step_weight: float = 0.8            # the loss of draft step k counts step_weight ** k
    checkpoint_every: int = 0           # optimizer steps between checkpoints; 0: at the end only
    weight_decay: float = 0.0           # AdamW's, decoupled
    eval_every: int = 0                 # optimizer steps between held-out scores (keep the best); 0: never
    seed: int = 0
    autocast_dtype: torch.dtype | None = None  # bfloat16 on a GPU: the head's weights stay fp32
    state_dtype: torch.dtype | None = None     # of the kept target states; None: the model's where all fit, else float8
    state_memory_share: float = DEVICE_SHARE   # of the device memory free at the start, for the kept states
    host_state_share: float = HOST_SHARE       # of the host memory available, for the states the device's cannot keep


def build_head(target: DecoderLM, algorithm: str, draft_vocab: torch.Tensor, max_positions: int,
               intermediate_size: int | None = None) -> EagleHead:
    """A fresh fp32 head for `target` over `draft_vocab`, borrowing the target's embedding.
    (Starting the lm_head from the target's rows was tried: its confident, wrong first
    drafts made the loss start ten times higher and the trained head draft worse.)"""
    weight = target.embed_tokens.weight
    config = EagleHeadConfig.for_target(target.config, algorithm, draft_vocab.numel(), intermediate_size)
    head = EagleHead(config, max_positions).to(weight.device)
    head.set_draft_vocab(draft_vocab)
    head.share_embedding(weight)
    return head


def kept_head(target: DecoderLM, directory: str) -> EagleHead:
    """A head saved earlier for `target` (a kept one's float8 rows read back as fp32), to
    train on from where it ended; its draft vocabulary and sizes are the saved ones."""
    weight = target.embed_tokens.weight
    head = load_head(directory, target.config.num_layers, device=weight.device)
    if (head.config.vocab_size, head.config.target_hidden_size) != (target.config.vocab_size, target.config.hidden_size):
        raise ValueError(f"--init-from {directory}: a head for a target of vocabulary {head.config.vocab_size} and "
                         f"hidden size {head.config.target_hidden_size}, not this one's "
                         f"({target.config.vocab_size}, {target.config.hidden_size})")
    head.share_embedding(weight)
    return head


def target_lm_head(target: DecoderLM) -> torch.Tensor:
    """(vocab, hidden): the untied lm_head, or the embedding it is tied to."""
    return target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight


class SoftCrossEntropy(torch.autograd.Function):
    """Mean over rows of -sum(p * log q), q = softmax(logits), p = the teacher's
    probabilities at `teacher_rows`; computed as logsumexp(logits) - sum(p * logits)
    (sum(p) = 1). Keeps only the (half-precision) logits and the row indices for backward,
    where the gradient softmax(logits) - p is recomputed: with a 32k vocabulary and 7 steps,
    saved fp32 softmaxes (or gathered teacher rows) would dominate memory."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, teacher_probs: torch.Tensor, teacher_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, teacher_probs, teacher_rows)
        logits32 = logits.float()
        return (logits32.logsumexp(-1) - (teacher_probs[teacher_rows] * logits32).sum(-1)).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, teacher_probs, teacher_rows = ctx.saved_tensors
        difference = logits.float().softmax(-1).sub_(teacher_probs[teacher_rows])
        return difference.mul_(grad / logits.shape[0]).to(logits.dtype), None, None


def ttt_loss(head: EagleHead, batch: TrainingBatch, steps: int,
             step_weight: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The weighted loss over `steps` draft steps, and each step's draft accuracy (0-dim
    tensors: read together, once per optimizer step)."""
    rows, targets = batch.draft_targets(steps)
    total, accuracies = batch.teacher_probs.new_zeros(()), []
    for step, (output, target) in enumerate(zip(unroll(head, batch.conversations, steps, rows), targets)):
        if len(target.rows) == 0:   # no conversation of the batch has an answer this long
            accuracies.append(total.new_tensor(float("nan")))
            continue
        logits = head.logits(output.index_select(0, target.rows))
        total = total + step_weight ** step * SoftCrossEntropy.apply(logits, batch.teacher_probs, target.teacher_rows)
        accuracies.append((logits.detach().argmax(-1) == target.labels).float().mean())
    return total, accuracies


class EagleTrainer:
    def __init__(self, head: EagleHead, builder: BatchBuilder, conversations: list[Conversation],
                 settings: TrainSettings, output_dir: str | None = None,
                 evaluate: Callable[[EagleHead], float] | None = None):
        """evaluate(head) -> a score, higher is better (the held-out accept length)."""
        self.head, self.builder, self.conversations, self.settings = head, builder, conversations, settings
        self.output_dir, self.evaluate = output_dir, evaluate
        self.parameters = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.parameters, lr=settings.lr, betas=(0.9, 0.95),
                                           weight_decay=settings.weight_decay)
        lengths = [len(c.tokens) for c in conversations]
        self.plan = [group for epoch in range(settings.epochs)
                     for group in plan_batches(lengths, settings.batch_tokens, settings.seed + epoch)]
        # the target's states of each batch as first computed, while they fit
        self.store = make_state_store(builder.extractor, sum(lengths), settings.state_dtype,
                                      settings.state_memory_share)
        self.host_store = make_host_state_store(builder.extractor, self.store, sum(lengths), settings.host_state_share)
        self.step, self.elapsed = 0, 0.0
        self.target_forwards = 0   # batches whose states the target computed (not read from the store)
        # where a step's time goes: until its launches end (building the batch, launching its
        # kernels) and the wait for the device at its end. Not a host/device split: once the
        # driver's launch queue is full (on the order of a thousand kernels; a step launches
        # ~1,200), each launch waits for the device, so a device-bound step shows much of its
        # device time in the first part
        self.host_seconds, self.wait_seconds, self.timed_steps = 0.0, 0.0, 0
        self.history: list[float] = []   # loss per optimizer step
        self.scores: list[tuple[int, float]] = []   # (step, held-out score) of each evaluation
        self._best: tuple[float, dict[str, torch.Tensor]] | None = None

    def train(self, on_step: Callable[[int, float, list[float]], None] = lambda *_: None) -> None:
        """Runs the remaining batches of the plan (or until max_seconds); on_step(step, loss, accuracies)."""
        settings = self.settings
        self.head.train()
        while self.step < len(self.plan) and not self._out_of_time():
            started = time.perf_counter()
            loss, accuracies = self._train_batch(self.plan[self.step])
            self.step += 1
            self.history.append(loss)
            if settings.eval_every and self.step % settings.eval_every == 0:
                self._score()
            self.elapsed += time.perf_counter() - started
            if settings.checkpoint_every and self.step % settings.checkpoint_every == 0:
                self.save_checkpoint()
            on_step(self.step, loss, accuracies)
        self.head.eval()
        if settings.eval_every and self.evaluate is not None:
            if not self.scores or self.scores[-1][0] != self.step:
                self._score()
            self.head.eval()
            best_score, best_state = self._best
            if best_score > self.scores[-1][1]:
                self.head.load_state_dict(best_state)

    def _score(self) -> None:
        """Scores the head on the held-out data; remembers its weights when it is the best yet."""
        if self.evaluate is None:
            return
        self.head.eval()
        score = self.evaluate(self.head)
        self.head.train()
        self.scores.append((self.step, score))
        if self._best is None or score > self._best[0]:
            self._best = (score, {name: value.detach().clone() for name, value in self.head.state_dict().items()})

    @property
    def best_score(self) -> tuple[int, float] | None:
        """(step, score) of the best evaluation, None before any."""
        return max(self.scores, key=lambda item: item[1]) if self.scores else None

    def _out_of_time(self) -> bool:
        return self.settings.max_seconds is not None and self.elapsed >= self.settings.max_seconds

    def _train_batch(self, group: list[int]) -> tuple[float, list[float]]:
        settings, started = self.settings, time.perf_counter()
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = self.learning_rate()
        conversations = [self.conversations[i] for i in group]
        stores = [store for store in (self.store, self.host_store) if store is not None]
        kept = next((store for store in stores if store.covers(group)), None)
        if kept is not None:
            batch = self.builder.from_store(kept, group, conversations)
        else:
            rows = sum(len(c.tokens) for c in conversations)
            keep_in = next((store for store in stores if store.has_room(rows)), None)
            batch = self.builder(conversations, keep_in=keep_in, indices=group)
            self.target_forwards += 1
        device_type = batch.conversations.tokens.device.type
        with torch.autocast(device_type, dtype=settings.autocast_dtype, enabled=settings.autocast_dtype is not None):
            loss, accuracies = ttt_loss(self.head, batch, settings.ttt_steps, settings.step_weight)
        if loss.requires_grad:   # else no step had a row to learn from
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.parameters, settings.grad_clip)
            self.optimizer.step()
        values = torch.stack([loss.detach().float()] + accuracies)
        launched = time.perf_counter()
        values = values.tolist()   # the step's one wait for the device
        self.wait_seconds += time.perf_counter() - launched
        self.host_seconds += launched - started
        self.timed_steps += 1
        return values[0], values[1:]

    def learning_rate(self) -> float:
        settings = self.settings
        progress = self.step / max(len(self.plan), 1)
        if settings.max_seconds:
            progress = max(progress, self.elapsed / settings.max_seconds)
        if progress < settings.warmup_fraction:
            return settings.lr * (progress + 1e-3) / settings.warmup_fraction
        decay = (progress - settings.warmup_fraction) / max(1 - settings.warmup_fraction, 1e-9)
        cosine = 0.5 * (1 + math.cos(math.pi * min(decay, 1.0)))
        return settings.lr * (settings.final_lr_fraction + (1 - settings.final_lr_fraction) * cosine)

    # --- checkpoints ---
    def save_checkpoint(self) -> None:
        if self.output_dir is None:
            return
        save_head(self.head, self.output_dir)
        state = {"step": self.step, "elapsed": self.elapsed, "history": self.history,
                 "optimizer": self.optimizer.state_dict(), "plan_size": len(self.plan)}
        torch.save(state, os.path.join(self.output_dir, TRAINER_STATE_FILE))

    def resume(self) -> bool:
        """Loads the head and trainer state saved in output_dir; False when there is none."""
        path = os.path.join(self.output_dir or "", TRAINER_STATE_FILE)
        if not os.path.isfile(path):
            return False
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["plan_size"] != len(self.plan):
            raise ValueError(f"{path} was saved for a plan of {state['plan_size']} batches, this run has "
                             f"{len(self.plan)}: resume with the same data, --epochs and --batch-tokens")
        load_head_state(self.head, read_weights(self.output_dir))
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.elapsed, self.history = state["step"], state["elapsed"], list(state["history"])
        return True
