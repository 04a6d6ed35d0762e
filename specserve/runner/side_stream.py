"""Small reads of a finished step's outputs that must not wait for the steps queued after it.

A host read of a device tensor (`tolist`, `item`) synchronizes the stream it runs on, and on
the default stream that includes every step launched since: under the overlap schedule a read
of step N's logits waits for step N+1 as well, and the host then launches N+2 only once the
GPU has gone idle. Run on a side stream that waits for an event recorded after step N's
outputs, the same read waits for those outputs and the few kernels it queues itself.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def beside(ready: torch.cuda.Event | None) -> Iterator[None]:
    """Runs the block's device work on a side stream that starts once `ready` has fired (on a
    CPU, or with no event: on the current stream). Tensors the block reads were made on the
    default stream; the block must read its results to the host before it ends (its kernels
    done), so none of them is freed while the side stream still uses it."""
    if ready is None:
        yield
        return
    device = torch.device("cuda", torch.cuda.current_device())
    stream = _STREAMS.get(device)
    if stream is None:
        stream = _STREAMS[device] = torch.cuda.Stream(device)
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        yield
