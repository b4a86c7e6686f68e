"""Where each tensor of a model lives in a Transformers checkpoint directory.

    source = CheckpointSource.open(model, "/ckpt")  # before fully_shard; maps files, reads nothing
    init_sharded(model, None, mesh=mesh, source="checkpoint", checkpoint=source)

Every rank maps the directory's ``*.safetensors`` read-only (zero-copy views, one page-cache copy per
host) and resolves the model's FQNs to checkpoint keys; see [Note: checkpoint key resolution].

[Note: checkpoint key resolution]
Checkpoint keys are turned into model keys by Transformers' own rules, exactly as ``from_pretrained``
applies them: ``get_model_conversion_mapping(model)`` (the model type's renamings and converters,
e.g. qwen4_exp's ``ngram_embedding.shard_*.weight`` -> ``ngram_embedding.weight``) and
``rename_source_key`` (renamings, at most one converter, the ``base_model_prefix`` rule). No
per-model table is written here. Each model tensor then comes out as one of:

- ``direct``: one checkpoint tensor, renamed at most (or a converter over a single tensor whose
  operations are all concatenations, which are then the identity): every rank copies its own rows
  from the mapping, converting the dtype as it copies;
- ``sliced``: experts merged from per-expert tensors (``MergeModulelist(dim=0)``, optionally then
  ``Concatenate`` along a later dimension, as qwen2_moe's ``gate_up_proj``): row ``e`` of the
  merged tensor is expert ``e``'s tensors concatenated, so every rank builds its own rows from its
  own experts' mapped tensors;
- ``converted``: anything else a converter builds (a table concatenated from shards, a fused qkv
  split): rank 0 runs Transformers' conversion on the mapped tensors and sends the rows (named in
  the log: they cost rank 0 a full copy of that tensor);
- ``missing``: not in the checkpoint (LoRA adapters, new heads): rank 0's own initialised value.

A PEFT-wrapped model is resolved through its Transformers model: the FQN prefix up to the
``PreTrainedModel`` and PEFT's ``base_layer`` wrappers are dropped (``base_model.model.x.q_proj.
base_layer.weight`` is the checkpoint's ``x.q_proj.weight``).
"""

from __future__ import annotations

import copy
import ctypes
import glob
import json
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp2_ext import log
from fsdp2_ext.safetensors_source import map_safetensors_state

__all__ = ["CheckpointSource", "checkpoint_files", "filesystem_type"]

INDEX_FILE = "model.safetensors.index.json"
# Filesystems whose pages do not come from a local disk's page cache: a mapped view would fetch
# every page over the network (per host, and again after eviction).
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "lustre", "gpfs", "ceph")


def checkpoint_files(directory: str) -> list[str]:
    """The checkpoint's safetensors files: those of its index when it has one, else all of them."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{index}: not a safetensors index ({error})") from error
        return [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"checkpoint directory {directory!r} has no *.safetensors files (load from rank 0 "
            "instead, or convert the checkpoint with save_pretrained(safe_serialization=True))"
        )
    return files


def filesystem_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mountinfo)."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                mount_point = fields[4]
                fs_type = fields[fields.index("-") + 1]
                inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best):
                    best, kind = mount_point, fs_type
    except (OSError, ValueError, IndexError):
        pass
    return kind


_MADV_DONTNEED = 4
_LIBC = ctypes.CDLL(None, use_errno=True)


def release_pages(view: torch.Tensor) -> None:
    """Drops this process's page-table entries for the whole pages inside a view of a read-only
    file mapping (``madvise(MADV_DONTNEED)``): the pages stay in the page cache, but stop counting
    in this process's RSS/PSS; a later read faults them back from the file. Only for views that
    ``CheckpointSource`` mapped (read-only, file-backed): on anonymous memory this would zero it."""
    page = mmap.PAGESIZE
    begin = -(-view.data_ptr() // page) * page
    end = (view.data_ptr() + view.nbytes) // page * page
    if end > begin and _LIBC.madvise(
        ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), _MADV_DONTNEED
    ):
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on a checkpoint view")


def _hf_model(model: nn.Module) -> tuple[str, nn.Module]:
    """(FQN prefix, module) of the outermost Transformers ``PreTrainedModel`` in ``model``."""
    from transformers import PreTrainedModel

    for path, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return path, module
    raise ValueError(
        f"loading from a checkpoint needs a Transformers model; {type(model).__name__} contains "
        "no PreTrainedModel (load from rank 0 instead)"
    )


def _hf_key(fqn: str, prefix: str) -> str | None:
    if prefix:
        if not fqn.startswith(prefix + "."):
            return None
        fqn = fqn[len(prefix) + 1 :]
    while ".base_layer." in fqn:  # PEFT's wrapper of a targeted module or parameter
        fqn = fqn.replace(".base_layer.", ".")
    return fqn


def _merges_rows(converter) -> bool:
    """``MergeModulelist(dim=0)`` then at most a ``Concatenate`` along a later dimension."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = converter.operations
    merge = len(ops) in (1, 2) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    return merge and (len(ops) == 1 or (isinstance(ops[1], Concatenate) and ops[1].dim >= 1))


@dataclass
class CheckpointSource:
    """A checkpoint directory resolved against a model's FQNs ([Note: checkpoint key resolution])."""

    directory: str
    files: list[str]
    filesystem: str
    direct: dict[str, torch.Tensor] = field(default_factory=dict)  # FQN -> mapped view
    direct_keys: dict[str, str] = field(default_factory=dict)  # FQN -> checkpoint key
    sliced: dict[str, str] = field(default_factory=dict)  # FQN -> what builds it, per rank
    converted: dict[str, str] = field(default_factory=dict)  # FQN -> what builds it, on rank 0
    missing: list[str] = field(default_factory=list)
    unused_keys: list[str] = field(default_factory=list)  # checkpoint keys no model tensor takes
    initialised: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0's new values
    _groups: dict[str, tuple] = field(default_factory=dict, repr=False)
    _state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _hf: nn.Module | None = field(default=None, repr=False)

    @classmethod
    def open(
        cls, model: nn.Module, directory: str | os.PathLike, fqns: Iterable[str] | None = None
    ) -> CheckpointSource:
        """Maps ``directory``'s safetensors and resolves ``fqns`` (default: every parameter and
        persistent buffer of ``model``, tied names included). Call it before ``fully_shard``."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
        files = checkpoint_files(directory)
        state = map_safetensors_state(files)
        prefix, hf_model = _hf_model(model)
        if fqns is None:
            fqns = [n for n, _ in model.named_parameters(remove_duplicate=False)]
            fqns += [n for n, _ in model.state_dict(keep_vars=True).items() if n not in fqns]
        by_hf_key: dict[str, list[str]] = {}
        for fqn in fqns:
            key = _hf_key(fqn, prefix)
            if key is not None:
                by_hf_key.setdefault(key, []).append(fqn)
        source = cls(directory, files, filesystem_type(directory), _hf=hf_model)

        mapping = get_model_conversion_mapping(hf_model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        known = dict.fromkeys(by_hf_key, True)
        groups: dict[str, tuple[object, list[tuple[str, str]]]] = {}
        for key in sorted(state, key=dot_natural_key):
            renamed, pattern = rename_source_key(
                key, renamings, converters, hf_model.base_model_prefix, known
            )
            if renamed not in known and key in known:
                renamed, pattern = rename_source_key(key, [], [], hf_model.base_model_prefix, known)
            if renamed not in known:
                source.unused_keys.append(key)
            elif pattern is None:
                for fqn in by_hf_key[renamed]:
                    source.direct[fqn], source.direct_keys[fqn] = state[key], key
            else:
                groups.setdefault(renamed, (by_pattern[pattern], []))[1].append((key, pattern))
        for renamed, (template, keys) in groups.items():
            if len(keys) == 1 and all(isinstance(op, Concatenate) for op in template.operations):
                ((key, _),) = keys  # one tensor concatenated: the identity
                for fqn in by_hf_key[renamed]:
                    source.direct[fqn], source.direct_keys[fqn] = state[key], key
                continue
            ops = "+".join(type(op).__name__ for op in template.operations)
            kind = source.sliced if _merges_rows(template) else source.converted
            for fqn in by_hf_key[renamed]:
                kind[fqn] = f"{ops} of {len(keys)} checkpoint tensors"
                source._groups[fqn] = (renamed, template, keys)
        source._state = state
        resolved = set(source.direct) | set(source.sliced) | set(source.converted)
        # A tied name is not missing when another name of the same tensor is in the checkpoint
        # (a tied checkpoint stores one of them).
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        resolved_ids = {id(tensors[f]) for f in resolved if f in tensors}
        source.missing = [
            fqn
            for fqn in fqns
            if fqn not in resolved and not (fqn in tensors and id(tensors[fqn]) in resolved_ids)
        ]
        if source.unused_keys:
            log.warn(
                f"checkpoint {directory}: {len(source.unused_keys)} keys match no tensor of "
                f"{type(hf_model).__name__} and are ignored: {source.unused_keys[:5]}"
            )
        if source.converted:
            log.info(
                f"checkpoint {directory}: {len(source.converted)} tensors need a conversion that "
                "cannot be sliced per rank; rank 0 builds them and sends the rows: "
                + ", ".join(f"{f} ({why})" for f, why in sorted(source.converted.items())[:8])
                + (" ..." if len(source.converted) > 8 else "")
            )
        return source

    def fill_rows(self, fqn: str, out: torch.Tensor, row_begin: int) -> None:
        """Writes rows ``row_begin : row_begin + len(out)`` of a ``sliced`` tensor into ``out``
        (any floating dtype): row ``e`` is expert ``e``'s tensors, concatenated in the converter's
        source-pattern order along the dimension its ``Concatenate`` names (minus the merged one)."""
        _, template, keys = self._groups[fqn]
        per_pattern = {p: [k for k, kp in keys if kp == p] for p in template.source_patterns}
        concat = template.operations[1].dim - 1 if len(template.operations) > 1 else 0
        for i in range(out.shape[0]):
            offset = 0
            for pattern in template.source_patterns:
                piece = self._state[per_pattern[pattern][row_begin + i]]
                length = piece.shape[concat] if piece.dim() else 1
                out[i].narrow(concat, offset, length).copy_(piece)
                offset += length

    def sliced_shape(self, fqn: str) -> tuple[int, ...]:
        """The merged tensor's shape, from its sources' shapes (for validation before loading)."""
        _, template, keys = self._groups[fqn]
        per_pattern = {p: [k for k, kp in keys if kp == p] for p in template.source_patterns}
        counts = {len(v) for v in per_pattern.values()}
        concat = template.operations[1].dim - 1 if len(template.operations) > 1 else 0
        shapes = [list(self._state[v[0]].shape) for v in per_pattern.values() if v]
        if len(counts) != 1 or not shapes:
            return (-1,)
        row = shapes[0]
        row[concat] = sum(shape[concat] for shape in shapes)
        return (counts.pop(), *row)

    def pieces(self, fqn: str) -> list[torch.Tensor] | None:
        """The mapped tensors a ``converted`` tensor concatenates along dim 0, in Transformers'
        order (source patterns, then natural key order), when that is all its conversion does
        (qwen4_exp's ``ngram_embedding.shard_*``); else None."""
        from transformers.core_model_loading import Concatenate

        if fqn not in self.converted:
            return None
        _, template, keys = self._groups[fqn]
        if not all(isinstance(op, Concatenate) and op.dim == 0 for op in template.operations):
            return None
        return [self._state[k] for p in template.source_patterns for k, kp in keys if kp == p]

    def materialize(self, fqn: str) -> torch.Tensor:
        """Runs Transformers' conversion for a ``converted`` tensor (on the mapped sources)."""
        renamed, template, keys = self._groups[fqn]
        converter = copy.deepcopy(template)  # holds no tensors: the template is never filled
        for key, pattern in keys:
            converter.add_tensor(renamed, key, pattern, self._state[key])
        produced = converter.convert(renamed, model=self._hf, config=self._hf.config)
        if renamed not in produced:
            raise ValueError(
                f"checkpoint {self.directory}: the conversion for {fqn} produced "
                f"{sorted(produced)}, not {renamed}"
            )
        return produced[renamed]

    def tensor_for(self, names: Iterable[str]) -> tuple[str, str] | None:
        """(kind, FQN) of the first of ``names`` (a tensor and its aliases) the checkpoint has:
        kind is "direct", "sliced" or "converted"."""
        for name in names:
            for kind in ("direct", "sliced", "converted"):
                if name in getattr(self, kind):
                    return kind, name
        return None
