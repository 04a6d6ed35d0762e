"""RunWatch: where a timed benchmark run's time went (its steps by kind, its longest step,
what can stall one step, optionally the host's phases) and the adaptive policy's trace of it."""
from __future__ import annotations

import gc
import os
import time
from collections import Counter

import torch

from specserve.bench.policy_trace import PolicyTrace
from specserve.engine.kernel_cache import TritonCompileCounter


class RunWatch:
    """Where a timed run's time went: its engine steps by kind (`prefill`, `plain` decode,
    `draft`: a verify step with draft nodes) with their count, wall seconds, mean batch size
    and how many plain steps were read from a step launched ahead (overlap.py) and, for
    drafting steps, the mean nodes per request; its longest step (and its kind, batch size
    and nodes per request); what can stall one step: the Triton kernels compiled during the
    run (first use in this process; a compile found in Triton's disk cache only loads, so
    `jit_compile_s` tells the two apart), Python's full GC collections and the caching
    allocator's cudaMalloc calls (one 386-ms drafting step with no compile in a suite run
    on an H200 is what these tell apart). A step drafts when the core
    proposed drafts in it (`planner.propose`), read a greedy drafting step
    (`drafting.read`) or verified draft nodes (`run_trees`): EAGLE's fused steps verify
    and draft inside the drafter's own graph and never reach run_trees, and a probe's
    proposals (the drafter's `propose`, shadows only) leave a plain step plain. Wraps the
    core's `step`, `planner.propose` and `drafting.read`, the scheduler's `schedule` and the
    runner's `run_trees`, and sets Triton's JIT hooks; `close` puts them back.

    The host's time per step by phase, and its wait for the GPU, come from `phase_timer`
    where one is set: a factory `core -> timer` with `reset()`, `end_step(kind, seconds)`,
    `summary()` and `close()`. The profiler that fills it (HostPhases, host_phases.py) wraps
    methods of the core's parts by name, so the benchmarks leave it off and
    `host_us_per_step` is None; `python -m lab.suite_host_phases MODULE ...` runs one with it."""

    phase_timer = None

    def __init__(self, engine, triton_runtime=None, trace_dir: str | None = None):
        """trace_dir: where each run's adaptive-policy trace goes (policy_trace.py), if anywhere."""
        self.core, self.trace_dir, self.trace = engine.core, trace_dir, None
        self.cell = "run"   # the benchmark cell the next runs belong to: names their traces
        self._traced: Counter[str] = Counter()   # runs traced so far, by name
        self._step, self._schedule, self._run_trees = self.core.step, self.core.scheduler.schedule, self.core.runner.run_trees
        self.core.step, self.core.scheduler.schedule, self.core.runner.run_trees = (
            self._timed_step, self._watched_schedule, self._watched_run_trees)
        self._propose, self._read_drafting = self.core.planner.propose, self.core.drafting.read
        self.core.planner.propose, self.core.drafting.read = self._watched_propose, self._watched_read_drafting
        self._overlap = self.core.overlap   # plain steps read from a step launched ahead are counted
        if self._overlap is not None:
            self._current_step = self._overlap.current_step
            self._overlap.current_step = self._watched_current_step
        self._compiles = TritonCompileCounter(triton_runtime).__enter__()
        factory = type(self).phase_timer
        self.host = factory(self.core) if factory is not None else None
        self.reset()

    def reset(self) -> None:
        self.longest_step_s = 0.0
        self.longest_step: dict | None = None   # what the longest step was: kind, batch size, nodes
        self._full_collections = _full_gc_collections()
        self._device_allocs = _device_allocs()
        self.mix = {kind: {"steps": 0, "s": 0.0, "requests": 0, "ahead": 0, "tokens": 0}
                    for kind in ("prefill", "plain", "draft")}
        self._draft_nodes = 0
        self._compiles.reset()
        if self.host is not None:
            self.host.reset()
        if self.trace is not None:
            self.trace.close()
        self.trace = PolicyTrace(self.core.adaptive) if self.core.adaptive is not None else None

    def summary(self) -> dict:
        counted = self._compiles.compiles is not None  # None: hooks someone else set are left alone
        drafts = self.mix["draft"]["steps"]
        device_allocs = _device_allocs()
        return {"longest_step_s": self.longest_step_s, "longest_step": self.longest_step,
                "full_gc_collections": _full_gc_collections() - self._full_collections,
                "device_allocs": None if device_allocs is None else device_allocs - self._device_allocs,
                "jit_compiles": self._compiles.compiles,
                "jit_compile_s": self._compiles.seconds if counted else None,
                "step_mix": {kind: _mix_row(m) for kind, m in self.mix.items()},
                "draft_nodes_mean": self._draft_nodes / drafts if drafts else None,
                "host_us_per_step": self.host.summary() if self.host is not None else None,
                "policy": self.trace.summary() if self.trace is not None else None}

    def dump_trace(self, name: str) -> None:
        """The run's policy events, appended to trace_dir/policy_trace.jsonl with `"run": NAME`
        (NAME-2, -3 ... for repeats)."""
        if self.trace is None or self.trace_dir is None:
            return
        os.makedirs(self.trace_dir, exist_ok=True)
        self._traced[name] += 1
        repeat = self._traced[name]
        self.trace.dump(os.path.join(self.trace_dir, "policy_trace.jsonl"), name if repeat == 1 else f"{name}-{repeat}")

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
        if self.host is not None:
            self.host.close()   # before the wrappers it wraps go
        if self._overlap is not None:
            self._overlap.current_step = self._current_step
        self.core.step, self.core.scheduler.schedule, self.core.runner.run_trees = (
            self._step, self._schedule, self._run_trees)
        del self.core.planner.propose, self.core.drafting.read   # the class's methods again
        self._compiles.__exit__(None, None, None)

    def _watched_schedule(self):
        batch = self._schedule()
        self._kind = None if batch is None else "prefill" if batch.is_extend else "plain"
        self._batch_size = 0 if batch is None else len(batch.reqs)   # the step resets the rest (_timed_step)
        self._tokens = sum(batch.extend_lens) if batch is not None and batch.is_extend else self._batch_size
        return batch

    def _watched_current_step(self, reqs, last_tokens):
        ahead = self._overlap.ahead
        step = self._current_step(reqs, last_tokens)
        self._from_ahead = ahead is not None and step is ahead
        return step

    def _watched_run_trees(self, reqs, proposal, *args, **kwargs):
        self._drafted(proposal.tokens.shape[1])
        return self._run_trees(reqs, proposal, *args, **kwargs)

    def _watched_propose(self, *args, **kwargs):
        proposal, num_nodes, record = self._propose(*args, **kwargs)
        self._drafted(proposal.num_slots)
        return proposal, num_nodes, record

    def _watched_read_drafting(self, launched):
        if self._kind is None:   # the step launched ahead, retired before a schedule (a request arrived)
            self._kind = "plain"
        self._drafted(launched.step.num_slots)
        return self._read_drafting(launched)

    def _drafted(self, nodes: int) -> None:
        """A decode step with `nodes` per request: a drafting step if nodes > 1 (its nodes
        counted once per step)."""
        if nodes > 1 and self._kind == "plain":
            self._kind = "draft"
            self._draft_nodes += nodes
            self._nodes = nodes

    def _timed_step(self):
        self._kind, self._batch_size, self._tokens, self._nodes, self._from_ahead = None, 0, 0, 1, False
        taken = self._drafts_taken_ahead()
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            elapsed = time.perf_counter() - start
            if elapsed > self.longest_step_s:
                self.longest_step_s = elapsed
                self.longest_step = {"kind": self._kind, "batch_size": self._batch_size, "nodes": self._nodes}
            if self._kind == "draft" and self._drafts_taken_ahead() > taken:
                self._from_ahead = True   # a drafting step launched before the last one's bookkeeping
            if self._kind is not None:
                mix = self.mix[self._kind]
                mix["steps"] += 1
                mix["s"] += elapsed
                mix["requests"] += self._batch_size
                mix["tokens"] += self._tokens
                mix["ahead"] += self._from_ahead
            if self.host is not None:
                self.host.end_step(self._kind, elapsed)

    def _drafts_taken_ahead(self) -> int:
        draft_ahead = self.core.draft_ahead
        return draft_ahead.steps_taken if draft_ahead is not None else 0


def _mix_row(mix: dict) -> dict:
    """A step kind's count, wall milliseconds, mean batch size, mean tokens scheduled (prefill:
    the prompt chunks, and in a mixed step one a decoding request; decode: one a request) and
    how many were read from a step launched ahead (plain steps: overlap.py; drafting steps:
    draft_ahead.py). The others paid their launch and host time in full: the first decode step
    after a prefill, after a drafting step, after a request ended, a drafting step after a
    plain one. (The chunk sizes say whether a speculative engine's extra prefill steps are
    smaller ones: gpu_suite's --enable-mixed-chunk says why that matters.)"""
    steps = mix["steps"]
    return {"steps": steps, "ms": round(mix["s"] * 1e3, 1),
            "mean_batch": round(mix["requests"] / steps, 1) if steps else None,
            "mean_tokens": round(mix["tokens"] / steps, 1) if steps else None, "from_ahead": mix["ahead"]}


def _full_gc_collections() -> int:
    """Python's full (generation-2) collections so far: one can pause a step for 100+ ms."""
    return gc.get_stats()[2]["collections"]


def _device_allocs() -> int | None:
    """cudaMalloc calls of torch's caching allocator so far (None without CUDA): one in a
    timed run means a step grew the pool, which can stall it."""
    return torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else None
