"""The transport bound both full-state benchmarks measure rank-0 loads against."""

from __future__ import annotations

import threading
import time


def rows_of(tensor, world: int, rank: int):
    """FSDP2's Shard(0) rows of ``rank`` in ``tensor`` (a view)."""
    from fsdp2_ext._fsdp2_ext import shard_rows

    split = shard_rows(tensor.shape[0], world, rank)
    return tensor.narrow(0, split.row_begin, split.rows)


def send_rows_from_rank0(state: dict, world: int, rank: int) -> tuple[float, bool, int]:
    """Rank 0 sends each other rank its Shard(0) rows of every tensor of ``state`` straight from
    it (rows of a tensor are contiguous: nothing to pack), copying its own rows meanwhile on a
    second thread; the others receive into fresh memory, as a load's shards. Every rank passes
    the full values (rank 0 the ones it sends; the others for the check). Returns (seconds,
    exact: this rank's rows equal ``state``'s, bytes sent)."""
    import torch
    import torch.distributed as dist

    received = (
        {}
        if rank == 0
        else {n: torch.empty_like(rows_of(t, world, rank)) for n, t in state.items()}
    )
    own: dict = {}
    sent = 0
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        copier = threading.Thread(
            target=lambda: own.update({n: rows_of(t, world, 0).clone() for n, t in state.items()})
        )
        copier.start()
        works = []
        for r in range(1, world):
            for tensor in state.values():
                rows = rows_of(tensor, world, r)
                if rows.numel():
                    works.append(dist.isend(rows.reshape(-1).view(torch.uint8), dst=r))
                    sent += rows.nbytes
        for work in works:
            work.wait()
        copier.join()
    else:
        works = [
            dist.irecv(t.reshape(-1).view(torch.uint8), src=0)
            for t in received.values()
            if t.numel()
        ]
        for work in works:
            work.wait()
    seconds = time.perf_counter() - start
    mine = own if rank == 0 else received
    exact = all(torch.equal(mine[n], rows_of(t, world, rank)) for n, t in state.items())
    return seconds, exact, sent
