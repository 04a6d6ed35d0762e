"""The counter-based uniforms' kernel (verify/random_kernels.py) gives random.py's numbers bit
for bit: float32 and float64, an index per position or several (broadcast or not), seeds and
positions of either sign and of any size (Triton's interpreter on the CPU)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import pytest
import torch

from specserve.verify import random as srandom
from specserve.verify import random_kernels
from specserve.verify.splitmix import salt_word

DEVICE = torch.device("cpu" if os.environ["TRITON_INTERPRET"] == "1" else "cuda")


def reference(seeds, positions, salt, index, dtype):
    """random.py's torch ops (what its CPU path computes)."""
    return srandom._draws(seeds.cpu(), positions.cpu(), salt, dtype)(index.cpu())


def kernel(seeds, positions, salt, index, dtype):
    return random_kernels.uniform_at(seeds.to(DEVICE), positions.to(DEVICE), salt_word(salt), index.to(DEVICE), dtype).cpu()


SEEDS = torch.tensor([0, 1, -1, 2**63 - 1, -2**63, 123456789012345])
POSITIONS = torch.tensor([[0, 1, 2], [7, 8, 9], [2**40, 5, 3], [1, 1, 1], [-3, 0, 2**62], [11, 12, 13]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("salt", [srandom.SALT_TOKEN, srandom.SALT_ACCEPT, srandom.SALT_DRAFT])
def test_one_number_per_position_is_the_torch_ops(dtype, salt):
    index = torch.tensor([[0, 3, 1], [2, 0, 0], [9, 9, 9], [0, 1, 2], [5, 4, 3], [2**33, 1, 0]])
    got = kernel(SEEDS, POSITIONS, salt, index, dtype)
    assert got.dtype == dtype and got.shape == POSITIONS.shape
    assert torch.equal(got, reference(SEEDS, POSITIONS, salt, index, dtype))
    assert bool(((got > 0) & (got < 1)).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_broadcast_index_per_position_is_the_torch_ops(dtype):
    """A block race's draw: the same arange for every position, read through zero strides, wider
    than one program's block."""
    index = torch.arange(1500).expand(*POSITIONS.shape, -1)
    got = kernel(SEEDS, POSITIONS, srandom.SALT_TOKEN, index, dtype)
    assert got.shape == (*POSITIONS.shape, 1500)
    assert torch.equal(got, reference(SEEDS, POSITIONS, srandom.SALT_TOKEN, index, dtype))


def test_an_index_of_its_own_per_position_is_the_torch_ops():
    """A token race's draw: each position's block of counters; one-dimensional positions."""
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 10**6, (5,), generator=gen)
    index = 594 + torch.randint(0, 600, (5, 1), generator=gen) * 256 + torch.arange(256)
    got = kernel(SEEDS[:5], positions, srandom.SALT_TOKEN, index, torch.float64)
    assert torch.equal(got, reference(SEEDS[:5], positions, srandom.SALT_TOKEN, index, torch.float64))


def test_uniform_is_uniform_at_over_an_arange():
    """random.uniform's numbers are uniform_at's over an arange: one definition of a stream, which
    the kernel draws."""
    u = srandom.uniform(SEEDS, POSITIONS, 2, (4, 5), dtype=torch.float64)
    index = torch.arange(20).expand(*POSITIONS.shape, -1)
    assert torch.equal(u.view(*POSITIONS.shape, 20), kernel(SEEDS, POSITIONS, 2, index, torch.float64))


def test_the_race_with_the_kernels_draws_samples_the_same_tokens(monkeypatch):
    """exponential_race as it runs on a GPU (each draw a kernel launch that hashes the key again)
    picks the tokens of the CPU's (the keys hashed once), over a vocabulary of many blocks and a
    partial last one."""
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(6, 3, 3 * srandom.RACE_BLOCK + 17, generator=gen) * 4, -1)
    expected = srandom.exponential_race(probs, SEEDS, POSITIONS)
    monkeypatch.setattr(srandom, "_draws", lambda seeds, positions, salt, dtype:
                        lambda index: kernel(seeds, positions, salt, index, dtype))
    assert torch.equal(srandom.exponential_race(probs, SEEDS, POSITIONS), expected)
