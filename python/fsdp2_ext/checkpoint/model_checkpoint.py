"""Where each tensor of a model lives in a Transformers checkpoint directory.

    source = ModelCheckpoint.open(model, "/ckpt")  # before fully_shard; maps files, reads headers
    source.apply_ties(model)                         # tie / untie as from_pretrained decides
    init_sharded(model, None, mesh=mesh, source="checkpoint", checkpoint=source)

Every rank maps the checkpoint's ``*.safetensors`` read-only (zero-copy views, one page-cache copy
per host) and resolves the model's FQNs to what builds them; see [Note: checkpoint key resolution].
The promise: if it loads, it is what ``from_pretrained`` would have given you.

[Note: checkpoint key resolution]
The files are the ones ``from_pretrained`` reads (``checkpoint_files``: the config's
``transformers_weights``, else ``model.safetensors``, else the index; a variant only when asked).
Checkpoint keys are grouped exactly as ``convert_and_load_state_dict_in_model`` groups them:
sorted by ``dot_natural_key``, renamed by ``rename_source_key`` (every ``WeightRenaming``, at most
one ``WeightConverter``, the ``base_model_prefix`` rule), each converter collecting its keys under
its first target. Every converter is then run once on meta tensors (cast first to the target's
dtype, as Transformers casts before converting): that gives the names and shapes of *all* its
outputs (a fused ``qkv`` chunked into three), and which outputs are views of one stored tensor.
Each model tensor then comes out as one of:

- ``direct``: a stored tensor, renamed at most, or a view of one (a chunk along dim 0, a
  transpose): every rank copies its own rows from the mapping, converting the dtype as it copies
  (casting commutes with selecting elements, so this equals cast-then-convert);
- ``sliced``: experts merged from per-expert tensors (``MergeModulelist(dim=0)``, optionally then
  ``Concatenate`` along a later dimension): row ``e`` is expert ``e``'s tensors concatenated, so
  every rank builds its own rows from its own experts' mapped tensors;
- ``converted``: any other output of a converter (a concatenation, a permutation, a split that
  copies): rank 0 runs Transformers' own conversion on the mapped tensors, cast first as
  Transformers casts, and sends the rows (named in the log: rank 0 holds that group in full);
- ``missing``: in no stored tensor and not tied to one. See [Note: missing tensors].

A PEFT-wrapped model is resolved through its Transformers model: the FQN prefix up to the
``PreTrainedModel`` and PEFT's ``base_layer`` wrappers are dropped (``base_model.model.x.q_proj.
base_layer.weight`` is the checkpoint's ``x.q_proj.weight``).

[Note: missing tensors]
A missing tensor is a decision, never a default. PEFT adapters and the tensors the model's class
declares initialised at load (``_keys_to_ignore_on_load_missing``) are initialised as
``from_pretrained`` initialises them (rank 0 runs ``_init_weights``, every rank gets rank 0's
values). Any other missing tensor refuses the load on every rank before data moves, naming the
keys (a base weight that a LoRA run trains against is corruption, not initialisation), unless the
caller opts in with ``allow_missing`` (``True`` or FQN patterns), which logs a WARNING per key.

[Note: checkpoint fingerprint]
Every rank reads its rows from its own host's copy of ``model.path`` (the recipe recommends
node-local copies), so the copies must hold the same bytes: a stale copy with the same keys and
shapes would silently mix two checkpoints across ranks and HSDP replicas. ``fingerprint`` is a
SHA-256 over each file's name and size, its safetensors header (every key, dtype, shape and
offset) and 16 samples of 4 KiB spread evenly over its data, read with ``pread`` (a few hundred
KiB per file, cheap next to the load). Every rank's fingerprint is gathered with the load's first
verdict; ranks whose copy differs from rank 0's refuse the load on every rank, naming their hosts.
It catches a different file set, a different header (another checkpoint, dtype or layout) and
most changed values; two copies that differ only in bytes between the samples pass it (a full
hash would read the whole checkpoint on every host).

[Note: checkpoint ties]
Ties follow ``PreTrainedModel.tie_weights(missing_keys=...)``: for each pair of
``all_tied_weights_keys``, tie when one of the two is stored, or both are stored with equal values
(cast to the parameter's dtype); when both are stored with different values, Transformers warns
and leaves them untied (and drops the pair from ``all_tied_weights_keys``), and so do we, with the
same warning. A model built on meta was tied from its config; ``apply_ties`` unties it there.
The checkpoint decides whether the two are one Parameter; the wrap rule then decides from that
and from the config (``wrap_targets.is_tied``): one Parameter in two branches is never wrapped
apart, and otherwise the config's ``tie_word_embeddings`` decides as VERL's rule does, so an
untying checkpoint under a tied config keeps embed and head in the root unit, as under VERL.
"""

from __future__ import annotations

import copy
import ctypes
import fnmatch
import hashlib
import json
import mmap
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp2_ext.checkpoint.safetensors_source import map_safetensors_state
from fsdp2_ext.common import log

__all__ = [
    "AllowMissing",
    "ModelCheckpoint",
    "checkpoint_files",
    "checkpoint_fingerprint",
    "filesystem_type",
]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Filesystems whose pages do not come from a local disk's page cache: a mapped view would fetch
# every page over the network (per host, and again after eviction).
_FINGERPRINT_SAMPLES, _FINGERPRINT_SAMPLE_BYTES = 16, 4096  # [Note: checkpoint fingerprint]

AllowMissing = bool | Iterable[str]


def _with_variant(name: str, variant: str | None) -> str:
    """Transformers' ``_add_variant``: the variant goes before the last extension
    (``model.fp16.safetensors``, ``model.safetensors.index.fp16.json``)."""
    if not variant:
        return name
    stem, _, extension = name.rpartition(".")
    return f"{stem}.{variant}.{extension}"


def _index_files(index: str) -> tuple[list[str], dict[str, str]]:
    """(shard files, key -> file) of a safetensors index; ValueError naming the file and field."""
    try:
        with open(index) as f:
            content = json.load(f)
    except ValueError as error:
        raise ValueError(f"{index}: not a safetensors index: invalid JSON ({error})") from error
    if not isinstance(content, dict) or "weight_map" not in content:
        raise ValueError(f"{index}: not a safetensors index: it has no 'weight_map' object")
    weight_map = content["weight_map"]
    if not isinstance(weight_map, dict):
        raise ValueError(
            f"{index}: 'weight_map' must be an object of tensor name -> file name, got "
            f"{type(weight_map).__name__}"
        )
    directory = os.path.dirname(index)
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name or os.path.basename(name) != name:
            raise ValueError(
                f"{index}: 'weight_map'[{key!r}] must be a file name in {directory}, got {name!r}"
            )
    files = sorted(set(weight_map.values()))
    absent = [name for name in files if not os.path.isfile(os.path.join(directory, name))]
    if absent:
        raise ValueError(f"{index}: 'weight_map' names files that do not exist: {absent[:5]}")
    return [os.path.join(directory, name) for name in files], dict(weight_map)


def checkpoint_files(
    directory: str, *, variant: str | None = None, with_index: bool = False
) -> list[str] | tuple[list[str], dict[str, str]]:
    """The safetensors files ``from_pretrained`` reads from a local ``directory``: the config's
    ``transformers_weights`` when it names one, else ``model.safetensors``, else the files of
    ``model.safetensors.index.json`` (``model.<variant>.*`` with ``variant``). Other files beside
    them (``model.fp16.safetensors``, stray shards) are not read. ``with_index``: also return the
    index's key -> file map ({} without an index)."""
    directory = os.fspath(directory)
    explicit = None
    config = os.path.join(directory, "config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                explicit = json.load(f).get("transformers_weights")
        except (ValueError, AttributeError):
            explicit = None
    candidates = (
        [explicit]
        if isinstance(explicit, str)
        else [_with_variant(WEIGHTS_FILE, variant), _with_variant(INDEX_FILE, variant)]
    )
    for name in candidates:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        if os.path.commonpath([os.path.abspath(directory), os.path.abspath(path)]) != (
            os.path.abspath(directory)
        ):
            raise ValueError(f"{config}: transformers_weights {name!r} leaves {directory}")
        found = _index_files(path) if name.endswith(".json") else ([path], {})
        return found if with_index else found[0]
    present = sorted(f for f in os.listdir(directory) if ".safetensors" in f or f.endswith(".bin"))
    raise FileNotFoundError(
        f"checkpoint directory {directory!r} has no {' or '.join(candidates)} (it holds "
        f"{present[:6] or 'no weights'}); from_pretrained would not load it either. Pass "
        "variant=... for a variant, convert .bin checkpoints with save_pretrained(), or load "
        "from rank 0"
    )


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
    ``ModelCheckpoint`` mapped (read-only, file-backed): on anonymous memory this would zero it."""
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
    # PEFT's ModulesToSaveWrapper: its original_module is the stored module; its trainable copy
    # (modules_to_save.<adapter>) is the adapter's (is_adapter), like a LoRA weight.
    return fqn.replace(".original_module.", ".")


def is_adapter(model: nn.Module, fqn: str) -> bool:
    """Whether ``fqn`` belongs to a PEFT adapter: inside a tuner layer, not its ``base_layer``;
    or a ``ModulesToSaveWrapper``'s trainable copy, not its ``original_module``."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import ModulesToSaveWrapper
    except ImportError:
        return False
    parts = fqn.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = model.get_submodule(".".join(parts[:cut]))
        if isinstance(module, BaseTunerLayer):
            return parts[cut] != "base_layer"
        if isinstance(module, ModulesToSaveWrapper):
            return parts[cut] != "original_module"
    return False


def _merges_rows(converter) -> bool:
    """``MergeModulelist(dim=0)`` then at most a ``Concatenate`` along a later dimension."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = getattr(converter, "operations", [])
    merge = len(ops) in (1, 2) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    return merge and (len(ops) == 1 or (isinstance(ops[1], Concatenate) and ops[1].dim >= 1))


def _only_concatenates(converter, dim: int | None = None) -> bool:
    from transformers.core_model_loading import Concatenate

    ops = getattr(converter, "operations", [])
    return all(isinstance(op, Concatenate) and (dim is None or op.dim == dim) for op in ops)


class _ModelByCheckpointNames:
    """The Transformers model as a converter sees it in ``from_pretrained``: ``get_parameter``
    with checkpoint-side names (PEFT's ``base_layer`` wrappers hidden); everything else is the
    model's own (``config``, submodules)."""

    def __init__(self, hf_model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        self._hf_model, self._tensors = hf_model, tensors

    def get_parameter(self, name: str) -> torch.Tensor:
        if name in self._tensors:
            return self._tensors[name]
        return self._hf_model.get_parameter(name)

    def __getattr__(self, name: str):
        return getattr(self._hf_model, name)


@dataclass
class _Group:
    """One entry of Transformers' ``param_name_to_load``: a transform, its checkpoint keys."""

    first_target: str  # checkpoint-side (HF) key of the first parameter it builds
    converter: object | None  # the WeightConverter template; None for a rename
    keys: list[tuple[str, str]] = field(default_factory=list)  # (checkpoint key, source pattern)
    dtype: torch.dtype | None = None  # what Transformers casts every source to first

    def describe(self) -> str:
        if self.converter is None:
            return self.keys[0][0]
        ops = "+".join(type(op).__name__ for op in self.converter.operations)
        return f"{ops} of {len(self.keys)} checkpoint tensors"


def checkpoint_fingerprint(files: Sequence[str]) -> str:
    """[Note: checkpoint fingerprint]: the files' names, sizes, headers and sampled bytes, hashed
    (cheap: 16 pages per file, read with ``pread``). Equal for two copies of one checkpoint."""
    digest = hashlib.sha256()
    for path in sorted(files, key=os.path.basename):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            header_bytes = int.from_bytes(head, "little") if len(head) == 8 else 0
            header_bytes = min(header_bytes, max(size - 8, 0))
            digest.update(f"{os.path.basename(path)}\0{size}\0".encode())
            digest.update(os.pread(fd, header_bytes, 8))
            data_begin, data_bytes = 8 + header_bytes, size - 8 - header_bytes
            for i in range(_FINGERPRINT_SAMPLES):
                offset = data_begin + data_bytes * i // _FINGERPRINT_SAMPLES
                digest.update(os.pread(fd, _FINGERPRINT_SAMPLE_BYTES, offset))
        finally:
            os.close(fd)
    return digest.hexdigest()[:32]


@dataclass
class ModelCheckpoint:
    """A checkpoint directory resolved against a model's FQNs ([Note: checkpoint key resolution])."""

    directory: str
    files: list[str]
    filesystem: str
    direct: dict[str, torch.Tensor] = field(default_factory=dict)  # FQN -> mapped (strided) view
    direct_keys: dict[str, str] = field(default_factory=dict)  # FQN -> checkpoint key
    sliced: dict[str, str] = field(default_factory=dict)  # FQN -> what builds it, per rank
    converted: dict[str, str] = field(default_factory=dict)  # FQN -> what builds it, on rank 0
    views: set[str] = field(default_factory=set)  # direct FQNs that view part of a stored tensor
    missing: list[str] = field(default_factory=list)  # FQNs in no stored tensor, adapters too
    load_time_init: list[str] = field(default_factory=list)  # missing, initialised at load by HF
    unused_keys: list[str] = field(default_factory=list)  # checkpoint keys no model tensor takes
    untied: list[tuple[str, str]] = field(default_factory=list)  # (target, source) HF keys
    index_only: dict[str, str] = field(default_factory=dict)  # key -> index file not holding it
    _ties: list[tuple[str, str]] = field(default_factory=list, repr=False)
    _groups: dict[str, _Group] = field(default_factory=dict, repr=False)  # FQN -> its group
    _produced: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    _by_hf_key: dict[str, list[str]] = field(default_factory=dict, repr=False)
    _hf_tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _dtypes: dict[str, torch.dtype] = field(default_factory=dict, repr=False)  # FQN -> its dtype
    _state: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _hf: nn.Module | None = field(default=None, repr=False)
    _hf_prefix: str = ""

    @classmethod
    def open(
        cls,
        model: nn.Module,
        directory: str | os.PathLike,
        fqns: Iterable[str] | None = None,
        *,
        variant: str | None = None,
    ) -> ModelCheckpoint:
        """Maps the checkpoint's safetensors and resolves ``fqns`` (default: every parameter and
        persistent buffer of ``model``, tied names included). Call it before ``fully_shard``."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
        files, index = checkpoint_files(directory, variant=variant, with_index=True)
        state = map_safetensors_state(files)
        prefix, hf_model = _hf_model(model)
        everything = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        everything += [n for n in model.state_dict(keep_vars=True) if n not in everything]
        requested = list(everything if fqns is None else fqns)
        by_hf_key: dict[str, list[str]] = {}
        for fqn in everything:
            key = _hf_key(fqn, prefix)
            if key is not None:
                by_hf_key.setdefault(key, []).append(fqn)
        source = cls(directory, files, filesystem_type(directory), _hf=hf_model, _hf_prefix=prefix)
        source._state, source._by_hf_key = state, by_hf_key
        source.index_only = {
            k: f for k, f in index.items() if k not in state and not k.startswith("__")
        }
        tensors = dict(model.named_parameters(remove_duplicate=False))
        tensors.update(model.named_buffers(remove_duplicate=False))
        hf_tensors = {k: tensors[fqns_[0]] for k, fqns_ in by_hf_key.items()}
        source._hf_tensors = hf_tensors
        source._dtypes = {fqn: t.dtype for fqn, t in tensors.items()}

        # Grouped as convert_and_load_state_dict_in_model groups them.
        mapping = get_model_conversion_mapping(hf_model)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        known = dict.fromkeys(by_hf_key, True)
        groups: dict[str, _Group] = {}
        for key in sorted(state, key=dot_natural_key):
            renamed, pattern = rename_source_key(
                key, renamings, converters, hf_model.base_model_prefix, known
            )
            if renamed not in known and key in known:
                renamed, pattern = rename_source_key(key, [], [], hf_model.base_model_prefix, known)
            if renamed not in known:
                source.unused_keys.append(key)
                continue
            group = groups.setdefault(
                renamed,
                _Group(
                    renamed,
                    by_pattern[pattern] if pattern is not None else None,
                    dtype=hf_tensors[renamed].dtype,
                ),
            )
            group.keys.append((key, pattern if pattern is not None else key))

        produced_fqns: set[str] = set()
        model_view = _ModelByCheckpointNames(hf_model, hf_tensors)
        for group in groups.values():
            for hf_key, how in source._plan_group(group, model_view).items():
                targets = by_hf_key.get(hf_key)
                if targets is None:
                    source.unused_keys.append(f"{hf_key} (made by {group.describe()})")
                    continue
                for fqn in targets:
                    produced_fqns.add(fqn)
                    kind, value = how
                    if kind == "direct":
                        source.direct[fqn], source.direct_keys[fqn] = value
                        if value[0] is not state[value[1]]:
                            source.views.add(fqn)
                    else:
                        getattr(source, kind)[fqn] = group.describe()
                        source._groups[fqn] = group
        source._decide_ties(hf_model, by_hf_key, produced_fqns)
        source._find_missing(model, requested, tensors, produced_fqns)
        for kind in ("direct", "direct_keys", "sliced", "converted"):
            resolved = getattr(source, kind)
            for fqn in [f for f in resolved if f not in requested]:
                del resolved[fqn]
        if source.unused_keys:
            ignored = getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or []
            pattern = re.compile("|".join(f"({p})" for p in ignored)) if ignored else None
            unexpected = [k for k in source.unused_keys if not (pattern and pattern.search(k))]
            if unexpected:
                log.warn(
                    f"checkpoint {directory}: {len(unexpected)} stored tensors match no "
                    f"tensor of {type(hf_model).__name__} and are not loaded (from_pretrained "
                    f"ignores them too): {unexpected[:5]}"
                )
        converted = {f: w for f, w in source.converted.items() if f in requested}
        if converted:
            log.info(
                f"checkpoint {directory}: {len(converted)} tensors need a conversion that "
                "cannot be sliced per rank; rank 0 runs it and sends the rows: "
                + ", ".join(f"{f} ({why})" for f, why in sorted(converted.items())[:8])
                + (" ..." if len(converted) > 8 else "")
            )
        return source

    def _plan_group(self, group: _Group, model_view) -> dict[str, tuple[str, object]]:
        """HF key -> ("direct", (view, key)) | ("sliced", None) | ("converted", None) for every
        output of the group, found by running its conversion on meta tensors."""
        if group.converter is None:
            ((key, _),) = group.keys[:1]
            return {group.first_target: ("direct", (self._state[key], key))}
        if len(group.keys) == 1 and _only_concatenates(group.converter):
            ((key, _),) = group.keys  # one tensor concatenated: the identity
            return {group.first_target: ("direct", (self._state[key], key))}
        meta_sources: dict[int, tuple[str, torch.Tensor]] = {}  # held: ids must not be reused
        converter = copy.deepcopy(group.converter)
        for key, pattern in group.keys:
            like = torch.empty(self._state[key].shape, dtype=group.dtype, device="meta")
            meta_sources[id(like)] = (key, like)
            converter.add_tensor(group.first_target, key, pattern, like)
        try:
            produced = converter.convert(
                group.first_target, model=model_view, config=self._hf.config
            )
        except Exception as error:
            raise ValueError(
                f"checkpoint {self.directory}: Transformers' conversion {group.describe()} for "
                f"{group.first_target} cannot be planned ({type(error).__name__}: {error}); "
                "load from rank 0 (FSDP2_EXT_INIT_SOURCE=rank0)"
            ) from error
        plan: dict[str, tuple[str, object]] = {}
        sliced = _merges_rows(group.converter) and len(produced) == 1
        for hf_key, output in produced.items():
            output = output[0] if isinstance(output, list) else output
            base = output if id(output) in meta_sources else output._base
            if base is not None and id(base) in meta_sources:
                key = meta_sources[id(base)][0]
                real = self._state[key]
                view = real.as_strided(
                    output.shape, output.stride(), real.storage_offset() + output.storage_offset()
                )
                plan[hf_key] = ("direct", (view, key))
            else:
                plan[hf_key] = ("sliced" if sliced else "converted", None)
        return plan

    def _decide_ties(self, hf_model, by_hf_key, produced_fqns: set[str]) -> None:
        """[Note: checkpoint ties]: which pairs of ``all_tied_weights_keys`` stay tied."""
        tied = dict(getattr(hf_model, "all_tied_weights_keys", None) or {})
        stored = {k for k, fqns in by_hf_key.items() if any(f in produced_fqns for f in fqns)}
        for target, source in tied.items():
            if target in stored and source in stored and not self._equal_values(source, target):
                self.untied.append((target, source))
            else:
                self._ties.append((target, source))

    def _equal_values(self, first: str, second: str) -> bool:
        a, b = (
            self.full_value(self._by_hf_key[first][0]),
            self.full_value(self._by_hf_key[second][0]),
        )
        return a.shape == b.shape and torch.equal(a, b)

    def _find_missing(self, model, requested, tensors, produced_fqns: set[str]) -> None:
        """Requested FQNs that no stored tensor gives, directly or through a tie."""
        tie_partner: dict[str, set[str]] = {}
        for target, source in self._ties:
            for a, b in ((target, source), (source, target)):
                tie_partner.setdefault(a, set()).add(b)
        untied = {frozenset(pair) for pair in self.untied}
        produced_ids = {id(tensors[f]) for f in produced_fqns if f in tensors}
        ignore = getattr(self._hf, "_keys_to_ignore_on_load_missing", None) or []
        ignore_pattern = re.compile("|".join(f"({p})" for p in ignore)) if ignore else None
        for fqn in requested:
            if fqn in produced_fqns:
                continue
            key = _hf_key(fqn, self._hf_prefix)
            partners = tie_partner.get(key, set()) if key is not None else set()
            if any(f in produced_fqns for p in partners for f in self._by_hf_key.get(p, [])):
                continue
            # Tied by the model itself (shared modules): the same object as a stored tensor.
            same_object = fqn in tensors and id(tensors[fqn]) in produced_ids
            if same_object and not any(key in pair for pair in untied):
                continue
            self.missing.append(fqn)
            if key is not None and ignore_pattern and ignore_pattern.search(key):
                self.load_time_init.append(fqn)

    def apply_ties(self, model: nn.Module) -> list[tuple[str, str]]:
        """Ties and unties ``model``'s parameters as ``from_pretrained`` would for this checkpoint
        ([Note: checkpoint ties]); before ``fully_shard``. Returns the (target, source) HF keys
        left untied, after logging Transformers' warning for each."""
        from fsdp2_ext.model.aliases import get_tensor, set_tensor

        for target, source in self._ties:
            for t_fqn in self._by_hf_key.get(target, []):
                s_fqn = self._by_hf_key.get(source, [None])[0]
                if s_fqn is not None and get_tensor(model, t_fqn) is not get_tensor(model, s_fqn):
                    set_tensor(model, t_fqn, get_tensor(model, s_fqn))
        for target, source in self.untied:
            t_fqn, s_fqn = self._by_hf_key[target][0], self._by_hf_key[source][0]
            shared = get_tensor(model, t_fqn)
            if shared is get_tensor(model, s_fqn):
                fresh = torch.empty_like(shared, device="meta")
                set_tensor(model, t_fqn, nn.Parameter(fresh, requires_grad=shared.requires_grad))
            getattr(self._hf, "all_tied_weights_keys", {}).pop(target, None)
            log.warn(
                f"The tied weights mapping and config for this model specifies to tie {source} to "
                f"{target}, but both are present in the checkpoints with different values, so we "
                "will NOT tie them. You should update the config with `tie_word_embeddings=False` "
                "to silence this warning."
            )
        return list(self.untied)

    @property
    def network_filesystem(self) -> str:
        """The network filesystem any of the files is on (their real paths: a hub cache's
        symlinks may point elsewhere), or "": the C++ core's one list."""
        from fsdp2_ext import _fsdp2_ext

        for path in self.files:
            name = _fsdp2_ext.network_filesystem_of(os.path.realpath(path))
            if name:
                return name
        return ""

    def fingerprint(self) -> str:
        """[Note: checkpoint fingerprint]: names, sizes, headers and sampled bytes, hashed."""
        return checkpoint_fingerprint(self.files)

    def kinds(self) -> dict[str, int]:
        """How many tensors load each way (a summary for reports and logs)."""
        return {
            "stored": len(self.direct) - len(self.views),
            "view": len(self.views),
            "sliced": len(self.sliced),
            "converted": len(self.converted),
            "missing": len(self.missing),
        }

    def missing_verdict(self, model: nn.Module, allow_missing: AllowMissing = False) -> str:
        """The refusal naming every missing tensor that may not be initialised ([Note: missing
        tensors]), or ""; logs a WARNING per tensor that ``allow_missing`` lets through."""
        refused = []
        for fqn in self.missing:
            if fqn in self.load_time_init or is_adapter(model, fqn):
                continue
            if _allowed(fqn, _hf_key(fqn, self._hf_prefix), allow_missing):
                log.warn(
                    f"{fqn} is not in checkpoint {self.directory}: initialised with "
                    f"{type(self._hf).__name__}._init_weights on rank 0 (allow_missing)"
                )
                continue
            refused.append(fqn)
        if not refused:
            return ""
        stray = [
            f"{k} (the index names {v}, which does not hold it)"
            for k, v in self.index_only.items()
            if any(_hf_key(f, self._hf_prefix) == k for f in refused)
        ]
        return (
            f"{len(refused)} tensors of {type(self._hf).__name__} are not in checkpoint "
            f"{self.directory}: {refused[:8]}{' ...' if len(refused) > 8 else ''}"
            + (f"; {stray[:3]}" if stray else "")
            + "; from_pretrained would initialise them with random values. Pass "
            "allow_missing=[names or patterns] (FSDP2_EXT_ALLOW_MISSING in VERL) to initialise "
            "them on purpose, or load a complete checkpoint"
        )

    def initialisable(self, model: nn.Module, allow_missing: AllowMissing) -> list[str]:
        """Missing FQNs that rank 0 initialises (adapters excluded: their init is PEFT's)."""
        return [
            f
            for f in self.missing
            if not is_adapter(model, f)
            and (
                f in self.load_time_init or _allowed(f, _hf_key(f, self._hf_prefix), allow_missing)
            )
        ]

    def fill_rows(self, fqn: str, out: torch.Tensor, row_begin: int) -> None:
        """Writes rows ``row_begin : row_begin + len(out)`` of a ``sliced`` tensor into ``out``
        (any floating dtype): row ``e`` is expert ``e``'s tensors, concatenated in the converter's
        source-pattern order along the dimension its ``Concatenate`` names (minus the merged one)."""
        group = self._groups[fqn]
        template = group.converter
        per_pattern = {p: [k for k, kp in group.keys if kp == p] for p in template.source_patterns}
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
        group = self._groups[fqn]
        template = group.converter
        per_pattern = {p: [k for k, kp in group.keys if kp == p] for p in template.source_patterns}
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
        if fqn not in self.converted:
            return None
        group = self._groups[fqn]
        if not _only_concatenates(group.converter, dim=0):
            return None
        return [self._state[k] for k in self.piece_keys(fqn)]

    def piece_keys(self, fqn: str) -> list[str]:
        """The checkpoint keys of ``pieces(fqn)``, in its order."""
        group = self._groups[fqn]
        return [k for p in group.converter.source_patterns for k, kp in group.keys if kp == p]

    def materialize(self, fqn: str) -> torch.Tensor:
        """Runs Transformers' conversion for a ``converted`` tensor on the mapped sources, each
        cast first to the parameter's dtype as Transformers casts; every output of the group is
        kept until asked for (a fused tensor split in three is converted once)."""
        group = self._groups[fqn]
        key = _hf_key(fqn, self._hf_prefix)
        produced = self._produced.get(id(group))
        if produced is None:
            converter = copy.deepcopy(group.converter)
            for source_key, pattern in group.keys:
                value = self._state[source_key].to(group.dtype)
                converter.add_tensor(group.first_target, source_key, pattern, value)
            produced = converter.convert(
                group.first_target,
                model=_ModelByCheckpointNames(self._hf, self._hf_tensors),
                config=self._hf.config,
            )
            produced = {k: v[0] if isinstance(v, list) else v for k, v in produced.items()}
            self._produced[id(group)] = produced
        if key not in produced:
            raise ValueError(
                f"checkpoint {self.directory}: the conversion for {fqn} produced "
                f"{sorted(produced)}, not {key}"
            )
        value = produced.pop(key)
        if not produced:
            del self._produced[id(group)]
        else:
            produced[key] = value  # a tied alias may ask again; dropped with the group
        return value

    def full_value(self, fqn: str) -> torch.Tensor:
        """The whole tensor as ``from_pretrained`` would load it (in its parameter's dtype)."""
        if fqn in self.direct:
            return self.direct[fqn].to(self._dtypes[fqn])
        if fqn in self.sliced:
            out = torch.empty(self.sliced_shape(fqn), dtype=self._dtypes[fqn])
            self.fill_rows(fqn, out, 0)
            return out
        return self.materialize(fqn).clone()

    def tensor_for(self, names: Iterable[str]) -> tuple[str, str] | None:
        """(kind, FQN) of the first of ``names`` (a tensor and its aliases) the checkpoint has:
        kind is "direct", "sliced" or "converted"."""
        for name in names:
            for kind in ("direct", "sliced", "converted"):
                if name in getattr(self, kind):
                    return kind, name
        return None


def _allowed(fqn: str, hf_key: str | None, allow_missing: AllowMissing) -> bool:
    if isinstance(allow_missing, bool):
        return allow_missing
    if isinstance(allow_missing, str):
        allow_missing = [allow_missing]
    names = [fqn] + ([hf_key] if hf_key else [])
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in allow_missing)
