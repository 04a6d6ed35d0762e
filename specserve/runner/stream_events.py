"""Recording a CUDA event on the current stream for a few microseconds of host time.

`torch.cuda.Event.record()` without a stream looks the stream up through
`torch.cuda.current_stream()`, which resolves the device index (CUDA's availability, the
device type, the current device) and builds a new Stream object on every call. Between
reading one speculative step and launching the next, the host records two or three events;
an H200 profile of a batch-1 verify step put those lookups beside the graph launch itself
(docs/bench/h200_2026-12-04b/verify4_b1_cprofile.txt.xz). Here the current stream is asked
of CUDA directly and its Stream object kept, so only the two C calls remain.
"""
from __future__ import annotations

import torch

_streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def current_stream() -> torch.cuda.Stream:
    """torch.cuda.current_stream() of the current device, without its per-call lookups."""
    key = torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def record(event: torch.cuda.Event) -> torch.cuda.Event:
    """Records `event` on the current stream (what event.record() does); returns it."""
    event.record(current_stream())
    return event
