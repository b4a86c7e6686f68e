"""Side-by-side full-state load benchmark: fsdp2_ext vs torch's loader vs the memcpy bound.

    python benchmarks/bench_full_state_load.py                    # 2 Gloo ranks, ~1 GiB bf16 model
    python benchmarks/bench_full_state_load.py --size-gib 0.25 --repeats 3

Every run starts fresh ranks (a cold start: first-touch page faults and first calls included, so
peak RSS is the method's own); `--repeats` rounds, the methods interleaved within each round, on
the same synthetic Qwen2-shaped bf16 model. The table reports the median wall time of the load
itself (each run's slowest rank; all runs in the JSON), the peak RSS summed over ranks, bytes
sent, whether every local shard equals the full state's rows exactly, and rank 0's stages.

- fsdp2_ext_rank0:       init_sharded(source="rank0"): rank 0 scatters bucketed per-rank rows
- fsdp2_ext_host_shared: init_sharded(source="local") from a host-shared mmap of the full state
- torch_dcp:             fully_shard + set_model_state_dict(full_state_dict, broadcast_from_rank0)
- memcpy_bound:          each rank copies its own rows from the same mmap (no FSDP, no checks)
- transport_bound:       rank 0 sends each other rank its rows of every tensor straight from its
                         full state (Gloo; rows are contiguous, nothing packed), overlapped with
                         its copy of its own rows (a second thread); the others receive into
                         fresh memory: the bound of any rank-0 load over this transport
Writes benchmarks/results/full_state_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fsdp2_ext.testing.spawn import free_port
from rank0_bound import rows_of

RESULTS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "full_state_load.json"
)


class Layer(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden // 4)
        self.v_proj = nn.Linear(hidden, hidden // 4)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.norm = nn.LayerNorm(hidden)


class SyntheticQwen2(nn.Module):
    _no_split_modules = ["Layer"]

    def __init__(
        self, layers: int, hidden: int = 1024, inter: int = 2816, vocab: int = 32003
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, inter) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


def layers_for(size_gib: float) -> int:
    per_layer = sum(p.numel() for p in Layer(1024, 2816).parameters()) * 2
    fixed = 2 * 32003 * 1024 * 2
    return max(1, round((size_gib * 2**30 - fixed) / per_layer))


def build(rank: int, layers: int, on_meta: bool) -> SyntheticQwen2:
    if on_meta:
        with torch.device("meta"):
            return SyntheticQwen2(layers).to(torch.bfloat16)
    torch.manual_seed(0)
    model = SyntheticQwen2(layers).to(torch.bfloat16)
    return model


def _rows(dim0: int, world: int, rank: int) -> tuple[int, int, int]:
    """FSDP2's Shard(0) rows of ``rank``: (row_begin, rows, padded_rows)."""
    from fsdp2_ext._fsdp2_ext import shard_rows

    split = shard_rows(dim0, world, rank)
    return split.row_begin, split.rows, split.padded_rows


def check_exact(model: nn.Module, full: dict[str, torch.Tensor], rank: int, world: int) -> bool:
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if not torch.equal(local, rows_of(full[name], world, rank)):
            return False
    return True


def run_method(
    method: str, rank: int, world: int, layers: int, state_path: str
) -> tuple[float, bool, int, dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.init.sharded_init import init_sharded
    from fsdp2_ext.testing.compare import load_like_verl_today

    mesh = init_device_mesh("cpu", (world,))
    mapped = torch.load(state_path, mmap=True, weights_only=True)
    if method == "memcpy_bound":
        dist.barrier()
        start = time.perf_counter()
        shards = {}
        for name, tensor in mapped.items():
            begin, rows, padded = _rows(tensor.shape[0], world, rank)
            buffer = torch.empty((padded, *tensor.shape[1:]), dtype=tensor.dtype)
            buffer[:rows].copy_(tensor[begin : begin + rows])
            shards[name] = buffer
        seconds = time.perf_counter() - start
        dist.barrier()
        own = {n: rows_of(t, world, rank) for n, t in mapped.items()}
        exact = all(torch.equal(shards[n][: len(own[n])], own[n]) for n in own)
        return seconds, exact, 0, {}
    if method == "transport_bound":
        return transport_bound(rank, world, mapped)
    # Same start for every method: the model on meta everywhere, the full state on rank 0's CPU
    # (a clone of the mapped file, touched before the clock starts) or, host-shared, the mapping.
    model = build(rank, layers, on_meta=True)
    full = (
        {k: v.clone() for k, v in mapped.items()}
        if (rank == 0 and method != "fsdp2_ext_host_shared")
        else None
    )
    dist.barrier()
    start = time.perf_counter()
    sent = 0
    stages = {}
    if method == "fsdp2_ext_rank0":
        report = init_sharded(model, full, mesh=mesh, tied=False)
        sent, stages = report.bytes_sent, report.stage_seconds
    elif method == "fsdp2_ext_host_shared":
        init_sharded(model, mapped, mesh=mesh, tied=False, source="local")
    elif method == "torch_dcp":
        load_like_verl_today(model, full, mesh, rank, tied=False)
        sent = sum(t.nbytes for t in mapped.values()) * (world - 1) if rank == 0 else 0
    seconds = time.perf_counter() - start
    dist.barrier()
    return seconds, check_exact(model, mapped, rank, world), sent, stages


def transport_bound(rank: int, world: int, mapped: dict) -> tuple[float, bool, int, dict]:
    """Rank 0 sends each rank its rows of its full state (a clone of the mapping, as the rank-0
    methods start from; ``send_rows_from_rank0``)."""
    from rank0_bound import send_rows_from_rank0

    full = {k: v.clone() for k, v in mapped.items()} if rank == 0 else mapped
    seconds, exact, sent = send_rows_from_rank0(full, world, rank)
    dist.barrier()
    return seconds, exact, sent, {}


def worker(rank, world, port, method, layers, state_path, repeats, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FSDP2_EXT_LOG_LEVEL="warn")
    torch.set_num_threads(1)  # one core per rank, as one GPU per rank: no oversubscription
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        runs = [run_method(method, rank, world, layers, state_path) for _ in range(repeats)]
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        queue.put(
            (rank, [r[0] for r in runs], all(r[1] for r in runs), runs[-1][2], peak, runs[-1][3])
        )
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=[
            "fsdp2_ext_rank0",
            "fsdp2_ext_host_shared",
            "torch_dcp",
            "memcpy_bound",
            "transport_bound",
        ],
    )
    args = parser.parse_args()
    layers = layers_for(args.size_gib)
    methods = args.methods
    with tempfile.TemporaryDirectory() as directory:
        state_path = os.path.join(directory, "full_state.pt")
        state = build(0, layers, on_meta=False).state_dict()
        model_bytes = sum(t.nbytes for t in state.values())
        torch.save(state, state_path)
        del state
        runs = {method: [] for method in methods}
        for _ in range(args.repeats):  # interleaved, each run in fresh ranks: a cold start each
            for method in methods:
                queue = mp.get_context("spawn").SimpleQueue()
                mp.start_processes(
                    worker,
                    args=(args.world_size, free_port(), method, layers, state_path, 1, queue),
                    nprocs=args.world_size,
                    start_method="spawn",
                )
                rows = [queue.get() for _ in range(args.world_size)]
                runs[method].append(
                    {
                        "wall_s": max(r[1][0] for r in rows),
                        "peak_rss_bytes_sum": sum(r[4] for r in rows),
                        "bytes_sent": sum(r[3] for r in rows),
                        "exact": all(r[2] for r in rows),
                        "stages_s": next(r[5] for r in rows if r[0] == 0),
                    }
                )
        results = {}
        for method, method_runs in runs.items():
            walls = [r["wall_s"] for r in method_runs]
            median = sorted(method_runs, key=lambda r: r["wall_s"])[len(method_runs) // 2]
            results[method] = {
                "wall_s": statistics.median(walls),
                "peak_rss_bytes_sum": max(r["peak_rss_bytes_sum"] for r in method_runs),
                "bytes_sent": median["bytes_sent"],
                "exact": all(r["exact"] for r in method_runs),
                "runs_wall_s": walls,
            }
            if median["stages_s"]:  # rank 0's stages in the median run
                results[method]["stages_s"] = {
                    k: round(v, 4) for k, v in median["stages_s"].items()
                }
    print(
        f"\nfull-state load, {model_bytes / 2**30:.2f} GiB bf16, {args.world_size} Gloo ranks, median of {args.repeats}"
    )
    print(
        f"{'method':<24}{'wall s':>9}{'vs torch':>10}{'peak RSS sum GiB':>18}{'sent GiB':>10}{'exact':>7}"
    )
    base = results.get("torch_dcp", next(iter(results.values())))
    for name, row in results.items():
        print(
            f"{name:<24}{row['wall_s']:>9.3f}{row['wall_s'] / base['wall_s']:>10.3f}"
            f"{row['peak_rss_bytes_sum'] / 2**30:>18.2f}{row['bytes_sent'] / 2**30:>10.2f}{str(row['exact']):>7}"
        )
    if "fsdp2_ext_rank0" in results and "transport_bound" in results:
        ratio = results["fsdp2_ext_rank0"]["wall_s"] / results["transport_bound"]["wall_s"]
        print(f"fsdp2_ext_rank0 / transport_bound: {ratio:.2f}")
        print(f"fsdp2_ext_rank0 stages (rank 0): {results['fsdp2_ext_rank0'].get('stages_s')}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(
            {"model_bytes": model_bytes, "world_size": args.world_size, "methods": results},
            handle,
            indent=2,
        )
    print(f"wrote {args.output}")
    return 0 if all(r["exact"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
