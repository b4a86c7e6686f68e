"""The trainer's host-shared tables, served to the rollout's processes on the same host.

    # the trainer (share_tables_on_host, each host's leader): every table that carries a key
    servers = serve_tables(manifest, keys)
    # a rollout rank (the vLLM plugin): its row range of that table, read-only, or None
    rows = map_table_rows(table_key(directory, pieces, shape, dtype), begin_row, rows)

[Note: the trainer's table served to the rollout]
The trainer keeps one copy of each frozen table per host: the file of ``VERL_NO_PLACEMENT_MMAP_DIR``
([Note: shm lifetime]), mapped read-only by every local rank and unlinked once all have mapped.
The rollout's engines (VERL's vLLM servers: processes of their own, started after the trainer's
model is built, ``verl/trainer/ppo/v1/trainer_base.py:329`` then ``:372``) need the same rows:
vLLM's ``Qwen4ExpPLEPinnedHostEmbedding`` gives each rank its ETP row range of the table
(``vllm/models/qwen4_exp/common/ngram_embedding.py:454-467``), whose row ``i`` is the checkpoint's
row ``i`` (``Qwen4ExpNGramEmbedding.load_weights`` places ``shard_k`` at ``k * ceil(rows /
parts)``, ``vllm/models/qwen4_exp/nvidia/ngram_embedding.py:413-470``; Transformers concatenates
the same shards in natural key order).

So each host's leader, once its file is filled and mapped, keeps a read-only descriptor of it and
serves it ([Note: a host copy without a group]: an abstract socket per key, ``SCM_RIGHTS``,
``SO_PEERCRED``) for its life, one name per table. A rank of the rollout asks with the table's
key, maps its row range read-only and uses it as its rows: a host then holds one copy of the
table for the trainer and every engine, where it held the trainer's and one per engine.

- **The key** (``table_key``) says what the bytes are, computed alike on both sides from the
  checkpoint directory alone: the checkpoint's fingerprint and each file's identity (device, inode,
  size, modification time), the checkpoint tensors the table concatenates in row order, its shape
  and dtype. The trainer's table is Transformers' concatenation of those tensors cast to the
  dtype; vLLM's rows are the same tensors cast by ``copy_ple_embedding_shard_`` (both torch's
  ``to``). A table built any other way (rank 0's values, a conversion that does more than
  concatenate) carries no key and is not served.
- **Read-only on both sides.** The trainer maps its file read-only; the rollout maps its range
  with ``PROT_READ``, so no rollout write can reach the trainer's rows. vLLM's weight loader, which
  would write the checkpoint's rows into them, checks them instead (bit for bit, at read rate) and
  refuses the engine's start, naming the layer, if they differ (``vllm_plugin``). The file can sit
  on disk (the recipe's ``/nvme``): no write dirties it. On a GPU the range is registered with
  ``cudaHostRegisterReadOnly`` (a ``PROT_READ`` mapping cannot be pinned for writing). Whether
  the driver pins a disk file's page-cache pages that way, on the recipe's kernel, is what
  ``benchmarks/gpu_check_ple_host_copy.py`` checks; unproven until it runs.
- **One host, one user, one name.** The socket's name carries ``FSDP2_EXT_HOST_ID`` (unset in a
  real run: the network namespace is the host) and the uid, so the trainer and the rollout find
  each other only when both run as the same user in the same namespace, as VERL's Ray workers do.
- **Lifetime.** The file is unlinked as before; its pages live while the trainer's ranks or any
  rollout rank map it, or the leader holds its descriptor. Nothing is left after a crash. A rollout
  that starts when no trainer serves the key (another host's trainer, a trainer restarted, a
  checkpoint other than the trainer's) keeps the rollout-only host copy or its own rows, logged.
- **Padding rows.** None for Qwen4Exp: its table is padded to ``make_ngram_vocab_size_divisible_by``
  rows in the checkpoint and in vLLM, which the ETP size must divide (``divide()``,
  ``nvidia/ngram_embedding.py:202-226``). Were a rank's range to run past the table's last row,
  those rows are never looked up (the kernel masks ids outside
  ``org_vocab_start_index``..``org_vocab_end_index``) and never written, so they may be the file's
  next bytes; past the file's end the range is refused.
- **Reloads.** A reload that would write the rows (vLLM's layerwise reload, its kernel-format
  ``reload_weights``: a full weight sync) is refused with a message, never a write into the
  read-only mapping; VERL's adapter-only sync (the recipe's) never reloads the base.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence

import torch

from fsdp2_ext.common import log
from fsdp2_ext.tables.host_copy import ServedRange, key_digest, serve_file

__all__ = [
    "checkpoint_fields",
    "checkpoint_identity",
    "checkpoint_keys",
    "checkpoint_table_pieces",
    "map_table_rows",
    "serve_tables",
    "table_key",
]

_KIND = "fsdp2_ext.checkpoint_table"


@functools.lru_cache(maxsize=8)
def checkpoint_identity(directory: str) -> tuple[str, tuple]:
    """The fingerprint of the files ``from_pretrained`` (and vLLM) read from ``directory``, and each
    file's identity (name, device, inode, size, modification time)."""
    from fsdp2_ext.checkpoint.model_checkpoint import checkpoint_files, checkpoint_fingerprint

    files = checkpoint_files(directory)
    identities = []
    for path in files:
        status = os.stat(os.path.realpath(path))
        identities.append((os.path.basename(path), status.st_dev, status.st_ino, status.st_size,
                           status.st_mtime_ns))  # fmt: skip
    return checkpoint_fingerprint(files), tuple(identities)


def checkpoint_keys(directory: str) -> list[str]:
    """The tensor names of the checkpoint in ``directory`` (its index, else its files' headers)."""
    from safetensors import safe_open

    from fsdp2_ext.checkpoint.model_checkpoint import checkpoint_files

    files, index = checkpoint_files(directory, with_index=True)
    if index:
        return sorted(index)
    names = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return sorted(names)


def checkpoint_table_pieces(directory: str, prefix: str) -> list[str] | None:
    """The checkpoint tensors a vLLM PLE layer at ``prefix`` (vLLM's module name) loads its table
    from, in row order, or None when no table of the checkpoint is unambiguously that layer's.

    vLLM names modules as its model class maps the checkpoint's names (``hf_to_vllm_mapper``:
    Qwen4Exp's causal LM maps ``model.language_model.`` to ``model.``, the conditional-generation
    class to ``language_model.model.``), and those mappers rename the model's root, never the path
    from ``layers.<i>`` on. So a checkpoint table is the layer's when its name ends with the
    layer's path from its last ``layers`` component (the whole prefix if it has none), and it is
    the only one that does: ``X.shard_<k>.weight`` by ``k`` (vLLM places shard ``k`` at
    ``k * ceil(rows / parts)``), else ``X.weight``. Which tensors vLLM's loader actually gives the
    layer is checked at load, bit for bit ([Note: the trainer's table served to the rollout])."""
    parts = prefix.split(".")
    tail = (
        parts[max(i for i, p in enumerate(parts) if p == "layers") :]
        if "layers" in parts
        else parts
    )
    shards: dict[str, dict[int, str]] = {}
    whole: dict[str, str] = {}
    for name in checkpoint_keys(directory):
        match = re.fullmatch(r"(.+)\.shard_(\d+)\.weight", name)
        if match:
            shards.setdefault(match[1], {})[int(match[2])] = name
        elif name.endswith(".weight"):
            whole[name[: -len(".weight")]] = name

    def _is_layer(table: str) -> bool:
        names = table.split(".")
        return len(names) >= len(tail) and names[len(names) - len(tail) :] == tail

    found = [t for t in shards if _is_layer(t)] or [t for t in whole if _is_layer(t)]
    if len(found) != 1:
        return None
    if found[0] in shards:
        by_index = shards[found[0]]
        return [by_index[k] for k in sorted(by_index)]
    return [whole[found[0]]]


def checkpoint_fields(directory: str) -> dict:
    """A key's fields naming the checkpoint in ``directory``: its fingerprint and each file's
    identity (``checkpoint_identity``), as JSON carries them."""
    fingerprint, files = checkpoint_identity(os.path.realpath(directory))
    return {"checkpoint": fingerprint, "files": [list(f) for f in files]}


def table_key(
    directory: str, pieces: Sequence[str], shape: Sequence[int], dtype: torch.dtype
) -> dict:
    """What a table's bytes are: ``pieces`` (checkpoint tensor names, in row order) of the
    checkpoint in ``directory``, concatenated and cast to ``dtype``
    ([Note: the trainer's table served to the rollout])."""
    return {
        "kind": _KIND,
        **checkpoint_fields(directory),
        "pieces": list(pieces),
        "shape": [int(s) for s in shape],
        "dtype": str(dtype),
    }


_LIVE: list = []  # this process's servers: they serve for its life


def serve_tables(manifest, keys: Sequence[dict | None]) -> list[str]:
    """Serves each entry of a host-shared file (``manifest``) that has a key, read-only, for this
    process's life; returns the digests of the keys served. Called by each host's leader before it
    unlinks the file. A failure is logged, never raised: the trainer does not depend on it."""
    servers = []
    for entry, key in zip(manifest.entries, keys):
        if key is None:
            continue
        try:
            fd = os.open(manifest.path, os.O_RDONLY | os.O_CLOEXEC)
            server = serve_file(key, fd, entry.offset, entry.bytes)
        except OSError as error:
            log.warn(f"host-shared table {entry.fqn}: not served to the rollout: {error}")
            continue
        if server is not None:
            servers.append(server)
            log.info(f"host-shared table {entry.fqn}: served read-only to this host's rollout "
                     f"(host copy {key_digest(key)})")  # fmt: skip
    _LIVE.extend(servers)
    return [key_digest(server.key) for server in servers]


def map_table_rows(
    key: dict, begin_row: int, rows: int, *, timeout_s: float = 60.0
) -> ServedRange | None:
    """Rows ``[begin_row, begin_row + rows)`` of the table ``key`` names, read-only, from the
    process that serves it on this host; None when none does. Raises ``HostCopyRefused`` when the
    server refuses (another user) or the range leaves its file."""
    shape, dtype = key["shape"], getattr(torch, key["dtype"].removeprefix("torch."))
    row_bytes = int(torch.empty((), dtype=dtype).element_size()) * int(
        torch.Size(shape[1:]).numel()
    )
    nbytes = row_bytes * int(shape[0])
    return ServedRange.map(key, nbytes, begin_row * row_bytes, rows * row_bytes,
                           timeout_s=timeout_s)  # fmt: skip
