"""Tied-parameter aliases and non-persistent buffers across meta conversion.

See [Note: alias restoration order] in ``include/fsdp2_ext/alias_map.h``: aliases are recorded
from tensor identity before anything is replaced, kept at the meta conversion (one meta tensor per
group, bound to every name), and verified at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_ext import _fsdp2_ext

__all__ = [
    "AliasMap",
    "check_aliases",
    "get_tensor",
    "record_aliases",
    "restore_non_persistent_buffers",
    "set_tensor",
    "share_non_persistent_buffers",
    "snapshot_non_persistent_buffers",
    "to_meta_preserving_aliases",
]


@dataclass
class AliasMap:
    """Every distinct parameter / buffer as a group of FQNs; ``group[0]`` is the canonical name."""

    parameter_groups: list[list[str]] = field(default_factory=list)
    buffer_groups: list[list[str]] = field(default_factory=list)

    @property
    def tied_parameter_groups(self) -> list[list[str]]:
        return [group for group in self.parameter_groups if len(group) > 1]

    def canonical(self) -> dict[str, str]:
        """FQN -> canonical FQN of its group."""
        return {
            name: group[0]
            for groups in (self.parameter_groups, self.buffer_groups)
            for group in groups
            for name in group
        }


def _split(fqn: str) -> tuple[str, str]:
    prefix, _, leaf = fqn.rpartition(".")
    return prefix, leaf


def get_tensor(model: nn.Module, fqn: str) -> torch.Tensor | None:
    prefix, leaf = _split(fqn)
    module = model.get_submodule(prefix)
    if leaf in module._parameters:
        return module._parameters[leaf]
    return module._buffers.get(leaf)


def set_tensor(model: nn.Module, fqn: str, tensor: torch.Tensor) -> None:
    """Rebinds the parameter or buffer slot ``fqn`` (keeps it a parameter or a buffer)."""
    prefix, leaf = _split(fqn)
    module = model.get_submodule(prefix)
    if leaf in module._parameters:
        module._parameters[leaf] = tensor
    elif leaf in module._buffers:
        module._buffers[leaf] = tensor
    else:
        raise KeyError(f"'{fqn}' is neither a parameter nor a buffer of {type(model).__name__}")


def _merge_groups(*group_lists: list[list[str]]) -> list[list[str]]:
    """Union of alias relations, ordered by the first list's order (union-find over names)."""
    parent: dict[str, str] = {}

    def find(name: str) -> str:
        while parent.setdefault(name, name) != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    order: list[str] = []
    for groups in group_lists:
        for group in groups:
            for name in group:
                if name not in parent:
                    order.append(name)
                parent.setdefault(name, name)
            for name in group[1:]:
                root_a, root_b = find(group[0]), find(name)
                if root_a != root_b:
                    parent[root_b] = root_a
    merged: dict[str, list[str]] = {}
    for name in order:
        merged.setdefault(find(name), []).append(name)
    return list(merged.values())


def record_aliases(model: nn.Module, *, group: dist.ProcessGroup | None = None) -> AliasMap:
    """Groups parameter and buffer FQNs by tensor identity (C++).

    With ``group``, the relations of all ranks are merged: ranks other than 0 often hold a meta
    model on which an ``init_empty_weights``-style context has already split the ties.
    """
    params = list(model.named_parameters(remove_duplicate=False))
    buffers = list(model.named_buffers(remove_duplicate=False))
    local = AliasMap(
        _fsdp2_ext.group_by_identity([n for n, _ in params], [t for _, t in params]),
        _fsdp2_ext.group_by_identity([n for n, _ in buffers], [t for _, t in buffers]),
    )
    if group is None or dist.get_world_size(group) == 1:
        return local
    gathered: list[AliasMap | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return AliasMap(
        _merge_groups(*(m.parameter_groups for m in gathered)),
        _merge_groups(*(m.buffer_groups for m in gathered)),
    )


def snapshot_non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """FQN -> the buffer tensor itself (not a copy) for every non-persistent buffer."""
    snapshot: dict[str, torch.Tensor] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name in module._non_persistent_buffers_set:
            buffer = module._buffers.get(name)
            if buffer is not None:
                snapshot[f"{path}.{name}" if path else name] = buffer
    return snapshot


def share_non_persistent_buffers(
    snapshot: dict[str, torch.Tensor], group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """Fills meta entries of the snapshot with rank 0's values (a model built fully on meta).

    One all-reduce decides whether any rank needs them; then rank 0 sends its buffers (small:
    rotary tables) or, if it lacks them too, an error every rank raises.
    """
    if dist.get_world_size(group) == 1:
        return snapshot
    needed = torch.tensor([int(any(b.is_meta for b in snapshot.values()))])
    dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    if not needed.item():
        return snapshot
    payload: list[object] = [None]
    if dist.get_rank(group) == 0:
        on_meta = [fqn for fqn, b in snapshot.items() if b.is_meta]
        payload[0] = (
            f"non-persistent buffers {on_meta[:5]} are on meta on rank 0 too; build rank 0's "
            "model with real buffers (init_empty_weights keeps buffers real)"
            if on_meta
            else {fqn: b.cpu() for fqn, b in snapshot.items()}
        )
    dist.broadcast_object_list(payload, group_src=0, group=group)
    if isinstance(payload[0], str):
        raise RuntimeError(payload[0])
    return {fqn: payload[0][fqn] if b.is_meta else b for fqn, b in snapshot.items()}


def restore_non_persistent_buffers(
    model: nn.Module, snapshot: dict[str, torch.Tensor], device: torch.device
) -> list[str]:
    """Puts the snapshot back on ``device`` with its recorded dtype; aliases stay one object."""
    moved: dict[int, torch.Tensor] = {}
    for fqn, buffer in snapshot.items():
        if buffer.is_meta:
            raise RuntimeError(
                f"non-persistent buffer '{fqn}' was already on meta when it was recorded; "
                "build the model with real buffers (init_empty_weights keeps them real)"
            )
        restored = moved.setdefault(id(buffer), buffer.to(device=device, dtype=buffer.dtype))
        set_tensor(model, fqn, restored)
    return list(snapshot)


def to_meta_preserving_aliases(
    model: nn.Module, aliases: AliasMap, *, keep: set[nn.Parameter] = frozenset()
) -> None:
    """Replaces every parameter and buffer by a meta tensor, one object per alias group.

    Parameters in ``keep`` (the no-placement set) are left untouched on CPU. Never ``to_empty``:
    see [Note: alias restoration order].
    """
    keep_ids = {id(p) for p in keep}
    for groups, is_param in ((aliases.parameter_groups, True), (aliases.buffer_groups, False)):
        for group in groups:
            current = get_tensor(model, group[0])
            if current is None or id(current) in keep_ids:
                continue
            if current.is_meta and all(get_tensor(model, f) is current for f in group[1:]):
                continue  # built on meta, ties intact
            meta = torch.empty_like(current, device="meta")
            if is_param:
                meta = nn.Parameter(meta, requires_grad=current.requires_grad)
            for fqn in group:
                set_tensor(model, fqn, meta)


def check_aliases(model: nn.Module, aliases: AliasMap) -> None:
    """Raises if an alias group no longer resolves to one tensor object."""
    for group in aliases.parameter_groups + aliases.buffer_groups:
        first = get_tensor(model, group[0])
        for fqn in group[1:]:
            if get_tensor(model, fqn) is not first:
                raise RuntimeError(
                    f"tied alias broken: '{fqn}' is no longer the same tensor as '{group[0]}'"
                )
