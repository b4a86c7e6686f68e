"""A resume on another number of ranks against the same-W resume, side by side, and the copy bound.

    python benchmarks/bench_reshard_load.py                 # 0.5 GiB of parameters (+ AdamW x2)
    python benchmarks/bench_reshard_load.py --model-gib 0.25 --repeats 3

One FSDP2 model (fp32 linears with odd row counts) and its AdamW state, after one step, saved in
VERL's per-rank format (``torch.save(model.state_dict())`` and ``optimizer.state_dict()`` per
rank, as ``FSDPCheckpointManager.save_checkpoint`` writes them) by 2 ranks and, the same state,
by 4 ranks. Then on 2 ranks, through VERL's own ``FSDPCheckpointManager.load_checkpoint`` with
the shim: the 2-rank save (VERL's own path) and the 4-rank save (resharded), alternating,
``--repeats`` times; the bound is one copy of a rank's bytes (``torch.Tensor.copy_`` of the
same size, fresh source pages), measured in the same run. Page cache warm (files just written).
Per load, the peak resident memory above the RSS at its start (``VmHWM`` after a reset by
``/proc/self/clear_refs``), worst rank: what the load itself adds (file pages it maps included). Writes
benchmarks/results/reshard_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

from fsdp2_ext.testing.spawn import gather_results, run_distributed

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "reshard_load.json")


def _model(model_bytes: int) -> nn.Module:
    layers = 8
    width = int((model_bytes / 4 / layers) ** 0.5) | 1  # odd: uneven shards
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _sharded(model_bytes, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(model_bytes)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    model(torch.randn(4, model[0].in_features)).sum().backward()
    optimizer.step()
    dist.barrier()
    return model, optimizer


def _save(rank, world, model_bytes, directory):
    model, optimizer = _sharded(model_bytes, world)
    path = os.path.join(directory, f"saved_{world}")
    os.makedirs(path, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(path, f"model_world_size_{world}_rank_{rank}.pt"))
    torch.save(
        optimizer.state_dict(), os.path.join(path, f"optim_world_size_{world}_rank_{rank}.pt")
    )
    extra = {"lr_scheduler": None, "rng": None}
    torch.save(extra, os.path.join(path, f"extra_state_world_size_{world}_rank_{rank}.pt"))


def _manager(model, optimizer):
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    contents = ["model", "optimizer", "extra"]
    config = OmegaConf.create({"load_contents": contents, "save_contents": contents})
    manager = FSDPCheckpointManager(model, optimizer, checkpoint_config=config)
    manager.load_rng_state = lambda state: None  # the benchmark saved none
    return manager


def _load(rank, world, model_bytes, directory, repeats):
    import torch.distributed as dist

    import fsdp2_ext.verl  # noqa: F401  (the shim: the resharded path)

    model, optimizer = _sharded(model_bytes, world)
    manager = _manager(model, optimizer)
    local = sum(p.to_local().nbytes for p in model.parameters())
    local += 2 * local  # exp_avg, exp_avg_sq
    times = {"same_w": [], "resharded": [], "copy_bound": []}
    peaks = {"same_w": 0, "resharded": 0}
    for _ in range(repeats):
        for name, source in (("same_w", "saved_2"), ("resharded", "saved_4")):
            dist.barrier()
            before = _rss_reset_peak()
            start = time.perf_counter()
            manager.load_checkpoint(os.path.join(directory, source))
            times[name].append(time.perf_counter() - start)
            peaks[name] = max(peaks[name], _status("VmHWM") - before)
        # the bound: one copy of a rank's bytes between pages already touched, as a load's are
        source = torch.empty(local, dtype=torch.uint8).fill_(1)
        target = torch.empty(local, dtype=torch.uint8).fill_(0)
        start = time.perf_counter()
        target.copy_(source)
        times["copy_bound"].append(time.perf_counter() - start)
        del source, target
    return {"times": times, "bytes_per_rank": local, "peak_above_before": peaks}


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key + ":"))


def _rss_reset_peak() -> int:
    """Resets VmHWM to the current RSS (``clear_refs`` 5) and returns that RSS."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _status("VmRSS")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-gib", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model_bytes = int(args.model_gib * 2**30)
    env = {"FSDP2_EXT_LOG_LEVEL": "warn"}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as directory:
        for world in (2, 4):
            run_distributed(world, _save, model_bytes, directory, env=env)
        reports = gather_results(2, _load, model_bytes, directory, args.repeats, env=env)
    medians = {
        name: max(statistics.median(reports[r]["times"][name]) for r in reports)
        for name in ("same_w", "resharded", "copy_bound")
    }
    result = {
        "model_gib": args.model_gib,
        "world_saved": [2, 4],
        "world_loaded": 2,
        "bytes_per_rank": reports[0]["bytes_per_rank"],
        "median_s": medians,
        "resharded_over_same_w": medians["resharded"] / medians["same_w"],
        "same_w_over_bound": medians["same_w"] / medians["copy_bound"],
        "resharded_over_bound": medians["resharded"] / medians["copy_bound"],
        "peak_above_before_gib": {
            name: max(reports[r]["peak_above_before"][name] for r in reports) / 2**30
            for name in ("same_w", "resharded")
        },
        "torch": torch.__version__,
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as out:
        json.dump(result, out, indent=2)
    print(
        f"resume of {args.model_gib:.2f} GiB of parameters + AdamW on 2 Gloo ranks "
        f"({result['bytes_per_rank'] / 2**30:.2f} GiB per rank), median of {args.repeats}:\n"
        f"  same W (VERL's path, 2-rank save)  {medians['same_w']:.3f} s  "
        f"x{result['same_w_over_bound']:.2f} the copy bound\n"
        f"  resharded (4-rank save)            {medians['resharded']:.3f} s  "
        f"x{result['resharded_over_bound']:.2f} the copy bound, "
        f"x{result['resharded_over_same_w']:.2f} the same-W load\n"
        f"  copy bound (one copy of a rank's bytes) {medians['copy_bound']:.3f} s\n"
        f"  peak RSS above the start of a load, worst rank: same W "
        f"{result['peak_above_before_gib']['same_w']:.2f} GiB, resharded "
        f"{result['peak_above_before_gib']['resharded']:.2f} GiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
