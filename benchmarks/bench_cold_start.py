"""Cold start through VERL's engine: checkpoint files -> an initialised TrainingWorker, 2 Gloo ranks.

    python benchmarks/bench_cold_start.py               # ~1 GiB bf16 models, 2 repeats
    python benchmarks/bench_cold_start.py --scale 0.25 --repeats 1

Two checkpoints, built here with ``save_pretrained`` (bf16) and kept in the page cache (each run
reads them once first, so every method starts from the same warm cache, the bound memcpy_bound
measures):

- ``qwen4_exp``: ~1 GiB text model (MoE experts stored per expert, as Transformers saves them) plus
  two n-gram no-placement tables, ~0.25 GiB;
- ``tied_qwen2``: a tied dense model of about the same bytes, for ``verl``: VERL alone cannot
  initialise qwen4_exp (its FSDP2 sharding of the CPU tables fails), so VERL's figure comes from the
  tied variant, where it builds the full model on every rank.

Methods (each in fresh ranks; ``worker.reset()`` timed: model build, PEFT, FSDP2, optimizer, with
the imports of a first build done before the clock), LoRA 16 on all linear layers, model dtype
bf16, as the recipe:

- ``verl``:                 VERL alone (rank 0 reads the model; tied: every rank does);
- ``fsdp2_ext_rank0``:      the shim: ranks > 0 on meta also for tied models, rank 0 sends rows;
- ``fsdp2_ext_checkpoint``: the shim with ``FSDP2_EXT_INIT_SOURCE=checkpoint``: every rank copies
  its own rows from the mapped safetensors; tables are views of the checkpoint file;
- ``memcpy_bound``:         each rank copies its own rows of every text tensor from the mapped
  files into fresh memory (no VERL, no FSDP): the bound of any per-rank load.

Keys per method: ``wall_s`` (slowest rank, median over repeats, with every run in ``runs``),
``pss_bytes_sum_peak`` and ``anon_bytes_sum_peak`` (summed over ranks, sampled every 50 ms by this
process during init, minus the same sum just before init: the imports' baseline, also reported),
``bytes_read`` (one more, untimed run after the checkpoint's pages are evicted from the page
cache: the bytes of the checkpoint files in the page cache afterwards, i.e. what the host read
from them, once however many ranks read a page), ``exact`` (each rank's local shards hash equal to the reference method's:
``verl`` for the tied model, ``fsdp2_ext_rank0`` for qwen4_exp, adapters' random A excluded there,
see tests/test_checkpoint_load.py). Writes benchmarks/results/cold_start.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cold_start.json")
METHODS = ("verl", "fsdp2_ext_rank0", "fsdp2_ext_checkpoint", "memcpy_bound")
SAMPLE_S = 0.05


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
    model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**kwargs))
    model.to(torch.bfloat16).save_pretrained(paths["qwen4_exp"])
    qwen4_bytes = sum(p.nbytes for p in model.parameters())
    del model
    layer_bytes = 2 * (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 2816)
    layers = max(1, int((qwen4_bytes - 2 * vocab * 1024) // layer_bytes))
    config = transformers.Qwen2Config(
        vocab_size=vocab, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True,
        max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(paths["tied_qwen2"])
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
        digest.update(local.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def warm_imports(path: str) -> None:
    """What the first model build imports (VERL resolves its auto class by importing every
    Transformers model module, ~1.5 s here): a process pays it once, whatever the loader."""
    import accelerate  # noqa: F401
    import peft.tuners.lora  # noqa: F401
    import transformers
    from verl.utils.model import get_hf_auto_model_class

    get_hf_auto_model_class(hf_config=transformers.AutoConfig.from_pretrained(path))


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
    if method == "memcpy_bound":
        from fsdp2_ext import _fsdp2_ext
        from fsdp2_ext.checkpoint_source import checkpoint_files
        from fsdp2_ext.safetensors_source import map_safetensors_state
    else:
        from fsdp2_ext.testing.verl_worker import build_training_worker

        worker = build_training_worker(
            path, shim=method != "verl", lora_rank=16, model_dtype="bf16", initialise=False
        )
        warm_imports(path)
    dist.barrier()
    ready.put(rank)
    go.wait()
    start = time.perf_counter()
    if method == "memcpy_bound":
        state = map_safetensors_state(checkpoint_files(path))
        rows = []
        for name, tensor in state.items():
            if "ngram_embedding" in name:
                continue  # a view of the file in fsdp2_ext_checkpoint: nothing to copy
            split = _fsdp2_ext.shard_rows(tensor.shape[0] if tensor.dim() else 1, world, rank)
            begin, count = (0, 1) if tensor.dim() == 0 else (split.row_begin, split.rows)
            source = tensor.view(1) if tensor.dim() == 0 else tensor
            rows.append((name, begin, source[begin : begin + count].clone()))
        seconds = time.perf_counter() - start
        exact = all(
            torch.equal(
                copy, (state[n].view(-1) if state[n].dim() == 0 else state[n])[b : b + len(copy)]
            )
            for n, b, copy in rows
        )
        digest = ""
    else:
        worker.reset()
        seconds = time.perf_counter() - start
        module = worker.engine.module
        params = [(n, p) for n, p in module.named_parameters() if "lora_A" not in n]
        digest = shard_digest(params)
        exact = True
    results.put({"rank": rank, "seconds": seconds, "digest": digest, "exact": exact})
    done.wait()
    dist.destroy_process_group()
    os._exit(0)


def _proc_rollup(pid: int) -> tuple[int, int]:
    pss = anon = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Anonymous:"):
                    anon = int(line.split()[1]) * 1024
    except OSError:
        pass
    return pss, anon


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    baseline = [sum(x) for x in zip(*(_proc_rollup(pid) for pid in pids))]
    peak = {"pss": 0, "anon": 0}
    finished: list[dict] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            pss, anon = (sum(x) for x in zip(*(_proc_rollup(pid) for pid in pids)))
            peak["pss"], peak["anon"] = max(peak["pss"], pss), max(peak["anon"], anon)
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    go.set()
    while len(finished) < world:
        finished.append(results.get(timeout=1200))
    time.sleep(2 * SAMPLE_S)
    stop.set()
    sampler.join()
    done.set()
    for p in procs:
        p.join(timeout=60)
    finished.sort(key=lambda r: r["rank"])
    return {
        "wall_s": max(r["seconds"] for r in finished),
        "pss_bytes_sum_peak": peak["pss"] - baseline[0],
        "anon_bytes_sum_peak": peak["anon"] - baseline[1],
        "pss_bytes_sum_baseline": baseline[0],
        "digests": [r["digest"] for r in finished],
        "exact": all(r["exact"] for r in finished),
    }


def method_env(method: str) -> dict:
    from fsdp2_ext.verl_cpu.toy_run import CPU_ENV

    env = dict(CPU_ENV, VERL_USE_EXTERNAL_MODULES="fsdp2_ext.verl_cpu.plugin")
    env["FSDP2_EXT_INIT_SOURCE"] = "checkpoint" if method == "fsdp2_ext_checkpoint" else "rank0"
    env["FSDP2_EXT_LOG_LEVEL"] = "warn"
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="model size relative to ~1 GiB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    plan = {
        "tied_qwen2": METHODS,
        "qwen4_exp": ("fsdp2_ext_rank0", "fsdp2_ext_checkpoint", "memcpy_bound"),
    }
    reference = {"tied_qwen2": "verl", "qwen4_exp": "fsdp2_ext_rank0"}
    report = {"world_size": args.world_size, "repeats": args.repeats, "models": {}}
    with tempfile.TemporaryDirectory(prefix="fsdp2_ext_cold_start_") as root:
        paths = save_models(root, args.scale)
        for model, methods in plan.items():
            path = paths[model]
            size = checkpoint_bytes(path)
            entry = {"checkpoint_bytes": size, "methods": {}}
            for method in methods:
                runs = []
                for _ in range(args.repeats):
                    warm(path)
                    runs.append(run_once(method, path, method_env(method), args.world_size))
                    print(f"{model:<11} {method:<21} {runs[-1]['wall_s']:7.2f} s", flush=True)
                best = dict(runs[0])
                best["wall_s"] = statistics.median(r["wall_s"] for r in runs)
                for key in ("pss_bytes_sum_peak", "anon_bytes_sum_peak"):
                    best[key] = max(r[key] for r in runs)
                best["runs_wall_s"] = [r["wall_s"] for r in runs]
                # One more, untimed run from an evicted page cache: what it brings in was read.
                evict(path)
                run_once(method, path, method_env(method), args.world_size)
                best["bytes_read"] = resident_bytes(path)
                entry["methods"][method] = best
            ref = entry["methods"][reference[model]]["digests"]
            for method, result in entry["methods"].items():
                if method != "memcpy_bound":
                    result["exact"] = result.pop("digests") == ref and result["exact"]
                else:
                    result.pop("digests")
            report["models"][model] = entry
    print_table(report)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {RESULTS}")
    return 0


def print_table(report: dict) -> None:
    gib = 2**30
    for model, entry in report["models"].items():
        size = entry["checkpoint_bytes"]
        verl = report["models"]["tied_qwen2"]["methods"]["verl"]["wall_s"]
        bound = entry["methods"]["memcpy_bound"]["wall_s"]
        print(f"\n{model}: checkpoint {size / gib:.2f} GiB, {report['world_size']} ranks")
        print(
            f"{'method':<22}{'wall s':>8}{'runs':>16}{'vs verl':>9}{'vs bound':>9}"
            f"{'PSS sum/ckpt':>13}{'anon GiB':>9}{'read GiB':>9}{'exact':>7}"
        )
        for method, r in entry["methods"].items():
            runs = "/".join(f"{w:.2f}" for w in r["runs_wall_s"])
            print(
                f"{method:<22}{r['wall_s']:>8.2f}{runs:>16}{r['wall_s'] / verl:>9.2f}"
                f"{r['wall_s'] / bound:>9.2f}{r['pss_bytes_sum_peak'] / size:>13.2f}"
                f"{r['anon_bytes_sum_peak'] / gib:>9.2f}{r['bytes_read'] / gib:>9.2f}"
                f"{str(r['exact']):>7}"
            )


if __name__ == "__main__":
    sys.exit(main())
