"""Counter-based random numbers: every number is a hash of (seed, position, salt, index).

Sampling must be reproducible per request whatever else shares its batch, so nothing here
keeps state (no torch.Generator): the same key gives the same number on any batch
composition, device or step. The hash is splitmix64's finaliser written with int64 torch
ops, so it runs on any device, never syncs with the host and fuses into one kernel under
torch.compile. Two facts about int64 tensors shape it: multiplication wraps modulo 2**64
(what splitmix64 wants), and `>>` is arithmetic, so logical shifts mask the sign bits away.

Key conventions (who uses which salt):
- `position` is the position of the token being decided (prefix_len + 1 for the token
  sampled after a plain decode step), so a position is decided in exactly one step and
  keys never repeat across steps.
- SALT_TOKEN: drawing a token from a distribution (the plain sampler, the bonus token).
- SALT_ACCEPT: accept/reject tests of speculative verification.
- SALT_DRAFT: drafters that sample their drafts; independent of the verifier's numbers.
"""
from __future__ import annotations

import math

import torch

SALT_TOKEN = 1
SALT_ACCEPT = 2
SALT_DRAFT = 3

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words with full avalanche."""
    x = (x ^ _shr(x, 30)) * _MUL1
    x = (x ^ _shr(x, 27)) * _MUL2
    return x ^ _shr(x, 31)


def _mix_int(x: int) -> int:
    """_mix on a Python int, for constants."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _signed(x ^ (x >> 31))


def _keys(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """One 64-bit key per (seed, position, salt): same shape as positions."""
    seeds = seeds.to(torch.int64).view(-1, *([1] * (positions.dim() - 1)))
    key = _mix(seeds + _GOLDEN)
    key = _mix(key ^ _mix_int(salt + 0x5151))
    # position * odd constant is injective modulo 2**64, and _mix is a bijection
    return _mix(key + positions.to(torch.int64) * _GOLDEN)


def _to_uniform(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Top bits of 64-bit words -> (k + 0.5) / 2**m in (0, 1): m = 23 for float32 (exact, so
    never 0 nor 1), 52 for float64."""
    mantissa = 23 if dtype == torch.float32 else 52
    return (_shr(bits, 64 - mantissa).to(dtype) + 0.5) * (2.0 ** -mantissa)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, salt: int,
            shape_tail: tuple[int, ...] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform numbers in the open interval (0, 1), one per (row, position, tail index).

    seeds: (bs,) int; positions: (bs,) or (bs, n) int. Returns positions.shape + shape_tail,
    float32 (23 random bits) or float64 (52 bits).
    """
    key = _keys(seeds, positions, salt)
    count = math.prod(shape_tail)
    index = torch.arange(1, count + 1, device=positions.device, dtype=torch.int64)
    # the splitmix64 stream of state key * golden: its i-th output is mix((key + i) * golden).
    # (Not key + i * golden: Inductor folds arange * constant into an int32 index expression.)
    bits = _mix((key.unsqueeze(-1) + index) * _GOLDEN)   # positions.shape + (count,)
    return _to_uniform(bits, dtype).view(*positions.shape, *shape_tail)


def uniform_at(seeds: torch.Tensor, positions: torch.Tensor, salt: int, index: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uniform(seeds, positions, salt, (m,))[..., index] for a per-element index (positions'
    shape) without drawing the other m - 1 numbers."""
    key = _keys(seeds, positions, salt)
    return _to_uniform(_mix((key + index.to(torch.int64) + 1) * _GOLDEN), dtype)


def uniform_per_row(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """One float32 uniform in (0, 1) per row: (bs,) (or positions' shape)."""
    return uniform(seeds, positions, salt)


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     salt: int = SALT_TOKEN) -> torch.Tensor:
    """Samples one index per row from `probs` (bs, V), which need not be normalised.

    With E_i ~ Exp(1) independent, E_i / p_i ~ Exp(p_i) and the smallest of independent
    exponentials is index i with probability p_i / sum(p): so argmax(p / E) is a sample.
    E is computed from 52-bit uniforms in float64: the winner of a low-probability token is
    decided by E values close to 0, which 23-bit uniforms would quantise.
    Returns (bs,) int64. Rows of all zeros return index 0.
    """
    u = uniform(seeds, positions, salt, (probs.shape[-1],), dtype=torch.float64)
    exp_noise = (-torch.log(u)).to(torch.float32)       # (bs, V), > 0
    return (probs / exp_noise).argmax(dim=-1)
