"""Cold start through VERL's engine: checkpoint files -> an initialised TrainingWorker, 2 Gloo ranks,
swept over checkpoint sizes so that fixed cost and per-byte cost come apart.

    python benchmarks/bench_cold_start.py                       # 0.5, 1, 2 GiB (~15 min)
    python benchmarks/bench_cold_start.py --sizes 0.5 1 2 3     # more sizes (longer)
    python benchmarks/bench_cold_start.py --sizes 0.5 1 --methods fsdp2_ext_checkpoint memcpy_bound

At each size two bf16 checkpoints are written with ``save_pretrained`` and kept in the page cache
(each run reads them once first, so every method starts from the same warm cache):

- ``qwen4_exp``: a text model (MoE experts stored per expert, as Transformers saves them) plus two
  n-gram no-placement tables (~a fifth of the bytes);
- ``tied_qwen2``: a tied dense model of about the same bytes (8 layers at every size, grown by
  width: vocabulary and MLP), for ``verl``: VERL alone cannot
  initialise qwen4_exp (its FSDP2 sharding of the CPU tables fails), so VERL's figure comes from the
  tied variant, where it builds the full model on every rank.

Methods (each in fresh ranks; ``worker.reset()`` timed: model build, PEFT, FSDP2, optimizer, with
the imports of a first build done before the clock), LoRA 16 on all linear layers, model dtype
bf16, as the recipe. The bounds run in ranks with the same history (VERL's worker built, the
imports done, untimed), so that a bound and a method copy into memory of the same process state:

- ``verl``:                 VERL alone (rank 0 reads the model; tied: every rank does);
- ``fsdp2_ext_rank0``:      the shim: ranks > 0 on meta also for tied models (built from the
  config, reading nothing), rank 0 sends rows; tables are views of the checkpoint file where
  rank 0's values are its bytes (they are here), else shared per host
  (``VERL_NO_PLACEMENT_MMAP_DIR``, a fresh directory beside the checkpoints, as the recipe
  requires);
- ``fsdp2_ext_checkpoint``: the shim with ``FSDP2_EXT_INIT_SOURCE=checkpoint``: every rank builds
  on meta reading nothing and copies its own rows from the mapped safetensors; tables are views of
  the checkpoint file;
- ``memcpy_bound``:         each rank maps the files and copies its own rows of every text tensor
  into fresh memory (no VERL, no FSDP): the bound of any per-rank load;
- ``transport_bound``:      rank 0 sends each rank its rows of every tensor straight from the
  mapped files, copying its own rows meanwhile: the bound of any rank-0 load over this transport;
- ``table_file_bound``:     (qwen4_exp) rank 0 writes the n-gram tables into a fresh file in the
  host-shared directory as the host-shared placement does, every rank maps it: the bound of
  placing the tables once per host, the rank-0 path's work where rank 0's tables are not the
  checkpoint's bytes (before 2026-12-03, always);
- ``transport_after_build_bound``: (qwen4_exp) ``transport_bound`` in ranks whose rank 0 first
  built the model with ``from_pretrained`` (untimed, kept), as the rank-0 path's rank 0 has when
  its transfer starts: the transport bound in that path's memory state (rank 0's stacked experts
  are fresh memory, and on this VM fresh memory past the first GiBs is slow to touch);
- ``verl_build``:           (qwen4_exp) VERL alone, timed as far as it gets: its model build
  (``from_pretrained`` on every rank: under VERL's ``init_empty_weights`` Transformers still
  reads and converts the checkpoint on ranks > 0; rank 0's is the very call the rank-0 path's
  rank 0 makes), before its FSDP2 sharding of the CPU tables fails (the failure is required; its
  text is kept in the run). What VERL's own build costs per byte on this model.

Per method and model, ``benchmarks/results/cold_start.json`` holds ``sizes`` (every run:
``checkpoint_gib``, ``wall_s`` of the slowest rank, ``anon_bytes_sum_peak`` summed over ranks,
sampled every 50 ms, and ``pss_bytes_sum_end``, once initialised, both above the imports' baseline,
``stages`` per rank, ``exact``, ``disk_read_bytes``: what the host read from disk during the run,
~0 from a warm page cache; ``dirty_bytes_at_start``, the host's page cache still to be written back
when the clock starts, ~0 as the checkpoints are synced once written; at the first size also
``bytes_read``, what one more run from an evicted page cache read from the files), and the
least-squares lines over them: ``fixed_s`` and ``marginal_s_per_gib`` for wall time,
``anon_fixed_gib`` and ``anon_gib_per_gib`` for anonymous memory, ``stage_marginal_s_per_gib`` for
each stage (its slowest rank's seconds). ``exact``: each rank's local shards hash as the reference
method's at the same size (``verl`` for the tied model, ``fsdp2_ext_rank0`` for qwen4_exp;
adapters' random A excluded, see tests/checkpoint/test_model_checkpoint_load.py; ``null`` for ``verl_build``,
which builds no shards). The plot of wall time against size goes to docs/cold_start.png.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time

from fsdp2_ext.testing.spawn import free_port, leave_cleanly

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cold_start.json")
PLOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "cold_start.png")  # fmt: skip
METHODS = (
    "verl", "fsdp2_ext_rank0", "fsdp2_ext_checkpoint", "memcpy_bound", "transport_bound",
    "table_file_bound", "verl_build", "transport_after_build_bound",
)  # fmt: skip
BOUNDS = ("memcpy_bound", "transport_bound", "table_file_bound", "transport_after_build_bound")
# VERL alone cannot init qwen4_exp (verl_build times it as far as it gets); the tied model has no
# tables to place.
PLAN = {"tied_qwen2": METHODS[:5], "qwen4_exp": METHODS[1:]}
VERL_ALONE = ("verl", "verl_build")
REFERENCE = {"tied_qwen2": "verl", "qwen4_exp": "fsdp2_ext_rank0"}
GIB_PER_SCALE = 1.13  # checkpoint GiB of save_models(scale=1), either model
SAMPLE_S = 0.05
TIED_LAYERS = 8  # tied_qwen2's layers at every size


def save_models(root: str, scale: float) -> dict[str, str]:
    import torch
    import transformers

    from fsdp2_ext.testing.tiny_models import tiny_qwen4_exp_kwargs

    paths = {
        "qwen4_exp": os.path.join(root, "qwen4_exp"),
        "tied_qwen2": os.path.join(root, "qwen2"),
    }
    vocab = int(131072 * scale) // 64 * 64
    kwargs = tiny_qwen4_exp_kwargs()
    kwargs.update(
        vocab_size=vocab, hidden_size=1024, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "indexed_attention", "indexed_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, indexer_head_dim=128,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
        linear_num_value_heads=8, moe_intermediate_size=512, shared_expert_intermediate_size=1024,
        num_experts=max(4, int(32 * scale)), num_experts_per_tok=2, ple_embed_dim=256,
        ngram_vocab_size_base=int(262144 * scale), max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of a 4 GiB model
    try:
        model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**kwargs))
    finally:
        torch.set_default_dtype(torch.float32)
    model.to(torch.bfloat16).save_pretrained(paths["qwen4_exp"])
    qwen4_bytes = sum(p.nbytes for p in model.parameters())
    del model
    # The tied model grows by width at a fixed layer count, as a model family grows at the
    # recipe's scale: its per-module costs (PEFT, fully_shard) stay fixed, only bytes grow.
    attention_bytes = 2 * (2 * 1024 * 1024 + 2 * 1024 * 256)
    per_layer = (qwen4_bytes - 2 * vocab * 1024) / TIED_LAYERS - attention_bytes
    intermediate = max(64, int(per_layer // (2 * 3 * 1024)) // 64 * 64)
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=1024, intermediate_size=intermediate,
        num_hidden_layers=TIED_LAYERS, num_attention_heads=8, num_key_value_heads=2,
        tie_word_embeddings=True, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(paths["tied_qwen2"])
    return paths


def checkpoint_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )


def resident_bytes(path: str) -> int:
    """Bytes of the checkpoint files in the page cache (mincore over a fresh mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    total = 0
    for name in os.listdir(path):
        size = os.path.getsize(os.path.join(path, name))
        if not size:
            continue
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            pages = -(-size // mmap.PAGESIZE)
            vector = (ctypes.c_ubyte * pages)()
            libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector)
            total += sum(v & 1 for v in vector) * mmap.PAGESIZE
            libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
        finally:
            os.close(fd)
    return total


def evict(path: str) -> None:
    os.sync()
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(path: str) -> None:
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            while f.read(64 << 20):
                pass


def shard_digest(tensors) -> str:
    import torch

    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        local = local.detach().contiguous().cpu()
        digest.update(name.encode())
        # Hashed in place (the buffer protocol): a ``tobytes()`` copy of the largest tensor would
        # count in the run's peak anonymous memory.
        digest.update(memoryview(local.view(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def warm_imports(path: str) -> None:
    """What the first model build imports (VERL resolves its auto class by importing every
    Transformers model module, ~1.5 s here): a process pays it once, whatever the loader."""
    import accelerate  # noqa: F401
    import peft.tuners.lora  # noqa: F401
    import transformers
    from verl.utils.model import get_hf_auto_model_class

    get_hf_auto_model_class(hf_config=transformers.AutoConfig.from_pretrained(path))


def time_stages(stages: dict[str, float]) -> None:
    """Per-stage clocks on VERL's own build steps (and, where the shim loads, our own stages):
    ``build_model`` (``from_pretrained``, on meta for the checkpoint path, then the dtype cast),
    ``peft`` (LoRA injection), ``fully_shard`` (VERL's ``apply_fsdp2``, ours under the shim),
    ``load`` (``fsdp2_load_full_state_dict``) with ``fsdp2_ext.*`` inside it, ``fsdp_module`` (the
    whole of ``_build_fsdp_module``: also VERL's ``state_dict()`` before sharding) and
    ``optimizer``. The time of the whole init not in a stage is barriers and VERL's logging."""
    from verl.workers.engine.fsdp import transformer_impl as impl

    from fsdp2_ext.init.sharded_init import prepared_state

    def timed(owner, name: str, stage: str) -> None:
        inner = getattr(owner, name)

        def clocked(*args, **kwargs):
            prepared = prepared_state(args[0]) if stage == "load" else None
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                stages[stage] = stages.get(stage, 0.0) + time.perf_counter() - start
                if prepared is not None:
                    stages.update({f"fsdp2_ext.{k}": v for k, v in prepared.stage_seconds.items()})

        setattr(owner, name, clocked)

    for name, stage in (
        ("_build_module", "build_model"),
        ("_build_lora_module", "peft"),
        ("_build_fsdp_module", "fsdp_module"),
        ("_build_optimizer", "optimizer"),
    ):
        timed(impl.FSDPEngine, name, stage)
    timed(impl, "apply_fsdp2", "fully_shard")
    timed(impl, "fsdp2_load_full_state_dict", "load")


def mapped_checkpoint(path: str) -> dict:
    """Every tensor of the checkpoint at ``path``, as views of its mapped safetensors files."""
    from fsdp2_ext.checkpoint.model_checkpoint import checkpoint_files
    from fsdp2_ext.checkpoint.safetensors_source import map_safetensors_state

    return map_safetensors_state(checkpoint_files(path))


def text_tensors(path: str) -> dict:
    """The mapped checkpoint's tensors that ranks copy (the n-gram tables stay views of it)."""
    state = mapped_checkpoint(path)
    return {n: t.view(1) if t.dim() == 0 else t for n, t in state.items() if "ngram" not in n}


def memcpy_bound(path: str, world: int, rank: int) -> tuple[float, bool]:
    """Each rank copies its own rows of every text tensor from the mapped files."""
    import torch

    from rank0_bound import rows_of

    start = time.perf_counter()
    state = text_tensors(path)
    copies = {name: rows_of(tensor, world, rank).clone() for name, tensor in state.items()}
    seconds = time.perf_counter() - start
    return seconds, all(torch.equal(copies[n], rows_of(t, world, rank)) for n, t in state.items())


def transport_bound(path: str, world: int, rank: int) -> tuple[float, bool]:
    """Rank 0 sends each rank its rows of every text tensor straight from the mapped files
    (``send_rows_from_rank0``). The fresh memory it touches is the shards', as any load's (a
    buffer packed before the clock added a full copy and moved this bound into the VM's slow
    first-touch regime at 2 GiB, see bench_first_touch.py)."""
    from rank0_bound import send_rows_from_rank0

    seconds, exact, _ = send_rows_from_rank0(text_tensors(path), world, rank)
    return seconds, exact


def table_file_bound(path: str, world: int, rank: int, directory: str) -> tuple[float, bool]:
    """Rank 0 writes the tables into a fresh file in ``directory`` with the host-shared
    placement's own file (``SharedFile``: reserved, then written) and every rank maps it
    (``map_shared_file``), without the placement's agreement rounds: the bound of placing the
    tables once per host, which the rank-0 path must do where ``VERL_NO_PLACEMENT_MMAP_DIR``
    is set."""
    import torch
    import torch.distributed as dist

    from fsdp2_ext import _fsdp2_ext

    tables = {n: t for n, t in mapped_checkpoint(path).items() if "ngram" in n}
    manifest = _fsdp2_ext.SharedManifest.plan(
        os.path.join(directory, "tables.bin"), list(tables), list(tables.values())
    )
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        shared_file = _fsdp2_ext.SharedFile.create(manifest)
        for index, tensor in enumerate(tables.values()):
            shared_file.write(index, tensor)
        shared_file.close()
    dist.barrier()
    mapped = _fsdp2_ext.map_shared_file(manifest)
    seconds = time.perf_counter() - start
    dist.barrier()
    if rank == 0:  # as the placement does once all have mapped: no dirty pages left to the next run
        _fsdp2_ext.unlink_shared_file(manifest.path)
    return seconds, all(torch.equal(m, t) for m, t in zip(mapped, tables.values()))


def rank0_build(path: str):
    """Rank 0's model as the rank-0 path's rank 0 holds it when its transfer starts: Transformers'
    ``from_pretrained`` on the CPU in bf16 (VERL's call; untimed), kept alive."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)


def verl_build(worker, stages: dict[str, float]) -> tuple[float, str]:
    """VERL alone on qwen4_exp, ``worker.reset()`` as far as it gets: (seconds of its model build,
    the failure's text). Its FSDP2 sharding of the CPU tables must fail after the build (the
    negative control of tests/verl/test_verl_engine.py); anything else ends the benchmark."""
    try:
        worker.reset()
    except Exception as error:
        if "build_model" not in stages or "fully_shard" not in stages:
            raise  # it failed before or inside the build: nothing measured
        return stages["build_model"], f"{type(error).__name__}: {error}"[:300]
    raise RuntimeError(
        "verl_build: VERL alone initialised qwen4_exp; the benchmark's premise (it cannot) is "
        "gone: time it as method 'verl' instead (PLAN in bench_cold_start.py)"
    )


def rank_main(rank, world, port, method, path, env, ready, go, done, results) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    stages: dict[str, float] = {}
    # Every process, bounds included, first builds VERL's worker and does a first build's imports
    # (untimed): on this VM a copy into fresh memory runs up to ~1.9x slower after those imports
    # than in a bare process (docs/BENCHMARKS.md), so bounds measured bare would flatter them.
    from fsdp2_ext.testing.verl_engine import build_training_worker

    worker = build_training_worker(
        path, shim=method not in VERL_ALONE, lora_rank=16, model_dtype="bf16", initialise=False
    )
    warm_imports(path)
    kept = rank0_build(path) if method == "transport_after_build_bound" and rank == 0 else None
    if method not in BOUNDS:
        time_stages(stages)
    dist.barrier()
    ready.put(rank)
    go.wait()
    digest, failure = "", None
    if method == "memcpy_bound":
        seconds, exact = memcpy_bound(path, world, rank)
    elif method in ("transport_bound", "transport_after_build_bound"):
        seconds, exact = transport_bound(path, world, rank)
    elif method == "table_file_bound":
        seconds, exact = table_file_bound(path, world, rank, env["VERL_NO_PLACEMENT_MMAP_DIR"])
    elif method == "verl_build":
        (seconds, failure), exact = verl_build(worker, stages), None
    else:
        start = time.perf_counter()
        worker.reset()
        seconds = time.perf_counter() - start
        module = worker.engine.module
        params = [(n, p) for n, p in module.named_parameters() if "lora_A" not in n]
        digest = shard_digest(params)
        exact = True
    results.put(
        {"rank": rank, "seconds": seconds, "digest": digest, "exact": exact, "stages": stages,
         "failure": failure}
    )  # fmt: skip
    done.wait()
    del kept
    leave_cleanly()


def _rss_anon(pid: int) -> int:
    """Anonymous resident bytes of ``pid`` (``RssAnon`` of /proc/<pid>/status); 0 once gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(
                (int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), 0
            )
    except OSError:
        return 0


def _anon_bytes(pids: list[int]) -> int:
    """Anonymous resident bytes of ``pids``: a counter read in O(1), what the sampler reads every
    SAMPLE_S. Not smaps_rollup: it walks all of a rank's page tables under its mmap lock, which
    cost this process ~3 s of CPU per 2 GiB run on a 2-core machine beside the 2 ranks, and the
    runs 0.3-1.8 s of 5-6.5 s (docs/BENCHMARKS.md)."""
    return sum(_rss_anon(pid) for pid in pids)


def _pss_bytes(pids: list[int]) -> int:
    """PSS of ``pids``, read before and after a run, never while it runs."""
    from fsdp2_ext.common.procfs import pss_bytes

    return sum(pss_bytes(pid) for pid in pids)


def _all_exact(exacts: list[bool | None]) -> bool | None:
    """Every run or rank exact; ``None`` where one had nothing to compare (``verl_build``)."""
    return None if None in exacts else all(exacts)


def host_dirty_bytes() -> int:
    """Bytes of this host's page cache still to be written back (/proc/meminfo Dirty +
    Writeback, KiB)."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return sum(int(fields[k].split()[0]) for k in ("Dirty", "Writeback")) * 1024


def host_read_bytes() -> int:
    """Bytes this host has read from block devices since boot (/proc/vmstat pgpgin, KiB)."""
    with open("/proc/vmstat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("pgpgin ")) * 1024


def run_once(method: str, path: str, env: dict, world: int) -> dict:
    context = multiprocessing.get_context("spawn")
    ready, results = context.Queue(), context.Queue()
    go, done = context.Event(), context.Event()
    port = free_port()
    procs = [
        context.Process(
            target=rank_main,
            args=(r, world, port, method, path, env, ready, go, done, results),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for _ in range(world):
        ready.get(timeout=600)
    pids = [p.pid for p in procs]
    time.sleep(0.5)
    pss_baseline, anon_baseline = _pss_bytes(pids), _anon_bytes(pids)
    peak_anon = [0]
    finished: list[dict] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak_anon[0] = max(peak_anon[0], _anon_bytes(pids))
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    read_before, dirty = host_read_bytes(), host_dirty_bytes()
    go.set()
    while len(finished) < world:
        finished.append(results.get(timeout=1200))
    disk_read = host_read_bytes() - read_before
    time.sleep(2 * SAMPLE_S)
    stop.set()
    sampler.join()
    pss_end = _pss_bytes(pids)  # the ranks wait for ``done``: what they hold once initialised
    done.set()
    for p in procs:
        p.join(timeout=60)
    finished.sort(key=lambda r: r["rank"])
    failures = [r["failure"] for r in finished if r["failure"]]
    return {
        "wall_s": max(r["seconds"] for r in finished),
        "pss_bytes_sum_end": pss_end - pss_baseline,
        "anon_bytes_sum_peak": peak_anon[0] - anon_baseline,
        "pss_bytes_sum_baseline": pss_baseline,
        "digests": [r["digest"] for r in finished],
        "exact": _all_exact([r["exact"] for r in finished]),
        "stages": [r["stages"] for r in finished],
        **({"failure": failures[0]} if failures else {}),
        "disk_read_bytes": disk_read,  # a warm page cache reads ~0 (this VM pages out idle memory)
        "dirty_bytes_at_start": dirty,  # ~0: the checkpoints are written back before any run
    }


def method_env(method: str, root: str) -> dict:
    from fsdp2_ext.verl_cpu.toy_run import CPU_ENV

    env = dict(CPU_ENV, VERL_USE_EXTERNAL_MODULES="fsdp2_ext.verl_cpu.plugin")
    env["FSDP2_EXT_INIT_SOURCE"] = "checkpoint" if method == "fsdp2_ext_checkpoint" else "rank0"
    if method.startswith("fsdp2_ext") or method == "table_file_bound":
        # As the recipe requires: one host-shared copy of a table.
        env["VERL_NO_PLACEMENT_MMAP_DIR"] = tempfile.mkdtemp(prefix="host_shared_", dir=root)
    env["FSDP2_EXT_LOG_LEVEL"] = "warn"
    return env


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = fixed + marginal * x`` over (GiB, value) points: (fixed, marginal)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(set(xs)) < 2:
        return statistics.fmean(ys), float("nan")
    marginal, fixed = statistics.linear_regression(xs, ys)
    return fixed, marginal


def stage_slopes(method_runs: list[dict]) -> dict[str, float]:
    """Each stage every run has: the slope of its slowest rank's seconds over the sizes."""
    if not method_runs or not all(r["stages"] for r in method_runs):
        return {}
    names = set.intersection(*(set(s) for r in method_runs for s in r["stages"]))
    slowest = {n: [(r["checkpoint_gib"], max(s[n] for s in r["stages"])) for r in method_runs]
               for n in sorted(names)}  # fmt: skip
    return {name: fit(points)[1] for name, points in slowest.items()}


def summarise(method_runs: list[dict]) -> dict:
    """One method of one model over the sweep: every run, and the fitted lines."""
    gib = 2**30
    walls = [(r["checkpoint_gib"], r["wall_s"]) for r in method_runs]
    anon = [(r["checkpoint_gib"], r["anon_bytes_sum_peak"] / gib) for r in method_runs]
    fixed_s, marginal_s = fit(walls)
    fixed_anon, anon_per_gib = fit(anon)
    return {
        "fixed_s": fixed_s,
        "marginal_s_per_gib": marginal_s,
        "anon_fixed_gib": fixed_anon,
        "anon_gib_per_gib": anon_per_gib,
        "stage_marginal_s_per_gib": stage_slopes(method_runs),
        "exact": _all_exact([r["exact"] for r in method_runs]),
        "sizes": method_runs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="checkpoint sizes to sweep, GiB (approximate)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=1, help="runs per method and size")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument("--plot", default=PLOT, help="the PNG of wall time against size")
    args = parser.parse_args()
    report = {"world_size": args.world_size, "repeats": args.repeats, "models": {}}
    runs: dict[str, dict[str, list[dict]]] = {m: {} for m in PLAN}
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="fsdp2_ext_cold_start_") as root:
            paths = save_models(root, size / GIB_PER_SCALE)
            # Written back before any run, so that no run shares the CPU and the disk with the
            # writeback of GiBs of just-saved checkpoints (a precaution; not measured on its own).
            os.sync()
            for model, methods in PLAN.items():
                path = paths[model]
                gib = checkpoint_bytes(path) / 2**30
                for method in (m for m in methods if m in args.methods):
                    for _ in range(args.repeats):
                        warm(path)
                        run = run_once(method, path, method_env(method, root), args.world_size)
                        run["checkpoint_gib"] = gib
                        runs[model].setdefault(method, []).append(run)
                        print(f"{model:<11} {gib:5.2f} GiB {method:<21} {run['wall_s']:7.2f} s",
                              flush=True)  # fmt: skip
                    if size == args.sizes[0]:
                        # One more, untimed run from an evicted page cache: what it brings in
                        # was read (per method, at the first size).
                        evict(path)
                        run_once(method, path, method_env(method, root), args.world_size)
                        runs[model][method][-1]["bytes_read"] = resident_bytes(path)
    for model, methods in runs.items():
        check_exact(methods, REFERENCE[model])
        report["models"][model] = {m: summarise(r) for m, r in methods.items()}
    print_table(report)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {args.output}")
    plot(report, args.plot)
    print(f"wrote {args.plot}")
    return 0


def check_exact(method_runs: dict[str, list[dict]], reference: str) -> None:
    """A run is exact when each rank's local shards hash as the reference method's at its size
    (adapters' random A excluded); the bounds check their own copies."""
    ref = {r["checkpoint_gib"]: r["digests"] for r in method_runs.get(reference, [])}
    for method, results in method_runs.items():
        for run in results:
            digests = run.pop("digests")
            if method not in BOUNDS and run["exact"] is not None:
                run["exact"] = run["exact"] and digests == ref.get(run["checkpoint_gib"])


def print_table(report: dict) -> None:
    gib = 2**30
    for model, methods in report["models"].items():
        bound = methods.get("memcpy_bound", {}).get("marginal_s_per_gib", float("nan"))
        transport = methods.get("transport_bound", {}).get("marginal_s_per_gib", float("nan"))
        print(f"\n{model}, {report['world_size']} ranks: wall s per size, fitted line")
        print(
            f"{'method':<22}{'runs (GiB: s)':<44}{'fixed s':>8}{'s/GiB':>7}{'x memcpy':>9}"
            f"{'x transport':>12}{'anon GiB/GiB':>13}{'exact':>7}"
        )
        for method, r in methods.items():
            points = " ".join(f"{x['checkpoint_gib']:.2f}:{x['wall_s']:.2f}" for x in r["sizes"])
            slope = r["marginal_s_per_gib"]
            print(
                f"{method:<22}{points:<44}{r['fixed_s']:>8.2f}{slope:>7.2f}{slope / bound:>9.2f}"
                f"{slope / transport:>12.2f}{r['anon_gib_per_gib']:>13.2f}"
                f"{'n/a' if r['exact'] is None else str(r['exact']):>7}"
            )
        for method, r in methods.items():
            slopes = r["stage_marginal_s_per_gib"]
            if slopes:
                top = sorted(slopes.items(), key=lambda item: -item[1])[:6]
                print(f"  {method} stages s/GiB: " + ", ".join(f"{k} {v:.2f}" for k, v in top))
            if "failure" in r["sizes"][0]:
                print(f"  {method} (as far as it gets): {r['sizes'][0]['failure']}")
        for method, r in methods.items():
            read = [x["bytes_read"] for x in r["sizes"] if "bytes_read" in x]
            if read:
                print(f"  {method}: read {read[0] / gib:.2f} GiB from a cold page cache")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for axis, model in zip(axes[0], models):
        for method, r in report["models"][model].items():
            xs = [x["checkpoint_gib"] for x in r["sizes"]]
            ys = [x["wall_s"] for x in r["sizes"]]
            (points,) = axis.plot(
                xs, ys, "o", label=f"{method} ({r['marginal_s_per_gib']:.2f} s/GiB)"
            )
            line = [min(xs), max(xs)]
            axis.plot(line, [r["fixed_s"] + r["marginal_s_per_gib"] * x for x in line], "-",
                      color=points.get_color())  # fmt: skip
        axis.set_title(f"{model}: cold start, {report['world_size']} Gloo ranks")
        axis.set_xlabel("checkpoint size (GiB)")
        axis.set_ylabel("wall time, slowest rank (s)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
