"""lab/turnover_step_host.py's virtual GPU: steps run one after another from their launch,
a wait moves the host clock to the step's end, and only host time with nothing queued is idle."""
from __future__ import annotations

from types import SimpleNamespace

from lab import turnover_step_host
from lab.turnover_step_host import VirtualGPU


def test_the_virtual_gpu_idles_only_while_nothing_is_queued(monkeypatch):
    clock = {"cpu": 0.0}
    monkeypatch.setattr(turnover_step_host.time, "thread_time", lambda: clock["cpu"])
    stand_in = SimpleNamespace(cpu_seconds=0.0)
    gpu = VirtualGPU(stand_in)
    gpu.launch(1.0)                       # runs 0 .. 1
    clock["cpu"] = 0.5
    gpu.launch(1.0)                       # launched ahead: queued behind it, 1 .. 2
    assert gpu.idle == 0.0 and gpu.free_at == 2.0
    gpu.wait_until(2.0)                   # the host reads the second step's tokens
    assert gpu.host() == 2.0
    clock["cpu"] = 1.0                    # half a second of host work with nothing queued
    gpu.launch(1.0)
    assert gpu.idle == 0.5 and gpu.free_at == 3.5
    stand_in.cpu_seconds = 0.25           # the stand-in's own time is no host time
    assert gpu.host() == 2.25
