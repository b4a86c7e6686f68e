"""Exact, order-sensitive fingerprints of tensors, computed alike on a trainer rank and in a vLLM
worker (CPU or GPU), so that two processes can prove they hold the same bytes without moving them.

[Note: a tensor's fingerprint]
A tensor's bytes are read as 16-bit words (bytes for a 1-byte dtype), each widened to int64; its
fingerprint is ``(dtype, shape, sum(w_i), sum(((i mod P) + 1) * w_i))``, both sums modulo 2**64,
with P = 1048573 (a prime). Integer sums are exact and do not depend on the order a device reduces
in, so the same bytes give the same fingerprint on every device and every torch, bit for bit (no
float rounding anywhere); no product or chunk sum can overflow int64 (|w| <= 2**15, weights <=
2**20, chunks of 2**24 words: under 2**59), so nothing relies on wrapping arithmetic. The plain
sum changes with any single word; the position-weighted sum changes when words move (a transposed
or shifted tensor, a slice taken at the wrong offset), which the plain sum cannot see. It is a
check against accidents (a stale slot, a wrong slice, a lost or garbled key), not against an
adversary. Cost: one pass over the words in chunks (two int64 temporaries of 128 MiB at most),
on the tensor's own device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

__all__ = ["digest", "fingerprint", "fingerprints"]

_CHUNK = 1 << 24
_PERIOD = 1048573
_MASK = (1 << 64) - 1


def fingerprint(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype, shape, word sum, position-weighted word sum)`` ([Note: a tensor's fingerprint])."""
    flat = tensor.detach().contiguous().reshape(-1)
    words = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16)
    total = weighted = 0
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        positions = torch.arange(start, start + chunk.numel(), dtype=torch.int64,
                                 device=chunk.device) % _PERIOD + 1  # fmt: skip
        total += int(chunk.sum())
        weighted += int((chunk * positions).sum())
    return (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), total & _MASK,
            weighted & _MASK)  # fmt: skip


def fingerprints(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict:
    """``{name: fingerprint}`` of named tensors."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return {name: fingerprint(tensor) for name, tensor in items}


def digest(prints: Mapping[str, tuple]) -> int:
    """One order-sensitive number for a ``{name: fingerprint}`` in name order (for a log line)."""
    blake = hashlib.blake2b(digest_size=8)
    for name in sorted(prints):
        blake.update(repr((name, tuple(prints[name]))).encode())
    return int.from_bytes(blake.digest(), "little")
