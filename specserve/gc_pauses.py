"""Keeping Python's full garbage collections short in the serving processes.

A full (generation-2) collection walks every container object the process tracks. After
start-up that is hundreds of thousands of them (torch modules, the tokenizer, FastAPI's
routes, the engine's buffers and graphs): one such walk took 174 ms on this project's CPU
(SmolLM2 engine, 355k objects), and on the H100 machine the server showed one-off stalls of
the same size where every request of a timed wave waited ~130-190 ms for its first token.
Those objects live as long as the process, so they are moved out of the collector's sight
once start-up is over (SGLang's scheduler does the same); later collections walk only what
serving created since.

Only processes that build one engine and serve it until they exit do this for good: a
frozen object in a reference cycle is never freed. A process that builds and drops engines
(benchmarks) freezes while one engine serves and unfreezes before dropping it
(`long_lived_objects_frozen`): its timed runs then see the collector as a server does (an
H200 suite run, which did not freeze, had one 386-ms drafting step with no kernel compiled
in it).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator


def freeze_long_lived_objects() -> int:
    """Collects what start-up left as garbage, then exempts every object alive now from
    future collections, until the process exits; returns how many objects are exempt.

    At exit they are put back in the collector's sight: the interpreter's last collections
    then free them, where frozen objects in cycles would outlive it (Triton's nanobind
    bindings, imported by torch, then print ~30 lines of "nanobind: leaked ..." at exit)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)   # once, however often this is called
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


@contextlib.contextmanager
def long_lived_objects_frozen() -> Iterator[int]:
    """freeze_long_lived_objects for the block (yields the count), then back in the
    collector's sight: what the block's engine held can be freed once it is dropped."""
    try:
        yield freeze_long_lived_objects()
    finally:
        gc.unfreeze()
