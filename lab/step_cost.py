"""What one decode, verify or fused EAGLE-3 step costs, by batch size and draft size, on a
real model's shapes with random weights (no checkpoint or head to stage):
`python -m lab.step_cost --shape qwen2.5-coder-1.5b --batch-sizes 1 8 32 64 --sizes 1 4 8 16`.

For each (batch size, step) the engine's own step loop runs requests whose drafter always
proposes a full chain of that size (size 1: plain decoding, on the overlap schedule), and
the bench reports per step: the wall time, the GPU time of the same graph replayed on its
own, and the difference (host time the GPU did not hide), plus the ratio to a plain step
at the same batch size. Random weights accept almost nothing, which does not change what
a step costs. With `--kernels N` a row also counts the kernel launches of its graph and
sums their times (torch.profiler) and lists the N slowest kernels: issue 10's comparison of
a verify step with a plain one is
`--batch-sizes 1 8 --sizes 1 8 16 --steps 100 --kernels 40`. Run through
`python -m lab.suite_host_phases lab.step_cost ...`, a row also has the host's
microseconds per step by phase (lab/host_phases.py: the schedule, the launch, the read
and the wait for the GPU in it, the commit): where the host time a verify step does not
hide goes (H200, random 1.5B, batch 1: 0.2-0.45 ms a step, session 24).

`--forecast` adds, for NGRAM, each verify size's steps launched before the step before them is
read, their drafts picked on the device from a forecast table (runner/forecast_step.py): the
host time such a step leaves unhidden, against the verify row's.

`--algorithm EAGLE3 --num-steps K` adds the fused EAGLE-3 step (speculative/model_drafters/fused_step.py: the
target's verify of K + 1 chain nodes with three layers' states kept, verification, commit,
the head's K + 1 fed rows and K - 1 draft steps, one graph) with a random head sized as a
real one (random_head.py). Rows, in one process: plain and NGRAM-style verify of K + 1
nodes on a target that keeps no states, the same two on the EAGLE-3 engine's target
(whose graphs keep the head's states), and the fused step; then a `step_split` row per
batch size: the fused step's time as target verify + hidden capture + head and
verification + host (GPU-time differences of those rows). The drafts are the random
head's: accept lengths are ~1 and are not the point.
With `--topk k --tree-nodes n` the fused step is EAGLE-2's tree instead: verify of n
nodes, the head fed the accepted path and its K - 1 steps of k beams, and the next tree.
"""
from __future__ import annotations

import argparse
import bisect
import gc
import os
import random
import time
from typing import Callable

import numpy as np
import torch

from lab.decode_profile import events_time_us, kernel_times
from lab.random_head import write_random_eagle3_head
from specserve.attention.triton_backend import TritonBackend
from specserve.bench.random_model import SHAPES, write_model_config
from specserve.bench.result_rows import emit_row
from specserve.request.forecast_record import ForecastRecord
from specserve.runner.forecast_step import empty_table
from specserve.speculative.drafter import Drafter, ForecastSteps
from specserve.verify.tree import TreeProposal

class ChainDrafter(Drafter):
    """Proposes a chain of `size` nodes (random tokens) for every request, within its limit."""
    proposes_ahead = True   # reads nothing the step's commit changes: the next step is launched ahead, as NGRAM's

    def __init__(self, size: int, seed: int = 0):
        self.size, self.rng = size, np.random.default_rng(seed)

    def propose(self, reqs, max_nodes):
        counts = [min(self.size, limit) for limit in max_nodes]
        n = max(counts)
        tokens = self.rng.integers(10, 4000, size=(len(reqs), n))
        tokens[:, 0] = [r.last_token for r in reqs]
        node = np.arange(n)
        parents = np.where(node < np.asarray(counts)[:, None], node - 1, -1)
        return TreeProposal(tokens, parents, np.asarray(counts, dtype=np.int64)), counts


class ForecastChainDrafter(ChainDrafter, ForecastSteps):
    """ChainDrafter whose next step is launched before this one is read (runner/forecast_step.py):
    a full table, `candidates` random bonus tokens a node each with a full chain, made in a few
    numpy calls (the trie's own forecast costs what lab.ngram_forecast reports). Random weights
    make the target's token none of them, so every step verifies its root alone, in a forward
    of the chain's size: the cost of a forecast step (and of the table sent each step)."""

    def __init__(self, size: int, candidates: int = 2, seed: int = 0):
        super().__init__(size, seed)
        self.candidates = candidates
        self.made = 0   # tables made: steps launched from a forecast

    def forecasts(self, batch_size):
        return True

    def forecast(self, reqs, proposal, nodes):
        self.made += 1
        table = empty_table(len(reqs), proposal.num_slots, self.candidates, nodes)
        table[..., 0] = self.rng.integers(10, 4000, size=table.shape[:3])     # bonus tokens
        table[..., 1:nodes] = self.rng.integers(10, 4000, size=table.shape[:3] + (nodes - 1,))
        table[..., nodes:2 * nodes - 1] = np.arange(nodes - 1)                # a chain
        table[..., 2 * nodes - 1] = nodes
        return table


class AlwaysForecast(ForecastRecord):
    """A request each of whose steps is a forecast one: the random outcomes miss every entry,
    which would stop an engine's requests from forecasting, and the row is such a step's cost."""

    def wants(self, step_ratio: float) -> bool:
        return True


# a step's graph of a batch bucket (and, for the fused step, a verification kind), or None where the
# step runs eagerly (CPU, no graphs)
GraphOf = Callable[[int, str], "torch.cuda.CUDAGraph | None"]

GREEDY = {"temperature": 0}


def use_step(engine, step: str, size: int, fused_drafter: Drafter | None = None) -> GraphOf:
    """Sets the core up for `step` ("plain", "verify" of `size` nodes, "forecast": verify
    steps launched before the step before is read, or "fused": the engine's fused EAGLE
    drafter, `size` = K + 1); the engine is idle then."""
    core = engine.core
    drafter = {"plain": None, "verify": ChainDrafter(size), "forecast": ForecastChainDrafter(size),
               "fused": fused_drafter}[step]
    core.drafter, core.adaptive = drafter, None
    core.num_draft_tokens = size if drafter is not None else 1
    core.stats.speculative = drafter is not None
    graphs = fused_drafter.fused.graphs if step == "fused" else core.runner.graphs
    if graphs is None:
        return lambda bs, kind: None
    return lambda bs, kind: graphs.graphs[graphs.buckets[bisect.bisect_left(graphs.buckets, bs)],
                                          kind if step == "fused" else size]


def start_requests(engine, bs: int, step: str, size: int, steps: int, prompt_len: int, warm_steps: int,
                   sampling: dict = GREEDY) -> list:
    """bs requests of random prompts (greedy, or under `sampling`'s parameters), prefilled and
    decoding (warm_steps steps in)."""
    core = engine.core
    rng = random.Random(bs * 100 + size)
    reqs = []
    for i in range(bs):
        prompt = [rng.randrange(10, 4000) for _ in range(prompt_len)]
        req = engine._make_request(prompt, {**sampling, "max_new_tokens": 4 * steps + 100, "ignore_eos": True},
                                   False, 0, f"step-cost-{step}-{bs}-{size}-{i}")
        if step == "forecast":
            req.forecast = AlwaysForecast()
        core.add_request(req)
        reqs.append(req)
    while any(r.kv_len < len(r.prompt_ids) for r in reqs):  # prefill
        # the step times go to the prefill pacer as the engine's loop gives them: without them
        # chunks stay at its floor (4 tokens) once some requests decode, and a batch whose
        # prompts exceed one chunk (32 x 600 tokens) takes thousands of steps to start
        start = time.perf_counter()
        core.step()
        core.scheduler.record_step_time(time.perf_counter() - start)
    for _ in range(warm_steps):
        core.step()
    return reqs


# A profiler of the host's time by phase (called with the engine core, it listens to its step
# events; summary, close), set by lab/suite_host_phases.py.
PHASE_TIMER = None


def time_steps(engine, bs: int, step: str, size: int, steps: int, kernels: int = 0,
               fused_drafter: Drafter | None = None, prompt_len: int = 300, warm_steps: int = 10,
               sampling: dict = GREEDY) -> dict:
    core = engine.core
    graph_of = use_step(engine, step, size, fused_drafter)
    reqs = start_requests(engine, bs, step, size, steps, prompt_len, warm_steps, sampling)
    fused_steps = FusedStepCount(fused_drafter) if step == "fused" else None
    synchronize = torch.cuda.synchronize if core.runner.device.type == "cuda" else lambda: None
    tokens_before = sum(len(r.output_ids) for r in reqs)
    made_before = core.drafter.made if step == "forecast" else 0
    phases = PHASE_TIMER(core) if PHASE_TIMER is not None else None
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    # tokens per request and step: random drafts are (almost) never accepted, which a step's cost does not depend on
    row = {"batch_size": bs, "step": step, "draft_size": size, "wall_ms": wall_ms,
           "accept_length": (sum(len(r.output_ids) for r in reqs) - tokens_before) / (steps * bs)}
    if phases is not None:   # us per step by phase; `host`: the step's wall time less its wait for the GPU
        row["host_us"] = phases.summary().get("plain" if step == "plain" else "draft")
        phases.close()   # before FusedStepCount's: each puts back what it wrapped
    if fused_steps is not None:   # steps the engine verified itself (not fused) would make the row a mix
        row.update(fused_share=fused_steps.close() / steps, drafts="a random head's: accept length is not the point")
    if step == "forecast":   # steps launched from a forecast, of those timed (the rest: after the read)
        row["forecast_share"] = (core.drafter.made - made_before) / steps
    # a sampled step's graph is its forward (and, fused, the head and verification under the kind the
    # step ran); the sampling of a plain or verify step runs after it, in the wall time only
    # greedy, or the sampler's rule: the fused step's own (rejection where its chains' drafts are sampled),
    # else the rule drafts without a q are verified by (ChainDrafter's random tokens are no sample of a q)
    rule = core.sampler.sampling_rule
    row["verification"] = fused_drafter.verification(reqs, rule) if step == "fused" else \
        "greedy" if all(r.params.greedy for r in reqs) else rule
    graph = graph_of(bs, row["verification"])
    if graph is not None:
        gpu_ms = events_time_us(graph.replay) / 1e3
        row.update(graph_gpu_ms=gpu_ms, host_not_hidden_ms=wall_ms - gpu_ms)
        if kernels:
            times, counts = kernel_times(graph.replay)
            # launches per step (all kernels, not only the listed ones) and their summed time: a step that
            # loses in the gaps between kernels has a kernel sum close to, or above, its graph's GPU time
            row.update(kernel_launches=round(sum(counts.values())), kernel_sum_ms=sum(times.values()) / 1e3)
            row["kernels"] = {name: [round(us, 1), round(counts[name])] for name, us in times.most_common(kernels)}
    for req in reqs:
        core.abort(req.rid)
    return row


class FusedStepCount:
    """Counts the batches the fused drafter ran as one fused step (launched from a proposal,
    or chained on the device from the step before), until close()."""

    LAUNCHES = ("launch_fused", "launch_chained")

    def __init__(self, drafter):
        self.drafter, self.count = drafter, 0
        for name in self.LAUNCHES:
            setattr(drafter, name, self._counting(getattr(drafter, name)))

    def _counting(self, launch):
        def counting(reqs, *args):
            launched = launch(reqs, *args)
            self.count += launched is not None
            return launched
        return counting

    def close(self) -> int:
        for name in self.LAUNCHES:
            delattr(self.drafter, name)   # the class's methods again
        return self.count


def step_split(rows: list[dict]) -> list[dict]:
    """Per batch size, the fused step's time from GPU-time differences: the target's verify
    of K + 1 nodes, the hidden capture (the same verify keeping the head's states), the
    head and verification (the fused graph beyond that verify), and host time not hidden."""
    def gpu(bs, step, capture):
        return next((r.get("graph_gpu_ms") for r in rows if (r["batch_size"], r["step"], r["hidden_capture"])
                     == (bs, step, capture)), None)

    splits = []
    for fused in (r for r in rows if r["step"] == "fused" and r.get("graph_gpu_ms") is not None):
        bs = fused["batch_size"]
        verify, verify_capture = gpu(bs, "verify", False), gpu(bs, "verify", True)
        if verify is None or verify_capture is None:
            continue
        splits.append({"kind": "step_split", "shape": fused["shape"], "batch_size": bs,
                       "draft_size": fused["draft_size"], "fused_wall_ms": fused["wall_ms"],
                       "target_verify_gpu_ms": verify, "hidden_capture_gpu_ms": verify_capture - verify,
                       "head_and_verification_gpu_ms": fused["graph_gpu_ms"] - verify_capture,
                       "host_not_hidden_ms": fused["host_not_hidden_ms"]})
    return splits


def engine_rows(ns, shape: str, path: str, algorithm: str, sizes: list[int], write) -> list[dict]:
    """Every row of one engine: NGRAM (a target that keeps no states: plain and verify
    steps of `sizes`) or EAGLE3 (plain, verify of K + 1 and the fused step)."""
    from specserve.engine.engine import Engine
    extra = {"speculative_num_draft_tokens": max(sizes)} if algorithm == "NGRAM" else {
        "speculative_num_steps": ns.num_steps, "speculative_eagle_topk": ns.topk,
        **({"speculative_num_draft_tokens": ns.tree_nodes} if ns.topk > 1 else {}),
        "speculative_draft_model_path": write_random_eagle3_head(
            os.path.join(ns.model_dir, f"random-{shape}-eagle3-head"), shape, ns.draft_vocab)}
    engine = Engine(model_path=path, load_format="dummy", log_level="warning", speculative_algorithm=algorithm,
                    device=ns.device, cuda_graph_max_bs=max(ns.batch_sizes), max_total_tokens=200_000,
                    skip_server_warmup=True, **extra)
    engine.shutdown()  # the step loop is driven from this thread
    fused_drafter = engine.core.drafter if algorithm == "EAGLE3" else None
    plan = [("plain" if size == 1 else "verify", size) for size in sorted(sizes)]
    if algorithm == "NGRAM" and ns.forecast:
        plan += [("forecast", size) for size in sorted(sizes) if size > 1]
    if fused_drafter is not None:
        plan.append(("fused", fused_drafter.fused.nodes))
    device = torch.cuda.get_device_name() if engine.core.runner.device.type == "cuda" else "cpu"
    rows = []
    for bs in ns.batch_sizes:
        for step, size in plan:
            row = time_steps(engine, bs, step, size, ns.steps, ns.kernels, fused_drafter, ns.prompt_len,
                             ns.warm_steps, sampling_of(ns))
            row = {"kind": "step_cost", "shape": shape, "engine": algorithm,
                   "max_tree_rows": TritonBackend.max_tree_rows,
                   "hidden_capture": engine.core.runner.hidden_capture is not None, **row,
                   "device": device, "date": time.strftime("%Y-%m-%d")}
            if ns.temperature > 0:
                row.update(temperature=ns.temperature, top_p=ns.top_p)
            rows.append(write(row))
    del engine, fused_drafter
    gc.collect()   # the next engine's memory (graphs, KV cache) comes from this one's
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def sampling_of(ns) -> dict:
    return {"temperature": ns.temperature, "top_p": ns.top_p} if ns.temperature > 0 else GREEDY


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="*", default=["qwen2.5-coder-1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--algorithm", default="NGRAM", choices=("NGRAM", "EAGLE3"),
                        help="EAGLE3: the fused EAGLE-3 step and its references (--sizes is then 1 and K + 1)")
    parser.add_argument("--num-steps", "--speculative-num-steps", type=int, default=3,
                        help="EAGLE3: K, the drafts of a fused step's chain")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="EAGLE3: the random head's draft vocabulary")
    parser.add_argument("--topk", "--speculative-eagle-topk", type=int, default=1,
                        help="EAGLE3: > 1 for EAGLE-2's trees of --tree-nodes nodes (the fused tree step)")
    parser.add_argument("--tree-nodes", "--speculative-num-draft-tokens", type=int, default=8,
                        help="EAGLE3 with --topk > 1: the tree's nodes, at least --num-steps + 1")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8, 32, 64])
    parser.add_argument("--sizes", type=int, nargs="*", default=[1, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warm-steps", type=int, default=10, help="untimed steps after the prefill")
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--forecast", action="store_true",
                        help="NGRAM: also verify steps launched before the step before is read (forecast drafts)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request sampled at this temperature (0: greedy): a sampled step's cost "
                             "against a sampled plain step's")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--kernels", type=int, default=0, help="also list the N slowest kernels of each step's graph")
    parser.add_argument("--device", default="cuda", help="cuda (graph times) or cpu (wall times only: smoke runs)")
    parser.add_argument("--model-dir", default="/tmp", help="where the random model (and head) are written")
    parser.add_argument("--max-tree-rows", type=int, default=None,
                        help="VERIFY batches of up to this many tree nodes run as decode-kernel rows "
                             "(TritonBackend.max_tree_rows; default: the backend's)")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ns = parser.parse_args(argv)
    if ns.max_tree_rows is not None:
        TritonBackend.max_tree_rows = ns.max_tree_rows
    if ns.num_steps < 1:
        parser.error(f"--num-steps must be >= 1, got {ns.num_steps}")
    os.makedirs(ns.out, exist_ok=True)
    eagle = ns.algorithm == "EAGLE3"
    if eagle and ns.topk > 1 and ns.tree_nodes < ns.num_steps + 1:
        parser.error(f"--tree-nodes must be at least --num-steps + 1 ({ns.num_steps + 1}), got {ns.tree_nodes}")
    sizes = [1, (ns.tree_nodes if ns.topk > 1 else ns.num_steps + 1)] if eagle else ns.sizes
    plain_ms: dict[int, float] = {}

    def write(row: dict) -> dict:
        if row.get("step") == "plain" and not row.get("hidden_capture"):
            plain_ms[row["batch_size"]] = row["wall_ms"]
        if row["kind"] == "step_cost":
            row["vs_plain"] = row["wall_ms"] / plain_ms[row["batch_size"]] if row["batch_size"] in plain_ms else None
        row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        emit_row(os.path.join(ns.out, "step_cost.jsonl"), row)
        return row

    rows = []
    for shape in ns.shape:
        # config and tokenizer only: the engines make random weights on the device (--load-format dummy),
        # where writing a 7B shape's 15 GB and reading it back took minutes of a lease
        path = write_model_config(os.path.join(ns.model_dir, f"random-{shape}"), shape)
        shape_rows = engine_rows(ns, shape, path, "NGRAM", sizes, write)
        if eagle:
            shape_rows += engine_rows(ns, shape, path, "EAGLE3", sizes, write)
            shape_rows += [write(split) for split in step_split(shape_rows)]
        rows += shape_rows
    return rows


if __name__ == "__main__":
    main()
