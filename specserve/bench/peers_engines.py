"""The engines of the peer benchmark, and one server process at a time.

Each `EngineConfig` names an engine (specserve, vLLM, SGLang), a speculation algorithm and
the command line of its OpenAI-compatible server; all serve the same HF directory in bf16
with CUDA graphs on, at most 64 running requests and the same memory share. The EAGLE-3
configurations draft with a head our trainer made (`EAGLE_HEAD` in their flags stands for
its directory, peers_heads.py finds it), a chain of 3 tokens on every engine. A server runs
with its engine's carried wheels first on PYTHONPATH (`peers_install.py`), logs to a file,
and is killed (its whole process group) when its turn is over.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

MAX_RUNNING = 64           # the largest concurrency measured: no engine queues at 64
MEMORY_FRACTION = 0.80     # weights + KV cache; the rest for activations and graphs
CONTEXT_LENGTH = 4096      # prompts of the suite stay under 2k tokens, outputs at 128 (longer workloads pass their own)
# vLLM's documented n-gram settings (docs: features/speculative_decoding/n_gram)
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
# vLLM's suffix decoding with its defaults (tree depth 24 = the most tokens drafted per step)
VLLM_SUFFIX = {"method": "suffix"}
EAGLE_HEAD = "{eagle_head}"   # in an EngineConfig's flags: the EAGLE-3 head's directory, filled in by command()
# likewise: an EAGLE-2 head's (train_eagle --algorithm EAGLE: it reads the target's final state)
EAGLE2_HEAD = "{eagle2_head}"
DRAFT_MODEL = "{draft_model}"  # likewise: a smaller model's HF directory that drafts for the target (STANDALONE)


def _eagle_flags(algorithm: str, head: str, topk: int, draft_tokens: int) -> tuple[str, ...]:
    """SGLang's EAGLE flags, 3 draft steps; specserve takes the same."""
    return ("--speculative-algorithm", algorithm, "--speculative-draft-model-path", head, "--speculative-num-steps",
            "3", "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", str(draft_tokens))


# a chain of 3 drafted tokens, verified with the token before them: SGLang's documented chain settings
# (num-steps 3, topk 1, num-draft-tokens 4)
EAGLE3_CHAIN = _eagle_flags("EAGLE3", EAGLE_HEAD, 1, 4)
# EAGLE-2's dynamic tree over the same head: 3 draft steps expanding the top 4 per step, the 8 best
# nodes by cumulative draft probability verified (SGLang's flags; its docs' example for an 8B target is
# 5 / 8 / 32, scaled down here for models whose verify of 32 nodes costs more than it saves)
EAGLE3_TREE = _eagle_flags("EAGLE3", EAGLE_HEAD, 4, 8)
# the chain with an EAGLE-2 head (--speculative-algorithm EAGLE)
EAGLE2_CHAIN = _eagle_flags("EAGLE", EAGLE2_HEAD, 1, 4)
# vLLM's EAGLE-3 with the same chain (docs: features/speculative_decoding/eagle)
VLLM_EAGLE3 = {"method": "eagle3", "model": EAGLE_HEAD, "num_speculative_tokens": 3}


@dataclass(frozen=True)
class EngineConfig:
    name: str                  # the column of the table: "<engine>-<algorithm>"
    engine: str                # specserve | vllm | sglang: which carried wheels it runs on
    algorithm: str             # plain | ngram | suffix | eagle3 | eagle3-tree | eagle | naive-eagle | standalone
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # seconds its server typically takes to start on an H100 (weights, graphs, a head's too):
    # a run shares its time out in proportion to start-up plus measuring (peers.engine_budget_end)
    startup_s: float = 40.0

    @property
    def needs_eagle_head(self) -> bool:
        return self._uses(EAGLE_HEAD)

    @property
    def needs_eagle2_head(self) -> bool:
        return self._uses(EAGLE2_HEAD)

    @property
    def needs_draft_model(self) -> bool:
        return self._uses(DRAFT_MODEL)

    def _uses(self, placeholder: str) -> bool:
        return any(placeholder in arg for arg in self.extra_args)

    def command(self, model_dir: str, served_name: str, port: int, eagle_head: str | None = None,
                draft_model: str | None = None, eagle2_head: str | None = None, load_format: str = "auto",
                context_length: int = CONTEXT_LENGTH) -> list[str]:
        """The server's command line; `eagle_head`, `eagle2_head` and `draft_model`
        (directories) replace EAGLE_HEAD, EAGLE2_HEAD and DRAFT_MODEL in the flags.
        load_format dummy: the target's weights are random (all three engines spell it
        --load-format dummy; specserve's drafters still load from their files). context_length:
        the most tokens a request may hold, prompt and output."""
        fills = {EAGLE_HEAD: ("eagle_head", "an EAGLE-3 head", eagle_head),
                 EAGLE2_HEAD: ("eagle2_head", "an EAGLE-2 head", eagle2_head),
                 DRAFT_MODEL: ("draft_model", "a draft model", draft_model)}
        extra = list(self.extra_args)
        for placeholder, (argument, what, directory) in fills.items():
            if self._uses(placeholder) and not directory:
                raise ValueError(f"{self.name} drafts with {what}: {argument} must name its directory")
            extra = [arg.replace(placeholder, directory) if directory else arg for arg in extra]
        loading = [] if load_format == "auto" else ["--load-format", load_format]
        return BASE_COMMANDS[self.engine](model_dir, served_name, port, context_length) + loading + extra


def _specserve(model_dir: str, served_name: str, port: int, context_length: int) -> list[str]:
    return [sys.executable, "-m", "specserve.launch_server", "--model-path", model_dir, "--served-model-name",
            served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--mem-fraction-static", str(MEMORY_FRACTION), "--max-running-requests", str(MAX_RUNNING),
            "--cuda-graph-max-bs", str(MAX_RUNNING), "--context-length", str(context_length), "--log-level", "warning"]


def _vllm(model_dir: str, served_name: str, port: int, context_length: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--gpu-memory-utilization", str(MEMORY_FRACTION), "--max-num-seqs", str(MAX_RUNNING),
            "--max-model-len", str(context_length), "--seed", "0", "--disable-uvicorn-access-log",
            # vLLM's own choice on an H100 (its vllm_flash_attn, FA3), named so that a failure is an error
            # rather than a silent fall-back to Triton attention
            "--attention-backend", "FLASH_ATTN"]


def _sglang(model_dir: str, served_name: str, port: int, context_length: int) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--served-model-name",
            served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--mem-fraction-static", str(MEMORY_FRACTION), "--max-running-requests", str(MAX_RUNNING),
            "--cuda-graph-max-bs-decode", str(MAX_RUNNING), "--context-length", str(context_length),
            "--log-level", "warning",
            # FlashAttention-3 from sgl-kernel (SGLang's H100 default), torch sampling and no autotuning:
            # flashinfer is carried only because SGLang's sampler module imports it; its kernels compile on
            # first use (minutes, nvcc), so none of them may run
            "--attention-backend", "fa3", "--sampling-backend", "pytorch", "--disable-flashinfer-autotune"]


BASE_COMMANDS = {"specserve": _specserve, "vllm": _vllm, "sglang": _sglang}
# no vLLM plugin loads (the arctic-inference wheel registers one that patches vLLM; suffix
# decoding needs only its suffix tree); no usage reports from a machine without network; no
# FlashInfer sampler: flashinfer is not carried, and vLLM 0.26.0 imports it at engine start-up
# for its top-k/top-p sampler unless told not to (v1/sample/ops/topk_topp_sampler.py,
# flashinfer_sampler_supported: the ModuleNotFoundError of the first H100 attempt). Greedy
# requests never sample; every other flashinfer use in vLLM is behind has_flashinfer()
_VLLM_ENV = {"VLLM_PLUGINS": "", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
# prefill graphs off for SGLang's EAGLE-3: 0.5.17 captured its piecewise prefill graphs (torch.compile,
# 58 token counts, 73 s for the first) for the target and the head and did not start in 161 s on an
# H100; its decode and draft graphs stay on, which is what the timed decode steps replay
SGLANG_NO_PREFILL_GRAPHS = ("--cuda-graph-backend-prefill", "disabled")
ENGINES = {c.name: c for c in [
    EngineConfig("specserve-plain", "specserve", "plain"),
    EngineConfig("specserve-ngram", "specserve", "ngram", ("--speculative-algorithm", "NGRAM")),   # default flags
    EngineConfig("specserve-eagle3", "specserve", "eagle3", EAGLE3_CHAIN, startup_s=75.0),
    EngineConfig("specserve-eagle3-tree", "specserve", "eagle3-tree", EAGLE3_TREE),
    EngineConfig("specserve-eagle", "specserve", "eagle", EAGLE2_CHAIN, startup_s=75.0),   # --eagle2-head MODEL=DIR
    # the same head drafting one token a step, fused with the verify (our NAIVE_EAGLE)
    EngineConfig("specserve-naive-eagle", "specserve", "naive-eagle",
                 ("--speculative-algorithm", "NAIVE_EAGLE", "--speculative-draft-model-path", EAGLE_HEAD)),
    # a smaller model of the same tokenizer drafting a chain of 3 (--draft-model TARGET=DRAFT)
    # two models' weights and graphs: with the default 40 s its share of a 330-s run (after two GGUF
    # conversions, beside specserve-plain) left it 49 s to start, and it did not (H200)
    EngineConfig("specserve-standalone", "specserve", "standalone",
                 ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", DRAFT_MODEL,
                  "--speculative-num-steps", "3"), startup_s=100.0),
    EngineConfig("vllm-plain", "vllm", "plain", env=_VLLM_ENV, startup_s=105.0),
    EngineConfig("vllm-ngram", "vllm", "ngram", ("--speculative-config", json.dumps(VLLM_NGRAM)), env=_VLLM_ENV,
                 startup_s=105.0),
    EngineConfig("vllm-suffix", "vllm", "suffix", ("--speculative-config", json.dumps(VLLM_SUFFIX)), env=_VLLM_ENV,
                 startup_s=105.0),
    # the 0.5B on an H100 was not ready after 126 s, still capturing the target's and the head's graphs
    EngineConfig("vllm-eagle3", "vllm", "eagle3", ("--speculative-config", json.dumps(VLLM_EAGLE3)), env=_VLLM_ENV,
                 startup_s=200.0),
    EngineConfig("sglang-plain", "sglang", "plain", startup_s=70.0),
    EngineConfig("sglang-ngram", "sglang", "ngram",
                 ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"), startup_s=70.0),
    EngineConfig("sglang-eagle3", "sglang", "eagle3", EAGLE3_CHAIN + SGLANG_NO_PREFILL_GRAPHS, startup_s=110.0),
    EngineConfig("sglang-eagle3-tree", "sglang", "eagle3-tree", EAGLE3_TREE + SGLANG_NO_PREFILL_GRAPHS,
                 startup_s=110.0),
]}
REFERENCE = "specserve-plain"   # greedy agreement is measured against its outputs


class ServerFailed(RuntimeError):
    """The server exited, or did not answer in time; the message ends with its log's tail."""


class ServerProcess:
    """One engine's server: started in its own process group, logging to `log_path`."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: str, port: int):
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self._proc = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def wait_ready(self, deadline: float) -> float:
        """Seconds until /health and /v1/models answer; ServerFailed if it dies or `deadline`
        (a time.monotonic() value) passes first."""
        start = time.monotonic()
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerFailed(f"the server exited with code {self._proc.returncode}: {self.log_tail()}")
            if _answers(self.base_url + "/health") and _answers(self.base_url + "/v1/models"):
                return time.monotonic() - start
            time.sleep(1.0)
        raise ServerFailed(f"the server was not ready within {time.monotonic() - start:.0f} s: {self.log_tail()}")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def log_tail(self, chars: int = 1500) -> str:
        self._log.flush()
        try:
            with open(self.log_path, errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        lines = [line for line in text.splitlines() if "%|" not in line]   # progress bars say nothing
        return "\n".join(lines)[-chars:]

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the group, SIGKILL after `grace_s`: engine workers and compile
        subprocesses go too, so the next engine gets the whole GPU."""
        if self._proc.poll() is None:
            _signal_group(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        _signal_group(self._proc.pid, signal.SIGKILL)    # children that outlived the leader
        self._log.close()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# what decides time to first token and batch shapes, as /get_server_info reports it (SGLang, specserve)
SETTINGS_KEYS = ("chunked_prefill_size", "max_prefill_tokens", "schedule_policy", "schedule_conservativeness",
                 "enable_mixed_chunk", "max_running_requests", "cuda_graph_max_bs", "attention_backend",
                 "speculative_num_draft_tokens")


def server_settings(base_url: str) -> dict:
    """The scheduling settings a ready server reports at /get_server_info ({} where it has no
    such route, like vLLM's): a peer's defaults are part of what the table compares."""
    info = _server_info(base_url)
    return {key: info[key] for key in SETTINGS_KEYS if key in info}


# how each engine's start-up log states its KV capacity in tokens
KV_CAPACITY_LOG = (re.compile(r"max_total_num_tokens=(\d+)"),          # SGLang's scheduler
                   re.compile(r"GPU KV cache size: ([\d,]+) tokens"),   # vLLM's
                   re.compile(r"KV cache: (\d+) tokens"))               # specserve's


def kv_capacity(base_url: str, log_text: str) -> int | None:
    """The KV tokens a ready server has room for: /get_server_info's max_total_num_tokens
    (specserve's and SGLang's), else the figure its start-up log states (vLLM has no such
    route); None where neither says."""
    tokens = _server_info(base_url).get("max_total_num_tokens")
    if isinstance(tokens, int):
        return tokens
    for pattern in KV_CAPACITY_LOG:
        if (match := pattern.search(log_text)) is not None:
            return int(match.group(1).replace(",", ""))
    return None


# vLLM's Prometheus counters (/metrics), summed over their label sets: verify steps that had
# drafts, over all requests, and the drafts they accepted
VLLM_DRAFTS, VLLM_ACCEPTED = "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"
PROMETHEUS_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)   # name, labels, value


def spec_counters(base_url: str) -> tuple[int, int] | None:
    """(decode steps, tokens they committed) over the requests of a speculative server so far:
    specserve's /get_server_info counts (its finished requests), else vLLM's /metrics counters
    (vllm_spec_counts); None where the server has neither."""
    info = _server_info(base_url)
    steps, tokens = info.get("spec_verify_steps_total"), info.get("spec_accepted_tokens_total")
    if isinstance(steps, int) and isinstance(tokens, int):
        return steps, tokens
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=5) as response:
            return vllm_spec_counts(response.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError, ValueError):
        return None


def vllm_spec_counts(metrics: str) -> tuple[int, int] | None:
    """(verify steps with drafts, tokens they committed) from a Prometheus text page of vLLM's:
    each such step commits its accepted drafts and one token of its own. None without them."""
    sums: dict[str, float] = {}
    for match in PROMETHEUS_SAMPLE.finditer(metrics):
        name, value = match.groups()
        if name in (VLLM_DRAFTS, VLLM_ACCEPTED):
            sums[name] = sums.get(name, 0.0) + float(value)
    if VLLM_DRAFTS not in sums or VLLM_ACCEPTED not in sums:
        return None
    steps = int(sums[VLLM_DRAFTS])
    return steps, steps + int(sums[VLLM_ACCEPTED])


def accept_between(before: tuple[int, int] | None, after: tuple[int, int] | None) -> dict:
    """A cell's decode steps (summed over its requests) and the tokens each committed on
    average (plain steps of an adaptive engine count as 1): {} without counts or steps."""
    if before is None or after is None or after[0] <= before[0]:
        return {}
    steps = after[0] - before[0]
    return {"decode_steps": steps, "accept_length": round((after[1] - before[1]) / steps, 3)}


def _server_info(base_url: str) -> dict:
    try:
        with urllib.request.urlopen(base_url + "/get_server_info", timeout=5) as response:
            info = json.load(response)
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
