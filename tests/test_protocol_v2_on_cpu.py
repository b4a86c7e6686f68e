"""Nested (jagged) position IDs: the shape-inferring path that the spec's fix replaces.

This file reproduces the upstream failure (VERL #7899): equal-length multi-row position IDs are
packed by `as_nested_tensor` with the row axis taken for the ragged one, and forcing
`_ragged_idx = 2` afterwards makes `unbind` fail with the split_with_sizes error.
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("rows", [3, 4])
def test_shape_inference_takes_the_row_axis_for_equal_lengths(rows):
    samples = [torch.arange(rows * 204).view(rows, 204) for _ in range(2)]
    nested = torch.nested.as_nested_tensor(samples, layout=torch.jagged)
    assert nested._ragged_idx == 1  # the row axis, not the sequence axis
    assert nested.values().shape == (2 * rows, 204)
    assert nested.offsets().tolist() == [0, rows, 2 * rows]


def test_forcing_ragged_idx_reproduces_the_split_with_sizes_error():
    nested = torch.nested.as_nested_tensor([torch.zeros(4, 204)], layout=torch.jagged)
    nested._ragged_idx = 2  # what maybe_fix_3d_position_ids does
    with pytest.raises(
        RuntimeError, match="split_with_sizes expects split_sizes to sum exactly to 204"
    ):
        nested.unbind()
