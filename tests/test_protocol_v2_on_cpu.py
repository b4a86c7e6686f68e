"""Nested (jagged) position IDs: explicit layouts for 1-D and multi-row (mRoPE, C = 3 / 4) ids.

The before/after case reproduces the upstream failure (VERL #7899): equal-length multi-row ids
packed by `as_nested_tensor` take the row axis for the ragged one, and forcing `_ragged_idx = 2`
makes `unbind` fail with the split_with_sizes error; `fsdp2_ext.positions` recovers both samples.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from tensordict import TensorDict

from fsdp2_ext import positions

ROWS = [None, 3, 4]  # None: 1-D position ids


def sample(rows: int | None, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (length,) if rows is None else (rows, length)
    return torch.randint(0, 10_000, shape, generator=generator)


def batch(rows, lengths):
    return [sample(rows, length, seed) for seed, length in enumerate(lengths)]


LENGTH_CASES = {
    "batch_of_one": [7],
    "equal_lengths": [5, 5, 5],
    "length_equals_rows": [4, 4],
    "distinct_lengths": [3, 9, 1, 6],
}


def assert_same_samples(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape
        assert torch.equal(a, e)


def expected_layout(rows, lengths):
    return (1 if rows is None else 2), sum(lengths)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("case", list(LENGTH_CASES))
def test_list_round_trip_keeps_layout(rows, case):
    lengths = LENGTH_CASES[case]
    samples = batch(rows, lengths)
    nested = positions.nested_from_list(samples)
    ragged_idx, total = expected_layout(rows, lengths)
    values, offsets, stored_idx = positions.parts(nested)
    assert stored_idx == ragged_idx
    assert values.shape == ((total,) if rows is None else (rows, total))
    assert offsets.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert_same_samples(positions.unbind(nested), samples)
    assert_same_samples(list(nested.unbind()), samples)  # torch's own unbind agrees


def padded_batch(rows, lengths, left):
    samples = batch(rows, lengths)
    width = max(lengths) + 2
    shape = (len(lengths), width) if rows is None else (len(lengths), rows, width)
    padded = torch.full(shape, -1, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for b, (s, length) in enumerate(zip(samples, lengths)):
        start = width - length if left else 0
        padded[b, ..., start : start + length] = s
        mask[b, start : start + length] = 1
    return samples, padded, mask


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("left", [False, True])
def test_padded_round_trip(rows, case, left):
    lengths = LENGTH_CASES[case]
    samples, padded, mask = padded_batch(rows, lengths, left)
    nested = positions.nested_from_padded(padded, mask)
    assert_same_samples(positions.unbind(nested), samples)
    back = positions.to_padded(nested, -1, max_len=padded.shape[-1], left=left)
    assert torch.equal(back, padded)
    if rows is not None:  # the row count comes from the tensor: torch's padding agrees
        theirs = torch.nested.to_padded_tensor(nested, -1, output_size=tuple(padded.shape))
        if not left:
            assert torch.equal(theirs, padded)


@pytest.mark.parametrize("rows", ROWS)
def test_chunk_concat_index_select_keep_layout(rows):
    samples = batch(rows, [5, 5, 5, 5, 2])
    nested = positions.nested_from_list(samples)
    chunks = positions.chunk(nested, 2)
    assert [len(positions.unbind(c)) for c in chunks] == [3, 2]
    for c in chunks:
        assert positions.parts(c)[2] == positions.parts(nested)[2]
    assert_same_samples(positions.unbind(positions.concat(chunks)), samples)
    picked = positions.index_select(nested, [3, 0, -1])
    assert_same_samples(positions.unbind(picked), [samples[3], samples[0], samples[4]])
    assert positions.parts(picked)[2] == positions.parts(nested)[2]


@pytest.mark.parametrize("rows", ROWS)
def test_pickle_and_tensordict_consolidate_round_trips(rows):
    samples = batch(rows, [6, 6])
    nested = positions.nested_from_list(samples)
    for restored in (
        pickle.loads(pickle.dumps(nested)),
        pickle.loads(
            pickle.dumps(TensorDict({"position_ids": nested}, batch_size=[2]).consolidate())
        )["position_ids"],
        positions.deserialize(pickle.loads(pickle.dumps(positions.serialize(nested)))),
    ):
        for a, b in zip(positions.parts(restored), positions.parts(nested)):
            assert (a == b) if isinstance(a, int) else torch.equal(a, b)
        assert_same_samples(positions.unbind(restored), samples)


@pytest.mark.parametrize("rows", [3, 4])
def test_coordinate_packed_is_repaired(rows):
    samples = batch(rows, [5, 5])
    inferred = torch.nested.as_nested_tensor(samples, layout=torch.jagged)  # ragged@1, (B*C, L)
    assert inferred._ragged_idx == 1 and inferred.values().shape == (2 * rows, 5)
    fixed, action = positions.repair(inferred, rows=rows)
    assert action == "coordinate-packed"
    assert_same_samples(positions.unbind(fixed), samples)


@pytest.mark.parametrize("rows", [3, 4])
def test_label_reset_is_repaired(rows):
    samples = batch(rows, [3, 7])
    good = positions.nested_from_list(samples)
    values, offsets, _ = positions.parts(good)
    broken = torch.nested.nested_tensor_from_jagged(values, offsets, jagged_dim=2)
    broken._ragged_idx = 1  # what a lossy (de)serialiser leaves behind
    fixed, action = positions.repair(broken, rows=rows)
    assert action == "label-reset"
    assert_same_samples(positions.unbind(fixed), samples)


def test_single_square_sample_with_known_rows_is_recovered():
    # B = 1, L == C: coordinate-packed (1 sample (4, 4)) and label-reset read the same bytes, so
    # with C known there is nothing to choose (VERL's own code gets this case right).
    inferred = torch.nested.as_nested_tensor([sample(4, 4, 0)], layout=torch.jagged)
    fixed, action = positions.repair(inferred, rows=4)
    assert action and fixed._ragged_idx == 2
    assert_same_samples(positions.unbind(fixed), [sample(4, 4, 0)])


def test_ambiguous_layout_without_rows_is_rejected_with_both_readings():
    # b * C == L: two (3, 6) samples packed along dim 0 look like 6 rows of two length-3 samples.
    inferred = torch.nested.as_nested_tensor(
        [sample(3, 6, 0), sample(3, 6, 1)], layout=torch.jagged
    )
    with pytest.raises(ValueError, match="ambiguous") as error:
        positions.repair(inferred)
    assert "rows" in str(error.value)


def test_canonical_layout_needs_no_repair():
    nested = positions.nested_from_list(batch(4, [4]))
    fixed, action = positions.repair(nested, rows=4)
    assert action == "" and fixed is nested


@pytest.mark.parametrize("rows", [3, 4])
def test_shape_inference_takes_the_row_axis_for_equal_lengths(rows):
    samples = [torch.arange(rows * 204).view(rows, 204) for _ in range(2)]
    nested = torch.nested.as_nested_tensor(samples, layout=torch.jagged)
    assert nested._ragged_idx == 1  # the row axis, not the sequence axis
    assert nested.values().shape == (2 * rows, 204)
    assert nested.offsets().tolist() == [0, rows, 2 * rows]


def test_before_after_equal_length_samples():
    samples = [sample(4, 204, 0), sample(4, 204, 1)]
    # Before: shape inference, then the blind `_ragged_idx = 2` fix-up.
    before = torch.nested.as_nested_tensor(samples, layout=torch.jagged)
    before._ragged_idx = 2
    with pytest.raises(
        RuntimeError, match="split_with_sizes expects split_sizes to sum exactly to 204"
    ):
        before.unbind()
    # After: the explicit layout recovers both samples exactly.
    after = positions.nested_from_list(samples)
    assert_same_samples(positions.unbind(after), samples)
    assert_same_samples(list(after.unbind()), samples)


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([0, 5, 3], "non-decreasing"),
        ([1, 3, 7], "start at 0"),
        ([0, 3, 6], "end at 6"),
    ],
)
def test_malformed_offsets_are_named(offsets, message):
    state = {"values": torch.zeros(3, 7), "offsets": torch.tensor(offsets), "ragged_idx": 2}
    with pytest.raises(ValueError, match=message):
        positions.deserialize(state)


@pytest.mark.parametrize("rows", ROWS)
def test_mask_with_holes_keeps_real_positions_in_order(rows):
    samples, padded, mask = padded_batch(rows, [6, 4], left=False)
    mask[0, 2] = 0  # a hole: not left/right padding, the general path
    nested = positions.nested_from_padded(padded, mask)
    expected0 = torch.cat([samples[0][..., :2], samples[0][..., 3:]], dim=-1)
    assert_same_samples(positions.unbind(nested), [expected0, samples[1]])


def test_index_select_on_a_ragged_dim_0_tensor():
    # Samples (L_i, D) ragged on their first dim (jagged_dim=1): selection keeps that layout.
    samples = [torch.arange(3 * 2).view(3, 2), torch.arange(5 * 2).view(5, 2) + 100]
    nested = torch.nested.nested_tensor_from_jagged(torch.cat(samples), torch.tensor([0, 3, 8]))
    picked = positions.index_select(nested, [1, 0])
    assert_same_samples(positions.unbind(picked), [samples[1], samples[0]])


def test_square_ragged_dim_1_without_rows_is_ambiguous():
    nested = torch.nested.nested_tensor_from_jagged(torch.zeros(4, 4), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="ambiguous"):
        positions.repair(nested)
