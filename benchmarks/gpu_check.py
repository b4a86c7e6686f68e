"""GPU check: the load paths onto CUDA devices on VERL's process group, against the pinned bound.

    python benchmarks/gpu_check.py                                        # one GPU, ~2 GiB bf16
    torchrun --standalone --nproc-per-node=2 benchmarks/gpu_check.py      # >= 2 GPUs, one host
    python benchmarks/gpu_check.py --size-gib 0.05 --on-cpu               # the script itself, here

Every rank joins VERL's group as VERL makes it on a GPU host, ``cpu:gloo,cuda:nccl``
(``verl/utils/distributed.py``): the shards' bytes travel on the GPU (NCCL), verdicts and tables
on the CPU (Gloo) ([Note: transport device]). Three init sources, each on a Qwen2-shaped bf16
checkpoint written here:

- ``rank0``: rank 0 holds the state in pageable host memory. Its own rows go straight to its GPU
  (on a stream of their own); with >= 2 ranks every other rank's part of a bucket is packed into
  pinned host staging, copied to rank 0's GPU and scattered over NCCL, one scatter per bucket
  ([Note: the rank-0 transfer on NCCL]);
- ``local``: every rank maps the safetensors file and copies its own rows to its GPU;
- ``checkpoint``: the same from the checkpoint directory, the model built on meta.

Per path it reports the **load stage** (``report.stage_seconds["load"]``, apart from
``fully_shard``, adoption and verification) as host -> device GB/s, against a pinned host ->
device copy of the same bytes measured in the same run (goal: >= 70% of it; rank 0 of the rank-0
path copies every byte of the state, the others their shard), the peak GPU memory against the
shard bytes plus staging (goal: at most shards + one bucket per slot), exactness (every local shard
equal to the file's rows, atol=0) and, with >= 2 ranks, the c10d calls as torch's profiler saw them
(goal: ``nccl:scatter``, never ``nccl:send``/``nccl:recv``).

Then the frozen no-placement tables of a tiny qwen4_exp (checkpoint path): stored in the model's
dtype they are read-only views of the checkpoint file (same inode on every rank), stored in
another dtype they go to one host-shared file (``VERL_NO_PLACEMENT_MMAP_DIR``), and either way they
stay on the CPU while the shards are on the GPU.

Writes benchmarks/results/gpu_check.json (rank 0; ``--output``); exits 1 if a goal is missed or a load is not
exact. ``--on-cpu`` runs the same code on CPU ranks with ``cpu:gloo`` (no bound, no GPU goals):
a check of the script, not of a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "gpu_check.json")
BUCKET_BYTES = 64 << 20
VERL_GROUP = "cpu:gloo,cuda:nccl"  # verl/utils/distributed.py on a GPU host


def pinned_bound(nbytes: int, device: torch.device) -> float:
    """GB/s of one pinned host -> device copy of ``nbytes`` (best of 3)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del host, target
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def save_checkpoint(directory: str, size_gib: float) -> str:
    import transformers

    layers = max(1, int(size_gib * 2**30 / (2 * 11.2e6)))
    config = transformers.Qwen2Config(
        vocab_size=32768, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _exact(model, mapped: dict, rank: int, world: int) -> bool:
    """Every local shard equals its rows of the file (FSDP2's chunking), atol=0."""
    from fsdp2_ext import _fsdp2_ext

    for name, param in model.named_parameters():
        if name not in mapped:
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        rows = _fsdp2_ext.shard_rows(mapped[name].shape[0], world, rank)
        expected = mapped[name][rows.row_begin : rows.row_begin + rows.rows]
        if not torch.equal(local.detach().cpu(), expected):
            return False
    return True


def run_path(path: str, checkpoint: str, device: torch.device, profile_calls: bool) -> dict:
    import transformers
    from accelerate import init_empty_weights
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from fsdp2_ext.checkpoint.model_checkpoint import checkpoint_files
    from fsdp2_ext.checkpoint.safetensors_source import map_safetensors_state
    from fsdp2_ext.init.sharded_init import init_sharded

    rank, world = dist.get_rank(), dist.get_world_size()
    mapped = map_safetensors_state(checkpoint_files(checkpoint))
    with init_empty_weights():  # kernels off on meta (5.25 would kernelize it and raise)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=torch.bfloat16, use_kernels=False
        )
    model.requires_grad_(False)
    state = None
    if path == "rank0" and rank == 0:
        state = {k: v.clone() for k, v in mapped.items()}  # pageable, as a loaded state
    elif path == "local":
        state = mapped
    mesh = init_device_mesh(device.type, (world,))
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    with profile(activities=[ProfilerActivity.CPU]) if profile_calls else _nothing() as profiler:
        report = init_sharded(
            model,
            state,
            mesh=mesh,
            source=path,
            checkpoint=checkpoint if path == "checkpoint" else None,
            bucket_bytes=BUCKET_BYTES,
        )
        _synchronize(device)
    calls = (
        collections.Counter(
            e.name for e in profiler.events() if e.name.split(":")[0] in ("nccl", "gloo")
        )
        if profile_calls
        else {}
    )
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    load_s = report.stage_seconds["load"]
    # What crosses host -> device on this rank: rank 0 of the rank-0 path copies the whole state
    # (its rows, and every part it stages for the scatter); every other load, its own shard.
    h2d_bytes = report.local_shard_bytes
    if path == "rank0" and rank == 0:
        h2d_bytes = sum(t.nbytes for t in mapped.values())
    result = {
        "load_s": load_s,
        "init_sharded_s": sum(report.stage_seconds.values()),
        "fully_shard_s": report.stage_seconds.get("fully_shard", 0.0),
        "h2d_bytes": h2d_bytes,
        "h2d_gb_per_s": h2d_bytes / load_s / 1e9,
        "shard_bytes": report.local_shard_bytes,
        "peak_gpu_bytes": peak,
        "stages_s": {k: round(v, 4) for k, v in report.stage_seconds.items()},
        "exact": _exact(model, mapped, rank, world),
        "calls": dict(calls),
    }
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def check_tables(root: str, device: torch.device) -> dict:
    """qwen4_exp's tables through the checkpoint path: a view of the file, then host-shared."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.checkpoint.model_checkpoint import checkpoint_files
    from fsdp2_ext.common.procfs import mapped_inode
    from fsdp2_ext.init.meta_build import build_on_meta
    from fsdp2_ext.init.sharded_init import init_sharded
    from fsdp2_ext.testing.tiny_models import save_tiny_qwen4_exp

    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for case, stored in (("view", torch.bfloat16), ("host_shared", torch.float32)):
        directory = os.path.join(root, f"qwen4_{case}")
        shared_dir = os.path.join(root, f"shared_{case}")
        if rank == 0:
            save_tiny_qwen4_exp(directory, dtype=stored)
            os.makedirs(shared_dir, exist_ok=True)
        dist.barrier()
        model = build_on_meta(transformers.AutoModelForCausalLM, directory, dtype=torch.bfloat16)
        model.requires_grad_(False)  # LoRA-style: the base, tables included, is frozen
        report = init_sharded(
            model,
            None,
            mesh=init_device_mesh(device.type, (world,)),
            layer_class_names=model._no_split_modules,
            source="checkpoint",
            checkpoint=directory,
            host_shared_dir=shared_dir,
        )
        files = {os.stat(f).st_ino for f in checkpoint_files(directory)}
        tables = {fqn: model.get_parameter(fqn) for fqn in report.no_placement_fqns}
        inodes = {fqn: mapped_inode(t) for fqn, t in tables.items()}
        shards_on = {str(p.device) for n, p in model.named_parameters() if n not in tables}
        if case == "view":
            placed = all(i in files for i in inodes.values())
        else:
            placed = all(i != 0 and i not in files for i in inodes.values())
        gathered = [None] * world
        dist.all_gather_object(gathered, sorted(inodes.items()), group=dist.group.WORLD)
        results[case] = {
            "tables": len(tables),
            "on_cpu": all(t.device.type == "cpu" for t in tables.values()),
            "shards_on": sorted(shards_on),
            "placed": placed,
            "one_copy_per_host": all(g == gathered[0] for g in gathered),
        }
        del model
    return results


def _goals(path: str, result: dict, bound: float, world: int, on_cpu: bool) -> list[str]:
    missed = [] if result["exact"] else [f"{path}: not exact"]
    if world > 1 and path == "rank0":
        calls = result["calls"]
        if calls.get("nccl:send", 0) or calls.get("nccl:recv", 0) or calls.get("gloo:send", 0):
            missed.append(f"{path}: unbatched point-to-point calls {calls}")
        scatter = "gloo:scatter" if on_cpu else "nccl:scatter"
        if not calls.get(scatter, 0):
            missed.append(f"{path}: no {scatter} seen {calls}")
    if on_cpu:
        return missed
    if result["vs_pinned"] < 0.7:
        missed.append(f"{path}: load stage at {result['vs_pinned']:.0%} of the pinned bound")
    if result["peak_vs_shards_plus_staging"] > 1.0:
        missed.append(f"{path}: peak GPU memory above shards + staging")
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size-gib", type=float, default=2.0, help="checkpoint size (bf16)")
    parser.add_argument(
        "--on-cpu", action="store_true", help="CPU ranks on cpu:gloo: checks the script only"
    )
    parser.add_argument(
        "--output",
        help=f"the JSON report (default: {os.path.relpath(RESULTS)}; with --on-cpu, a temp file)",
    )
    args = parser.parse_args()
    output = args.output or (
        os.path.join(tempfile.gettempdir(), "gpu_check_on_cpu.json") if args.on_cpu else RESULTS
    )
    if not args.on_cpu and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here; run it on a GPU machine (or --on-cpu)", file=sys.stderr
        )
        return 2
    if "RANK" not in os.environ:  # plain python: a group of one
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.on_cpu:
        device = torch.device("cpu")
        dist.init_process_group("cpu:gloo")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(VERL_GROUP)
    rank, world = dist.get_rank(), dist.get_world_size()
    from fsdp2_ext import _fsdp2_ext

    transport = str(_fsdp2_ext.transport_device(dist.group.WORLD, device))
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world,
        "group": "cpu:gloo" if args.on_cpu else VERL_GROUP,
        "transport_device": transport,
        "size_gib": args.size_gib,
        "paths": {},
    }
    missed = [] if transport == str(device) else [f"data would travel on {transport}"]
    staging = 2 * BUCKET_BYTES  # two slots: rank 0's parts of a bucket sum to one bucket each
    with tempfile.TemporaryDirectory(prefix="fsdp2_ext_gpu_check_") as root:
        shared = [root]
        dist.broadcast_object_list(shared, src=0)  # one host: rank 0's directory for everyone
        checkpoint = os.path.join(shared[0], "model")
        if rank == 0:
            save_checkpoint(checkpoint, args.size_gib)
        dist.barrier()
        nbytes = sum(os.path.getsize(f) for f in _files(checkpoint))
        bound = 0.0 if args.on_cpu else pinned_bound(nbytes, device)
        report["pinned_bound_gb_per_s"] = bound
        for path in ("rank0", "local", "checkpoint"):
            result = run_path(path, checkpoint, device, profile_calls=world > 1)
            result["vs_pinned"] = result["h2d_gb_per_s"] / bound if bound else None
            result["peak_vs_shards_plus_staging"] = result["peak_gpu_bytes"] / (
                result["shard_bytes"] + staging
            )
            gathered = [None] * world
            dist.all_gather_object(gathered, result)
            report["paths"][path] = gathered
            for r, each in enumerate(gathered):
                missed += [f"rank {r}: {m}" for m in _goals(path, each, bound, world, args.on_cpu)]
            if rank == 0:
                for r, each in enumerate(gathered):
                    vs = f"{each['vs_pinned']:.0%} of pinned {bound:.2f}" if bound else "no bound"
                    print(
                        f"{path:<11} rank {r}: load stage {each['load_s']:.3f} s, "
                        f"{each['h2d_gb_per_s']:6.2f} GB/s H2D ({vs}); all stages "
                        f"{each['init_sharded_s']:.2f} s (fully_shard {each['fully_shard_s']:.2f}); "
                        f"peak {each['peak_gpu_bytes'] / 2**30:.2f} GiB for "
                        f"{each['shard_bytes'] / 2**30:.2f} GiB of shards; exact={each['exact']}"
                        + (f"; calls {each['calls']}" if each["calls"] else ""),
                        flush=True,
                    )
        tables = check_tables(shared[0], device)
        report["tables"] = tables
        for case, facts in tables.items():
            ok = facts["on_cpu"] and facts["placed"] and facts["one_copy_per_host"]
            ok = ok and facts["tables"] > 0 and facts["shards_on"] == [str(device)]
            if not ok:
                missed.append(f"tables ({case}): {facts}")
            if rank == 0:
                print(f"tables {case:<11} {facts}", flush=True)
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {output}; goals {'met' if not missed else 'MISSED: ' + '; '.join(missed)}")
    return 0 if not missed else 1


def _files(directory: str) -> list[str]:
    from fsdp2_ext.checkpoint.model_checkpoint import checkpoint_files

    return checkpoint_files(directory)


if __name__ == "__main__":
    sys.exit(main())
