"""No-placement tables in VERL's training checkpoints and weight sync: written once, never moved.

[Note: frozen tables in checkpoints]
VERL's ``FSDPCheckpointManager.save_checkpoint`` writes ``model.state_dict()`` on every rank; a
no-placement table is a plain CPU tensor replicated on every rank, so each rank's file would hold
a full copy (16 x 95.37 GiB per save at the recipe's scale). The table is frozen and comes from
the model checkpoint, so the per-rank files leave it out and rank 0 records where it comes from
(``no_placement_tables.json``: FQN, shape, dtype, content fingerprint, source checkpoint);
``load_checkpoint`` loads every other parameter strictly and keeps the live tables, after
checking that they are the tables the checkpoint was trained with: a resume whose ``model.path``
holds a different table (same name and shape, other values) is refused on every rank, naming the
table and both sources (``no_placement.fingerprint``: shape, dtype, size, sampled pages). The ``hf_model`` export stays complete
(a loadable HF checkpoint): VERL gathers it on rank 0 only, so each table is written once.

Weight sync: the adapter-only path never touches the tables. The base path
(``collect_lora_params(base_sync_done=False)``) moves the whole model with ``Module.to``; with the
tables detached they stay on CPU, and rank 0 alone adds each table once, under the checkpoint's
own names (Transformers' ``revert_weight_conversion``, e.g. ``ngram_embedding.shard_0.weight``).
Models without no-placement parameters take VERL's functions unchanged ([Note: do no harm]).
"""

from __future__ import annotations

import contextvars
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from fsdp2_ext.common import log
from fsdp2_ext.common.run_report import write_record
from fsdp2_ext.model.no_placement import (
    detached_no_placement_params,
    fingerprint,
    no_placement_params,
)
from fsdp2_ext.verl.checkpoint_reshard import (
    ReshardRefused,
    agreed_saved_world_size,
    load_resharded,
    refuse_undivided_mini_batch,
)
from fsdp2_ext.verl.rollout_sync import record_gather
from fsdp2_ext.verl.targets import (
    CHECKPOINT_MANAGER,
    ENGINE_WORKERS,
    FSDP_UTILS,
    original,
    replaces,
)

RECORD_FILE = "no_placement_tables.json"
# (model, registrations) while a save has the tables detached; the full export re-attaches them.
_detached_for_save: contextvars.ContextVar = contextvars.ContextVar(
    "fsdp2_ext_detached_for_save", default=None
)


def _tables(model) -> list:
    return no_placement_params(model) if isinstance(model, nn.Module) else []


def _source_of(model) -> str | None:
    inner = getattr(model, "base_model", None)
    inner = getattr(inner, "model", model) if inner is not None else model
    return getattr(getattr(inner, "config", None), "_name_or_path", None) or None


@replaces(CHECKPOINT_MANAGER, "FSDPCheckpointManager.save_checkpoint")
def save_checkpoint(self, local_path, *args, **kwargs):
    tables = _tables(self.model)
    if not tables:
        return original(CHECKPOINT_MANAGER, "FSDPCheckpointManager.save_checkpoint")(
            self, local_path, *args, **kwargs
        )
    with detached_no_placement_params(self.model, tables):
        token = _detached_for_save.set((self.model, tables))
        try:
            result = original(CHECKPOINT_MANAGER, "FSDPCheckpointManager.save_checkpoint")(
                self, local_path, *args, **kwargs
            )
        finally:
            _detached_for_save.reset(token)
    if local_path is not None and dist.get_rank() == 0:
        record = {
            "reason": "frozen no-placement tables are left out of the per-rank model files; "
            "they come from the model checkpoint below (see fsdp2_ext [Note: frozen tables in "
            "checkpoints])",
            "source": _source_of(self.model),
            "tables": [
                {
                    "fqn": t.fqn,
                    "shape": list(t.param.shape),
                    "dtype": str(t.param.dtype),
                    "fingerprint": fingerprint(t.param),
                }
                for t in tables
            ],
        }
        with open(os.path.join(local_path, RECORD_FILE), "w") as out:
            json.dump(record, out, indent=2)
    skipped = sum(t.param.nbytes for t in tables)
    log.info(f"checkpoint: {len(tables)} no-placement tables ({skipped} bytes) left out per rank")
    return result


@replaces(CHECKPOINT_MANAGER, "FSDPCheckpointManager.load_checkpoint")
def load_checkpoint(self, local_path, *args, **kwargs):
    """VERL's load; a save from another world size is resharded ([Note: resharding a resume])."""
    tables = _tables(self.model)
    load = original(CHECKPOINT_MANAGER, "FSDPCheckpointManager.load_checkpoint")
    if local_path is None:
        return load(self, local_path, *args, **kwargs)
    kinds = [kind for kind, wanted in (("model", self.should_load_model),
             ("optim", self.should_load_optimizer), ("extra_state", self.should_load_extra))
             if wanted]  # fmt: skip
    saved_world = (
        agreed_saved_world_size(local_path, kinds, self.world_size, self.rank) if kinds else None
    )
    if saved_world is None and not tables:
        return load(self, local_path, *args, **kwargs)
    if tables:
        check_tables_match(self.model, tables, local_path)
    with detached_no_placement_params(self.model, tables):  # strict for every other parameter
        if saved_world is not None:
            return load_resharded(self, local_path, saved_world)
        return load(self, local_path, *args, **kwargs)


@replaces(ENGINE_WORKERS, "ActorRolloutRefWorker.load_checkpoint")
def actor_load_checkpoint(self, local_path, *args, **kwargs):
    """VERL's load, after refusing a resharded resume that VERL would stop on at the first update
    (the live world size does not divide the actor's mini-batch; [Note: resharding a resume])."""
    if local_path is not None and "actor" in self.role:
        try:
            refuse_undivided_mini_batch(
                local_path, live_world=dist.get_world_size(), rank=dist.get_rank(),
                data_parallel=self.actor.engine.get_data_parallel_size(),
                mini_batch=self.config.actor.ppo_mini_batch_size, responses=self.config.rollout.n,
            )  # fmt: skip
        except ReshardRefused as error:
            # Ray carries one worker's exception to the driver; with FSDP2_EXT_REPORT_DIR every
            # rank's refusal is on record (the toy run checks it is every rank's, one message).
            write_record(
                f"refused-rank{dist.get_rank()}",
                {"kind": "refusal", "rank": dist.get_rank(), "message": str(error)},
            )
            raise
    return original(ENGINE_WORKERS, "ActorRolloutRefWorker.load_checkpoint")(
        self, local_path, *args, **kwargs
    )


def check_tables_match(model, tables, local_path: str) -> None:
    """Refuses (on this rank, as on every other: each checks its own live tables) a resume whose
    tables are not the ones the checkpoint at ``local_path`` was trained with."""
    path = os.path.join(local_path, RECORD_FILE)
    if not os.path.exists(path):
        return
    with open(path) as f:
        record = json.load(f)
    saved = {t["fqn"]: t for t in record.get("tables", [])}
    different = []
    for table in tables:
        expected = saved.get(table.fqn, {}).get("fingerprint")
        actual = fingerprint(table.param) if expected is not None else None
        if expected is not None and actual != expected:
            different.append(f"{table.fqn} (saved: {expected}, now: {actual})")
    if different:
        raise ValueError(
            f"resume from {local_path}: the frozen no-placement tables differ from the ones it "
            f"was trained with: {different}; they came from {record.get('source')}, this run "
            f"loads them from {_source_of(model)}. Point model.path (MODEL_PATH) at the "
            "checkpoint the run started from"
        )


@replaces(FSDP_UTILS, "get_fsdp_full_state_dict")
def get_fsdp_full_state_dict(model, *args, **kwargs):
    full = original(FSDP_UTILS, "get_fsdp_full_state_dict")
    detached = _detached_for_save.get()
    if detached is None or detached[0] is not model:
        return full(model, *args, **kwargs)
    for table in detached[1]:  # the hf_model export stays a complete checkpoint
        table.module._parameters[table.name] = table.param
    try:
        return full(model, *args, **kwargs)
    finally:
        for table in detached[1]:
            table.module._parameters[table.name] = None


def _checkpoint_names(hf_model, tables, prefix: str) -> dict[str, torch.Tensor]:
    """Each table under the checkpoint's own key(s), by Transformers' reverse conversion."""
    from transformers.core_model_loading import revert_weight_conversion

    state = {t.fqn.removeprefix(prefix): t.param.detach() for t in tables}
    return dict(revert_weight_conversion(hf_model, state))


@replaces(FSDP_UTILS, "collect_lora_params")
def collect_lora_params(module, layered_summon, base_sync_done):
    start = time.monotonic()
    params = _collect_lora_params(module, layered_summon, base_sync_done)
    record_gather(time.monotonic() - start)  # the adapter sync's report: its gather
    return params


def _collect_lora_params(module, layered_summon, base_sync_done):
    collect = original(FSDP_UTILS, "collect_lora_params")
    tables = _tables(module)
    if not tables:
        return collect(module, layered_summon, base_sync_done)
    with detached_no_placement_params(module, tables):  # Module.to inside cannot move them
        params = collect(module, layered_summon, base_sync_done)
    if base_sync_done or (dist.is_initialized() and dist.get_rank() != 0):
        return params
    peft_model = getattr(module, "_fsdp_wrapped_module", module)
    hf_model = peft_model.base_model.model
    params.update(_checkpoint_names(hf_model, tables, prefix="base_model.model."))
    return params
