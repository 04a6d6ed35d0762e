"""Random weights for a model config: the state dict that `--load-format dummy` serves.

Kernel timings depend on shapes, not on weight values, so any size can be benchmarked from
its config.json alone. `RandomWeights` is a read-only state dict (Hugging Face names, the
shapes `ModelConfig.parameter_shapes` lists) whose tensors are made when read, directly on
the target device in the run dtype: a model loaded from it holds one extra tensor at a time,
never a second copy of its weights, and nothing is written or staged on the host.

Values: N(0, std) with a small std and every norm weight 1, so hidden states and logits stay
finite through any depth. Each tensor has a generator of its own, seeded from the seed and
its name: a tensor does not depend on which others are read or in which order, and a
tensor-parallel rank cuts its part out of the same tensor that one device would hold.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping

import torch

from specserve.model.config import ModelConfig
from specserve.model.parallel.sharding import ModelShard

DEFAULT_STD = 0.02   # the initializer range of Llama's and Qwen2's configs


class RandomWeights(Mapping[str, torch.Tensor]):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                 shard: ModelShard | None = None, std: float = DEFAULT_STD):
        """shard: the tensor-parallel rank whose part each tensor is (default: the whole model)."""
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.seed, self.std = seed, std
        self.shard = shard or ModelShard.whole(config)
        self._full_shapes = config.parameter_shapes()

    def __getitem__(self, name: str) -> torch.Tensor:
        full_shape = self._full_shapes[name]   # KeyError for a name the model does not have
        if name.endswith("norm.weight"):
            tensor = torch.ones(full_shape, dtype=self.dtype, device=self.device)
        else:
            generator = torch.Generator(device=self.device).manual_seed(tensor_seed(self.seed, name))
            tensor = torch.randn(full_shape, generator=generator, dtype=self.dtype, device=self.device)
            tensor.mul_(self.std)
        return self.shard.select(name, tensor)

    def __iter__(self) -> Iterator[str]:
        return iter(self._full_shapes)

    def __len__(self) -> int:
        return len(self._full_shapes)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape as __getitem__ returns it (the shard's), without making it."""
        return {name: self.shard.shape(name, shape) for name, shape in self._full_shapes.items()}

    def num_parameters(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes().values())


def tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed for tensor `name` under `seed` (stable across processes, unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
