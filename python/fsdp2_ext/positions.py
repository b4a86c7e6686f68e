"""Jagged position IDs with an explicit layout, as real ``torch.nested`` jagged tensors.

Every builder sets ``(values, offsets, ragged_idx)`` itself (C++, [Note: jagged layout] in
``include/fsdp2_ext/jagged_positions.h``); nothing is inferred from component shapes, so equal
lengths, a batch of one and L == C come back exactly. Works for 1-D ids and any number of rows C.

    nt = nested_from_padded(position_ids, attention_mask)   # (B, C, L) or (B, L) + (B, L) mask
    samples = unbind(nt)                                    # [(C, L_i)]
    padded = to_padded(nt, max_len=L)                       # (B, C, L)
    nt, action = repair(bad_nt, rows=C)                     # "", "coordinate-packed", "label-reset"
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fsdp2_ext import _fsdp2_ext

__all__ = [
    "chunk",
    "concat",
    "deserialize",
    "index_select",
    "nested_from_list",
    "nested_from_padded",
    "parts",
    "repair",
    "serialize",
    "to_padded",
    "unbind",
    "validate",
]


def _nested(positions: _fsdp2_ext.JaggedPositions) -> torch.Tensor:
    # max_seqlen is passed so to_padded_tensor never has to guess (pytorch #159380).
    values, offsets = positions.values, positions.offsets
    lengths = offsets.diff()
    return torch.nested.nested_tensor_from_jagged(
        values,
        offsets,
        jagged_dim=positions.ragged_idx,
        max_seqlen=int(lengths.max()) if lengths.numel() else 0,
    )


def parts(nested: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(values, offsets, ragged_idx)`` of a jagged tensor, exactly as stored (not re-inferred)."""
    if not getattr(nested, "is_nested", False) or nested.layout != torch.jagged:
        raise ValueError("expected a torch.nested tensor with layout=torch.jagged")
    if nested._lengths is not None:
        raise ValueError(
            "jagged tensor has holes (_lengths is set, e.g. after narrow); call .contiguous() first"
        )
    return nested._values, nested._offsets, int(nested._ragged_idx)


def _positions(nested: torch.Tensor) -> _fsdp2_ext.JaggedPositions:
    return _fsdp2_ext.JaggedPositions(*parts(nested))


def nested_from_list(samples: Sequence[torch.Tensor]) -> torch.Tensor:
    """Samples ``(*rows, L_i)`` -> jagged tensor ragged on the last dim (``ragged_idx = dim``)."""
    return _nested(_fsdp2_ext.JaggedPositions.from_list(list(samples)))


def nested_from_padded(padded: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``(B, L)`` or ``(B, *rows, L)`` plus a ``(B, L)`` mask (left or right padding)."""
    return _nested(_fsdp2_ext.JaggedPositions.from_padded(padded, attention_mask))


def validate(nested: torch.Tensor) -> None:
    """Raises ValueError naming the broken invariant (offsets, ragged_idx, packed length)."""
    _positions(nested).validate()


def unbind(nested: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample views ``(*rows, L_i)``, split on the stored ragged axis."""
    return _positions(nested).split()


def to_padded(
    nested: torch.Tensor,
    padding_value: float = 0,
    *,
    max_len: int | None = None,
    left: bool = False,
) -> torch.Tensor:
    """``(B, *rows, max_len)``; the row count is read from the tensor, never assumed."""
    return _positions(nested).to_padded(float(padding_value), max_len, left)


def chunk(nested: torch.Tensor, chunks: int) -> list[torch.Tensor]:
    return [_nested(p) for p in _positions(nested).chunk(chunks)]


def index_select(nested: torch.Tensor, indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
    indices = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
    return _nested(_positions(nested).index_select(indices))


def concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return _nested(_fsdp2_ext.JaggedPositions.concat([_positions(t) for t in tensors]))


def repair(nested: torch.Tensor, *, rows: int | None = None) -> tuple[torch.Tensor, str]:
    """Validates; rebuilds a coordinate-packed or label-reset tensor when exactly one reading fits.

    ``rows``: the expected number of position rows C (0 for 1-D ids), when known. Returns the
    canonical tensor and what was done ("" if nothing). Ambiguous layouts raise ValueError naming
    both readings.
    """
    values, offsets, ragged_idx = nested._values, nested._offsets, int(nested._ragged_idx)
    repaired = _fsdp2_ext.repair_jagged(values, offsets, ragged_idx, rows)
    return (nested if not repaired.action else _nested(repaired.positions)), repaired.action


def serialize(nested: torch.Tensor) -> dict:
    """A plain dict that records the layout explicitly (safe through any pickler)."""
    values, offsets, ragged_idx = parts(nested)
    return {"values": values, "offsets": offsets, "ragged_idx": ragged_idx}


def deserialize(state: dict) -> torch.Tensor:
    """The inverse of ``serialize``; a missing or mistyped field raises ValueError naming it."""
    missing = [k for k in ("values", "offsets", "ragged_idx") if k not in state]
    if missing:
        raise ValueError(
            f"deserialize: the state lacks {missing}; it needs values, offsets and ragged_idx "
            "(as written by fsdp2_ext.positions.serialize)"
        )
    if not isinstance(state["ragged_idx"], int) or isinstance(state["ragged_idx"], bool):
        raise ValueError(f"deserialize: ragged_idx must be an int, got {state['ragged_idx']!r}")
    positions = _fsdp2_ext.JaggedPositions(
        state["values"], state["offsets"], int(state["ragged_idx"])
    )
    positions.validate()
    return _nested(positions)
