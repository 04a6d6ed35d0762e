"""vLLM's `vllm serve` command line (release 0.26) read into specserve's ServerArgs.

A team that starts vLLM with `vllm serve MODEL --max-model-len 8192 --gpu-memory-utilization
0.9 --speculative-config '{"method": "ngram", ...}'` starts specserve with the same flags
(`python -m specserve.vllm_serve`). Every flag known here is one of three kinds, as in
sglang_compat:

- in `MAPPED`: it sets ServerArgs fields (`--max-model-len` -> context_length, ...);
- in `VLLM_ONLY_OPTIONS` with a reason: it only tunes how vLLM does something specserve does
  its own way: accepted, one warning when it is not at vLLM's default;
- in `VLLM_ONLY_OPTIONS` without one: a feature specserve lacks (quantization, LoRA,
  pipeline parallelism, ...): accepted at vLLM's default, a NotSupportedError otherwise.

`--speculative-config`'s JSON keys are sorted the same way (`SPECULATIVE_*`). Any other flag
or key is an error with a did-you-mean. Unlike vLLM, the server listens on 127.0.0.1 unless
--host says otherwise, and specserve's adaptive draft length stays on
(num_speculative_tokens is the most it drafts).
"""
from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from specserve.args import MODEL_ALGORITHMS, ServerArgs
from specserve.errors import ArgumentError, NotSupportedError, UnknownArgumentError, UserError, did_you_mean
from specserve.sglang_compat import accept_foreign_option

logger = logging.getLogger("specserve")

VLLM_PORT = 8000


_TOKEN_KV = "specserve's KV cache is token-granular (blocks of one token)"
_GRAPHS = ("specserve captures its own CUDA graphs, up to --max-cudagraph-capture-size requests, "
           "and uses no torch.compile")
_SCHEDULER = "specserve's scheduler paces prompt chunks among decode steps itself"
_LOADER = "specserve runs its own code of each architecture (Llama, Qwen2, Qwen3) and loads the weights whole"
_ONE_PROCESS = "specserve starts one process per tensor-parallel rank and serves HTTP from one more"
_LOGS = "specserve logs a throughput line every 10 s and serves /metrics; it never logs requests' contents"
_ADAPTIVE = "specserve's adaptive policy picks each step's draft size, down to none, from measured acceptance and cost"
_LOSSLESS = "specserve's drafters propose their likeliest tokens; verification is lossless either way"
_DRAFTER_ON_RANK_0 = "specserve runs a drafter once, on rank 0, with whole weights"


# --- --speculative-config ---
SPECULATIVE_METHODS = {"ngram": "NGRAM", "ngram_gpu": "NGRAM", "eagle": "EAGLE", "eagle3": "EAGLE3",
                       "draft_model": "STANDALONE", "mtp": "MTP"}   # and vLLM's per-model "<model>_mtp"
# --speculative-config keys -> the ServerArgs field they set (num_speculative_tokens: speculative_keywords)
SPECULATIVE_FIELDS = {"model": "speculative_draft_model_path",
                      "prompt_lookup_max": "speculative_ngram_max_match_window_size",
                      "prompt_lookup_min": "speculative_ngram_min_match_window_size"}
# the other keys: key -> (vLLM's default, or the value specserve matches; the reason, None: refused)
SPECULATIVE_ONLY_KEYS: dict[str, tuple[Any, str | None]] = {
    "draft_tensor_parallel_size": (1, _DRAFTER_ON_RANK_0),
    "disable_by_batch_size": (None, _ADAPTIVE),
    "num_speculative_tokens_per_batch_size": (None, _ADAPTIVE),
    "draft_sample_method": ("greedy", _LOSSLESS),
    "max_model_len": (None, "specserve's drafters take the target's context length"),
    "enforce_eager": (None, _GRAPHS),
    "disable_padded_drafter_batch": (False, _GRAPHS),
    "attention_backend": (None, "specserve's drafters use the target's attention backend"),
    "use_local_argmax_reduction": (False, _DRAFTER_ON_RANK_0),
    "quantization": (None, None),
    "kv_cache_dtype": (None, None),
    "revision": (None, None),
    "code_revision": (None, None),
    "parallel_drafting": (False, None),
    "rejection_sample_method": ("standard", None),
    "speculative_token_tree": (None, None),
}


def speculative_keywords(config: dict[str, Any]) -> dict[str, Any]:
    """ServerArgs' speculative keywords for a --speculative-config object."""
    algorithm = _algorithm(config)
    _check_speculative_keys(config)
    keywords = {"speculative_algorithm": algorithm,
                **{field: config[key] for key, field in SPECULATIVE_FIELDS.items() if key in config}}
    if algorithm in MODEL_ALGORITHMS and not config.get("model"):
        raise ArgumentError(f"--speculative-config: method {config.get('method')!r} needs a 'model' (the draft "
                            "model, EAGLE head or MTP layer's directory)")
    tokens = config.get("num_speculative_tokens")
    if tokens is not None:
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise ArgumentError(f"--speculative-config: num_speculative_tokens must be a positive integer, "
                                f"got {tokens!r}")
        # NGRAM verifies a tree of that many drafts and its root; a model drafter drafts a chain
        keywords.update({"speculative_num_draft_tokens": tokens + 1} if algorithm == "NGRAM"
                        else {"speculative_num_steps": tokens})
    return keywords


def _algorithm(config: dict[str, Any]) -> str:
    method = config.get("method")
    if method is None:   # vLLM guesses an EAGLE head from its name, else takes a draft model
        model = str(config.get("model") or "").lower()
        if not model:
            raise ArgumentError("--speculative-config needs a 'method' "
                                f"({', '.join(SPECULATIVE_METHODS)}) or a draft 'model'")
        return "EAGLE3" if "eagle3" in model else "EAGLE" if "eagle" in model else "STANDALONE"
    if isinstance(method, str) and method.endswith("_mtp"):
        return "MTP"
    if method not in SPECULATIVE_METHODS:
        raise NotSupportedError(f"--speculative-config: method {method!r} is not one specserve has; it drafts with "
                                f"{', '.join(SPECULATIVE_METHODS)} (and vLLM's <model>_mtp names)")
    return SPECULATIVE_METHODS[method]


def _check_speculative_keys(config: dict[str, Any]) -> None:
    known = ["method", "num_speculative_tokens", *SPECULATIVE_FIELDS, *SPECULATIVE_ONLY_KEYS]
    for key, value in config.items():
        if key in SPECULATIVE_ONLY_KEYS:
            default, tuning = SPECULATIVE_ONLY_KEYS[key]
            accept_foreign_option("vLLM", f"--speculative-config {key}", value, default, tuning)
        elif key not in known:
            raise UnknownArgumentError(f"--speculative-config: unknown key {key!r}{did_you_mean(key, known)}")


# --- flags ---
class Mapped(NamedTuple):
    kind: str                                  # the value's kind, as in VLLM_ONLY_OPTIONS
    to_fields: Callable[[Any], dict[str, Any]]  # the flag's value -> ServerArgs keywords
    help: str


def _field(name: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {name: value}


def _served_model_name(names: list[str]) -> dict[str, Any]:
    if len(names) > 1:
        logger.warning("/v1/models lists one name, %r (not %s); requests naming any model are served by it",
                       names[0], ", ".join(map(repr, names[1:])))
    return {"served_model_name": names[0]}


def _log_level(level: str) -> dict[str, Any]:
    # uvicorn's levels that specserve lacks, as their nearest; specserve has one level for all its logs
    return {"log_level": {"critical": "error", "trace": "debug"}.get(level, level)}


# vLLM's flag (its dest) -> the ServerArgs keywords it sets. Applied in this order, so a later
# flag wins: --no-enable-chunked-prefill over --max-num-batched-tokens (with chunking off, vLLM's
# token budget only has to hold a whole prompt, as specserve's unchunked prefill steps do).
MAPPED: dict[str, Mapped] = {
    "model": Mapped("s", _field("model_path"), "the model (api_server's spelling; vllm serve takes it first)"),
    "served_model_name": Mapped("l", _served_model_name, "the name /v1/models lists (the first, if several)"),
    "tokenizer": Mapped("s", _field("tokenizer_path"), "specserve's --tokenizer-path"),
    "dtype": Mapped("s", _field("dtype"), "auto, bfloat16, float16, half, float32 or float"),
    "load_format": Mapped("s", _field("load_format"), "auto, safetensors, pt, gguf or dummy"),
    "seed": Mapped("i", _field("random_seed"), "specserve's --random-seed"),
    "max_model_len": Mapped("t", _field("context_length"), "specserve's --context-length (32k and 32K too)"),
    "gpu_memory_utilization": Mapped("f", _field("mem_fraction_static"), "specserve's --mem-fraction-static"),
    "max_num_seqs": Mapped("i", _field("max_running_requests"), "specserve's --max-running-requests"),
    "max_num_batched_tokens": Mapped("t", _field("chunked_prefill_size"), "specserve's --chunked-prefill-size"),
    "enable_chunked_prefill": Mapped("b", lambda on: {} if on else {"chunked_prefill_size": -1},
                                     "off: specserve's --chunked-prefill-size -1"),
    "enable_prefix_caching": Mapped("b", lambda on: {"disable_radix_cache": not on},
                                    "off: specserve's --disable-radix-cache"),
    "enforce_eager": Mapped("b", _field("disable_cuda_graph"), "specserve's --disable-cuda-graph"),
    "max_cudagraph_capture_size": Mapped("i", _field("cuda_graph_max_bs"), "specserve's --cuda-graph-max-bs"),
    "tensor_parallel_size": Mapped("i", _field("tp_size"), "specserve's --tp-size"),
    "speculative_config": Mapped("j", speculative_keywords, "JSON: method ngram, eagle, eagle3, draft_model or mtp"),
    "host": Mapped("s", _field("host"), "default 127.0.0.1 (vLLM: every interface; 0.0.0.0 serves others)"),
    "port": Mapped("i", _field("port"), f"default {VLLM_PORT}, as vLLM's"),
    "api_key": Mapped("s", _field("api_key"), "require this Bearer token on every request"),
    "uvicorn_log_level": Mapped("s", _log_level, "specserve's --log-level, for all its logs (critical: error, "
                                                 "trace: debug)"),
}
SHORT_FLAGS = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",),
               "data_parallel_size": ("-dp",), "quantization": ("-q",), "compilation_config": ("-O",)}

# vLLM's flags without a specserve field: name -> (vLLM's default, value kind: b bool flag with
# its --no- form, i int, f float, s str, l list, t token count, j JSON object; what specserve
# does instead, or None for a feature it lacks). A default may instead be the value whose
# behaviour specserve already has (--disable-log-requests): setting that one is silent.
VLLM_ONLY_OPTIONS: dict[str, tuple[Any, str, str | None]] = {
    "block_size": (None, "i", _TOKEN_KV),
    "swap_space": (4, "f", "specserve preempts by recomputing a request's KV later, with no CPU swap space"),
    "compilation_config": (None, "s", _GRAPHS),
    "cuda_graph_sizes": (None, "l", _GRAPHS),
    "max_seq_len_to_capture": (8192, "i", _GRAPHS),
    "async_scheduling": (None, "b", "specserve queues each step before the previous one is read, by default"),
    "scheduling_policy": ("fcfs", "s", None),
    "max_num_partial_prefills": (1, "i", _SCHEDULER),
    "max_long_partial_prefills": (1, "i", _SCHEDULER),
    "long_prefill_token_threshold": (0, "i", _SCHEDULER),
    "disable_custom_all_reduce": (False, "b", "specserve's tensor parallelism all-reduces through NCCL (gloo on a CPU)"),
    "distributed_executor_backend": (None, "s", _ONE_PROCESS),
    "api_server_count": (1, "i", _ONE_PROCESS),
    "disable_frontend_multiprocessing": (False, "b", _ONE_PROCESS),
    "max_parallel_loading_workers": (None, "i", _LOADER),
    "trust_remote_code": (False, "b", _LOADER),
    "model_impl": ("auto", "s", _LOADER),
    "tokenizer_mode": ("auto", "s", "specserve tokenizes with the model's own tokenizer"),
    "disable_log_stats": (False, "b", _LOGS),
    "disable_log_requests": (True, "b", _LOGS),
    "enable_log_requests": (False, "b", _LOGS),
    "max_log_len": (None, "i", _LOGS),
    "otlp_traces_endpoint": (None, "s", _LOGS),
    "disable_uvicorn_access_log": (False, "b", "specserve logs one line a request at --uvicorn-log-level info or debug"),
    "max_logprobs": (20, "i", "specserve returns up to 20 logprobs a token"),
    "generation_config": ("auto", "s", "specserve reads only the stop tokens from generation_config.json"),
    "structured_outputs_config": (None, "s", "specserve's structured output always goes through xgrammar"),
    "guided_decoding_backend": ("auto", "s", "specserve's structured output always goes through xgrammar"),
    "enable_auto_tool_choice": (True, "b", "specserve always parses tool calls"),
    "tool_call_parser": (None, "s", "specserve reads the tool-call format off the chat template (Hermes-style "
                                    "<tool_call> of Qwen, JSON of Llama 3.1)"),
    "reasoning_parser": (None, "s", None),
    "chat_template": (None, "s", None),
    "response_role": ("assistant", "s", None),
    "return_tokens_as_token_ids": (False, "b", None),
    "config": (None, "s", None),
    "runner": ("auto", "s", None),
    "task": ("auto", "s", None),
    "skip_tokenizer_init": (False, "b", None),
    "enable_prompt_embeds": (False, "b", None),
    "revision": (None, "s", None),
    "tokenizer_revision": (None, "s", None),
    "code_revision": (None, "s", None),
    "download_dir": (None, "s", None),
    "hf_overrides": (None, "s", None),
    "rope_scaling": (None, "s", None),
    "rope_theta": (None, "f", None),
    "quantization": (None, "s", None),
    "kv_cache_dtype": ("auto", "s", None),
    "calculate_kv_scales": (False, "b", None),
    "kv_cache_memory_bytes": (None, "i", None),
    "cpu_offload_gb": (0, "f", None),
    "enable_sleep_mode": (False, "b", None),
    "pipeline_parallel_size": (1, "i", None),
    "data_parallel_size": (1, "i", None),
    "enable_expert_parallel": (False, "b", None),
    "kv_transfer_config": (None, "s", None),
    "headless": (False, "b", None),
    "enable_lora": (False, "b", None),
    "lora_modules": (None, "l", None),
    "max_loras": (1, "i", None),
    "max_lora_rank": (16, "i", None),
    "max_cpu_loras": (None, "i", None),
    "fully_sharded_loras": (False, "b", None),
    "limit_mm_per_prompt": (None, "s", None),
    "mm_processor_kwargs": (None, "s", None),
    "ssl_keyfile": (None, "s", None),
    "ssl_certfile": (None, "s", None),
    "root_path": (None, "s", None),
}


def server_args_of(given: dict[str, Any]) -> ServerArgs:
    """The ServerArgs of a parsed `vllm serve` command line (flag dest -> value, only the flags
    given); warnings for the tuning options it sets, a UserError for what specserve cannot do."""
    keywords: dict[str, Any] = {"port": VLLM_PORT}
    origins: dict[str, str] = {}   # ServerArgs field -> the vLLM flag that set it
    for name, mapped in MAPPED.items():
        if name in given:
            fields = mapped.to_fields(given[name])
            keywords.update(fields)
            origins.update(dict.fromkeys(fields, flag(name)))
    if "model_tag" in given:   # vllm serve's positional MODEL wins over --model, as in vLLM
        keywords["model_path"] = given["model_tag"]
    for name, (default, _, tuning) in VLLM_ONLY_OPTIONS.items():
        if name in given:
            accept_foreign_option("vLLM", flag(name), given[name], default, tuning)
    return _build(keywords, origins)


def _build(keywords: dict[str, Any], origins: dict[str, str]) -> ServerArgs:
    try:
        return ServerArgs.from_kwargs(**keywords)
    except UserError as error:
        # ServerArgs' message names its own fields: add the vLLM flags the user wrote instead
        flags = sorted({flag for field, flag in origins.items() if re.search(rf"\b{field}\b", str(error))})
        if not flags:
            raise
        raise type(error)(f"{error} (set by vLLM's {', '.join(flags)})") from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "K": 2**10, "M": 2**20}


def token_count(text: str) -> int:
    """A token count as vLLM reads one: 8192, or 32k (32000), 32K (32768), 1.5k."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmKM]?)", text.strip())
    count = float(match.group(1)) * _TOKEN_UNITS[match.group(2)] if match else None
    if count is None or count != int(count):
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (8192, 32k or 32K)")
    return int(count)


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value
