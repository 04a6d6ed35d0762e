"""stream_events on a GPU: its current stream is torch's, under a stream context too, and an
event it records marks the work queued on that stream before it."""
from __future__ import annotations

import torch

from specserve.runner.stream_events import current_stream, record


def test_current_stream_is_torchs_inside_and_outside_a_stream_context() -> None:
    assert current_stream() == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream() == side
        assert current_stream() is current_stream()   # kept, not rebuilt
    assert current_stream() == torch.cuda.current_stream()


def test_recorded_event_waits_for_the_streams_earlier_work() -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)   # ~0.1 s of GPU cycles
        event = record(torch.cuda.Event())
    assert not event.query()
    event.synchronize()
    assert event.query()
    assert side.query()
