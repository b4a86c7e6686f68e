"""Resuming VERL's per-rank FSDP2 checkpoint on another number of ranks.

[Note: resharding a resume]
VERL 0.9.1 saves ``model_/optim_/extra_state_world_size_{W}_rank_{r}.pt`` per rank (each rank's
``state_dict()``: DTensors whose local tensors are FSDP2's Shard(0) chunks at W) and at load
rebuilds those names from the live world size, so a run started again on another number of GPUs
stops on ``FileNotFoundError``. When the live world size's files are absent and one other world
size's are all present, ``load_resharded`` loads them instead:

- Each rank maps the saved ranks' files that overlap its rows, and rank 0's for the keys
  (``torch.load(mmap=True)``, opened on first use: unpickling a DTensor needs no process group;
  only the pages read are touched; about W_saved / W_live + 1 files per rank, not W_saved), and
  copies, per tensor, the rows of its own FSDP2 chunk at the live world size (``torch.chunk`` on
  dim 0: ``ceil(n / W)`` rows per rank, the last ones short or empty) from the saved chunks that
  overlap them: on the host, no cast, never a full tensor on any rank; a tie saved under two
  names (one storage in the file, one live parameter) is assembled once. The result is a DTensor on
  the live mesh (``DTensor.from_local`` with the live parameter's global shape and stride), which
  moves the rows onto the mesh's device (torch/distributed/tensor/_api.py, ``from_local``:
  "convert the local tensor to desired device base on device mesh's device_type",
  ``local_tensor.to(device_type)``): on a GPU mesh the resumed state is on the device once more,
  beside the live state, until ``load_state_dict`` has copied it in (the planner counts it, per
  GPU). It is loaded as VERL loads its own files (``load_state_dict``, strict unless the save is
  LoRA-only; the optimizer's state keyed by parameter index, as ``Optimizer.state_dict`` writes
  it).
- ``step`` counters, ``param_groups``, the lr scheduler: from rank 0's files (every rank saved the
  same). Per-rank RNG is not carried (there is no rank to take it from at another world size);
  the dataloader position and the global step live outside these files (VERL's ``data.pt``,
  the step directory) and are unaffected.
- Refused before any state is touched, on every rank with one message: each rank reads what it
  needs and judges it, and the verdicts are agreed over the world (bounded by the floor plus the
  rank's state bytes read meanwhile) before any state changes, so a rank whose files differ (a
  host-local copy missing a rank's files, a truncated file) stops every rank, none blocks: saved ranks missing, a save or a live model that is not FSDP2's Shard(0) on a
  1-D mesh (VERL's 2-D ``("ddp", "fsdp")`` HSDP mesh; both meshes named), saved chunks that are
  not FSDP2's layout, a different parameter set, shape or dtype than the live model's (the first key
  and both values), more than one other world size saved in the directory; and, one level up
  (``ActorRolloutRefWorker.load_checkpoint``, where the trainer's config is known), a live world
  size that does not divide the actor's mini-batch (``ppo_mini_batch_size x rollout.n``): VERL
  would stop on it at the first update (``TrainingWorker.train_mini_batch`` asserts it), after the
  whole load (``refuse_undivided_mini_batch``).

What stays equal: every parameter and optimizer tensor gathered at the new world size equals the
saved one bit for bit. What cannot: the steps after it, which reduce gradients over another
number of ranks (``tests/verl/test_resume_reshard.py`` states both).
"""

from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

from fsdp2_ext import _fsdp2_ext
from fsdp2_ext.common import log
from fsdp2_ext.init.sharded_init import describe_mesh

__all__ = [
    "ReshardRefused",
    "SavedWorld",
    "chunk_rows",
    "agreed_saved_world_size",
    "load_resharded",
    "refuse_undivided_mini_batch",
    "saved_world_size",
]

KINDS = ("model", "optim", "extra_state")


class ReshardRefused(ValueError):
    """A resharded resume that cannot be exact: raised on every rank before any state is touched."""


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows ``[begin, end)`` of a dim-0 chunked tensor, as FSDP2 chunks it
    (``torch.chunk``: ``ceil(rows / world)`` per rank; the last short, trailing ranks empty)."""
    per = -(-rows // world) if rows else 0
    begin = min(rows, rank * per)
    return begin, min(rows, begin + per)


def _file(directory: str, kind: str, world: int, rank: int) -> str:
    return os.path.join(directory, f"{kind}_world_size_{world}_rank_{rank}.pt")


def _saved_worlds(directory: str, kinds) -> list[int]:
    """Every world size some ``kinds`` file in ``directory`` was saved with, ascending."""
    pattern = re.compile(rf"^({'|'.join(kinds)})_world_size_(\d+)_rank_(\d+)\.pt$")
    return sorted({int(m.group(2)) for n in os.listdir(directory) if (m := pattern.match(n))})


def saved_world_size(directory: str, kinds, live_world: int, rank: int) -> int | None:
    """The world size whose files to load: ``None`` where this rank's files at the live world
    size are there (VERL's own path, unchanged, a per-host local save included), else the one
    other world size saved; refuses where there are several or none."""
    kinds = list(kinds)
    if all(os.path.exists(_file(directory, k, live_world, rank)) for k in kinds):
        return None
    worlds = _saved_worlds(directory, kinds)
    others = [w for w in worlds if w != live_world]
    if len(others) != 1:
        found = ", ".join(str(w) for w in worlds) or "none"
        raise ReshardRefused(
            f"resume from {directory}: no {'/'.join(kinds)} files for the live world size "
            f"{live_world}, and {'no' if not others else 'more than one'} other world size to "
            f"reshard from (saved world sizes: {found}); point the resume at a step directory "
            "that one run saved"
        )
    return others[0]


def agreed_saved_world_size(directory: str, kinds, live_world: int, rank: int) -> int | None:
    """``saved_world_size``, agreed over the world before anything is loaded: a rank whose host
    sees other files (its own files at the live world size where the others have none, or no
    single other world size) stops every rank with one message, never a split between VERL's
    load on some ranks and a resharded one on the others."""
    if _world() is None:
        return saved_world_size(directory, kinds, live_world, rank)
    verdict, world = "", None
    try:
        world = saved_world_size(directory, kinds, live_world, rank)
    except ReshardRefused as error:
        verdict = f"rank {dist.get_rank()}: {error}"
    _agreed(verdict, 0, "finding the saved world size")
    least, greatest = _fsdp2_ext.figure_range(
        dist.group.WORLD, [world or 0], None, stage="resharded resume: agreeing on the saved world"
    )
    if least != greatest:
        raise ReshardRefused(
            f"resume from {directory}: the ranks see different saves (some find their files at "
            f"the live world size {live_world}, some must reshard from {max(greatest[0], 1)} "
            "ranks); give every rank the same step directory (a shared filesystem, or the same "
            "copy on each host)"
        )
    return world


def refuse_undivided_mini_batch(
    directory: str, *, live_world: int, rank: int, data_parallel: int, mini_batch: int,
    responses: int,
) -> None:  # fmt: skip
    """Refuses (on every rank: each reads the same files and config) a resume that reshards a
    save onto ``data_parallel`` ranks that do not divide the actor's mini-batch of ``mini_batch``
    prompts x ``responses`` responses. A same-W resume, or a directory the checkpoint manager will
    judge itself (no files, several world sizes), is left to VERL and the manager."""
    # one verdict on every rank: judged from rank 0's files alone, never this rank's
    if not os.path.isdir(directory) or os.path.exists(_file(directory, "model", live_world, 0)):
        return
    worlds = set(_saved_worlds(directory, ["model"])) - {live_world}
    sequences = mini_batch * responses
    if len(worlds) != 1 or sequences % data_parallel == 0:
        return
    fits = sorted(
        (d for d in range(1, sequences + 1) if sequences % d == 0),
        key=lambda d: abs(d - data_parallel),
    )[:6]
    raise ReshardRefused(
        f"resume from {directory}: saved by {worlds.pop()} ranks, resumed on {live_world}, whose "
        f"{data_parallel} data-parallel ranks do not divide the actor's mini-batch "
        f"(actor.ppo_mini_batch_size {mini_batch} x rollout.n {responses} = {sequences} "
        "sequences): VERL would stop on it at the first update. Resume with a number of "
        "data-parallel ranks (GPUs / ulysses_sequence_parallel_size) that divides "
        f"{sequences} (the nearest: {', '.join(map(str, sorted(fits)))}), or set "
        f"actor.ppo_mini_batch_size so that ppo_mini_batch_size x rollout.n is a multiple of "
        f"{data_parallel}"
    )


class SavedWorld:
    """One kind of a save's per-rank files at the world size they were written with. A file is
    opened (``torch.load(mmap=True)``) only when a row in it is needed, so a live rank opens the
    saved files that overlap its rows (and rank 0's, for keys and metadata): about W_saved /
    W_live + 1 of them, not W_saved. ``opened`` lists them."""

    def __init__(self, directory: str, kind: str, world: int):
        self.directory, self.kind, self.world = directory, kind, world
        missing = [r for r in range(world) if not os.path.exists(_file(directory, kind, world, r))]
        if missing:
            raise ReshardRefused(
                f"resume from {directory}: saved by {world} ranks, but the {kind} files of "
                f"rank(s) {missing} are not there ({_file(directory, kind, world, missing[0])}); "
                "put every rank's files where every rank can read them (a shared filesystem, or "
                "a copy of the whole step directory on each host)"
            )
        self._files: dict[int, dict] = {}

    def file(self, rank: int) -> dict:
        if rank not in self._files:
            self._files[rank] = torch.load(
                _file(self.directory, self.kind, self.world, rank), map_location="cpu", mmap=True,
                weights_only=False,
            )  # fmt: skip
        return self._files[rank]

    @property
    def opened(self) -> list[int]:
        return sorted(self._files)

    def rows(self, key: str, local_of, total: int, begin: int, end: int) -> torch.Tensor:
        """Rows ``[begin, end)`` of the ``total``-row tensor ``key``, copied from the saved chunks
        that overlap them (``local_of(r)``: saved rank r's local chunk; only those are read)."""
        pieces, like = [], None
        for r in range(self.world):
            first, last = chunk_rows(total, self.world, r)
            lo, hi = max(begin, first), min(end, last)
            if lo >= hi and like is not None:
                continue
            chunk = local_of(r)
            like = chunk
            if chunk.shape[0] != last - first:
                raise ReshardRefused(
                    f"resume from {self.directory}: {self.kind} '{key}' on saved rank {r} holds "
                    f"{chunk.shape[0]} rows where FSDP2's Shard(0) at {self.world} ranks holds "
                    f"{last - first}; only FSDP2's own layout on a 1-D mesh is resharded"
                )
            if lo < hi:
                pieces.append(chunk[lo - first : hi - first])
        if not pieces:
            return like.new_empty((0, *like.shape[1:]))
        return torch.cat(pieces).contiguous() if len(pieces) > 1 else pieces[0].clone()


def _local(value) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def _refuse_unless_1d_shard0(key: str, saved, live, directory: str) -> None:
    """Only FSDP2's Shard(0) on a 1-D mesh, saved and live, is resharded: VERL's 2-D
    ``("ddp", "fsdp")`` mesh (``fsdp_size`` below the world size, HSDP) is refused, naming both."""
    from torch.distributed.tensor import Shard

    def plain(value) -> bool:
        return value.device_mesh.ndim == 1 and tuple(value.placements) == (Shard(0),)

    if not (plain(saved) and plain(live)):
        raise ReshardRefused(
            f"resume from {directory}: '{key}' was saved on a {describe_mesh(saved.device_mesh)} "
            f"with placements {tuple(saved.placements)}, and the live mesh is "
            f"{describe_mesh(live.device_mesh)} with {tuple(live.placements)}; only FSDP2's Shard(0) on "
            "a 1-D mesh is resharded to another world size (resume it on the world size and "
            "fsdp_size it was saved with)"
        )


def _resharded(key, saved: SavedWorld, value_of, template, directory: str):
    """The live rank's DTensor of ``key`` (``value_of(r)``: saved rank r's value) on
    ``template``'s mesh with its global shape; a plain tensor (replicated) is rank 0's."""
    from torch.distributed.tensor import DTensor

    first = value_of(0)
    if not isinstance(first, DTensor):
        return first
    if template is None or not isinstance(template, DTensor):
        raise ReshardRefused(
            f"resume from {directory}: '{key}' is sharded in the save, but the live model has "
            f"{'no such key' if template is None else 'it unsharded'}"
        )
    _refuse_unless_1d_shard0(key, first, template, directory)
    if tuple(first.shape) != tuple(template.shape) or first.dtype != template.dtype:
        raise ReshardRefused(
            f"resume from {directory}: '{key}' was saved as {tuple(first.shape)} {first.dtype}, "
            f"the live model has {tuple(template.shape)} {template.dtype}; resume with the model "
            "(and LoRA rank) the checkpoint was trained with"
        )
    rank, world = template.device_mesh.get_local_rank(), template.device_mesh.size()
    begin, end = chunk_rows(first.shape[0], world, rank)
    local = saved.rows(key, lambda r: _local(value_of(r)), first.shape[0], begin, end)
    return DTensor.from_local(
        local, template.device_mesh, template.placements, run_check=False,
        shape=template.shape, stride=template.stride(),
    )  # fmt: skip


def _model_state(manager, directory: str, world: int) -> dict:
    saved = SavedWorld(directory, "model", world)
    live = manager.model.state_dict(keep_vars=True)  # the parameters themselves: ties are one
    keys = list(saved.file(0))
    lora_only = manager.is_lora_only_state_dict(saved.file(0))
    unexpected = [k for k in keys if k not in live]
    missing = [] if lora_only else [k for k in live if k not in saved.file(0)]
    if unexpected or missing:
        first = (unexpected or missing)[0]
        raise ReshardRefused(
            f"resume from {directory}: the saved parameters differ from the live model's "
            f"(first: '{first}' {'saved, not in the live model' if unexpected else 'live, not saved'}; "
            f"{len(unexpected)} unexpected, {len(missing)} missing); resume with the model and "
            "LoRA settings the checkpoint was trained with"
        )
    state, first_of = {}, {}  # first_of: id of a live tensor -> the first key that named it
    for k in keys:
        template = live.get(k)
        alias = first_of.setdefault(id(template), k) if torch.is_tensor(template) else k
        if alias != k and _one_saved_tensor(saved.file(0)[alias], saved.file(0)[k]):
            state[k] = state[alias]  # a tie: its rows are assembled once, for both names
            continue
        state[k] = _resharded(k, saved, lambda r, k=k: saved.file(r)[k], template, directory)
    return state, lora_only, saved.opened


def _one_saved_tensor(a, b) -> bool:
    """Whether two saved entries are one tensor (a tie saved under two names: ``torch.save``
    keeps one storage for both), so that one's rows stand for the other's."""
    a, b = _local(a), _local(b)
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    )  # fmt: skip


def _optimizer_state(manager, directory: str, world: int) -> dict:
    saved = SavedWorld(directory, "optim", world)
    params = [p for group in manager.optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in manager.model.named_parameters()}
    first = saved.file(0)
    saved_ids = [i for group in first["param_groups"] for i in group["params"]]
    if len(saved_ids) != len(params):
        raise ReshardRefused(
            f"resume from {directory}: the saved optimizer has {len(saved_ids)} parameters, the "
            f"live one {len(params)}; resume with the model and LoRA settings it was trained with"
        )
    state = {}
    for index, param in zip(saved_ids, params, strict=True):
        if index not in first["state"]:
            continue
        name = names.get(id(param), f"param {index}")
        state[index] = {
            key: _resharded(
                f"{name}:{key}", saved,
                lambda r, index=index, key=key: saved.file(r)["state"][index][key],
                param if hasattr(value, "to_local") else None, directory,
            )
            for key, value in first["state"][index].items()
        }  # fmt: skip
    return {"state": state, "param_groups": first["param_groups"]}, saved.opened


def _live_bytes(manager) -> int:
    """This rank's bytes of the live state a resume reads and writes (its shards of every
    parameter, and two AdamW moments each when the optimizer loads): what a wait on the other
    ranks allows for ([Note: bounded waits])."""
    params = sum(
        _local(p).nbytes for p in manager.model.state_dict().values() if torch.is_tensor(p)
    )
    return params * (3 if manager.should_load_optimizer else 1)


def _world():
    """The group to agree over: the default one with more than one rank, else None (a process of
    its own, as VERL's checkpoint manager tests run it: nothing to agree, the verdict is its own)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD


def _rank_name() -> str:
    return f"rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else "rank 0"


def _agreed(verdict: str, bytes_: int, stage: str) -> None:
    """One verdict for every rank of the world (the reads of one rank may fail where another's
    do not: files missing on one host, a truncated copy), bounded by the floor plus the bytes the
    ranks read meanwhile; every rank raises the same ReshardRefused."""
    if _world() is None:
        if verdict:
            raise ReshardRefused(verdict)
        return
    verdict = _fsdp2_ext.agree_on_verdict(
        dist.group.WORLD, verdict, torch.device("cpu"), None, allow_bytes=bytes_,
        allows_for="every rank reading its rows of the saved files", stage=f"resharded resume: {stage}",
    )  # fmt: skip
    if verdict:  # the same text on every rank, whoever reported it
        raise ReshardRefused(re.sub(r"^\(reported by rank \d+\) ", "", verdict))


def load_resharded(manager, local_path: str, world: int) -> None:
    """Loads the save at ``local_path``, written by ``world`` ranks, into the live model,
    optimizer and scheduler at the live world size ([Note: resharding a resume]). Every rank reads
    and checks first; the verdicts are agreed over the world before any state is touched."""
    live_world = manager.world_size
    model_state = optim_state = extra = None
    lora_only, opened, verdict = False, {}, ""
    try:
        if manager.should_load_model:
            model_state, lora_only, opened["model"] = _model_state(manager, local_path, world)
        if manager.should_load_optimizer:
            optim_state, opened["optim"] = _optimizer_state(manager, local_path, world)
        if manager.should_load_extra:
            extra = SavedWorld(local_path, "extra_state", world).file(0)
    except Exception as error:  # ReshardRefused, or a file that cannot be read
        what = "" if isinstance(error, ReshardRefused) else f"{type(error).__name__}: "
        verdict = f"{_rank_name()}: {what}{error}"
    live_bytes = _live_bytes(manager)
    _agreed(verdict, live_bytes, "reading the saved files")
    # every check passed on every rank: only now is live state touched
    resharded = 0
    if model_state is not None:
        resharded += len(
            {id(v) for v in model_state.values() if hasattr(v, "to_local")}
        )  # a tie once
        # (a LoRA-only save misses the base's keys; an unexpected key was refused above, in
        # _model_state, before any state was touched)
        manager.model.load_state_dict(model_state, strict=not lora_only)
    if optim_state is not None:
        resharded += sum(
            hasattr(v, "to_local") for s in optim_state["state"].values() for v in s.values()
        )
        manager.optimizer.load_state_dict(manager._backfill_optimizer_state(optim_state))
    if extra is not None and extra.get("lr_scheduler") is not None and manager.lr_scheduler:
        manager.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    log.info(
        f"resumed a checkpoint saved by {world} ranks on {live_world}: {resharded} tensors "
        f"resharded, per-rank RNG not carried; saved files opened here: "
        f"{ {kind: ranks for kind, ranks in opened.items()} } ({local_path})"
    )
    _agreed("", live_bytes, "loaded")
