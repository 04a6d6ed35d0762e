"""HostPhases: where a step's host time goes, by phase, and how long the host waited for the GPU.

A plain decode step on the overlap schedule costs its GPU time only while the host's work
between reading one step and launching the one after next fits inside it. Where it does
not (a 0.5B at concurrency 64 on an H200: ~1.7 ms a step), every microsecond of host work
is step time, and the NGRAM configuration's plain steps cost 17-22% more than a plain
engine's (session 16) with no CPU replay able to say where: a loaded 2-core CPU is not
the GPU machine's host. This measures it there, in the timed runs themselves.

Wraps, while open: the time blocked on a step's outcome (`InFlight.wait`: the GPU is
behind the host), the core's commit, its showing tokens to the drafter and the policy
(`observe`), the policy's probe, a plain step's after-work (`after_step`: observe, probe
and pricing), the deferred detokenizing, the overlap schedule's launch (`launch`, and
`launch_cpu`: this thread's CPU time in it, less than its wall time where it waited for
the GIL or the device), the graph runner's replay in it (`replay`: inputs filled and
copied, the graph launched), CUDA's graph launch itself (`graph_launch`), every CUDA event
wait (`event_sync`: gpu_wait's and the replay's wait for its pinned buffer), the
scheduler's `schedule`, and a drafting step's KV commit (`commit_kv`), proposal (`propose`),
launch of its trees (`run_trees`, containing replay) or a fused drafter's step
(`launch_fused`), and an n-gram drafter's wait for its writer thread's indexing (`drain`, in
a proposal or a probe: the H200 host's batch-1 proposal took ~240 us where the CPU bench's
takes ~25, its drain not told apart). Phases are inclusive (after_step contains observe and
probe, launch contains replay, propose and probe contain drain). The step's owner
(RunWatch, bench.step_cost) ends each step with its kind; totals are kept per kind.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from specserve.runner.model_runner import InFlight

# (attribute path from the core, phase): methods timed on their instance (a path through
# None, e.g. a runner without CUDA graphs, is skipped)
CORE_PHASES = (("committer.verified", "commit"), ("planner.observe", "observe"), ("planner.probe", "probe"),
               ("plain.after_step", "after_step"), ("text.run", "detokenize"),
               ("runner.launch_greedy_decode", "launch"), ("runner.graphs.replay", "replay"),
               ("scheduler.schedule", "schedule"), ("committer.kv", "commit_kv"), ("planner.propose", "propose"),
               ("runner.run_trees", "run_trees"), ("drafter.launch_fused", "launch_fused"),
               ("drafter.writer.drain", "drain"))
CPU_PHASES = (("runner.launch_greedy_decode", "launch_cpu"),)   # timed by this thread's CPU clock


class HostPhases:
    def __init__(self, core):
        self._restore = []
        self._step: defaultdict[str, float] = defaultdict(float)      # the step in progress
        self.totals: dict[str, defaultdict[str, float]] = {}            # kind -> phase -> seconds
        self.steps: defaultdict[str, int] = defaultdict(int)
        for paths, clock in ((CORE_PHASES, time.perf_counter), (CPU_PHASES, time.thread_time)):
            for path, phase in paths:
                owner, name = _resolve(core, path)
                if owner is not None and hasattr(owner, name):
                    self._wrap(owner, name, phase, getattr(owner, name), clock)
        self._wrap(InFlight, "wait", "gpu_wait", InFlight.wait)
        if torch.cuda.is_available():
            self._wrap(torch.cuda.Event, "synchronize", "event_sync", torch.cuda.Event.synchronize)
            self._wrap(torch.cuda.CUDAGraph, "replay", "graph_launch", torch.cuda.CUDAGraph.replay)

    def _wrap(self, owner, name: str, phase: str, method, clock=time.perf_counter) -> None:
        spent = self._step

        def timed(*args, **kwargs):
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                spent[phase] += clock() - start
        # put back as found: a class's method, or an instance's own attribute (another wrapper's,
        # e.g. RunWatch's schedule); an attribute the instance did not have is deleted again
        own = isinstance(owner, type) or name in vars(owner)
        setattr(owner, name, timed)
        self._restore.append((owner, name, method if own else None))

    def end_step(self, kind: str | None, seconds: float) -> None:
        """The step just run was of `kind` (None: nothing ran) and took `seconds` of wall time."""
        if kind is not None:
            totals = self.totals.setdefault(kind, defaultdict(float))
            for phase, spent in self._step.items():
                totals[phase] += spent
            totals["step"] += seconds
            self.steps[kind] += 1
        self._step.clear()

    def reset(self) -> None:
        self.totals.clear()
        self.steps.clear()
        self._step.clear()

    def summary(self) -> dict:
        """Microseconds per step, by kind and phase; `host` is the step's wall time less its
        wait for the GPU (what the host did while the GPU ran, or idled)."""
        out = {}
        for kind, totals in self.totals.items():
            steps = self.steps[kind]
            per_step = {phase: round(spent * 1e6 / steps, 1) for phase, spent in sorted(totals.items())}
            per_step["host"] = round((totals["step"] - totals.get("gpu_wait", 0.0)) * 1e6 / steps, 1)
            out[kind] = per_step
        return out

    def close(self) -> None:
        for owner, name, method in reversed(self._restore):
            if method is None:
                delattr(owner, name)
            else:
                setattr(owner, name, method)
        self._restore.clear()


def _resolve(core, path: str):
    """(object, attribute name) of a dotted path from the core; (None, name) through a None
    or an attribute the object lacks (a drafter without a writer; nor is a missing last
    attribute wrapped)."""
    *parents, name = path.split(".")
    owner = core
    for parent in parents:
        owner = getattr(owner, parent, None) if owner is not None else None
    return owner, name
