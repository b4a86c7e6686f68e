"""Bad inputs to fsdp2_ext.positions: a ValueError naming the field, never an overflow, an
IndexError from deep inside, or a NaN taken for a value."""

from __future__ import annotations

import pytest
import torch

from fsdp2_ext import _fsdp2_ext, positions


def test_chunk_with_a_huge_count_does_not_overflow():
    nested = positions.nested_from_list([torch.arange(3), torch.arange(2)])
    pieces = positions.chunk(nested, 2**63 - 1)  # was: batch + chunks - 1 overflowed, offs[-1] read
    assert [p.size(0) for p in pieces] == [1, 1]
    assert torch.equal(positions.unbind(pieces[1])[0], torch.arange(2))


def test_from_padded_with_no_positions_gives_empty_samples():
    for padded in (torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, 3, 0, dtype=torch.long)):
        nested = positions.nested_from_padded(padded, torch.zeros(2, 0, dtype=torch.long))
        samples = positions.unbind(nested)
        assert [s.shape[-1] for s in samples] == [0, 0]
        assert samples[0].shape[:-1] == padded.shape[1:-1]


@pytest.mark.parametrize("bad", [float("nan"), 2.0, -1.0])
def test_a_mask_value_other_than_0_or_1_is_refused(bad):
    mask = torch.tensor([[1.0, 1.0, bad]])
    with pytest.raises(ValueError, match="only 0 and 1"):
        positions.nested_from_padded(torch.arange(3).view(1, 3), mask)


def test_float_offsets_are_refused_by_repair_as_by_validate():
    values = torch.arange(6).view(2, 3)
    offsets = torch.tensor([0.0, 3.0])
    with pytest.raises(ValueError, match="offsets must be int64 or int32, got Float"):
        _fsdp2_ext.JaggedPositions(values, offsets, 2).validate()
    with pytest.raises(ValueError, match="offsets must be int64 or int32, got Float"):
        _fsdp2_ext.repair_jagged(values, offsets, 1, 2)


def test_nan_offsets_are_named_as_a_dtype_problem_not_printed_as_a_huge_integer():
    with pytest.raises(ValueError) as caught:
        _fsdp2_ext.repair_jagged(torch.arange(4), torch.tensor([0.0, float("nan")]), 1, 0)
    assert "-9223372036854775808" not in str(caught.value)
    assert "int64 or int32" in str(caught.value)


def test_deserialize_names_a_missing_field():
    state = positions.serialize(positions.nested_from_list([torch.arange(3)]))
    del state["ragged_idx"]
    with pytest.raises(ValueError, match=r"lacks \['ragged_idx'\]"):
        positions.deserialize(state)
    with pytest.raises(ValueError, match="ragged_idx must be an int"):
        positions.deserialize({**state, "ragged_idx": "1"})
