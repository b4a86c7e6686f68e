"""Host-shared frozen tables: memory (PSS summed over ranks) and publish time, side by side.

    python benchmarks/bench_host_shared.py                  # N = 2 and 4 local ranks, 1 GiB table
    python benchmarks/bench_host_shared.py --table-gib 0.25

For each N, the same table is given to every rank twice: without sharing (rank 0 broadcasts,
every rank keeps its own CPU copy: what happens without VERL_NO_PLACEMENT_MMAP_DIR) and with
sharing (one file-backed copy per host, mapped read-only by every rank). PSS comes from
/proc/<pid>/smaps_rollup after the table is in place, summed over ranks, minus each rank's PSS
before it. Writes benchmarks/results/host_shared.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp2_ext.common.procfs import pss_bytes
from fsdp2_ext.testing.spawn import free_port

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "host_shared.json")


def worker(rank, world, port, table_bytes, shared, directory, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FSDP2_EXT_LOG_LEVEL="warn")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from fsdp2_ext import _fsdp2_ext
        from fsdp2_ext.tables.host_shared import share_tables_on_host

        rows = table_bytes // (2 * 1024)
        like = torch.empty(rows, 1024, dtype=torch.bfloat16, device="meta")
        source = torch.ones(rows, 1024, dtype=torch.bfloat16) if rank == 0 else like
        dist.barrier()
        before = pss_bytes() - (source.nbytes if rank == 0 else 0)  # the source is the caller's
        start = time.perf_counter()
        if shared:
            (table,), _ = share_tables_on_host(
                ["table"], [source], group=dist.group.WORLD, directory=directory
            )
        else:
            table = source if rank == 0 else torch.empty(rows, 1024, dtype=torch.bfloat16)
            _fsdp2_ext.broadcast_in_chunks(dist.group.WORLD, table, chunk_bytes=64 << 20)
        dist.barrier()
        seconds = time.perf_counter() - start
        del source  # with sharing, rank 0 drops its own copy once the mapping serves it
        table.sum(
            dtype=torch.float32
        )  # every rank reads every page (lookups touch all rows over time)
        queue.put((rank, pss_bytes() - before, seconds, float(table[0, 0])))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--table-gib", type=float, default=1.0)
    parser.add_argument("--local-ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--directory", default=None, help="node-local directory (default: a temp dir)"
    )
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    table_bytes = int(args.table_gib * 2**30) // 2048 * 2048
    runs = []
    with tempfile.TemporaryDirectory(dir=args.directory) as directory:
        for world in args.local_ranks:
            for shared in (False, True):
                queue = mp.get_context("spawn").SimpleQueue()
                mp.start_processes(
                    worker,
                    args=(world, free_port(), table_bytes, shared, directory, queue),
                    nprocs=world,
                    start_method="spawn",
                )
                rows = [queue.get() for _ in range(world)]
                assert all(r[3] == 1.0 for r in rows), "table values differ"
                assert os.listdir(directory) == [], "a shared file was left behind"
                runs.append(
                    {
                        "local_ranks": world,
                        "shared": shared,
                        "pss_bytes_sum": sum(r[1] for r in rows),
                        "publish_s": max(r[2] for r in rows),
                    }
                )
    print(f"\nhost-shared tables: {table_bytes / 2**30:.2f} GiB table, PSS summed over local ranks")
    print(f"{'ranks':>5} {'shared':>7} {'PSS sum GiB':>12} {'x table':>8} {'publish s':>10}")
    for run in runs:
        print(
            f"{run['local_ranks']:>5} {str(run['shared']):>7} {run['pss_bytes_sum'] / 2**30:>12.2f} "
            f"{run['pss_bytes_sum'] / table_bytes:>8.2f} {run['publish_s']:>10.3f}"
        )
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump({"table_bytes": table_bytes, "runs": runs}, handle, indent=2)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
