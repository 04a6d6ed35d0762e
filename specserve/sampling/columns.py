"""SamplingColumns: verify_sampling's per-request columns (temperature, top-k, top-p, min-p, seed,
position) in one packed int64 buffer, so that they reach the device in a single copy.

The integer columns come first, then the float32 ones in the storage of the upper half. On the
host the buffer is filled through numpy views; a step's columns are then one pinned buffer and
one copy, where a tensor a column cost six of each (the eager sampler's) or a graph's static inputs
needed them packed (plain_graphs.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_COLUMNS = ("temperatures", "top_ps", "min_ps")
INT_COLUMNS = ("top_ks", "seeds", "positions")


@dataclass
class SamplingColumns:
    packed: torch.Tensor   # (2 * len(INT_COLUMNS) * rows,) int64

    @classmethod
    def allocate(cls, rows: int, device, pin: bool = False) -> "SamplingColumns":
        return cls(torch.zeros(2 * len(INT_COLUMNS) * rows, dtype=torch.long, device=device, pin_memory=pin))

    @property
    def rows(self) -> int:
        return self.packed.shape[0] // (2 * len(INT_COLUMNS))

    def columns(self) -> dict[str, torch.Tensor]:
        """Each column's view, rows long."""
        rows = self.rows
        ints = {name: self.packed[i * rows:(i + 1) * rows] for i, name in enumerate(INT_COLUMNS)}
        floats = self.packed[len(INT_COLUMNS) * rows:].view(torch.float32)
        return ints | {name: floats[i * rows:(i + 1) * rows] for i, name in enumerate(FLOAT_COLUMNS)}

    def fill(self, values: dict[str, list], padding: dict[str, float] | None = None) -> None:
        """Host buffers: each column's values from row 0, and, where `padding` gives each column's
        value, the rows past them set to it, in the same pass."""
        for name, column in self.columns().items():
            rows = column.numpy()
            rows[:len(values[name])] = values[name]
            if padding is not None:
                rows[len(values[name]):] = padding[name]

    def to(self, device) -> "SamplingColumns":
        """This buffer on `device`, in one copy (non-blocking from pinned memory)."""
        return SamplingColumns(self.packed.to(device, non_blocking=True))
