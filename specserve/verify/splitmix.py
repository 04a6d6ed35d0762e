"""splitmix64's finaliser, its constants and the same hash on Python ints: what random.py runs as
int64 torch ops and random_kernels.py as one Triton kernel (the two must give the same words)."""
from __future__ import annotations

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15   # the stream's increment (2**64 / golden ratio, odd)
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
SHIFTS = (30, 27, 31)          # mix(x): x ^= x >> 30; x *= MUL1; x ^= x >> 27; x *= MUL2; x ^= x >> 31
SALT_OFFSET = 0x5151           # a salt enters the key as mix(salt + SALT_OFFSET)
# random bits a uniform keeps: the top m bits k of a word give (k + 0.5) / 2**m, exact in the float
FLOAT32_BITS, FLOAT64_BITS = 23, 52


def signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix_int(x: int) -> int:
    """The finaliser on a Python int (unsigned 64-bit result), for constants."""
    x &= MASK64
    x = ((x ^ (x >> SHIFTS[0])) * MUL1) & MASK64
    x = ((x ^ (x >> SHIFTS[1])) * MUL2) & MASK64
    return x ^ (x >> SHIFTS[2])


def salt_word(salt: int) -> int:
    """What a salt contributes to a key: mix(salt + SALT_OFFSET), unsigned."""
    return mix_int(salt + SALT_OFFSET)
