"""Which lines of the fused EAGLE-3 step issue its small device operations: every aten op the
step dispatches, counted by the innermost specserve frame that called it.

On a GPU the step is one CUDA graph and the profiler sees kernels without their Python
lines (lab.step_cost --kernels: 394 launches for a 1.5B batch-1 chain of 3, 250 of them the
target's verify). Run eagerly on the GPU (no graphs), the step issues the same torch calls
for its glue (index, cat, arange, copies), and Triton kernels, launched past torch's
dispatcher, are not counted; so this census says where the small launches come from
(the eager attention planning differs from the graphs' somewhat). On a CPU every fused
kernel is counted as its torch fallback's ops. Counts only, no times.

    python -m lab.fused_step_ops --shape qwen2.5-coder-1.5b --num-steps 3 [--top 60]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lab.random_head import write_random_eagle3_head
from lab.step_cost import GREEDY, start_requests, use_step
from specserve.bench.random_model import SHAPES, write_model_config
from specserve.speculative.model_drafters import fused_chain

# ops that move no data on a GPU (views, metadata) and launch nothing
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "t", "transpose", "permute",
             "select", "slice", "split", "split_with_sizes", "as_strided", "alias", "detach", "unbind", "lift_fresh",
             "empty", "empty_like", "new_empty", "empty_strided", "_to_copy_noop", "is_nonzero", "_local_scalar_dense"}


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH:
            self.counts[(_caller(), name)] += 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if f"{os.sep}specserve{os.sep}" in path and "_python_dispatch" not in path:
            return f"{path.split(os.sep + 'specserve' + os.sep)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def main(argv=None) -> collections.Counter:
    """Prints the census; returns the ops per step by line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-coder-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--num-steps", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--top", type=int, default=80)
    parser.add_argument("--temperature", type=float, default=0.0, help="the request sampled (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--device", default="cuda", help="cuda: eager (no graphs), Triton kernels uncounted")
    ns = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fused-ops-") as directory:
        census = _census(ns, directory)
    steps = 3
    by_line, ops_of = collections.Counter(), collections.defaultdict(list)
    for (line, op), count in census.counts.most_common():
        by_line[line] += count / steps
        ops_of[line].append(f"{op} {count / steps:g}")
    print(f"ops per step: {sum(by_line.values()):.0f}")
    for line, count in by_line.most_common(ns.top):
        print(f"{count:6.1f}  {line}  [{', '.join(ops_of[line])}]")
    return by_line


def _census(ns, directory: str, steps: int = 3) -> Census:
    """The ops of `steps` fused steps of one request (greedy, or sampled at --temperature), after
    its first drafts."""
    from specserve.engine.engine import Engine
    path = write_model_config(os.path.join(directory, "target"), ns.shape)
    head = write_random_eagle3_head(os.path.join(directory, "head"), ns.shape, ns.draft_vocab)
    engine = Engine(model_path=path, load_format="dummy", log_level="warning", speculative_algorithm="EAGLE3",
                    device=ns.device, dtype="float32" if ns.device == "cpu" else "bfloat16", disable_cuda_graph=True,
                    max_total_tokens=4096, skip_server_warmup=True, speculative_num_steps=ns.num_steps,
                    speculative_eagle_topk=1, speculative_draft_model_path=head)
    engine.shutdown()   # the step loop is driven from this thread
    use_step(engine, "fused", ns.num_steps + 1, engine.core.drafter)
    sampling = {"temperature": ns.temperature, "top_p": ns.top_p} if ns.temperature > 0 else GREEDY
    start_requests(engine, 1, "fused", ns.num_steps + 1, 10, 40, 3, sampling)
    census, run = Census(), fused_chain.run_fused_step

    def counted(*args, **kwargs):
        with census:
            return run(*args, **kwargs)
    fused_chain.run_fused_step = counted
    try:
        for _ in range(steps):
            engine.core.step()
    finally:
        fused_chain.run_fused_step = run
    return census


if __name__ == "__main__":
    main()
