"""Host time of a drafting (verify) step, by phase, at batch 1 and 64.

A drafting step used to be synchronous: the host proposed, packed and launched, waited for
the GPU, then committed, and only the drafter's indexing and the last step's text ran
while the GPU computed. Now a GPU engine launches the next drafting step right after
reading and committing this one (engine/draft_ahead.py), and this bench runs it so
(`--sync`: the synchronous schedule, for comparison). At concurrency
64 on an H100 that host time made a step of 8-node trees cost 9-15 ms where its GPU work
is ~3 ms more than a plain step's (issue 10). This bench prices it on the CPU: forwards
are host_replay's stand-ins (the logits' argmax replays a recorded continuation, so
drafts, accept lengths and every bit of host work are the real ones), installed behind the
runner's CUDA-graph interface, so the runner's own packing (TreeStepInputs.fill into a
reused buffer) is host work as on a GPU, and the forward, tree build, greedy verification
and KV-table commit (device work) are the stand-in's, not counted.

Phases (exclusive host microseconds per timed step, the median over steps: the machine is
shared): schedule, propose (drafter.propose), adaptive (the policy's record_proposals /
choose / observe / record_step / should_draft), launch (runner.run_trees: packing and
launching), index (drafter.flush), text (the previous step's deferred detokenizing),
wait_parse (the outcome read back and parsed), drain (see below), commit_kv, commit (per-request token
commits), observe (drafter.observe), detokenize, other (the rest of the step). Each
wrapped call costs ~0.3 us of its own: `--no-phases` times whole steps only (the
headline). host_us is a step's wall time less the stand-in's, cpu_us its thread CPU time
less the stand-in's (what other processes take does not count), exposed_us what the host
adds to a GPU step's own time: with a step launched ahead, the time from reading one
step's outcome (DraftStep.read) to the end of launching the next (the stand-in's time
less); in a synchronous step, the host time less what runs while a GPU computes the step
(index and text, inclusive). Neither counts `drain`, a proposal's wait for the drafter's
writer thread to index what was handed over to it: here that indexing competes with
this thread for two cores, on a GPU it has a whole step's GPU time to finish.
exposed_cpu_us is the same in this thread's CPU time: steadier where other processes share
the cores (what it leaves out: the waits for them).

`python -m lab.draft_step_host --batch-sizes 1 64 --configs 8-multi 16-one
 8-multi-adaptive --workloads code-types code-rename sharegpt --rounds 2`
prints one JSON line per (workload, batch size, config, round). Configs: host_replay's names;
`-adaptive` runs the default policy pinned to drafting (its tier choice and bookkeeping, but
never the plain mode: only drafting steps are priced here).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict

import torch

from lab.draft_step_workloads import WORKLOADS, code_edit_streams
from lab.host_replay import ReplayForward, parse_config
from lab.plain_step_host import MAX_PROMPT, sharegpt_streams
from specserve.bench.gpu_suite import set_drafter
from specserve.engine.draft_ahead import DraftAhead, DraftStep
from specserve.request.detokenizer import IncrementalDetokenizer
from specserve.runner.tree_step import GreedyOutcome, TreeStepInputs, TreeStepOutputs, greedy_commit

GRAPH_SIZES = [1, 4, 8, 16]   # what a GPU engine with 16 draft tokens captures


class PhaseClock:
    """Exclusive wall time per phase: a phase's time less that of the phases inside it; and
    each phase's inclusive wall and thread CPU time."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.inclusive: dict[str, float] = defaultdict(float)       # phases inside included
        self.inclusive_cpu: dict[str, float] = defaultdict(float)   # the same, this thread's CPU time
        self._stack: list[list] = []     # [phase, start, CPU start, time of phases inside]
        # (wall, CPU, device and drain wall, device and drain CPU) at the step's first outcome
        # read, and at the end of its last launch
        self.read_at: tuple[float, float, float, float] | None = None
        self.launch_at: tuple[float, float, float, float] | None = None

    def reset(self) -> None:
        self.totals.clear()
        self.inclusive.clear()
        self.inclusive_cpu.clear()
        self.read_at = self.launch_at = None

    def mark(self, name: str) -> None:
        now = (time.perf_counter(), time.thread_time(), self.totals["device"] + self.inclusive["drain"],
               self.inclusive_cpu["device"] + self.inclusive_cpu["drain"])
        if name == "read" and self.read_at is None:
            self.read_at = now
        elif name == "launch":
            self.launch_at = now

    def exposed_ahead(self) -> tuple[float, float] | None:
        """Read to launch, less the device's time and the waits for indexing in between, when
        a launch followed a read: (wall, CPU)."""
        read, launch = self.read_at, self.launch_at
        if read is None or launch is None or launch[0] < read[0]:
            return None
        return (launch[0] - read[0]) - (launch[2] - read[2]), (launch[1] - read[1]) - (launch[3] - read[3])

    def hidden(self, phases: tuple[str, ...]) -> tuple[float, float]:
        """The phases' inclusive (wall, CPU) time."""
        return sum(self.inclusive[p] for p in phases), sum(self.inclusive_cpu[p] for p in phases)

    def enter(self, phase: str) -> None:
        self._stack.append([phase, time.perf_counter(), time.thread_time(), 0.0])

    def exit(self) -> float:
        phase, start, cpu_start, inner = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.totals[phase] += elapsed - inner
        self.inclusive[phase] += elapsed
        self.inclusive_cpu[phase] += time.thread_time() - cpu_start
        if self._stack:
            self._stack[-1][3] += elapsed
        return elapsed

    def wrap(self, function, phase: str):
        def timed(*args, **kwargs):
            self.enter(phase)
            try:
                return function(*args, **kwargs)
            finally:
                self.exit()
        return timed


class GraphStandIn(ReplayForward):
    """Stands in for the runner's CudaGraphRunner: `replay` fills a reused packed buffer as a
    graph replay does (host work), then runs the stand-in forward, the tree build, greedy
    verification and the table commit (device work on a GPU: the `device` phase)."""

    def __init__(self, prompts, outputs, eos, vocab_size, runner, clock: PhaseClock):
        super().__init__(prompts, outputs, eos, vocab_size)
        self.runner, self.clock, self.sizes = runner, clock, GRAPH_SIZES
        self.host_inputs: dict[tuple[int, int], TreeStepInputs] = {}
        self.reqs_by_row: dict[int, object] = {}
        self.replays = 0
        self._depth = 0

    @contextlib.contextmanager
    def timed(self):
        """Counted once when nested (the argmax inside a replay)."""
        if self._depth:
            yield
            return
        self._depth += 1
        self.clock.enter("device")
        try:
            with super().timed():
                yield
        finally:
            self.clock.exit()
            self._depth -= 1

    def can_run(self, bs: int, n: int) -> bool:
        return True

    def replay(self, proposal, node_slots, req_rows, kv_lens, derive=None, every_node=False) -> TreeStepOutputs:
        """As CudaGraphRunner.replay; `derive` may set the roots only (the trees are read from
        `proposal` on the host: no forecast steps)."""
        self.replays += 1
        bs, n = proposal.tokens.shape
        host = self.host_inputs.get((bs, n))
        if host is None:
            host = self.host_inputs[(bs, n)] = TreeStepInputs.allocate(bs, n, "cpu")
        host.fill(proposal, node_slots, req_rows, kv_lens, self.runner.pool.scratch_row)
        with self.timed():
            inputs = TreeStepInputs.view(host.packed.clone(), bs, n)   # the device's copy
            if derive is not None:
                derive(inputs)
            reqs = [self.reqs_by_row[row] for row in req_rows]
            trees = proposal.trees() if n > 1 else None
            depth = trees.depth.tolist() if trees is not None else [[0]] * bs
            first = [kv - len(r.prompt_ids) + 1 for kv, r in zip(kv_lens, reqs)]
            logits = self._logits([[self._target(r, first[b] + d) for d in depth[b]] for b, r in enumerate(reqs)])
            outcome = greedy_commit(trees, logits, inputs, self.runner.pool) if trees is not None else None
            return TreeStepOutputs(logits, trees, outcome)


def _pin_drafting(core) -> None:
    """The policy's choice among drafting tiers, its bookkeeping included, but no plain mode:
    the bucket always drafts, and plain decoding is priced out of reach (never measured
    here, since no step is plain). Nor does a step decode plainly while the drafter's writer
    is behind (ready_to_draft): its proposals wait for the writer instead (`drain`), as
    without a policy. On a loaded CPU the writer lagged through every timed step of a run,
    which then measured plain steps (accept length 1.0; 1 run in 3 with two busy cores)."""
    adaptive = core.adaptive
    core.drafter.ready_to_draft = lambda: True
    adaptive.should_draft = lambda batch_size: True
    adaptive.costs.refresh_due = lambda bucket: False   # plain decoding always contends for a refresh
    record = adaptive.costs.record

    def record_keeping_plain_dear(bucket: int, tree_size: int, seconds: float, steady: bool = True) -> int:
        # a drafting step without drafts (tier 1) would price plain decoding at its host time
        # and make the tier choice, and with it the accept length, vary from run to run
        tier = record(bucket, tree_size, seconds, steady)
        adaptive.costs.seconds[(bucket, 1)] = 1.0
        return tier
    adaptive.costs.record = record_keeping_plain_dear
    for bucket in (1, 2, 4, 8, 16, 32, 64):
        adaptive.costs.seconds[(bucket, 1)] = 1.0
        adaptive.costs.measured_at[(bucket, 1)] = 0


def _marking(clock: PhaseClock, function, name: str, after: bool):
    def marked(*args, **kwargs):
        if not after:
            clock.mark(name)
        result = function(*args, **kwargs)
        if after:
            clock.mark(name)
        return result
    return marked


def instrument(core, clock: PhaseClock, phases: bool) -> contextlib.ExitStack:
    """Wraps what each phase runs (instance attributes, and the detokenizer's class method);
    the stack puts everything back."""
    stack = contextlib.ExitStack()

    def patch(owner, name: str, phase: str) -> None:
        if owner is None or not hasattr(owner, name):
            return
        original = owner.__dict__.get(name) if isinstance(owner, type) else None
        setattr(owner, name, clock.wrap(getattr(owner, name), phase))
        if isinstance(owner, type):
            stack.callback(setattr, owner, name, original)
        else:
            stack.callback(owner.__dict__.pop, name, None)

    runner, read = core.runner, DraftStep.read
    runner.run_trees = _marking(clock, runner.run_trees, "launch", after=True)
    DraftStep.read = _marking(clock, read, "read", after=False)
    stack.callback(setattr, DraftStep, "read", read)
    stack.callback(runner.__dict__.pop, "run_trees", None)
    patch(core, "step", "other")
    patch(core.drafter, "flush", "index")
    patch(getattr(core.drafter, "writer", None), "drain", "drain")
    patch(getattr(core, "text", None), "run", "text")   # None before deferred text existed
    if not phases:
        return stack
    patch(core.scheduler, "schedule", "schedule")
    patch(core.drafter, "propose", "propose")
    patch(core.drafter, "observe", "observe")
    for name in ("record_proposals", "choose", "observe", "record_step", "should_draft", "would_draft"):
        patch(core.adaptive, name, "adaptive")
    patch(core.runner, "run_trees", "launch")
    patch(core.committer, "kv", "commit_kv")
    patch(core.committer, "one", "commit")
    patch(GreedyOutcome, "parse", "wait_parse")
    patch(DraftStep, "read", "wait_parse")
    patch(IncrementalDetokenizer, "add", "detokenize")
    patch(IncrementalDetokenizer, "add_many", "detokenize")
    return stack


def time_drafting_steps(engine, stand_in: GraphStandIn, prompts, spec: tuple, phases: bool, max_steps: int,
                        ahead: bool = True) -> dict:
    """Runs the batch from prefill until its first request finishes (or max_steps decode
    steps), timing every decode step that has the whole batch. ahead: the next drafting
    step is launched before this one's bookkeeping, as on a GPU (else synchronously)."""
    core, clock = engine.core, stand_in.clock
    set_drafter(engine, *spec)
    core.draft_ahead = DraftAhead(core.scheduler) if ahead else None
    if core.adaptive is not None:
        _pin_drafting(core)
    params = {"temperature": 0, "max_new_tokens": 4096, "ignore_eos": True}
    reqs = [engine._make_request(p, params, False, 0, f"draft-host-{i}") for i, p in enumerate(prompts)]
    for req in reqs:
        core.add_request(req)
    steps, committed = [], 0
    with instrument(core, clock, phases):
        while not any(r.finished or len(r.output_ids) >= len(stand_in.greedy[tuple(r.prompt_ids)]) for r in reqs):
            stand_in.reqs_by_row = {r.row: r for r in reqs if r.row is not None}
            clock.reset()
            replays, before_cpu, cpu_start, start = stand_in.replays, stand_in.cpu_seconds, time.thread_time(), time.perf_counter()
            outputs = core.step()
            cpu = time.thread_time() - cpu_start - (stand_in.cpu_seconds - before_cpu)
            core.scheduler.record_step_time(time.perf_counter() - start)   # the prefill pacer's, as in the engine
            if stand_in.replays > replays and len(outputs) == len(reqs):   # a decode step of the whole batch
                totals = dict(clock.totals)
                totals.pop("device", None)
                host = sum(totals.values())
                exposed = clock.exposed_ahead()
                if exposed is None:   # synchronous: all but what runs while the step's forward does
                    hidden, hidden_cpu = clock.hidden(("index", "text", "drain"))
                    exposed = (host - hidden, cpu - hidden_cpu)
                steps.append((host, cpu, totals, *exposed))
                committed += sum(len(o.new_token_ids) for o in outputs)
                if len(steps) >= max_steps:
                    break
    for req in reqs:
        core.abort(req.rid)
    return _summary(steps, committed, len(prompts), phases)


def _summary(steps, committed: int, batch_size: int, phases: bool) -> dict:
    if not steps:
        raise RuntimeError("no decode step had the whole batch")
    row = {"batch_size": batch_size, "steps": len(steps), "accept_length": committed / len(steps) / batch_size,
           "host_us_median": 1e6 * statistics.median(s[0] for s in steps),
           "cpu_us_median": 1e6 * statistics.median(s[1] for s in steps),
           "exposed_us_median": 1e6 * statistics.median(s[3] for s in steps),
           "exposed_cpu_us_median": 1e6 * statistics.median(s[4] for s in steps)}
    if phases:
        names = sorted({name for _, _, totals, _, _ in steps for name in totals})
        row["phases_us_median"] = {name: round(1e6 * statistics.median(s[2].get(name, 0.0) for s in steps), 1)
                                 for name in names}
    return row


def load_workload(engine, name: str, count: int, min_output: int):
    if name == "sharegpt":
        return sharegpt_streams(engine, count, min_output)
    return code_edit_streams(engine.tokenizer, lambda m: engine.apply_chat_template(m), count,
                             name.removeprefix("code-"), min_output)


def main(argv=None) -> None:
    from specserve.engine.engine import Engine
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="only its tokenizer and vocabulary matter")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--configs", nargs="*", default=["8-multi", "16-one", "8-multi-adaptive"])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--max-steps", type=int, default=40, help="timed decode steps per run at most")
    parser.add_argument("--min-output", type=int, default=160, help="tokens of each continuation at least")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-phases", action="store_true", help="whole steps only (no per-call timers)")
    parser.add_argument("--sync", action="store_true", help="synchronous drafting steps (no step launched ahead)")
    ns = parser.parse_args(argv)
    most = max(ns.batch_sizes)
    engine = Engine(model_path=ns.model_path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                    log_level="warning", device="cpu", dtype="bfloat16", max_running_requests=most,
                    max_total_tokens=most * (MAX_PROMPT + 4 * ns.min_output + 64))
    engine.shutdown()   # stops the engine's step loop only: this bench steps the core itself
    config = engine.core.runner.config
    runner = engine.core.runner
    for workload in ns.workloads:
        prompts, outputs = load_workload(engine, workload, most, ns.min_output)
        stand_in = GraphStandIn(prompts, outputs, (config.eos_token_ids or (0,))[0], config.vocab_size, runner,
                                PhaseClock())
        graphs, runner.graphs = runner.graphs, stand_in
        try:
            with stand_in.installed(runner), torch.inference_mode():
                runner.run_trees = type(runner).run_trees.__get__(runner)   # the real one, over the stand-in graphs
                for batch_size in ns.batch_sizes:
                    for round_ in range(ns.rounds):
                        for name in ns.configs:
                            row = time_drafting_steps(engine, stand_in, prompts[:batch_size], parse_config(name),
                                                      not ns.no_phases, ns.max_steps, not ns.sync)
                            print(json.dumps({"workload": workload, "config": name, "round": round_ + 1,
                                              "schedule": "sync" if ns.sync else "ahead", **row}), flush=True)
        finally:
            runner.graphs = graphs
            runner.__dict__.pop("run_trees", None)


if __name__ == "__main__":
    main()
