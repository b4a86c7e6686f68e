"""The bounded agreement every stage uses: which host a rank is on, a wait on another rank within
[Note: bounded waits]'s bound, and ``all_gather_object`` built from such waits.

A failed wait names this rank, what it waited for, and the peer (or "one of the ranks"), so that
the error a surviving rank raises says who most likely died or stopped.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket

import torch
import torch.distributed as dist

from fsdp2_ext import _fsdp2_ext

__all__ = ["ENV_HOST_ID", "bounded_wait", "gather_objects", "host_id"]

ENV_HOST_ID = "FSDP2_EXT_HOST_ID"


def host_id() -> str:
    """This rank's host: ``$FSDP2_EXT_HOST_ID`` (tests simulate hosts with it), else the hostname."""
    return os.environ.get(ENV_HOST_ID) or socket.gethostname()


def bounded_wait(
    work, group, peer: int | None, what: str, timeout_s: float, nbytes: int = 0,
    allows_for: str = "",
) -> None:  # fmt: skip
    """``work.wait`` within the bound of [Note: bounded waits] for ``nbytes`` of the peers' work
    (``allows_for`` says what that work is); a failure names this rank, ``what`` and the peer."""
    seconds, bound = _fsdp2_ext.wait_bound(timeout_s, nbytes, allows_for)
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except Exception as error:
        rank = dist.get_rank(group)
        who = f"rank {peer}" if peer is not None else "one of the ranks"
        raise RuntimeError(
            f"rank {rank}: {what}"
            + (f" with rank {peer}" if peer is not None else "")
            + f" failed within {bound}: {error} -- {who} has most likely died or stopped"
        ) from error


def gather_objects(
    obj, group, what: str, timeout_s: float, allow_bytes: int = 0, allows_for: str = ""
) -> list:
    """``all_gather_object`` with bounded waits (pickled bytes, padded to the longest); the first
    wait allows for ``allow_bytes`` of work the other ranks may still do before it."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    work = dist.all_gather(sizes, torch.tensor([payload.numel()]), group=group, async_op=True)
    bounded_wait(work, group, None, f"{what} (sizes)", timeout_s, allow_bytes, allows_for)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    work = dist.all_gather(gathered, padded, group=group, async_op=True)
    bounded_wait(work, group, None, what, timeout_s, longest * world)
    return [pickle.loads(g[: int(n.item())].numpy().tobytes()) for g, n in zip(gathered, sizes)]
