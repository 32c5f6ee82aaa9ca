"""Counter-based probe streams: sparse Rademacher directions regenerated from their key.

A probe is never stored. Row ``j`` of an update's probe matrix is a pure function of the key
``(seed, expert, update, batch, direction_j)`` and of the coordinate index, computed with integer
arithmetic that every device performs exactly, so CPU and CUDA (and every rank) produce the same
bits and a resumed run draws the probes the uninterrupted run would have drawn.

The hash
--------
1. The key (a tuple of ints) is absorbed into two 32-bit words ``(k0, k1)`` in plain Python: each
   element is written as 64-bit two's complement (so any int in [-2^63, 2^64) is accepted and
   ``-1`` reads as ``2^64 - 1``), split into two 32-bit limbs, and every limb goes through
   ``h = mix32(h ^ limb) + GOLDEN`` on one lane and ``h' = mix32(h' + limb) ^ h`` on the other.
   The key length is absorbed first, so ``(1, 2)`` and ``(1, 2, 0)`` differ.
2. Coordinate ``i`` (``0 <= i < 2^32``) gets ``mix32(mix32(mix32(i ^ k0) + k1) ^ k0)`` (``+``
   modulo 2^32). For a fixed key this is a bijection of 32-bit words, so distinct coordinates
   never share their bits.

``mix32`` is the "lowbias32" finaliser (xor-shift / multiply / xor-shift / multiply / xor-shift).
Its multipliers are 32-bit, so a product of two 32-bit words would overflow int64; it is computed
modulo 2^32 from two 16-bit halves of the constant, which keeps every intermediate below 2^49 on
int64 tensors (no signed overflow anywhere, hence no device-specific behaviour).

The distribution
----------------
Gains (normalisation weights) get ``±1`` with probability ½ each (bit 0 = sign). Every other
coordinate is 0 with probability ½ (bit 1 clear) and ``±1`` with probability ¼ each (bit 0 = sign),
so ``E[z_j^2] = q_j`` is 1 for gains and ½ otherwise (:func:`second_moments`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


def _mul32_py(x: int, c: int) -> int:
    return (x * c) & MASK32


def _mix32_py(x: int) -> int:
    """lowbias32 on a Python int in [0, 2^32)."""
    x ^= x >> 16
    x = _mul32_py(x, _M1)
    x ^= x >> 15
    x = _mul32_py(x, _M2)
    x ^= x >> 16
    return x


def key_words(key: Sequence[int]) -> tuple[int, int]:
    """The two 32-bit words ``(k0, k1)`` a key is absorbed into (pure Python, see module doc)."""
    limbs = [len(key) & MASK32]
    for element in key:
        value = int(element)
        if not -(2**63) <= value < 2**64:
            raise ValueError(f"probe key element {value} does not fit in 64 bits")
        value &= 2**64 - 1
        limbs += [value & MASK32, value >> 32]
    h0, h1 = 0x243F6A88, 0x85A308D3  # arbitrary nonzero starting words (digits of π)
    for limb in limbs:
        h0 = (_mix32_py(h0 ^ limb) + _GOLDEN) & MASK32
        h1 = _mix32_py((h1 + limb) & MASK32) ^ h0
    return _mix32_py(h0), _mix32_py(h1 ^ h0)


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """In place: ``x * c mod 2^32`` for int64 ``x`` in [0, 2^32) and a 32-bit constant ``c``,
    with every intermediate below 2^49: x·c = x·c_lo + 2^16·x·c_hi, and only the low 16 bits of
    x·c_hi survive the shift."""
    hi = x * (c >> 16)
    hi &= 0xFFFF
    hi <<= 16
    x *= c & 0xFFFF
    x += hi
    x &= MASK32
    return x


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place: lowbias32 of int64 ``x`` in [0, 2^32)."""
    x ^= x >> 16
    _mul32_(x, _M1)
    x ^= x >> 15
    _mul32_(x, _M2)
    x ^= x >> 16
    return x


def _coordinate_bits(k0: torch.Tensor, k1: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The per-coordinate hash; ``k0``, ``k1`` broadcast against ``idx`` (all int64)."""
    x = _mix32_(idx ^ k0)  # a fresh tensor, so the rounds can work in place
    x += k1
    x &= MASK32
    _mix32_(x)
    x ^= k0
    return _mix32_(x)


def _check_n(n: int) -> None:
    if not 0 <= n <= 2**32:
        raise ValueError(f"a probe stream has at most 2^32 coordinates, asked for {n}")


def _rademacher_from_bits(
    bits: torch.Tensor, gain_mask: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    sign = 1 - 2 * (bits & 1)  # bit 0: +1 / -1
    keep = ((bits >> 1) & 1) | gain_mask.to(torch.int64)  # bit 1: nonzero (gains always)
    return (sign * keep).to(dtype)


def probe_rows(
    keys: Sequence[Sequence[int]], gain_mask: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(len(keys), n) probes in {-1, 0, +1}, row ``i`` the probe of key ``keys[i]`` at
    coordinates ``0..n-1`` (``n = gain_mask.numel()``), on ``gain_mask``'s device: where
    ``gain_mask`` is true ±1 with probability ½ each, elsewhere 0 with probability ½ and ±1 with
    ¼. All rows are hashed in one broadcast pass (no Python loop over rows or coordinates);
    identical on every device (integer arithmetic only, no intermediate reaches 2^63)."""
    n = gain_mask.numel()
    _check_n(n)
    device = gain_mask.device
    if not keys:
        return torch.empty(0, n, dtype=dtype, device=device)
    words = torch.tensor([key_words(key) for key in keys], dtype=torch.int64, device=device)
    idx = torch.arange(n, dtype=torch.int64, device=device)
    bits = _coordinate_bits(words[:, :1], words[:, 1:], idx[None, :])
    return _rademacher_from_bits(bits, gain_mask.reshape(1, -1), dtype)


def probe_matrix(
    seed: int,
    expert: int,
    update: int,
    batch: int,
    directions: Sequence[int],
    gain_mask: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(len(directions), n) probes of one update; row ``j`` is the probe of key
    ``(seed, expert, update, batch, directions[j])`` (:func:`probe_rows`)."""
    keys = [(seed, expert, update, batch, d) for d in directions]
    return probe_rows(keys, gain_mask, dtype=dtype)


def second_moments(gain_mask: torch.Tensor, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(n,) ``q_j = E[z_j^2]``: 1.0 for gains, 0.5 for every other coordinate."""
    return torch.where(gain_mask.reshape(-1), 1.0, 0.5).to(dtype)
