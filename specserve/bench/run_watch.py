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
from specserve.engine.step_events import StepListener
from specserve.speculative.hybrid.drafter import HybridDrafter


class RunWatch(StepListener):
    """Where a timed run's time went: its engine steps by kind (`prefill`, `plain` decode,
    `draft`: a decode step with draft nodes) with their count, wall seconds, mean batch size
    and how many were read from a step launched ahead (overlap.py, draft_ahead.py) and, for
    drafting steps, the mean nodes per request; its longest step (and its kind, batch size
    and nodes per request); what can stall one step: the Triton kernels compiled during the
    run (first use in this process; a compile found in Triton's disk cache only loads, so
    `jit_compile_s` tells the two apart; `jit_kernels` names each with its specialisation),
    Python's full GC collections and the caching
    allocator's cudaMalloc calls (one 386-ms drafting step with no compile in a suite run
    on an H200 is what these tell apart); the rows of plain steps launched ahead that a
    grammar sent back (`grammar_relaunches`). A probe's proposals leave a plain step plain.
    It listens to the core's step events (engine/step_events.py) and sets Triton's JIT
    hooks; `close` takes both back.

    The host's time per step by phase, and its wait for the GPU, come from `phase_timer`
    where one is set: a factory `core -> timer` with `reset()`, `summary()` and `close()`
    that listens to the same events (HostPhases, lab/host_phases.py). The benchmarks leave
    it off and `host_us_per_step` is None; `python -m lab.suite_host_phases MODULE ...`
    runs one with it."""

    phase_timer = None

    def __init__(self, engine, triton_runtime=None, trace_dir: str | None = None):
        """trace_dir: where each run's adaptive-policy trace goes (policy_trace.py), if anywhere."""
        self.core, self.trace_dir, self.trace = engine.core, trace_dir, None
        self.cell = "run"   # the benchmark cell the next runs belong to: names their traces
        self._traced: Counter[str] = Counter()   # runs traced so far, by name
        self._compiles = TritonCompileCounter(triton_runtime).__enter__()
        factory = type(self).phase_timer
        self.host = factory(self.core) if factory is not None else None
        self.reset()
        self.step_began()   # the step fields, before the first step sets them
        self.core.events.add(self)

    def reset(self) -> None:
        self.longest_step_s = 0.0
        self.longest_step: dict | None = None   # what the longest step was: kind, batch size, nodes
        self._full_collections = _full_gc_collections()
        self._device_allocs = _device_allocs()
        self._relaunches = self._grammar_relaunches()
        gate = self.core.drafting.forecast_gate
        self._forecast_start = (gate.picks, gate.found)
        self.mix = {kind: {"steps": 0, "s": 0.0, "requests": 0, "ahead": 0, "tokens": 0}
                    for kind in ("prefill", "plain", "draft")}
        self._draft_nodes = 0
        self._compiles.reset()
        if self.host is not None:
            self.host.reset()
        if self.trace is not None:
            self.trace.close()
        drafter = self.core.drafter
        choice = drafter.choice if isinstance(drafter, HybridDrafter) else None
        self.trace = PolicyTrace(self.core.adaptive, choice) if self.core.adaptive is not None else None

    def summary(self) -> dict:
        counted = self._compiles.compiles is not None  # None: hooks someone else set are left alone
        drafts = self.mix["draft"]["steps"]
        device_allocs = _device_allocs()
        return {"longest_step_s": self.longest_step_s, "longest_step": self.longest_step,
                "full_gc_collections": _full_gc_collections() - self._full_collections,
                "device_allocs": None if device_allocs is None else device_allocs - self._device_allocs,
                "jit_compiles": self._compiles.compiles,
                "jit_compile_s": self._compiles.seconds if counted else None,
                "jit_kernels": list(self._compiles.kernels) if counted else None,
                "step_mix": {kind: _mix_row(m) for kind, m in self.mix.items()},
                "draft_nodes_mean": self._draft_nodes / drafts if drafts else None,
                "grammar_relaunches": self._grammar_relaunches() - self._relaunches,
                "forecast": self._forecast(),
                "host_us_per_step": self.host.summary() if self.host is not None else None,
                "policy": self.trace.summary() if self.trace is not None else None}

    def _forecast(self) -> dict | None:
        """The run's NGRAM forecast steps (--speculative-ngram-forecast): requests' picks, the
        share that found their entry, and the gate's measured step ratio at batch 1 and 8
        (request/forecast_record.py); None where none was forecast."""
        gate = self.core.drafting.forecast_gate
        picks, found = gate.picks - self._forecast_start[0], gate.found - self._forecast_start[1]
        if picks == 0:
            return None
        return {"picks": picks, "found": found / picks, "step_ratio": {bs: gate.cycles.ratio(bs) for bs in (1, 8)}}

    def _grammar_relaunches(self) -> int:
        """Rows of plain steps launched ahead on a token the request's grammar forbade, cut and
        launched again (overlap.py): what greedy constrained decoding's unmasked launches cost."""
        overlap = self.core.overlap
        return overlap.relaunches if overlap is not None else 0

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
            self.host.close()
        self.core.events.remove(self)
        self._compiles.__exit__(None, None, None)

    # --- the step events ---
    def step_began(self) -> None:
        self._kind, self._batch_size, self._tokens, self._nodes, self._from_ahead = None, 0, 0, 1, False
        self._started = time.perf_counter()

    def step_scheduled(self, batch) -> None:
        self._batch_size = len(batch.reqs)
        self._tokens = sum(batch.extend_lens) if batch.is_extend else self._batch_size

    def step_launched(self, kind, nodes, from_ahead) -> None:
        self._kind, self._nodes, self._from_ahead = kind, nodes, from_ahead
        if kind == "draft":
            self._draft_nodes += nodes

    def step_ended(self) -> None:
        elapsed = time.perf_counter() - self._started
        if elapsed > self.longest_step_s:
            self.longest_step_s = elapsed
            self.longest_step = {"kind": self._kind, "batch_size": self._batch_size, "nodes": self._nodes}
        if self._kind is not None:
            mix = self.mix[self._kind]
            mix["steps"] += 1
            mix["s"] += elapsed
            mix["requests"] += self._batch_size
            mix["tokens"] += self._tokens
            mix["ahead"] += self._from_ahead


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
