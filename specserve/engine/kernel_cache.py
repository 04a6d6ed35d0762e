"""Compiled GPU kernels across starts: Triton's on-disk cache in specserve's cache
directory, and a count of the kernels a stretch of work compiled (or loaded from it).

Triton compiles a kernel the first time a process launches it with a new specialisation
(constexprs, and which integer arguments are 1 or multiples of 16), ~0.3-1.5 s each, and
keeps the binary on disk: a later start that finds it there only loads it (milliseconds).
The cache directory is Triton's `TRITON_CACHE_DIR`; unless the user chose one, specserve
puts it beside its other build products (the n-gram trie's C library), under
`$SPECSERVE_CACHE_DIR` (default `~/.cache/specserve`), so one setting makes every compiled
artefact persist (e.g. a volume mounted into a container).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger("specserve")
KEY_CHARS = 1500   # of a compiled kernel's cache key kept with it (a key lists every argument's specialization)


def specserve_cache_dir() -> Path:
    """Where specserve keeps what it builds (the n-gram trie follows the same rule)."""
    return Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve")


def use_persistent_triton_cache(device: torch.device) -> Path | None:
    """Points Triton's kernel cache at specserve's cache directory unless TRITON_CACHE_DIR
    is set already; must run before the first kernel compiles. Returns the directory in
    use (None on a CPU, where no Triton kernel runs)."""
    if device.type != "cuda":
        return None
    chosen = os.environ.get("TRITON_CACHE_DIR")
    if chosen:
        return Path(chosen)
    path = specserve_cache_dir() / "triton"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # Triton then keeps its own default (~/.triton/cache)
        logger.warning("cannot create %s for Triton's kernel cache (%s); set SPECSERVE_CACHE_DIR or "
                       "TRITON_CACHE_DIR to a writable directory", path, error)
        return None
    os.environ["TRITON_CACHE_DIR"] = str(path)
    return path


class TritonCompileCounter:
    """Counts the Triton kernels compiled while it is open (a kernel found in the disk cache
    counts too: it is then only loaded, which `seconds` tells apart) through Triton's JIT
    hooks (`knobs.runtime`, or a stand-in given for tests). Without Triton, or while someone
    else holds the hooks, it counts nothing and `compiles` stays None."""

    def __init__(self, runtime=None):
        self.compiles: int | None = None
        self.seconds = 0.0
        # each compile's kernel, seconds and specialisation (Triton's repr: the argument types, with
        # which integers were 1 or multiples of 16 and which pointers 16-byte aligned), which tells
        # what shape made a kernel compile in the middle of serving
        self.kernels: list[dict] = []
        self._given_runtime = runtime
        self._runtime = None
        self._started: float | None = None

    def __enter__(self) -> "TritonCompileCounter":
        runtime = self._given_runtime
        if runtime is None:
            try:
                from triton import knobs
            except ImportError:  # a CPU install, or a Triton too old to have knobs
                return self
            runtime = knobs.runtime
        if runtime.jit_cache_hook is None and runtime.jit_post_compile_hook is None:
            self._runtime, self.compiles = runtime, 0
            runtime.jit_cache_hook = self._before_compile
            runtime.jit_post_compile_hook = self._after_compile
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook = self._runtime.jit_post_compile_hook = None
            self._runtime = None

    def reset(self) -> None:
        """Counts from zero again (the hooks stay)."""
        if self.compiles is not None:
            self.compiles, self.seconds, self.kernels = 0, 0.0, []

    def _before_compile(self, **_) -> None:  # must return None: a true value makes Triton skip the compile
        self._started = time.perf_counter()

    def _after_compile(self, **hook) -> None:   # Triton's keywords: key, repr, fn, compile, ...
        self.compiles += 1
        seconds = None
        if self._started is not None:
            seconds = time.perf_counter() - self._started
            self.seconds += seconds
            self._started = None
        # Triton's repr names the arguments but may not show their specialization (3.6: "(q_ptr: ()");
        # its cache key holds each argument's type and alignment / divisibility, which tell a new variant
        self.kernels.append({"kernel": getattr(hook.get("fn"), "name", None), "s": seconds,
                             "specialization": hook.get("repr"), "key": str(hook.get("key"))[:KEY_CHARS]})
