"""Counter-based random numbers: every number is a hash of (seed, position, salt, index).

Sampling must be reproducible per request whatever else shares its batch, so nothing here
keeps state (no torch.Generator): the same key gives the same number on any batch
composition, device or step. The hash is splitmix64's finaliser (splitmix.py) written with
int64 torch ops, so it runs on any device and never syncs with the host; on a GPU one Triton
kernel computes the same numbers (random_kernels.py), where the torch ops would be ~55
launches a draw. Two facts about int64 tensors shape the torch version: multiplication wraps
modulo 2**64 (what splitmix64 wants), and `>>` is arithmetic, so logical shifts mask the
sign bits away.

Key conventions (who uses which salt):
- `position` is the position of the token being decided (prefix_len + 1 for the token
  sampled after a plain decode step), so a position is decided in exactly one step and
  keys never repeat across steps.
- SALT_TOKEN: the token sampled at a position (`exponential_race`): the plain sampler, the
  coupled verifier at every tree node (so both decide a position with the same numbers),
  the bonus token of residual rejection.
- SALT_ACCEPT: accept/reject tests of residual-rejection verification.
- SALT_DRAFT: drafters that sample their drafts; independent of the verifier's numbers.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from specserve.verify.splitmix import FLOAT32_BITS, FLOAT64_BITS, GOLDEN, MUL1, MUL2, SHIFTS, salt_word, signed

SALT_TOKEN = 1
SALT_ACCEPT = 2
SALT_DRAFT = 3

_GOLDEN = signed(GOLDEN)
_MUL1 = signed(MUL1)
_MUL2 = signed(MUL2)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (splitmix.py): a bijection of 64-bit words with full avalanche."""
    x = (x ^ _shr(x, SHIFTS[0])) * _MUL1
    x = (x ^ _shr(x, SHIFTS[1])) * _MUL2
    return x ^ _shr(x, SHIFTS[2])


def _keys(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """One 64-bit key per (seed, position, salt): same shape as positions."""
    seeds = seeds.to(torch.int64).view(-1, *([1] * (positions.dim() - 1)))
    key = _mix(seeds + _GOLDEN)
    key = _mix(key ^ signed(salt_word(salt)))
    # position * odd constant is injective modulo 2**64, and _mix is a bijection
    return _mix(key + positions.to(torch.int64) * _GOLDEN)


def _to_uniform(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Top bits of 64-bit words -> (k + 0.5) / 2**m in (0, 1): m = 23 for float32 (exact, so
    never 0 nor 1), 52 for float64."""
    mantissa = FLOAT32_BITS if dtype == torch.float32 else FLOAT64_BITS
    return (_shr(bits, 64 - mantissa).to(dtype) + 0.5) * (2.0 ** -mantissa)


def _stream(key: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The index-th uniform of the splitmix64 stream of each key: the stream of state
    key * golden, whose i-th output is mix((key + i + 1) * golden). (Not key + i * golden:
    Inductor folds arange * constant into an int32 index expression.) key and index broadcast."""
    return _to_uniform(_mix((key + index.to(torch.int64) + 1) * _GOLDEN), dtype)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, salt: int,
            shape_tail: tuple[int, ...] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform numbers in the open interval (0, 1), one per (row, position, tail index).

    seeds: (bs,) int; positions: (bs,) or (bs, n) int. Returns positions.shape + shape_tail,
    float32 (23 random bits) or float64 (52 bits).
    """
    index = torch.arange(math.prod(shape_tail), device=positions.device, dtype=torch.int64)
    return uniform_at(seeds, positions, salt, index.expand(*positions.shape, -1), dtype).view(
        *positions.shape, *shape_tail)


def uniform_at(seeds: torch.Tensor, positions: torch.Tensor, salt: int, index: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uniform(seeds, positions, salt, (m,))[..., index] without drawing the other numbers.

    index: positions' shape (one number per position), or positions.shape + (k,) (k numbers
    per position; leading dimensions may broadcast). On a GPU one Triton kernel computes the
    same numbers (random_kernels.py), where the torch ops below are ~55 launches."""
    return _draws(seeds, positions, salt, dtype)(index)


def _draws(seeds: torch.Tensor, positions: torch.Tensor, salt: int,
           dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """index -> uniform_at(seeds, positions, salt, index, dtype), for several draws with one key
    per position: on a GPU a kernel a draw (it hashes the key again, in registers), elsewhere
    the keys hashed once for every draw."""
    if positions.is_cuda:
        from specserve.verify import random_kernels   # lazily: CPU-only installs never import Triton
        return lambda index: random_kernels.uniform_at(seeds, positions, salt_word(salt), index, dtype)
    key = _keys(seeds, positions, salt)
    return lambda index: _stream(key.unsqueeze(-1) if index.dim() > key.dim() else key, index, dtype)


# Tokens per block of the two-level race. Part of the sampling rule: changing it changes
# which token a seed gives (like changing the hash), never the distribution.
RACE_BLOCK = 256


def _race(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """argmax(w / E) with E = -log(u) ~ Exp(1): index i wins with probability w_i / sum(w).

    E_i / w_i ~ Exp(w_i), and the smallest of independent exponentials is index i with
    probability w_i / sum(w) (the Gumbel-max trick: log w - log E = log w + Gumbel).
    E is computed from 52-bit uniforms in float64: a low-probability index wins on E values
    close to 0, which 23-bit uniforms would quantise. Ties: the lowest index."""
    exp_noise = (-torch.log(u)).to(torch.float32)
    return (weights / exp_noise).argmax(dim=-1)


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                     salt: int = SALT_TOKEN) -> torch.Tensor:
    """Samples one index per row from `probs` (positions.shape + (V,)), which need not be
    normalised: a deterministic function of (seed, position, probs), so a token decided at
    a position is the same in a plain step and at any node of a draft tree.

    A two-level race over blocks of RACE_BLOCK tokens: first the block b, from a race with
    weights mass(b) = sum of its probs; then the token, from a race inside b. With E_t ~
    Exp(1) per token, the block whose min_t E_t / p_t is smallest is b with probability
    mass(b) / sum(mass), its min is ~ Exp(mass(b)) whatever token attains it, and that token
    is t with probability p_t / mass(b), independently. So drawing the block's clock
    directly from Exp(mass(b)), then the token inside the winner, has the law of the flat
    race over the vocabulary, p_t / sum(p): V / 256 + 256 random numbers per row instead of
    V. Counters: index b for block b's clock, num_blocks + t for token t's.
    Returns positions' shape, int64. Rows of all zeros return index 0.
    """
    vocab = probs.shape[-1]
    num_blocks = -(-vocab // RACE_BLOCK)
    full = vocab // RACE_BLOCK
    mass = probs[..., :full * RACE_BLOCK].unflatten(-1, (full, RACE_BLOCK)).sum(dim=-1)   # (..., full)
    if full < num_blocks:                          # the last, partial block
        mass = torch.cat([mass, probs[..., full * RACE_BLOCK:].sum(dim=-1, keepdim=True)], dim=-1)
    draw = _draws(seeds, positions, salt, torch.float64)   # both races' numbers from one key per position
    block_index = torch.arange(num_blocks, device=probs.device)
    block = _race(mass, draw(block_index.expand(*positions.shape, -1)))
    width = min(RACE_BLOCK, vocab)
    tokens = block.unsqueeze(-1) * RACE_BLOCK + torch.arange(width, device=probs.device)   # (..., width)
    in_vocab = tokens < vocab
    members = torch.where(in_vocab, probs.gather(-1, tokens.clamp(max=vocab - 1)), 0.0)
    member = _race(members, draw(num_blocks + tokens))
    return tokens.gather(-1, member.unsqueeze(-1)).squeeze(-1)
