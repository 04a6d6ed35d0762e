"""The target's states of training batches, kept on the device once computed.

A head trains over the same batches for many epochs (the same groups of conversations in
another order each epoch), and the target's forward that gives a batch its states costs
about as much as the head's training step (1.5B target: ~65% of a 32k-token step's FLOPs
when the states are recomputed). `StateStore` keeps each batch's states the first time the
target computes them, while it has room, so from the second epoch on a kept batch costs a
gather; the batches it has no room for are computed each time they train.

The store is sized once, when training starts, to a share of the device memory free then
(DEVICE_SHARE: the rest is training's). Where that does not hold every batch, a second store
in the host's pinned memory (HOST_SHARE of what the host has available) keeps the next ones:
reading a 32k-token batch's float8 states back over PCIe (~200 MB, ~10-20 ms) costs a tenth
of the target's forward that would recompute them (1.5B: ~150 ms). Its rows are kept in the model's dtype, or where
those would not hold every token, as float8 e4m3 with one float32 scale per token and
layer (fp8_rows.quantize_matrix), half the bytes: a 1.5B's EAGLE-3 states take 12,288
bytes a token in bf16, 6,160 in float8. They are read back in the model's dtype. A row's
largest element keeps its value and the others are rounded to e4m3's 3 mantissa bits (a
relative error of at most 1/16, ~1/30 on average): the teacher and the head's input see
that noise, the drafts are still checked by the target.
"""
from __future__ import annotations

import torch

from specserve.kv.pool import host_to_device_async
from specserve.runner.cpu_kv_budget import available_memory_bytes
from specserve.speculative.heads.fp8_rows import FP8, dequantize_matrix, quantize_matrix
from specserve.training.target_features import TargetFeatureExtractor, TargetStates

# the store takes at most this share of the device memory free when training starts: the
# rest is for training (a 7-step 1.5B head of MLP 8960 and 32k draft tokens peaked at 70.1
# GiB in 32k-token steps, one of MLP 2048 and 16k draft tokens ~29 GiB beyond its store; an
# H200 has ~133 GiB free once the generating engine is gone). train_eagle --state-memory-share
DEVICE_SHARE = 0.4
# ... and the host store at most this share of the host memory available when training starts
# (an H100 or H200 machine: 128 GiB; the training data and the process take some)
HOST_SHARE = 0.5
_SCALE_BYTES = 4   # a float32 scale


class StoredRows:
    """Rows of a (num_rows, width) matrix kept as `dtype`, read back as `out_dtype`: as they
    are, or for float8 each row's `segments` equal slices scaled on their own (one per layer)."""

    def __init__(self, num_rows: int, width: int, dtype: torch.dtype, out_dtype: torch.dtype,
                 device: torch.device, segments: int = 1, pin: bool = False):
        """pin: in page-locked host memory (a host store beside a GPU's)."""
        self.out_dtype, self.segments = out_dtype, segments
        self.quantized = dtype == FP8
        # float8 rows are held as bytes: index_select and copies of float8 are not on every device
        self.data = torch.empty((num_rows, width), dtype=torch.uint8 if self.quantized else dtype, device=device,
                                pin_memory=pin)
        self.scale = (torch.empty((num_rows, segments), dtype=torch.float32, device=device, pin_memory=pin)
                      if self.quantized else None)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> list[torch.Tensor]:
        return [self.data] + ([self.scale] if self.scale is not None else [])

    def write(self, first: int, values: torch.Tensor) -> None:
        """Rows first.. = values (num, width), converted where they are (a GPU's, for a host store:
        float8 then crosses PCIe at a byte a value)."""
        rows = slice(first, first + values.shape[0])
        if not self.quantized:
            self.data[rows] = values.to(self.data.dtype)
            return
        quantized, scale = quantize_matrix(values.reshape(values.shape[0] * self.segments, -1))
        self.data[rows] = quantized.view(torch.uint8).view(values.shape)
        self.scale[rows] = scale.view(-1, self.segments)

    def gather(self, index: torch.Tensor, out_device: torch.device | None = None) -> torch.Tensor:
        """Rows `index` (on this device) as out_dtype, on `out_device` (default this device):
        rows kept in host memory travel as kept (float8: a byte a value) and are converted there."""
        rows = self.data.index_select(0, index)
        scale = self.scale.index_select(0, index) if self.quantized else None
        if out_device is not None and out_device != rows.device:
            rows = host_to_device_async(rows, out_device)
            scale = None if scale is None else host_to_device_async(scale, out_device)
        if not self.quantized:
            return rows.to(self.out_dtype)
        pieces = rows.view(FP8).view(rows.shape[0] * self.segments, -1)
        return dequantize_matrix(pieces, scale.view(-1, 1), self.out_dtype).view(rows.shape)


class StateStore:
    """The target's states of the sequences of the batches kept so far (up to `capacity` tokens)."""

    def __init__(self, extractor: TargetFeatureExtractor, capacity: int, dtype: torch.dtype,
                 device: torch.device | None = None):
        """device: where the rows are kept (default the extractor's; the host's, pinned, beside a GPU's)."""
        config = extractor.model.config
        model_dtype = extractor.model.embed_tokens.weight.dtype
        self.device = extractor.device if device is None else torch.device(device)
        self.dtype, self.capacity, self.used = dtype, capacity, 0
        pin = self.device.type == "cpu" and extractor.device.type == "cuda"
        self.starts: dict[int, int] = {}     # sequence index -> its first row
        self.final = StoredRows(capacity, config.hidden_size, dtype, model_dtype, self.device, pin=pin)
        aux = len(extractor.aux_layers)
        self.layers = (StoredRows(capacity, aux * config.hidden_size, dtype, model_dtype, self.device, segments=aux,
                                  pin=pin) if aux else None)

    def has_room(self, num_rows: int) -> bool:
        return self.used + num_rows <= self.capacity

    def keep(self, indices: list[int], lengths: list[int], states: TargetStates) -> bool:
        """Keeps the states of sequences `indices`, of `lengths` tokens (concatenated in that
        order in `states`), where they fit; False where they do not or are kept already."""
        num_rows = sum(lengths)
        if not self.has_room(num_rows) or self.covers(indices):
            return False
        self.final.write(self.used, states.final)
        if self.layers is not None:
            self.layers.write(self.used, states.layers)
        for index, length in zip(indices, lengths):
            self.starts[index] = self.used
            self.used += length
        return True

    def covers(self, indices) -> bool:
        """Whether the states of all these sequences are kept."""
        return all(i in self.starts for i in indices)

    def fill(self, extractor: TargetFeatureExtractor, sequences: list[list[int]], groups: list[list[int]]) -> None:
        """Computes and keeps the states of these groups of sequences (one extractor call a
        group, each within its limits), in order, while they fit."""
        for group in groups:
            if self.covers(group):
                continue
            members = [sequences[i] for i in group]
            if not self.keep(group, [len(ids) for ids in members], extractor(members)):
                return

    def tensors(self) -> list[torch.Tensor]:
        return [t for rows in (self.final, self.layers) if rows is not None for t in rows.tensors()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def state_bytes(extractor: TargetFeatureExtractor, num_tokens: int, dtype: torch.dtype) -> int:
    """What a StateStore of num_tokens tokens kept as `dtype` takes."""
    config, aux = extractor.model.config, len(extractor.aux_layers)
    per_token = (aux + 1) * config.hidden_size * dtype.itemsize
    if dtype == FP8:
        per_token += (aux + 1) * _SCALE_BYTES
    return num_tokens * per_token


def device_token_budget(extractor: TargetFeatureExtractor, dtype: torch.dtype, share: float = DEVICE_SHARE) -> int | None:
    """Tokens whose states, kept as `dtype`, fit `share` of the GPU memory free for them (None
    on a CPU: no bound, the states are a small part of what a CPU run holds)."""
    device = extractor.device
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # PyTorch's cache is free to it
    return int(share * free) // state_bytes(extractor, 1, dtype)


def make_state_store(extractor: TargetFeatureExtractor, total_tokens: int, dtype: torch.dtype | None = None,
                     share: float = DEVICE_SHARE) -> StateStore | None:
    """A store for up to `total_tokens` tokens (all the training data's), as many as fit;
    dtype None: the model's where all of them fit, float8 where not. None where not one fits."""
    if not 0 < share <= 1:
        raise ValueError(f"state memory share {share}: must be in (0, 1]")
    if dtype is None:
        dtype = extractor.model.embed_tokens.weight.dtype
        budget = device_token_budget(extractor, dtype, share)
        if budget is not None and budget < total_tokens:
            dtype = FP8
    budget = device_token_budget(extractor, dtype, share)
    capacity = total_tokens if budget is None else min(total_tokens, budget)
    return StateStore(extractor, capacity, dtype) if capacity > 0 else None


def host_token_budget(extractor: TargetFeatureExtractor, dtype: torch.dtype, share: float = HOST_SHARE) -> int:
    """Tokens whose states, kept as `dtype`, fit `share` of the host memory available now."""
    return int(share * (available_memory_bytes() or 0)) // state_bytes(extractor, 1, dtype)


def make_host_state_store(extractor: TargetFeatureExtractor, beside: StateStore | None, total_tokens: int,
                          share: float = HOST_SHARE) -> StateStore | None:
    """Beside a GPU's store that cannot hold every token, one in pinned host memory for the
    tokens left, as many as fit `share` of the host's available memory (kept as the GPU
    store's dtype: float8 there is float8 here). None on a CPU, where the store is host
    memory already, where the GPU's holds all, or where `share` is 0."""
    if extractor.device.type != "cuda" or share <= 0 or beside is None or beside.capacity >= total_tokens:
        return None
    capacity = min(total_tokens - beside.capacity, host_token_budget(extractor, beside.dtype, share))
    if capacity <= 0:
        return None
    try:
        return StateStore(extractor, capacity, beside.dtype, device="cpu")
    except RuntimeError as error:   # pinned memory refused: the batches are computed as before
        print(f"train_eagle: no host store for the target's states ({error}); those batches are recomputed",
              flush=True)
        return None
