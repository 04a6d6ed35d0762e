"""The KV cache: token-granular K/V buffers, the free-slot allocator and `req_to_token`.

Page size is 1 (SGLang's default): every token owns one slot in every layer's buffer.
Slot 0 is never handed out; padded rows of a CUDA-graph batch write their K/V there, so
padding never touches a live request's cache.
"""
from __future__ import annotations

import numpy as np
import torch

PADDING_SLOT = 0


class SlotAllocator:
    """A free list of KV slots, kept on the host so that allocation never syncs the GPU."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[int] = list(range(size, 0, -1))  # pop() hands out low slots first

    def available(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self._free):
            return None
        if count == 0:
            return []
        taken = self._free[-count:]
        del self._free[-count:]
        taken.reverse()
        return taken

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))

    def free_list(self) -> list[int]:
        """A copy of the free slots (for accounting checks)."""
        return list(self._free)


class KVPool:
    """Per-layer K and V buffers of shape (size + 1, num_kv_heads, head_dim), plus the
    `req_to_token[row, position] -> slot` table for the requests that are running."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, size: int,
                 max_requests: int, max_context: int, dtype: torch.dtype, device: torch.device):
        self.size = size
        self.max_context = max_context
        self.dtype = dtype
        self.device = device
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # (max_requests + 1, max_context) int32: small enough for the GPU and what the kernels
        # index with. The last row belongs to no request: padding rows of a graph batch name it,
        # and table writes a step computes but does not need (rejected nodes) land there.
        self.req_to_token = torch.zeros((max_requests + 1, max_context), dtype=torch.int32, device=device)
        self.scratch_row = max_requests
        self.max_requests = max_requests
        self.slots = SlotAllocator(size)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def free_rows(self) -> int:
        return len(self._free_rows)

    def write_positions(self, row: int, start: int, slots: torch.Tensor) -> None:
        """req_to_token[row, start : start + len(slots)] = slots."""
        self.req_to_token[row, start:start + slots.numel()] = slots

    def write_entries_async(self, rows: list[int], positions: list[int], slots: list[int]) -> None:
        """req_to_token[rows[i], positions[i]] = slots[i], queued on the stream without
        blocking the host (through pinned memory), e.g. behind a step still in flight. The
        lists go through numpy: a head's feed writes ~37k entries at once (64 chats' prompts
        and answers), which torch.tensor took ~5.8 ms to read on a 2-core CPU, numpy ~1.8 ms."""
        values = np.array([rows, positions, slots], dtype=np.int64)
        values = host_to_device_async(torch.from_numpy(values), self.device)
        self.req_to_token[values[0], values[1]] = values[2].to(torch.int32)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (num_tokens, num_kv_heads, head_dim) written to the given slots."""
        self.k_buffers[layer][slots] = k.to(self.dtype)
        self.v_buffers[layer][slots] = v.to(self.dtype)


def host_to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, queued without waiting: a copy from pageable memory
    may wait for the stream to drain, which would stall a step launched ahead."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
