"""The engine the EAGLE trainer generates its answers with, and a line saying where its
start-up went.

Every second the engine takes to start is a second of --time-budget not spent training.
A serving engine prepares for any request; the trainer's sends thousands of prompts at
--max-running-requests at once, for a minute or two, and only its throughput counts.
What a serving engine does at start-up that the trainer does not need (H100, Qwen2.5-Coder-1.5B
GGUF on a fresh machine, py-spy over `train_eagle --time-budget 450`: 122 s to ready):

- the one-row GEMV autotune (model/gemv.py), 27.5 s: every fused GEMV variant compiled
  and timed against cuBLAS for each weight shape, for batch-1 decode steps; generation
  decodes at batch 256 and meets batch 1 only in its last steps, where cuBLAS is a few
  microseconds a layer slower. The trainer's engine runs one-row matmuls on cuBLAS.
- the start-up warm-up (engine/warmup.py), 2.8 s: it keeps first-use compiles out of a
  user's request; here they land in the generation, which is one batch job anyway.

What stays: the weights (27 s: reading the GGUF's metadata, dequantizing on the host), the
GGUF's tokenizer (35 s when transformers rebuilt it; from the header now, gguf_tokenizer.py:
~1.5 s on a 2-core CPU), the decode CUDA graphs for every batch size to --max-running-requests
(7.8 s, of which 6.8 s compile Triton kernels generation needs anyway, ~1 s capturing 20
graphs) and the prefill graphs (4 s).

The engine logs each stage at level info; the trainer runs it at warning (no step logs
between its progress bars), so StartupLog keeps the engine's info lines while it starts
and `summary()` turns them into one line.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import time
from collections.abc import Iterator

import torch

ENGINE_LOGGER = "specserve"


def engine_kwargs(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    """The generating engine's arguments (ServerArgs keywords)."""
    kwargs = dict(device=str(device), dtype=str(dtype).removeprefix("torch."), log_level="warning",
                  context_length=context_length(args), max_running_requests=args.max_running_requests,
                  skip_server_warmup=True)
    if device.type == "cuda":
        kwargs["mem_fraction_static"] = args.mem_fraction_static
        # generation is all throughput: every batch size it runs at decodes in a CUDA graph (by
        # default graphs stop at 64 and larger steps run eagerly: ~25-35 ms of launches on an
        # H100 for the 1.5B, prefill_pacer.py, against a few ms replayed); capturing all 20
        # buckets to 256 takes ~1 s
        kwargs["cuda_graph_max_bs"] = args.max_running_requests
    return kwargs


def context_length(args: argparse.Namespace) -> int:
    """The target's context: a prompt and its answer, or a fixed-text chat (the target's
    forward over the training data reuses the engine's model and its RoPE tables)."""
    return max(args.max_prompt_len + args.max_new_tokens, args.max_text_len) + 8


@contextlib.contextmanager
def generating_engine(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Iterator:
    """The engine, started with its start-up line printed; shut down at the exit (its model,
    taken out before, stays usable)."""
    from specserve.engine.engine import Engine
    with _one_row_matmuls_on_cublas(device):
        with StartupLog() as log:
            engine = Engine(model_path=args.model_path, **engine_kwargs(args, device, dtype))
        print(log.summary(), flush=True)
        try:
            yield engine
        finally:
            engine.shutdown()


@contextlib.contextmanager
def _one_row_matmuls_on_cublas(device: torch.device) -> Iterator[None]:
    """No GEMV autotune (see the module docstring): gemv.ENABLED, lab.decode_profile's switch."""
    if device.type != "cuda":
        yield
        return
    from specserve.model import gemv   # imports Triton: on a GPU only
    saved, gemv.ENABLED = gemv.ENABLED, False
    try:
        yield
    finally:
        gemv.ENABLED = saved


class StartupLog(logging.Handler):
    """The engine's log lines of level info and up while the block runs, kept with their
    times; warnings and errors are passed on to the root logger's handlers as before."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[float, str]] = []   # (time.time(), message)
        self.started = self.ended = 0.0
        self._saved: tuple[int, bool] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.created, record.getMessage()))
        if record.levelno >= logging.WARNING:
            logging.getLogger().handle(record)

    def __enter__(self) -> "StartupLog":
        logger = logging.getLogger(ENGINE_LOGGER)
        self._saved = logger.level, logger.propagate
        # the engine sets the root logger to its log level (warning): this logger lets info
        # through to this handler alone
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(self)
        self.started = time.time()
        return self

    def __exit__(self, *exc) -> None:
        self.ended = time.time()
        logger = logging.getLogger(ENGINE_LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._saved[0])
        logger.propagate = self._saved[1]

    def summary(self) -> str:
        """One line: the start-up's seconds, then each line the engine logged with the seconds
        since the one before (lines announcing a stage, ending in '...', only mark its start)."""
        parts, previous = [], self.started
        for created, message in self.lines:
            if not message.endswith("..."):
                parts.append(f"[+{created - previous:.1f} s] {message}")
            previous = created
        parts.append(f"[+{self.ended - previous:.1f} s] the rest")
        return f"engine start-up {self.ended - self.started:.1f} s: " + "; ".join(parts)
