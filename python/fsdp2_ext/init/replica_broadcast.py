"""HSDP: a 2-D (replicate, shard) mesh filled by one replica, sent along the replicate dimension.

[Note: HSDP loads]
On VERL's 2-D mesh ``("ddp", "fsdp")`` (``fsdp_size`` below the world size) FSDP2 shards over
each ``fsdp`` group and replicates across ``ddp``: the rank at ``(d, f)`` holds the same padded
Shard(0) rows as ``(0, f)``. A load therefore runs as on a 1-D mesh, over the shard group, and
only what must come from rank 0 crosses between replicas:

- the leading replica (``ddp`` coordinate 0, the one that holds global rank 0) runs the init
  source's 1-D load over its shard group, unchanged (``rank0``: rank 0 scatters; ``checkpoint``:
  every rank copies its rows from the mapped files, rank 0 sends what the files lack);
- every other replica loads what it can read itself over its own shard group (``checkpoint``:
  its rows from the files; ``local``: its rows from the full state it sees) and nothing of what
  rank 0 sends;
- then each leading rank broadcasts, along its ``ddp`` group, the tensors its replicas could not
  read (``rank0``: all of them; ``checkpoint``: the converted and missing ones, the adapters
  among them; ``local``: none), in buckets of at most ``bucket_bytes``, one broadcast per bucket
  of one dtype. Each byte crosses the network once per receiving replica, on the ``ddp`` group's
  own communicator (NCCL: one broadcast over the group's ring or tree, no per-pair send/recv).
  The tensors are on the load device, and ``ProcessGroup::broadcast`` (ProcessGroup.hpp) calls
  the ``c10d::broadcast_`` op, which the dispatcher routes by the tensors' device: on VERL's
  ``cpu:gloo,cuda:nccl`` group GPU shards take NCCL, CPU-offloaded ones Gloo (checked for a CPU
  backend in ``prepare_sharded``, as for the shard group).

Every wait is bounded ([Note: bounded waits]): the replicate group's first collective is
``bounded_first_collective`` (on NCCL it creates the ``ddp`` communicator, inside the call, before
any ``Work`` exists to wait on: torch's ``ProcessGroupNCCL::getNCCLComm`` runs
``ncclCommInitRank`` lazily in the first collective, which blocks until every rank has joined),
run on a helper thread and bounded by the floor plus the leader's own load before it (at most its
shard group's bytes at the bandwidth floor), which the replicas do not take part in. Each
broadcast after it is asynchronous and waited on with the floor plus its bytes. On NCCL that
wait is
``WorkNCCL::wait(timeout)`` (ProcessGroupNCCL.hpp: "it will block the CPU thread until the NCCL
work is completed or timed out. If timeout, exception will be thrown"); on Gloo the same call
raises on timeout. A leader that died or stopped makes its replicas raise, naming it. The verdict before any data moves is agreed over the whole world
(``cpu_group`` defaults to the world group on a 2-D mesh), and so are the tables (one host-shared
copy per host, whatever the mesh) and the non-persistent buffers.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from fsdp2_ext import _fsdp2_ext

__all__ = ["broadcast_to_replicas"]


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` in buckets of one dtype and device, each at most ``bucket_bytes``
    (a larger tensor alone), in order."""
    buckets: list[list[int]] = []
    open_bucket: dict[tuple, tuple[list[int], int]] = {}
    for index, tensor in enumerate(tensors):
        key = (tensor.dtype, tensor.device)
        members, size = open_bucket.get(key, ([], 0))
        if members and size + tensor.nbytes > bucket_bytes:
            buckets.append(members)
            members, size = [], 0
        open_bucket[key] = (members + [index], size + tensor.nbytes)
    buckets += [members for members, _ in open_bucket.values() if members]
    return buckets


def broadcast_to_replicas(
    tensors: list[torch.Tensor],
    *,
    group: dist.ProcessGroup,
    bucket_bytes: int,
    timeout_s: float,
    lead_bytes: int = 0,
) -> tuple[int, int]:
    """The leading rank of ``group`` (its rank 0) sends ``tensors``; every other rank receives
    them in place (the same shapes and dtypes, allocated by its plan). ``bucket_bytes`` bounds
    one broadcast on this rank (unlike the scatter's, summed over ranks); ``lead_bytes``: what
    the leader loads before it sends, allowed for in the first wait. Returns (bytes received,
    bytes sent) by this rank. [Note: HSDP loads]."""
    leader = dist.get_global_rank(group, 0)
    sending = dist.get_rank(group) == 0
    received = sent = 0
    if tensors:  # the communicator, bounded; the leader arrives once its own load is done
        try:
            _fsdp2_ext.bounded_first_collective(
                group, tensors[0].device, timeout_s, allow_bytes=lead_bytes,
                allows_for=f"rank {leader}'s own load before it",
            )  # fmt: skip
        except RuntimeError as error:
            raise RuntimeError(
                f"init_sharded: the replicas' first collective with rank {leader} (their leader) "
                f"did not complete: {error}; rank {leader} died or stopped (see its log)"
            ) from error
    for bucket in _buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in bucket]
        numel = sum(t.numel() for t in members)
        if len(members) == 1:  # sent from, received into, the tensor itself
            flat = members[0].view(-1)
        elif sending:
            flat = torch.cat([t.reshape(-1) for t in members])
        else:
            flat = torch.empty(numel, dtype=members[0].dtype, device=members[0].device)
        seconds, bound = _fsdp2_ext.wait_bound(timeout_s, flat.nbytes, "the bucket")
        work = dist.broadcast(flat, src=leader, group=group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=seconds))
        except RuntimeError as error:
            raise RuntimeError(
                f"init_sharded: the replicas' broadcast from rank {leader} did not complete within "
                f"{bound} ({error}); rank {leader} died or stopped (see its log)"
            ) from error
        if sending:
            sent += flat.nbytes
            continue
        received += flat.nbytes
        if len(members) == 1:
            continue
        offset = 0
        for tensor in members:
            tensor.view(-1).copy_(flat[offset : offset + tensor.numel()])
            offset += tensor.numel()
    return received, sent
