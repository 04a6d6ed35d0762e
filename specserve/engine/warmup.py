"""Start-up warm-up: before the engine takes its first request, run one request of every
shape the plan names (warmup_plan.py), so that whatever a step builds on first use (Triton
kernel variants, cuBLAS modules, the GEMV autotune, pinned buffers, the drafter's first
calls) is built now and not inside a user's request.

It drives the engine's own surface, `EngineCore.add_request` / `step`, with synthetic
requests, so it follows the core wherever its internals go, and it leaves nothing behind
that could change a later output: drafts come from a scratch drafter of the configured
kind (the real one never sees the synthetic prompts), the adaptive draft length and the
step logger are scratch copies too, and every KV slot and request row is back in its pool
at the end (checked). The sampler keys its random numbers by request seed and position,
so nothing else carries over. `--skip-server-warmup` skips it.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from specserve.engine.kernel_cache import TritonCompileCounter, use_persistent_triton_cache
from specserve.engine.stats import StepLogger
from specserve.engine.warmup_plan import (DRAFT_PROMPT, SHORT_PROMPT, BatchShape, EngineShape, WarmupPlan,
                                          plan_warmup)
from specserve.request.detokenizer import IncrementalDetokenizer
from specserve.request.req import Req
from specserve.request.sampling_params import SamplingParams
from specserve.speculative.adaptive.policy import AdaptiveDraftLength

logger = logging.getLogger("specserve")

prepare_kernel_cache = use_persistent_triton_cache  # the builder calls it before anything compiles

# Prompt material: ordinary prose and code, so token ids are the usual ones.
WARMUP_TEXT = ("def merge_intervals(intervals):\n    \"\"\"Merge overlapping [start, end] pairs.\"\"\"\n"
               "    intervals = sorted(intervals)\n    merged = [list(intervals[0])]\n"
               "    for start, end in intervals[1:]:\n        if start <= merged[-1][1]:\n"
               "            merged[-1][1] = max(merged[-1][1], end)\n        else:\n"
               "            merged.append([start, end])\n    return merged\n\n"
               "The river runs past the old mill, under two stone bridges, and out to the sea. ")
DRAFT_TEXT = " one, two, three, four, five, six, seven, eight, nine, ten,"
MAX_GROUP_STEPS = 100_000   # a group that has not finished by then is stuck (a bug, not a slow GPU)
LATE_ARRIVAL_TOKENS = 32      # what the requests decoding while a prompt arrives generate


@dataclass(frozen=True)
class SamplingVariant:
    name: str
    params: dict
    return_logprob: bool = False
    top_logprobs_num: int = 0


SAMPLING_VARIANTS = (
    SamplingVariant("greedy", {"temperature": 0.0}),
    SamplingVariant("temperature", {"temperature": 0.8}),
    SamplingVariant("top-k/top-p", {"temperature": 0.7, "top_k": 40, "top_p": 0.9}),
    SamplingVariant("min-p", {"temperature": 0.7, "min_p": 0.05}),
    SamplingVariant("penalties", {"temperature": 0.0, "repetition_penalty": 1.2, "frequency_penalty": 0.3,
                                  "presence_penalty": 0.3}),
    SamplingVariant("min_new_tokens", {"temperature": 0.0, "min_new_tokens": 2}),
    SamplingVariant("stop string", {"temperature": 0.0, "stop": ["\n\n\n"]}),
    SamplingVariant("logprobs", {"temperature": 0.0}, return_logprob=True),
    SamplingVariant("top logprobs", {"temperature": 0.9, "top_p": 0.95, "repetition_penalty": 1.1},
                    return_logprob=True, top_logprobs_num=5),
)


@dataclass
class WarmupReport:
    plan: WarmupPlan
    seconds: float
    steps: int
    drafter: str | None
    triton_compiles: int | None      # None: not counted (no Triton)
    triton_seconds: float
    sampling_graphs: int = 0         # sampled plain steps' graphs captured (sampling/plain_graphs.py)
    sampling_graph_seconds: float = 0.0
    sampling_graph_bytes: int = 0    # the device memory their capture reserved

    def summary(self) -> str:
        plan = self.plan
        parts = []
        if plan.prompt_lengths:
            parts.append(f"prompts of {_span(plan.prompt_lengths)} tokens ({len(plan.prompt_lengths)})")
        sizes = sorted({batch.size for batch in plan.decode_batches})
        if sizes:
            parts.append(f"decode at batch sizes {_span(sizes)} ({len(sizes)})")
        tier_sizes = sorted({batch.size for batch in plan.tier_batches})
        if plan.tiers and tier_sizes:
            parts.append(f"{self.drafter} trees of {'/'.join(map(str, plan.tiers))} nodes at batch sizes "
                         f"{_span(tier_sizes)} ({len(tier_sizes)})")
        if plan.sampling_variants:
            parts.append(f"{len(SAMPLING_VARIANTS)} sampling variants")
        if self.sampling_graphs:
            parts.append(f"{self.sampling_graphs} sampling graphs captured ({self.sampling_graph_seconds:.1f} s, "
                         f"{self.sampling_graph_bytes / 2**20:.0f} MiB)")
        line = f"start-up warm-up: {self.seconds:.1f} s, {self.steps} steps: " + ", ".join(parts)
        if self.triton_compiles is not None:
            line += (f"; {self.triton_compiles} Triton kernels compiled or loaded from cache "
                     f"({self.triton_seconds:.1f} s)")
        return line


def warm_up(core, tokenizer, args, plan: WarmupPlan | None = None) -> WarmupReport | None:
    """Runs `plan` (default: the one for this engine) through `core`, idle before it
    serves; logs and returns what it did. None: nothing to do (a CPU engine), or
    `args.skip_server_warmup`."""
    if args.skip_server_warmup:
        logger.info("start-up warm-up skipped (--skip-server-warmup): first requests of a new shape may stall")
        return None
    plan = plan or plan_warmup(EngineShape.of(core, args))
    if plan is None:
        logger.debug("no start-up warm-up on a CPU: nothing is compiled or autotuned there")
        return None
    driver = _Driver(core, tokenizer)
    pool = core.runner.pool
    free_slots, free_rows = pool.slots.available(), pool.free_rows()
    start = time.perf_counter()
    # uncached: every prompt shape runs in full, and real requests find none of these prompts cached
    with TritonCompileCounter() as compiles, core.scheduler.without_prefix_cache():
        graphs = _capture_sampling_graphs(core.sampler)
        _run_plan(core, driver, plan, args)
    _check_clean(core, free_slots, free_rows)
    report = WarmupReport(plan, time.perf_counter() - start, driver.steps,
                          args.speculative if plan.tiers else None, compiles.compiles, compiles.seconds, *graphs)
    logger.info(report.summary())
    return report


def _capture_sampling_graphs(sampler) -> tuple[int, float, int]:
    """Every sampled plain step's graph (sampling/plain_graphs.py), before any sampled step
    captures one lazily, so that their shared pool is sized by the largest: (how many, seconds,
    device bytes reserved)."""
    if sampler.plain_graphs is None:
        return 0, 0.0, 0
    start, reserved = time.perf_counter(), torch.cuda.memory_reserved()
    captured = sampler.plain_graphs.capture_all()
    return captured, time.perf_counter() - start, torch.cuda.memory_reserved() - reserved


def _run_plan(core, driver: "_Driver", plan: WarmupPlan, args) -> None:
    """Plain phases without a drafter; then, with a scratch drafter of the configured kind,
    every tier (the full drafts, no adaptive cut) and the adaptive draft length's own path."""
    real_adaptive, real_drafter = core.adaptive, core.drafter
    with _swapped(core, drafter=None, adaptive=None):
        driver.run_plain(plan)
        if not plan.tiers:
            return
        drafter = real_drafter.scratch()
        with _swapped(core, drafter, adaptive=None):
            driver.run_drafted(plan, drafter)
        if real_adaptive is not None:
            policy = AdaptiveDraftLength(real_adaptive.tiers, real_adaptive.switch_margin, real_adaptive.ragged,
                                         real_adaptive.cost_per_node, real_adaptive.leave_margin)
            with _swapped(core, real_drafter.scratch(), policy):
                driver.run([driver.request(driver.draft_prompt(DRAFT_PROMPT, 0), 2 * plan.longest_tier + 2)])


class _Driver:
    """Makes the synthetic requests and runs them to completion through the core."""

    def __init__(self, core, tokenizer):
        self.core, self.tokenizer = core, tokenizer
        config = core.runner.config
        vocab = config.vocab_size
        self.context_length = core.runner.context_length
        self.text_ids = [t % vocab for t in tokenizer(WARMUP_TEXT, add_special_tokens=False).input_ids]
        self.draft_ids = [t % vocab for t in tokenizer(DRAFT_TEXT, add_special_tokens=False).input_ids]
        self.stop_token = config.eos_token_ids[0] if config.eos_token_ids else 0
        self.steps = 0
        self._numbers = itertools.count()

    # --- the phases ---
    def run_plain(self, plan: WarmupPlan) -> None:
        for i, length in enumerate(plan.prompt_lengths):
            self.run([self.request(self.prompt(length, i), plan.new_tokens)])
        for batch in plan.decode_batches:
            self.run(self.batch_requests(batch, self.prompt, plan.new_tokens))
        if plan.late_prompt_length:
            # a prompt arriving while others decode: its chunks are paced between (or inside) decode steps
            decoding = [self.request(self.prompt(SHORT_PROMPT, i), LATE_ARRIVAL_TOKENS) for i in range(4)]
            self.run(decoding, late=[self.request(self.prompt(plan.late_prompt_length, 9), plan.new_tokens)])
        if plan.sampling_variants:
            self.run(self.variant_requests(lambda i: self.prompt(SHORT_PROMPT, i), plan.new_tokens + 2))

    def run_drafted(self, plan: WarmupPlan, drafter) -> None:
        """Every tier at every batch size. A primer request shows the trie its prompt and
        greedy continuation first; the groups' prompts end with that prompt, so a request
        allowed tier + 1 tokens verifies a full tree of `tier` nodes after its prefill,
        whatever the model."""
        primer = self.draft_prompt(SHORT_PROMPT, 0)
        self.run([self.request(primer, plan.longest_tier + 2)])
        drafter.flush()  # index it all now (on a GPU, flush indexes only while the GPU is busy)
        primed = lambda length, _: self.draft_prompt(length - len(primer), len(primer)) + primer
        for tier in plan.tiers:
            for batch in plan.tier_batches:
                self.run(self.batch_requests(batch, primed, tier + 1))
                drafter.flush()
        if plan.tier_batches and plan.sampling_variants:
            self.run(self.variant_requests(lambda _: primer, plan.longest_tier + 2))

    # --- requests ---
    def prompt(self, length: int, offset: int) -> list[int]:
        """`length` tokens of the warm-up text from a different place for each offset (so
        that prompts of one batch differ from their first token)."""
        ids = self.text_ids
        start = offset * 7
        return [ids[(start + i) % len(ids)] for i in range(length)]

    def draft_prompt(self, length: int, offset: int) -> list[int]:
        """`length` tokens of the counting sequence, from its `offset`-th token (a language
        model continues it: the adaptive draft length sees drafts accepted)."""
        ids = self.draft_ids
        return [ids[(offset + i) % len(ids)] for i in range(length)]

    def batch_requests(self, batch: BatchShape, prompt, max_new_tokens: int) -> list[Req]:
        return [self.request(prompt(length, i), max_new_tokens) for i, length in enumerate(batch.prompt_lengths)]

    def variant_requests(self, prompt, max_new_tokens: int) -> list[Req]:
        return [self.request(prompt(i), max_new_tokens, variant) for i, variant in enumerate(SAMPLING_VARIANTS)]

    def request(self, ids: list[int], max_new_tokens: int, variant: SamplingVariant = SAMPLING_VARIANTS[0]) -> Req:
        ids = ids[:self.context_length - 2]
        max_new_tokens = max(1, min(max_new_tokens, self.context_length - len(ids)))
        extra = {"stop_token_ids": [self.stop_token]} if "min_new_tokens" in variant.params else {}
        params = SamplingParams.from_dict({**variant.params, **extra, "ignore_eos": True,
                                           "max_new_tokens": max_new_tokens,
                                           "min_new_tokens": min(variant.params.get("min_new_tokens", 0),
                                                                 max_new_tokens)})
        number = next(self._numbers)
        return Req(rid=f"specserve-warmup-{number}", prompt_ids=ids, params=params,
                   detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                                      params.stop, params.no_stop_trim),
                   seed=number, stop_ids=frozenset(params.stop_token_ids), max_new_tokens=max_new_tokens,
                   return_logprob=variant.return_logprob, top_logprobs_num=variant.top_logprobs_num)

    def run(self, reqs: list[Req], late: list[Req] = ()) -> None:
        """Adds `reqs`, steps until they are all decoding, adds `late`, steps until all end."""
        for req in reqs:
            self.core.add_request(req)
        pending_late = list(late)
        for _ in range(MAX_GROUP_STEPS):
            if pending_late and all(r.output_ids or r.finished for r in reqs):
                for req in pending_late:
                    self.core.add_request(req)
                pending_late = []
            if not self.core.has_work() and not pending_late:
                return
            self.core.step()
            self.steps += 1
        raise RuntimeError(f"start-up warm-up: a group of {len(reqs) + len(late)} requests did not finish "
                           f"in {MAX_GROUP_STEPS} steps")


@contextlib.contextmanager
def _swapped(core, drafter, adaptive):
    """The core drafts with `drafter` and `adaptive` (None: none) and logs to a scratch
    step logger while the block runs; its own come back afterwards, untouched."""
    saved = core.drafter, core.adaptive, core.stats
    core.drafter, core.adaptive = drafter, adaptive
    core.stats = StepLogger(float("inf"), speculative=drafter is not None)
    try:
        yield
    finally:
        core.drafter, core.adaptive, core.stats = saved


def _check_clean(core, free_slots: int, free_rows: int) -> None:
    pool = core.runner.pool
    if core.has_work() or pool.slots.available() != free_slots or pool.free_rows() != free_rows:
        raise RuntimeError(f"start-up warm-up left state behind: {pool.slots.available()} free KV slots "
                           f"(before: {free_slots}), {pool.free_rows()} free request rows (before: {free_rows}), "
                           f"work pending: {core.has_work()}")


def _span(values) -> str:
    values = sorted(values)
    return f"{values[0]}..{values[-1]}" if len(values) > 1 else str(values[0])
