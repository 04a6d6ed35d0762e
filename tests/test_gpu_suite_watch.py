"""gpu_suite's RunWatch: each timed run reports its longest engine step and the Triton JIT
compiles it set off (a first-use compile is a one-off stall of every request in flight, not
a per-step cost), and the report shows both. Runs on the CPU with a tiny random model and a
stand-in for Triton's `knobs.runtime`."""
from __future__ import annotations

import argparse
import gc
import json
import time
from types import SimpleNamespace

import pytest

from specserve.bench.gpu_suite import parse_config, run, set_drafter, timed_runs
from specserve.bench.report import DEFAULT_LABEL, markdown, speed_rows
from specserve.bench.run_watch import RunWatch
from specserve.speculative.ngram.writer import TrieWriterError
from tests.spec_fixtures import make_tiny_directory, tiny_engine

PROMPTS = [[5, 6, 7, 8, 9] * 4, [20, 21, 22, 23] * 5, list(range(30, 50))]
STALL_S = 0.2


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-watch")
    make_tiny_directory(path, "llama", seed=2)
    with tiny_engine(path) as engine:
        yield engine


def fake_runtime():
    return SimpleNamespace(jit_cache_hook=None, jit_post_compile_hook=None)


def in_the_next_step(core, stall) -> None:
    """Runs `stall()` inside the core's next step (in its schedule)."""
    schedule, pending = core.scheduler.schedule, [True]

    def stalling_schedule():
        if pending:
            pending.clear()
            stall()
        return schedule()

    core.scheduler.schedule = stalling_schedule


def compile_once_in_a_step(core, runtime):
    """Makes the core's next step "compile" a kernel: Triton calls the cache hook, compiles
    (here: sleeps), then calls the post-compile hook, all inside the step."""
    fn = SimpleNamespace(module=None, name="_kernel", jit_function=None)   # Triton's JitFunctionInfo
    spec = "_kernel[num_warps=4](x_ptr: *bf16, n: i32)"

    def compile_kernel():
        assert runtime.jit_cache_hook(key="k", repr=spec, fn=fn, compile={},
                                      is_manual_warmup=False, already_compiled=False) is None
        time.sleep(STALL_S)
        runtime.jit_post_compile_hook(key="k", repr=spec, fn=fn, compile={},
                                      is_manual_warmup=False, already_compiled=False)
    in_the_next_step(core, compile_kernel)


def test_watch_reports_the_stall_and_the_compile_of_its_run_only(engine):
    runtime = fake_runtime()
    compile_once_in_a_step(engine.core, runtime)
    watch = RunWatch(engine, triton_runtime=runtime)
    try:
        first, second = run(engine, PROMPTS, 2, 6, "plain", turns=2, watch=watch)
    finally:
        watch.close()
        del engine.core.scheduler.schedule   # the class's method again
    assert first["jit_compiles"] == 1 and first["jit_compile_s"] >= STALL_S
    [kernel] = first["jit_kernels"]   # which kernel, and the specialisation that was new
    assert kernel["kernel"] == "_kernel" and kernel["s"] >= STALL_S and "n: i32" in kernel["specialization"]
    assert second["jit_kernels"] == []
    assert first["forecast"] is None   # no NGRAM step was forecast
    assert first["longest_step_s"] >= STALL_S
    assert second["jit_compiles"] == 0 and second["jit_compile_s"] == 0.0
    assert 0.0 < second["longest_step_s"] < STALL_S
    assert first["output_tokens"] == second["output_tokens"] == 6 * len(PROMPTS)
    # close() gives the hooks back and stops listening
    assert runtime.jit_cache_hook is None and runtime.jit_post_compile_hook is None
    assert watch not in engine.core.events.listeners


def test_watch_leaves_someone_elses_hooks_alone(engine):
    theirs = lambda **_: None  # noqa: E731
    runtime = SimpleNamespace(jit_cache_hook=theirs, jit_post_compile_hook=None)
    watch = RunWatch(engine, triton_runtime=runtime)
    [summary] = run(engine, PROMPTS[:1], 1, 3, "plain", watch=watch)
    watch.close()
    assert runtime.jit_cache_hook is theirs and runtime.jit_post_compile_hook is None
    assert summary["jit_compiles"] is None and summary["longest_step_s"] > 0


def test_watch_splits_the_run_into_prefill_plain_and_drafting_steps(engine):
    watch = RunWatch(engine)
    try:
        [plain] = run(engine, PROMPTS, 3, 12, "plain", watch=watch)
        set_drafter(engine, 4, True, False)   # drafts of 4 nodes on every step: the prompts repeat
        [drafted] = run(engine, PROMPTS, 3, 12, "ngram", watch=watch)
    finally:
        set_drafter(engine, None)
        watch.close()
    mix = plain["step_mix"]
    assert mix["prefill"]["steps"] >= 1 and mix["plain"]["steps"] >= 11 and mix["draft"]["steps"] == 0
    assert mix["plain"]["from_ahead"] == 0 and mix["plain"]["mean_batch"] > 1   # no overlap on a CPU
    prompt_tokens = sum(len(p) for p in PROMPTS)   # token ids already
    assert mix["prefill"]["mean_tokens"] * mix["prefill"]["steps"] == pytest.approx(prompt_tokens, abs=len(PROMPTS))
    assert mix["plain"]["mean_tokens"] == mix["plain"]["mean_batch"]   # a decode step schedules a token a request
    assert plain["draft_nodes_mean"] is None
    assert drafted["step_mix"]["draft"]["steps"] >= 1 and drafted["step_mix"]["draft"]["ms"] > 0
    assert drafted["step_mix"]["draft"]["from_ahead"] == 0   # no drafting step launched ahead on a CPU
    assert 1 < drafted["draft_nodes_mean"] <= 4


def test_watch_counts_drafting_steps_read_from_a_launch_ahead(engine, monkeypatch):
    """With draft_ahead.py on (as on a GPU), a drafting step that comes from a launch ahead
    counts as from_ahead: all but the first of a run of drafting steps."""
    from specserve.engine.draft_ahead import DraftAhead
    monkeypatch.setattr(engine.core, "draft_ahead", DraftAhead(engine.core.scheduler))
    watch = RunWatch(engine)
    try:
        set_drafter(engine, 4, True, False)   # drafts of 4 nodes on every step: the prompts repeat
        [drafted] = run(engine, PROMPTS, 3, 12, "ngram", watch=watch)
    finally:
        set_drafter(engine, None)
        watch.close()
    mix = drafted["step_mix"]["draft"]
    assert 0 < mix["from_ahead"] < mix["steps"]
    assert mix["from_ahead"] <= engine.core.draft_ahead.steps_taken


def test_repeated_cells_report_their_median_run(engine):
    watch = RunWatch(engine)
    try:
        ns = argparse.Namespace(repeats=3, max_new_tokens=4)
        [median] = timed_runs(engine, PROMPTS, 3, ns, "plain", 1, watch)
        assert len(median["repeat_tok_s"]) == 3
        assert round(median["output_tokens_per_s"], 1) == sorted(median["repeat_tok_s"])[1]
        once = timed_runs(engine, PROMPTS, 3, ns, "plain", 2, watch)   # two turns: not repeated
        assert len(once) == 2 and "repeat_tok_s" not in once[0]
        [single] = timed_runs(engine, PROMPTS[:1], 1, ns, "plain", 1, watch)   # batch 1: not repeated
        assert "repeat_tok_s" not in single
    finally:
        watch.close()


def test_report_shows_longest_step_and_compile_time():
    base = {"kind": "specserve", "model": "m", "workload": "w", "concurrency": 8, "turn": 1}
    rows = [{**base, "config": "plain", "output_tokens_per_s": 100.0, "longest_step_s": 0.004, "jit_compile_s": 0.0},
            {**base, "config": "ngram-8-multi", "output_tokens_per_s": 25.0, "accept_length": 2.0,
             "longest_step_s": 1.5, "jit_compile_s": 1.45,
             "jit_kernels": [{"kernel": "_extend_kernel", "s": 1.45, "specialization": "_extend_kernel(row_blocks: i32)"}]},
            {**base, "config": "ngram-4-one", "output_tokens_per_s": 75.0}]        # a row from before the watch
    by_config = {r["config"]: r for r in speed_rows(rows)}
    assert by_config["ngram-8-multi"]["speedup"] == 0.25 and by_config["ngram-8-multi"]["jit_compile_s"] == 1.45
    table = markdown(rows)
    assert "| 0.25x |  | 1500.0 | 1.45 |" in table
    assert "| ngram-4-one | 75.0 |  | 0.75x |  |  |  |" in table
    # which kernel compiled in which run, and the specialisation that was new
    assert "- m w turn 1 at 8, ngram-8-multi: `_extend_kernel` 1.45 s: _extend_kernel(row_blocks: i32)" in table


def test_watch_traces_the_adaptive_policy_of_each_run(engine, tmp_path):
    watch = RunWatch(engine, trace_dir=str(tmp_path))
    try:
        set_drafter(engine, 4, True, True)    # adaptive: the policy decides every decode step
        policy = engine.core.adaptive
        watch.cell = "repeat c3"
        [summary] = run(engine, PROMPTS, 3, 24, "adaptive", watch=watch)
        assert policy.listener is watch.trace and policy.modes.listener is watch.trace   # heard during the run
    finally:
        set_drafter(engine, None)
        watch.close()
    assert policy.listener is None and policy.modes.listener is None   # and no more after it
    mix, buckets = summary["step_mix"], summary["policy"]
    decode_steps = mix["plain"]["steps"] + mix["draft"]["steps"]
    assert sum(b["plain_steps"] + b["draft_steps"] for b in buckets.values()) == decode_steps
    assert sum(b["draft_steps"] for b in buckets.values()) == mix["draft"]["steps"]
    [trace_file] = tmp_path.iterdir()   # one file for every run (the GPU machine returns few files)
    assert trace_file.name == "policy_trace.jsonl"
    events = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert {e["run"] for e in events} == {"repeat c3 adaptive t1"}
    assert sum(e["e"] == "step" for e in events) == decode_steps
    assert any(e["e"] == "rates" for e in events), "the policy priced tiers during the run"
    probes = [i for i, e in enumerate(events) if e["e"] == "probe"]
    assert probes, "the plain steps of the run probed"
    for i in probes:   # each probe marks the plain step it came after, and that step only
        step = next(e for e in events[i + 1:] if e["e"] == "step")
        assert step["probe"] and step["tree"] == 1
    assert sum(e["e"] == "step" and e["probe"] for e in events) == len(probes)


def test_rounds_are_divided_round_by_round_and_the_median_round_reported():
    base = {"kind": "specserve", "model": "m", "workload": "w", "concurrency": 1, "turn": 1}
    speeds = [(100.0, 90.0), (80.0, 100.0), (120.0, 120.0)]   # (plain, ngram) per round: 0.9, 1.25, 1.0
    rows = [{**base, "config": config, "round": i, "output_tokens_per_s": tok_s}
            for i, pair in enumerate(speeds) for config, tok_s in zip(("plain", DEFAULT_LABEL), pair)]
    by_config = {r["config"]: r for r in speed_rows(rows)}
    ngram = by_config[DEFAULT_LABEL]
    assert ngram["speedup"] == 1.0 and ngram["tok_s"] == 120.0   # the median round, not a ratio of medians
    assert ngram["round_speedups"] == [0.9, 1.25, 1.0]
    assert by_config["plain"]["speedup"] == 1.0 and by_config["plain"]["tok_s"] == 100.0
    assert "| 1.00x | 0.90 1.25 1.00 |" in markdown(rows)


def test_each_run_starts_from_an_empty_prefix_cache(engine):
    flushed = []
    original = engine.flush_cache
    engine.flush_cache = lambda: flushed.append(True) or original()
    try:
        run(engine, PROMPTS[:2], 2, 3, "plain", turns=2)
    finally:
        engine.flush_cache = original
    assert flushed == [True]   # once before the first turn: the second turn reuses the first's prefixes


def test_watch_names_the_longest_step_and_counts_full_gc_collections(engine):
    """A stall's suspects other than a compile: the longest step is described (kind, batch
    size, nodes per request), and full GC collections during the run are counted."""
    in_the_next_step(engine.core, gc.collect)   # a full collection inside the run's first step
    watch = RunWatch(engine, triton_runtime=fake_runtime())
    try:
        first, second = run(engine, PROMPTS, 2, 6, "plain", turns=2, watch=watch)
    finally:
        watch.close()
        del engine.core.scheduler.schedule
    assert first["full_gc_collections"] >= 1 and second["full_gc_collections"] == 0
    assert first["longest_step"]["kind"] in ("prefill", "plain") and first["longest_step"]["batch_size"] >= 1
    assert first["longest_step"]["nodes"] == 1
    assert first["device_allocs"] is None   # no CUDA here


def test_watch_splits_host_time_by_phase_and_counts_the_wait_for_the_device(engine, monkeypatch):
    """HostPhases as RunWatch's phase timer: a step's wait on its outcome is the GPU's time,
    not the host's; every phase is per step of its kind; closing puts the wait back."""
    from lab.host_phases import HostPhases
    from specserve.engine.overlap import OverlapSchedule
    from specserve.runner.model_runner import InFlight
    original_wait, waits = InFlight.wait, []

    def slow_wait(self):   # a device that takes 2 ms longer than the host
        waits.append(1)
        time.sleep(0.002)
        return original_wait(self)
    monkeypatch.setattr(InFlight, "wait", slow_wait)
    core = engine.core
    monkeypatch.setattr(core, "overlap", OverlapSchedule(core.runner, core.scheduler, core.sampler))   # CUDA-graph-only by default
    monkeypatch.setattr(RunWatch, "phase_timer", HostPhases)
    watch = RunWatch(engine)
    try:
        [plain] = run(engine, PROMPTS, 3, 12, "plain", watch=watch)
    finally:
        watch.close()
    mix = plain["step_mix"]["plain"]
    assert 0 < mix["from_ahead"] < mix["steps"] and 1 <= mix["mean_batch"] <= len(PROMPTS)   # the first is launched fresh
    phases = plain["host_us_per_step"]["plain"]
    assert waits and phases["gpu_wait"] >= 2000 * len(waits) / plain["step_mix"]["plain"]["steps"] * 0.99
    assert 0 < phases["host"] == pytest.approx(phases["step"] - phases["gpu_wait"], abs=0.2)
    assert 0 < phases["commit"] < phases["host"] and 0 < phases["schedule"] < phases["host"]
    assert phases["read"] >= phases["gpu_wait"]   # the outcome's wait is part of the step's read
    assert phases["step"] == pytest.approx(sum(phases[p] for p in ("schedule", "launch", "read", "commit", "after")),
                                           abs=1.0)
    assert "prefill" in plain["host_us_per_step"]
    assert InFlight.wait is slow_wait and core.events.listeners == []
    assert 0 < phases["launch_cpu"] <= phases["launch"] * 1.05 + 5


def test_watch_without_a_phase_timer_times_steps_whole(engine):
    """By default RunWatch is the core's one step listener and the summary has no phases."""
    watch = RunWatch(engine)
    try:
        assert engine.core.events.listeners == [watch]
        [plain] = run(engine, PROMPTS, 3, 8, "plain", watch=watch)
    finally:
        watch.close()
    assert plain["host_us_per_step"] is None and plain["step_mix"]["plain"]["steps"] > 0


def test_the_lab_runner_turns_host_phases_on_for_the_watches_it_makes(engine):
    from lab.suite_host_phases import host_phases_timed
    with host_phases_timed():
        watch = RunWatch(engine)
    try:
        [plain] = run(engine, PROMPTS, 3, 8, "plain", watch=watch)
    finally:
        watch.close()
    assert plain["host_us_per_step"]["plain"]["step"] > 0 and RunWatch.phase_timer is None


def test_held_configs_decode_plainly_and_blind_indexes_nothing(engine):
    """The diagnostic labels: -held keeps the drafter observing and indexing with the policy
    never drafting nor probing; -blind also shows the drafter no token."""
    indexed, watch = {}, RunWatch(engine)
    try:
        for mode in ("adaptive", "held", "blind"):
            set_drafter(engine, *parse_config(f"ngram-4-one-{mode}"))
            probes = []
            policy = engine.core.adaptive
            original_probe = policy.record_probe
            policy.record_probe = lambda *args: probes.append(args) or original_probe(*args)
            [summary] = run(engine, PROMPTS * 2, 3, 24, f"ngram-4-one-{mode}", watch=watch)
            engine.core.drafter.writer.drain()
            indexed[mode] = engine.core.drafter.trie.num_nodes()
            drafted_or_probed = summary["step_mix"]["draft"]["steps"] > 0 or bool(probes)
            assert drafted_or_probed == (mode == "adaptive")   # the adaptive run shows what is held back
    finally:
        set_drafter(engine, None)
        watch.close()
    assert indexed["held"] == indexed["adaptive"] > 0   # the same tokens indexed, drafting or not
    assert indexed["blind"] == 0


def test_swapping_drafters_closes_the_one_replaced(engine):
    """A replaced drafter's writer thread does not run on (one left mid-insert into the
    compiled trie at interpreter exit crashed a bench)."""
    set_drafter(engine, 4, True, True)
    first = engine.core.drafter
    thread = first.writer.thread
    set_drafter(engine, 8, True, True)
    assert engine.core.drafter is not first
    if thread is not None:   # the compiled trie writes on a thread; the pure-Python one inline
        assert not thread.is_alive()
    with pytest.raises(TrieWriterError, match="closed"):
        first.writer.submit(lambda: None)
    set_drafter(engine, None)


def test_host_phases_time_a_writers_drain_and_skip_a_drafter_without_one():
    """`drain` (an n-gram drafter's wait for its writer thread) is a phase of its own; a
    drafter without a writer (a model drafter) has nothing to wrap there; closing puts the
    writer's own method back."""
    from types import SimpleNamespace

    from lab.host_phases import HostPhases
    from specserve.engine.step_events import StepEvents
    from specserve.speculative.ngram.writer import TrieWriter
    writer = TrieWriter(background=True)
    try:
        writer.submit(lambda: time.sleep(0.003))
        phases = HostPhases(SimpleNamespace(drafter=SimpleNamespace(writer=writer), events=StepEvents()))
        writer.drain()                                 # waits for the job
        phases.end_step("draft", 0.004)
        phases.close()
        assert phases.summary()["draft"]["drain"] >= 1000
        assert "drain" not in vars(writer)
        without = HostPhases(SimpleNamespace(drafter=SimpleNamespace(), events=StepEvents()))
        without.close()
    finally:
        writer.close()


def test_runs_appended_to_one_file_divide_by_their_own_plain_rounds():
    """Two suite runs in one file both number their rounds 0 and 1: each run's round is divided
    by plain's of the same run, not by the last run's."""
    base = {"kind": "specserve", "model": "m", "workload": "w", "concurrency": 32, "turn": 1}
    runs = [[(100.0, 90.0), (100.0, 95.0)], [(200.0, 200.0), (200.0, 210.0)]]   # (plain, ngram) per round
    rows = [{**base, "config": config, "round": i, "output_tokens_per_s": tok_s}
            for run in runs for i, pair in enumerate(run) for config, tok_s in zip(("plain", DEFAULT_LABEL), pair)]
    ngram = {r["config"]: r for r in speed_rows(rows)}[DEFAULT_LABEL]
    assert sorted(ngram["round_speedups"]) == [0.9, 0.95, 1.0, 1.05]
