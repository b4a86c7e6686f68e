"""The trainer's cold start at a recipe's scale, on paper: what ``fsdp2-ext plan`` estimates.

[Note: cold-start projection]
Only the per-byte part of an init grows with the model; its fixed part (building on meta, PEFT
injection, ``fully_shard``, VERL's setup) grows with the number of modules and is reported as
measured on the benchmark's model, never scaled. The per-byte part of each init source is the
bytes it moves at the recipe's scale over the rate of the hardware that moves them (stated by
the caller: a host's disk, a rank's copy rate, rank 0's link), times the efficiency measured by
``benchmarks/bench_cold_start.py``: the method's marginal seconds per GiB over its bound's
(``memcpy_bound`` for per-rank copies, ``transport_bound`` for rank 0 sending), both from the
same run. Per init source, with S the text bytes of one rank's shards, T of all, W ranks and H
ranks per host:

- ``checkpoint``: every rank copies its S from the mapped checkpoint (S / copy rate); from a
  cold page cache each host reads its ranks' rows (H * S / disk rate) as the copies fault them
  in (the slower of the two), the tables never (they are views of the files);
- ``rank0``: rank 0 reads T (T / disk rate, cold) and sends (W - 1) / W * T over its link;
- ``verl`` (VERL alone, ``set_model_state_dict(broadcast_from_rank0=True)``): rank 0 reads T
  and builds the full model on its host, then broadcasts every tensor whole (T over its link at
  least), at the efficiency VERL reaches against ``transport_bound`` here.

On an HSDP layout (``fsdp_size`` F below W: R = W / F replicas, S the bytes of one rank's shards
at F, T = F * S one replica's) each source fills one replica as above over its shard group and
[Note: HSDP loads] adds, for ``rank0``, each leading rank's broadcast of its S along ``ddp``
(a pipelined broadcast: about S over each link, whatever R); ``checkpoint`` adds nothing but what
rank 0 makes (the adapters, any tensor converted on rank 0): every replica copies its own rows,
each host reading its ranks' rows once (replicas on one host share the page cache); VERL alone
still broadcasts T whole from rank 0 to all W ranks.

[Note: the tables' path at the recipe's scale]
The frozen tables (X bytes, the 95.37 GiB n-gram table) take one of four paths
(``table_placement``), which ``estimate_tables`` names with what it moves and how long the init
waits for it, and the bound of the longest wait on it ([Note: bounded waits], with the floor and
the bandwidth floor the environment sets, [Note: wait knobs]):

- ``views``: views of the local checkpoint files: nothing moves at the init (the page cache
  fills as lookups touch rows);
- ``host files, each host's own``: the checkpoint source with ``VERL_NO_PLACEMENT_MMAP_DIR``:
  each host's leader reads X from its own mapping (disk, cold) and writes it into its host's
  file (the copy rate): nothing crosses the network; the others wait in host sharing's "fill"
  for floor + X at the bandwidth floor;
- ``host files, sent by rank 0``: the rank-0 path with the directory: rank 0 writes X into host
  0's file and sends X to each other host's leader over its link (N - 1 copies);
- ``a copy per rank``: no directory: rank 0 assembles X and broadcasts it to every rank, each
  keeping its own (W x X on the hosts).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

GIB = 1 << 30
BENCHMARK_RESULTS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
    "benchmarks",
    "results",
    "cold_start.json",
)


@dataclass
class HardwareRates:
    """The rates the projection assumes, GiB/s (defaults: one H200 node of the recipe)."""

    disk_gibps: float = 6.0  # one host's NVMe, sequential reads (a cold page cache)
    copy_gibps: float = 10.0  # one rank copying mapped rows into its (pinned, then GPU) shards
    link_gibps: float = 40.0  # rank 0's egress to the other ranks (NCCL over NVLink and one NIC)


@dataclass
class MethodEstimate:
    method: str
    efficiency: float  # measured marginal / its bound's marginal (1.0 = at the bound)
    warm_s: float  # per-byte seconds, checkpoint in the page cache
    cold_s: float  # per-byte seconds, checkpoint read from disk first
    fixed_s_measured: float  # the fixed part measured on the benchmark model (not scaled)


@dataclass
class ColdStartEstimate:
    rates: HardwareRates
    text_bytes: int  # T: all sharded bytes
    shard_bytes_per_rank: int  # S
    world_size: int
    ranks_per_host: int
    measured_on: str  # the results file and model the efficiencies come from
    methods: list[MethodEstimate] = field(default_factory=list)


# The one benchmark model every method initialises (VERL alone cannot init qwen4_exp), grown as
# the recipe's model grows (the same layers, larger tensors): every method's efficiency comes
# from the same model and run.
REPRESENTATIVE_MODEL = "tied_qwen2"


def _efficiencies(results: dict) -> tuple[dict[str, tuple[float, float]], str]:
    """Method -> (marginal over its bound's marginal, fixed seconds): from REPRESENTATIVE_MODEL
    where it has the method and its bound, else the largest ratio among the other models."""
    bound_of = {
        "verl": "transport_bound",
        "fsdp2_ext_rank0": "transport_bound",
        "fsdp2_ext_checkpoint": "memcpy_bound",
    }
    chosen: dict[str, tuple[float, float, str]] = {}  # method -> (ratio, fixed s, model)
    models = results.get("models", {})
    for model in sorted(models, key=lambda name: name == REPRESENTATIVE_MODEL):
        methods = models[model]
        for method, bound in bound_of.items():
            if method not in methods or bound not in methods:
                continue
            ratio = methods[method]["marginal_s_per_gib"] / methods[bound]["marginal_s_per_gib"]
            if model == REPRESENTATIVE_MODEL or ratio >= chosen.get(method, (0.0,))[0]:
                chosen[method] = (ratio, methods[method]["fixed_s"], model)
    found = {method: (ratio, fixed) for method, (ratio, fixed, _) in chosen.items()}
    used = sorted({model for _, _, model in chosen.values()})
    return found, ", ".join(
        f"{m}: {', '.join(k for k, v in chosen.items() if v[2] == m)}" for m in used
    )


def estimate_cold_start(
    shard_bytes_per_rank: int,
    world_size: int,
    nodes: int,
    *,
    rates: HardwareRates | None = None,
    results_path: str = BENCHMARK_RESULTS,
    fsdp_size: int | None = None,
) -> ColdStartEstimate | None:
    """The projection of [Note: cold-start projection]; None without benchmark results.
    ``shard_bytes_per_rank``: at the shard group's size ``fsdp_size`` (default: the world)."""
    if not os.path.isfile(results_path):
        return None
    with open(results_path) as f:
        found, models = _efficiencies(json.load(f))
    if not found:
        return None
    rates = rates or HardwareRates()
    per_host = max(1, world_size // max(1, nodes))
    shard_world = world_size if fsdp_size is None or fsdp_size < 0 else fsdp_size
    total = shard_bytes_per_rank * shard_world  # one replica: the whole model once
    sent = total * (shard_world - 1) / shard_world
    if shard_world < world_size:  # each leading rank's broadcast along ddp ([Note: HSDP loads])
        sent += shard_bytes_per_rank
    read_by_rank0 = total / GIB / rates.disk_gibps
    per_byte = {
        "fsdp2_ext_checkpoint": (
            shard_bytes_per_rank / GIB / rates.copy_gibps,
            # a host's replicas read the same rows once (one page cache)
            min(per_host, shard_world) * shard_bytes_per_rank / GIB / rates.disk_gibps,
        ),
        "fsdp2_ext_rank0": (sent / GIB / rates.link_gibps, read_by_rank0),
        "verl": (total / GIB / rates.link_gibps, read_by_rank0),
    }
    estimate = ColdStartEstimate(
        rates, total, shard_bytes_per_rank, world_size, per_host, f"{results_path} ({models})"
    )
    for method in ("verl", "fsdp2_ext_rank0", "fsdp2_ext_checkpoint"):
        if method not in found:
            continue
        efficiency, fixed = found[method]
        moved, read = per_byte[method]
        warm = efficiency * moved
        # Per-rank copies overlap the reads they fault in; rank 0 reads the model, then sends.
        cold = max(warm, read) if method == "fsdp2_ext_checkpoint" else warm + read
        estimate.methods.append(MethodEstimate(method, efficiency, warm, cold, fixed))
    return estimate


@dataclass
class TableEstimate:
    """The tables' path at the init and its cost ([Note: the tables' path at the recipe's
    scale])."""

    path: str
    table_bytes: int
    network_bytes: int  # crossing between hosts
    seconds: float  # the init's time on the tables, cold page cache
    longest_wait_bound_s: float  # the bound of the wait on it ([Note: bounded waits])
    wait_floor_s: float
    min_bandwidth_mibps: float


def estimate_tables(
    table_bytes: int,
    *,
    world_size: int,
    nodes: int,
    init_source: str,
    shared_directory: bool,
    views: bool,
    rates: HardwareRates | None = None,
) -> TableEstimate | None:
    """The tables' path for a recipe's settings, and what it costs; None without tables."""
    from fsdp2_ext import _fsdp2_ext

    if not table_bytes:
        return None
    rates = rates or HardwareRates()
    floor = _fsdp2_ext.wait_floor_s()
    bandwidth = _fsdp2_ext.min_bandwidth_bytes_per_second()
    x = table_bytes / GIB
    if views:
        path, network, seconds, work = "views of the local checkpoint files", 0, 0.0, 0
    elif shared_directory and init_source == "checkpoint":
        path = "host files, each host's leader from its own mapping (no network)"
        network, seconds, work = 0, x / rates.disk_gibps + x / rates.copy_gibps, table_bytes
    elif shared_directory:
        path = "host files, rank 0 writes host 0's and sends one to each other host's leader"
        network = table_bytes * (nodes - 1)
        seconds = x / rates.copy_gibps + network / GIB / rates.link_gibps
        work = table_bytes * (2 + nodes - 1)  # write, read to send, send (host sharing's fill)
    else:
        path = "a copy per rank, broadcast from rank 0"
        network = table_bytes * (world_size - world_size // max(nodes, 1))
        seconds = x / rates.copy_gibps + x / rates.link_gibps
        work = table_bytes  # rank 0 assembling it before its first chunk
    bound = _fsdp2_ext.wait_bound(floor, int(work), "")[0]
    return TableEstimate(path, table_bytes, network, seconds, bound, floor, bandwidth / (1 << 20))


def format_tables(estimate: TableEstimate) -> str:
    return (
        f"    no-placement tables ({estimate.table_bytes / GIB:,.2f} GiB): {estimate.path}; "
        f"~{estimate.seconds:,.0f} s cold, {estimate.network_bytes / GIB:,.2f} GiB between hosts; "
        f"the longest wait on them is bounded by {estimate.longest_wait_bound_s:,.0f} s (floor "
        f"{estimate.wait_floor_s:g} s + their bytes at {estimate.min_bandwidth_mibps:g} MiB/s: "
        "FSDP2_EXT_WAIT_FLOOR_S, FSDP2_EXT_MIN_BANDWIDTH_MIB_S)"
    )


def format_cold_start(estimate: ColdStartEstimate) -> str:
    rates = estimate.rates
    lines = [
        "  cold start, trainer side (estimate, [Note: cold-start projection] in "
        "fsdp2_ext/plan/cold_start.py):",
        f"    moves {estimate.text_bytes / GIB:,.1f} GiB of shards, "
        f"{estimate.shard_bytes_per_rank / GIB:,.2f} GiB per rank; assumes disk "
        f"{rates.disk_gibps:g} GiB/s per host, copy {rates.copy_gibps:g} GiB/s per rank, "
        f"rank 0's link {rates.link_gibps:g} GiB/s; efficiencies from {estimate.measured_on}",
    ]
    for m in estimate.methods:
        fixed = (
            f"{m.fixed_s_measured:.1f} s on the benchmark's model"
            if m.fixed_s_measured >= 0
            else "its sweep curves upward: no intercept"
        )
        lines.append(
            f"    {m.method:<21} per-byte {m.warm_s:8.1f} s warm cache, {m.cold_s:8.1f} s cold "
            f"(x{m.efficiency:.2f} its bound), + fixed part ({fixed})"
        )
    return "\n".join(lines)
