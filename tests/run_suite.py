"""`make test`: the suite in several pytest processes, one after another, then one closing
line with the totals ("total: N passed, N failed", errors counted as failures).

Why processes: a process keeps what its tests loaded (models, engines, compiled kernels),
and one process for the whole suite grew past 18 GB. So each file that loads a real model
or starts an engine or a server (it names `smollm2`, `Engine(`, `engine_factory`,
`launch_server` or `start_server`) runs alone when it is long: the largest,
test_spec_greedy.py and test_overlap.py, peak at ~6 GB (four SmolLM2 engines alive at once,
each ~1 GB of fp32 weights and their oneDNN-packed copy). The short ones (under
SHARED_BELOW seconds in SECONDS; a file it lacks counts as short) share processes of about
SHARED_PROCESS seconds each, longest first: each process of its own paid ~4 s of Python,
torch and pytest start-up and ~4 s of parsing SmolLM2's GGUF again. What a file's module
loads is freed when the file ends (conftest.py's _free_engines_made_by_the_module), so a
shared process peaks near its largest file. The other files, tiny random models and pure
functions, share one process; the Triton kernel tests share another, under Triton's
interpreter (TRITON_INTERPRET=1 must be set before Triton is first imported), and record what
they launch for test_gpu_compile.py, which runs last there and compiles it for an H100. A file that
fails to import fails alone (--continue-on-collection-errors).

Two processes run at a time where there are two cores or more (--jobs N changes that), the
longest first (SECONDS, from a CI run, orders them; a file it lacks counts as short), each
with its share of the cores as torch threads (OMP_NUM_THREADS, which conftest.py follows):
two processes of two threads each on CI's two cores would spin against each other. Memory
stays near two of the largest processes, ~12 GB. A group's line is printed when it ends.

Under each group's line, its SLOWEST tests (pytest's --durations): where CI's time goes, in
every CI log.

`python tests/run_suite.py [--jobs N] [FILES...] [-- PYTEST ARGS]` runs some files, with
pytest flags.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

KERNEL_TESTS = {"test_triton_attention.py", "test_fused_ops.py", "test_gemv.py", "test_prefill_graph.py",
                "test_tree_kernels.py", "test_hybrid_attention.py", "test_forecast_kernel.py", "test_random_kernels.py",
                "test_ragged_verify_attention.py", "test_draft_argmax.py", "test_gpu_compile.py"}
LOADS_A_MODEL = re.compile(r"smollm2|Engine\(|engine_factory|launch_server|start_server")
SLOWEST = 5   # tests listed under each group's line, by duration
DURATION = re.compile(r"^\d+\.\d+s (call|setup|teardown) ")
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# seconds per file in CI (2 cores, two processes at a time): they order the processes and say
# which files that load a model are short enough to share one (the light group and the kernel
# group are one process each). From the 2026-12-04 CI run, and three quarters of a local run's
# seconds, that machine being slower, for the files that run lacked; the files timed again on
# 2026-12-07 (after SmolLM2 test engines came to share their built weights) are that day's local
# seconds, one file a process with OMP_NUM_THREADS=1, unscaled: that machine was as fast as CI's
# (test_draft_ahead.py 200 s there, 199 s in that day's CI run); "light" is that CI run's 1042 s
# less what test_structured_output.py then saved; "kernels" and "light" since test_gpu_compile.py and two kernel files
# moved into the kernel group: the 2026-12-08 CI run's (a faster run than the others: all its files took less)
SECONDS = {"kernels": 66, "light": 655, "test_seeded_speculation.py": 186, "test_peers_bench.py": 143,
           "test_draft_ahead.py": 151, "test_structured_suite.py": 99, "test_overlap.py": 93,
           "test_prefix_cache_engine.py": 77, "test_generation.py": 90, "test_spec_greedy.py": 49,
           "test_engine_sampling.py": 58, "test_server_shutdown.py": 64, "test_server.py": 30,
           "test_failure_isolation.py": 25, "test_kv_accounting.py": 24, "test_load_and_fault.py": 49,
           "test_engine_process.py": 46, "test_first_contact.py": 41, "test_engine_errors.py": 38,
           "test_bench_serving.py": 32, "test_structured_server.py": 32, "test_spec_adaptive.py": 25,
           "test_ngram_forecast.py": 50, "test_gguf_tokenizer.py": 27, "test_hidden_capture.py": 23,
           "test_import_layers.py": 23, "test_loader.py": 22, "test_peers_dummy.py": 20, "test_model_logits.py": 18,
           "test_standalone.py": 18, "test_ngram_writer.py": 8, "test_train_eagle.py": 17, "test_token_map.py": 16,
           "test_gguf_file.py": 15, "test_server_rough_edges.py": 15, "test_eagle_chats.py": 14,
           "test_bench_offline.py": 13, "test_sglang_generate_fields.py": 12, "test_run_suite.py": 11,
           "test_structured_workloads.py": 4}
UNKNOWN_SECONDS = 20
SHARED_BELOW = 80      # a file that loads a model and runs shorter than this shares a process
SHARED_PROCESS = 150   # ... with others, up to about this many seconds in all


def groups(files: list[str]) -> list[list[str]]:
    """The kernel tests together, the light files together, each long heavy file alone, the
    short heavy files packed into shared processes."""
    kernels = [f for f in files if os.path.basename(f) in KERNEL_TESTS]
    rest = [f for f in files if f not in kernels]
    heavy = [f for f in rest if LOADS_A_MODEL.search(open(os.path.join(ROOT, f), encoding="utf-8").read())]
    light = [f for f in rest if f not in heavy]
    alone = [[f] for f in heavy if file_seconds(f) >= SHARED_BELOW]
    return [group for group in (kernels, light, *alone, *packed([f for f in heavy if file_seconds(f) < SHARED_BELOW]))
            if group]


def file_seconds(path: str) -> int:
    return SECONDS.get(os.path.basename(path), UNKNOWN_SECONDS)


def packed(files: list[str]) -> list[list[str]]:
    """Short heavy files in processes of up to ~SHARED_PROCESS seconds: longest first, each into
    the first process with room (first-fit decreasing), a file in the order given within one."""
    bins: list[list[str]] = []
    for f in sorted(files, key=file_seconds, reverse=True):
        fits = next((b for b in bins if sum(map(file_seconds, b)) + file_seconds(f) <= SHARED_PROCESS), None)
        if fits is None:
            bins.append([f])
        else:
            fits.append(f)
    return [sorted(b) for b in bins]


def expected_seconds(paths: list[str]) -> int:
    """How long a group ran in CI: the kernel group, the light group, or the sum of its files."""
    if os.path.basename(paths[0]) in KERNEL_TESTS:
        return SECONDS["kernels"]
    if not LOADS_A_MODEL.search(open(os.path.join(ROOT, paths[0]), encoding="utf-8").read()) and len(paths) > 1:
        return SECONDS["light"]
    return sum(map(file_seconds, paths))


def run_group(paths: list[str], pytest_args: list[str], threads: int = 0) -> tuple[Counter, str, int, str]:
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if os.path.basename(paths[0]) in KERNEL_TESTS:
        env["TRITON_INTERPRET"] = "1"
        env["SPECSERVE_RECORD_KERNEL_SPECS"] = "1"   # for test_gpu_compile.py, last in the group (conftest.py)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--continue-on-collection-errors", f"--durations={SLOWEST}", *paths, *pytest_args],
                            cwd=ROOT, env=env, capture_output=True, text=True)
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if COUNTS.search(line)]
    summary = lines[-1].strip("= ") if lines else f"exit status {result.returncode}, no summary"
    counts = Counter()
    for number, kind in COUNTS.findall(lines[-1] if lines else ""):
        counts["error" if kind.startswith("error") else kind] += int(number)
    if result.returncode not in (0, 5) and not counts["failed"] + counts["error"]:
        counts["error"] += 1   # a crash before pytest could count
    return counts, summary, result.returncode, output


def main(argv: list[str]) -> int:
    jobs = min(2, os.cpu_count() or 1)
    if argv[:1] in (["--jobs"], ["-j"]):
        jobs, argv = max(1, int(argv[1])), argv[2:]
    split = argv.index("--") if "--" in argv else len(argv)
    files = argv[:split] or sorted(glob.glob(os.path.join("tests", "test_*.py"), root_dir=ROOT))
    pytest_args = argv[split + 1:]
    totals, failures, start = Counter(), [], time.perf_counter()
    batches = sorted(groups(files), key=expected_seconds, reverse=True) if jobs > 1 else groups(files)
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0
    ended = 0

    def run(paths: list[str]) -> None:
        nonlocal ended
        group_start = time.perf_counter()
        counts, summary, status, output = run_group(paths, pytest_args, threads)
        name = paths[0] if len(paths) == 1 else f"{len(paths)} files ({', '.join(os.path.basename(p) for p in paths)})"
        with lock:   # one group's lines together
            ended += 1
            totals.update(counts)
            print(f"[{ended}/{len(batches)}] {name} ... {summary} ({time.perf_counter() - group_start:.0f} s)",
                  flush=True)
            for line in output.splitlines():
                if DURATION.match(line):
                    print(f"    {line}", flush=True)
            if status not in (0, 5):
                failures.extend(paths)
                print(output, flush=True)

    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(run, batches))
    if failures:
        print("failed files: " + " ".join(failures))
    print(f"{len(batches)} pytest processes ({jobs} at a time) in {time.perf_counter() - start:.0f} s")
    # the closing line CI reads: "N passed, N failed" alone (errors count as failures)
    skipped = f", {totals['skipped']} skipped" if totals["skipped"] else ""
    print(f"total: {totals['passed']} passed, {totals['failed'] + totals['error']} failed{skipped}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
