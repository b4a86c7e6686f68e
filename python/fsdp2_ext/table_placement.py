"""Where a process's frozen no-placement tables live: views of the checkpoint file when it stores
them as the model needs them ([Note: zero-copy tables]), else the caller's fallback.

    remaining = view_tables_from_checkpoint(model, "/ckpt", who="rollout server 0")

Used by the processes that load a model with ``from_pretrained`` outside the trainer's sharded
init (the ``hf`` rollout servers): the trainer's ranks and the servers then share the page
cache's one copy of each table.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp2_ext import log
from fsdp2_ext.checkpoint_load import table_view
from fsdp2_ext.checkpoint_source import CheckpointSource
from fsdp2_ext.no_placement import NoPlacementParam, find_no_placement_params

__all__ = ["view_tables_from_checkpoint"]


def view_tables_from_checkpoint(model: nn.Module, path: str, *, who: str) -> list[NoPlacementParam]:
    """Makes each no-placement table of ``model`` a read-only view of the checkpoint at ``path``
    where it can be one; returns the tables that could not (each reason logged once)."""
    tables = find_no_placement_params(model)
    if not tables:
        return []
    source = CheckpointSource.open(model, path, fqns=[t.fqn for t in tables])
    remaining = []
    for table in tables:
        view, reason = table_view(source, [table.fqn], table.param)
        if view is None:
            log.info(f"{who}: table {table.fqn} is a private copy, not a view of {path}: {reason}")
            remaining.append(table)
        else:
            setattr(table.module, table.name, torch.nn.Parameter(view, requires_grad=False))
    return remaining
