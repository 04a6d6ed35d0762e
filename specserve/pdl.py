"""Programmatic dependent launch (PDL, Hopper and newer) for the batch-1 decode chain.

A decode step at batch 1 is a chain of small kernels (GEMVs, attention), each too short to
hide its own start: its programs launch, fetch their first bytes from HBM, and only then
stream at full bandwidth. With PDL a kernel launched with `launch_pdl=True` may start
while the previous one is still running, once that one has executed
`gdc_launch_dependents()` on every SM; it then calls `gdc_wait()`, which returns when the
previous kernel has finished and its writes are visible. The protocol our kernels keep:

- call `gdc_launch_dependents()` first thing (the next kernel may start right away);
- before `gdc_wait()`, only read what no kernel of the chain writes: weights, and the
  batch's metadata written before the step's first kernel (a chained kernel may start
  before even the kernel two back has finished, since that one may still be waiting);
- write nothing before `gdc_wait()`.

Kernels launched without the flag (torch's, cuBLAS) wait for their predecessor as usual,
so mixing both is safe. Captured CUDA graphs keep the programmatic edges.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def uses_pdl(device: torch.device) -> bool:
    """PDL on this device: a CUDA GPU of compute capability 9.0 or newer (never on the
    CPU, where Triton's interpreter runs the kernels)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
