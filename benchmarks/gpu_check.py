"""GPU readiness: the load paths onto one CUDA device (world size 1), against the pinned bound.

    python benchmarks/gpu_check.py                 # ~2 GiB bf16, needs CUDA
    python benchmarks/gpu_check.py --size-gib 8

For each path, the whole full state goes host -> device through ``init_sharded`` (world size 1:
the local shard is the whole tensor, so every byte crosses PCIe once):

- ``rank0``:      rank 0's pageable CPU state, staged through pinned buckets;
- ``local``:      the same state mapped from a safetensors file (``source="local"``);
- ``checkpoint``: a Transformers checkpoint directory (``source="checkpoint"``);

and reports H2D GB/s against a pinned-memory copy of the same bytes measured in the same run
(goal: >= 70% of it) and the peak GPU memory against the shard bytes (goal: at most the shards
plus one bucket), plus exactness (every shard equal to its source, atol=0). Writes
benchmarks/results/gpu_check.json; exits 1 if a goal is missed or a load is not exact.
"""

from __future__ import annotations

import argparse
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


def run_path(path: str, checkpoint: str, device: torch.device) -> dict:
    import transformers
    from accelerate import init_empty_weights
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.model_checkpoint import checkpoint_files
    from fsdp2_ext.safetensors_source import map_safetensors_state
    from fsdp2_ext.sharded_init import init_sharded

    mapped = map_safetensors_state(checkpoint_files(checkpoint))
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    model.requires_grad_(False)
    state = None
    if path == "rank0":
        state = {k: v.clone() for k, v in mapped.items()}  # pageable, as a loaded state
    elif path == "local":
        state = mapped
    mesh = init_device_mesh("cuda", (1,))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    report = init_sharded(
        model,
        state,
        mesh=mesh,
        source=path,
        checkpoint=checkpoint if path == "checkpoint" else None,
        bucket_bytes=BUCKET_BYTES,
    )
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) - before
    shard_bytes = report.local_shard_bytes
    exact = all(
        torch.equal(p.to_local().cpu() if hasattr(p, "to_local") else p.cpu(), mapped[n])
        for n, p in model.named_parameters()
        if n in mapped
    )
    del model
    torch.cuda.empty_cache()
    return {
        "seconds": seconds,
        "h2d_gb_per_s": shard_bytes / seconds / 1e9,
        "shard_bytes": shard_bytes,
        "peak_gpu_bytes": peak,
        "stages_s": {k: round(v, 4) for k, v in report.stage_seconds.items()},
        "exact": exact,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    report = {"device": torch.cuda.get_device_name(device), "size_gib": args.size_gib}
    ok = True
    with tempfile.TemporaryDirectory(prefix="fsdp2_ext_gpu_check_") as root:
        checkpoint = save_checkpoint(os.path.join(root, "model"), args.size_gib)
        nbytes = sum(os.path.getsize(f) for f in _files(checkpoint))
        report["pinned_bound_gb_per_s"] = pinned_bound(nbytes, device)
        report["paths"] = {}
        for path in ("rank0", "local", "checkpoint"):
            result = run_path(path, checkpoint, device)
            result["vs_pinned"] = result["h2d_gb_per_s"] / report["pinned_bound_gb_per_s"]
            result["peak_vs_shards_plus_bucket"] = result["peak_gpu_bytes"] / (
                result["shard_bytes"] + BUCKET_BYTES
            )
            report["paths"][path] = result
            ok &= result["exact"] and result["vs_pinned"] >= 0.7
            ok &= result["peak_vs_shards_plus_bucket"] <= 1.0
            print(
                f"{path:<11} {result['h2d_gb_per_s']:6.2f} GB/s ({result['vs_pinned']:.0%} of "
                f"pinned {report['pinned_bound_gb_per_s']:.2f}), peak "
                f"{result['peak_gpu_bytes'] / 2**30:.2f} GiB for "
                f"{result['shard_bytes'] / 2**30:.2f} GiB of shards, exact={result['exact']}",
                flush=True,
            )
    dist.destroy_process_group()
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {RESULTS}; goals {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


def _files(directory: str) -> list[str]:
    from fsdp2_ext.model_checkpoint import checkpoint_files

    return checkpoint_files(directory)


if __name__ == "__main__":
    sys.exit(main())
