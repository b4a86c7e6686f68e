"""Nested position IDs in VERL: built with an explicit layout, repaired with a witness.

[Note: VERL position IDs]
VERL's multi-row (mRoPE) position IDs are ``(C, L_i)`` per sample, C = 3 or 4, held as a jagged
tensor ragged on the last dim (``_ragged_idx = 2``, values ``(C, sum L_i)``). VERL builds them with
``torch.nested.as_nested_tensor`` (``left_right_2_no_padding``, ``deserialize_tensordict``), which
infers the ragged dim from the shapes and, for equal lengths or one sample, packs the C axis
instead (ragged@1, values ``(B*C, L)``); VERL's ``maybe_fix_3d_position_ids`` then sets
``_ragged_idx = 2`` on that tensor and the next ``unbind`` or ``index_select`` fails. So:

1. where VERL builds them, we build the same samples with ``nested_from_padded`` /
   ``nested_from_list``: nothing is inferred (``left_right_2_no_padding``,
   ``deserialize_tensordict``);
2. a tensor that still arrives ragged@1 (built by a process without the shim) is repaired, not
   relabelled: the batch's own ``input_ids`` (jagged, offsets = sequence lengths) says which reading
   it is, so C never has to be guessed. For one sample with L == C both readings are the same
   sample. Without a witness an ambiguous tensor is an error naming both readings.
"""

from __future__ import annotations

import torch

from fsdp2_ext import positions
from fsdp2_ext.verl.targets import PADDING, PROTOCOL, TENSORDICT_UTILS, original, replaces


def _is_multi_row(ids) -> bool:
    return isinstance(ids, torch.Tensor) and getattr(ids, "is_nested", False) and ids.dim() == 3


def rows_from_witness(ids: torch.Tensor, input_ids) -> int | None:
    """C for a ragged@1 ``ids``, read off the sequence lengths that ``input_ids`` carries."""
    if not (isinstance(input_ids, torch.Tensor) and getattr(input_ids, "is_nested", False)):
        return None
    if input_ids._lengths is not None:
        return None
    lengths = input_ids._offsets.diff().tolist()
    values, offsets = ids._values, ids._offsets.tolist()
    batch = len(lengths)
    if values.dim() != 2 or len(offsets) != batch + 1 or batch == 0:
        return None
    if offsets == input_ids._offsets.tolist() and values.size(1) == sum(lengths):
        return int(values.size(0))  # label-reset: values (C, sum L), offsets over the sequence
    rows, remainder = divmod(values.size(0), batch)
    if (
        remainder == 0
        and all(length == values.size(1) for length in lengths)
        and offsets == [b * rows for b in range(batch + 1)]
    ):
        return int(rows)  # coordinate-packed: values (B*C, L)
    return None


@replaces(TENSORDICT_UTILS, "maybe_fix_3d_position_ids")
def maybe_fix_3d_position_ids(data) -> None:
    """VERL's hook, made a validating repair; see [Note: VERL position IDs]."""
    if "position_ids" not in data.keys():  # noqa: SIM118 (TensorDict refuses `in`)
        return
    ids = data["position_ids"]
    if not _is_multi_row(ids) or int(ids._ragged_idx) == 2:
        if _is_multi_row(ids):
            positions.validate(ids)
        return
    has_witness = "input_ids" in data.keys()  # noqa: SIM118 (TensorDict refuses `in`)
    input_ids = data["input_ids"] if has_witness else None
    fixed, action = positions.repair(ids, rows=rows_from_witness(ids, input_ids))
    if action:
        data["position_ids"] = fixed


@replaces(PADDING, "left_right_2_no_padding")
def left_right_2_no_padding(data):
    """VERL's conversion, with multi-row position IDs nested from the padded ones explicitly."""
    has_ids = "position_ids" in data.keys()  # noqa: SIM118 (TensorDict refuses `in`)
    padded = data["position_ids"] if has_ids else None
    explicit = None
    if isinstance(padded, torch.Tensor) and not padded.is_nested and padded.dim() == 3:
        explicit = positions.nested_from_padded(padded, data["attention_mask"])
    data = original(PADDING, "left_right_2_no_padding")(data)
    if explicit is not None:
        data["position_ids"] = explicit
    return data


@replaces(PROTOCOL, "deserialize_tensordict")
def deserialize_tensordict(arr):
    """VERL's deserialiser; multi-row position IDs are re-nested from their samples explicitly."""
    batch = original(PROTOCOL, "deserialize_tensordict")(arr)
    if batch is not None and "position_ids" in batch.keys():  # noqa: SIM118 (TensorDict refuses `in`)
        ids = batch["position_ids"]
        if _is_multi_row(ids) and int(ids._ragged_idx) != 2:
            # as_nested_tensor's reading is self-consistent, so its unbind gives the samples back.
            batch["position_ids"] = positions.nested_from_list(list(ids.unbind()))
    return batch
