"""Loading straight from a checkpoint directory (``source="checkpoint"``) on 2 Gloo ranks.

Every rank builds on meta and copies only its rows from the mapped safetensors; the result must
equal the rank-0 path (rank 0 runs ``from_pretrained`` on the CPU) bit for bit: tied Qwen2, and
qwen4_exp + LoRA on modules and expert parameters (experts merged per rank from per-expert
tensors, adapters from rank 0), in bf16 and converted to fp32 on the fly. A frozen table stored as
one tensor with the model's dtype becomes a view of the checkpoint file itself.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from fsdp2_ext.testing.spawn import run_distributed, run_with_faults

pytestmark = pytest.mark.distributed
WORLD = 2
LORA = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "o_proj", "down_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}


def save_qwen4_exp(directory: str, **overrides) -> str:
    import transformers

    from fsdp2_ext.testing.tiny_models import tiny_qwen4_exp_kwargs

    config = transformers.Qwen4ExpTextConfig(**{**tiny_qwen4_exp_kwargs(), **overrides})
    torch.manual_seed(0)
    transformers.Qwen4ExpForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def save_qwen2(directory: str) -> str:
    from fsdp2_ext.testing.tiny_models import save_tiny_qwen2

    return save_tiny_qwen2(directory, tied=True)


def build(path: str, *, on_meta: bool, lora: bool, dtype: torch.dtype, keep_adapters: bool):
    """As VERL's engine builds: ``from_pretrained`` on the CPU or on meta, then PEFT."""
    import transformers
    from accelerate import init_empty_weights

    from fsdp2_ext.init.model_checkpoint_load import adapters_kept_off_meta

    torch.manual_seed(0)
    # On meta, kernels off: Transformers 5.25 would kernelize a meta model and raise; the rank
    # follows rank 0's choice after the load ([Note: hub kernels once the weights are real]).
    with init_empty_weights() if on_meta else contextlib.nullcontext():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, **({"use_kernels": False} if on_meta else {})
        )
    if on_meta:
        model.tie_weights()  # init_empty_weights re-registers tied parameters as separate ones
    if lora:
        from peft import LoraConfig, get_peft_model

        config = dict(LORA)
        if "qwen4" not in model.config.model_type:
            config.pop("target_parameters")
        with adapters_kept_off_meta() if keep_adapters else contextlib.nullcontext():
            model = get_peft_model(model, LoraConfig(**config))
    return model


def _load(
    rank, world_size, path, source, lora, dtype, out, shared_dir=None, allow_missing=False,
    rank0_knows_checkpoint=False, rank0_changes_a_table=False, mesh_shape=None,
    rollout_probe=False,
):  # fmt: skip
    """``mesh_shape``: VERL's 2-D ``("ddp", "fsdp")`` mesh of that shape (HSDP), else 1-D."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.common.procfs import mapped_inode
    from fsdp2_ext.init.sharded_init import init_sharded
    from fsdp2_ext.model.no_placement import find_no_placement_params

    mesh = (
        init_device_mesh("cpu", (world_size,)) if mesh_shape is None
        else init_device_mesh("cpu", mesh_shape, mesh_dim_names=("ddp", "fsdp"))
    )  # fmt: skip
    on_meta = rank != 0 or source == "checkpoint"
    model = build(path, on_meta=on_meta, lora=lora, dtype=dtype, keep_adapters=rank == 0)
    hf = model.get_base_model() if lora else model
    if rank0_changes_a_table and rank == 0:  # rank 0's value is no longer the file's bytes
        first = min(find_no_placement_params(model), key=lambda t: t.fqn)
        with torch.no_grad():
            first.param[0].add_(1)
    concatenated = []  # the shape of every torch.cat in memory (a spy: cat runs unchanged)
    cat = torch.cat

    def spy(tensors, *args, **kwargs):
        result = cat(tensors, *args, **kwargs)
        if not result.is_meta:  # planning a conversion on meta holds no data
            concatenated.append(tuple(result.shape))
        return result

    torch.cat = spy
    try:
        report = init_sharded(
            model,
            None,
            mesh=mesh,
            layer_class_names=hf._no_split_modules,
            source=source,
            checkpoint=path if source == "checkpoint" or rank0_knows_checkpoint else None,
            allow_missing=allow_missing,
            host_shared_dir=shared_dir,
        )
    finally:
        torch.cat = cat
    state = {}
    for name, param in model.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        state[name] = tensor.detach().clone()
    inodes = {
        r: mapped_inode(r_param)
        for r, r_param in ((t, hf.get_parameter(t.split("base_model.model.")[-1]))
                           for t in report.no_placement_fqns)
    }  # fmt: skip
    probe = _rollout_probe(rank, path, hf, report) if rollout_probe else None
    torch.save(
        {
            "probe": probe,
            "state": state,
            "inodes": inodes,
            "sent": report.bytes_sent,
            "cat": concatenated,
            "stages": set(report.stage_seconds),
        },
        os.path.join(out, f"{source}_rank{rank}.pt"),
    )


def _rollout_probe(rank, path, hf, report) -> dict | None:
    """Rank 1, a process other than the host's leader, asks for each table's rows as the vLLM
    plugin does: the key from the checkpoint directory and the layer's prefix alone
    ([Note: the trainer's table served to the rollout]); the leader serves until it has."""
    import torch.distributed as dist

    from fsdp2_ext.common.procfs import mapped_inode
    from fsdp2_ext.tables.table_service import checkpoint_table_pieces, map_table_rows, table_key

    probe = {}
    if rank == 1:
        for fqn in report.no_placement_fqns:
            name = fqn.split("base_model.model.")[-1]
            table = hf.get_parameter(name)
            # vLLM's module name (the conditional-generation class's mapper; the recipe's
            # language_model_only), not the checkpoint's: the plugin matches from "layers" on
            prefix = "language_model." + name.removesuffix(".weight")
            pieces = checkpoint_table_pieces(path, prefix)
            key = table_key(path, pieces, table.shape, table.dtype)
            begin, rows = table.shape[0] // 3, table.shape[0] // 2  # a rank's range, any
            served = map_table_rows(key, begin, rows)
            mine = table.detach()[begin : begin + rows].contiguous().view(torch.uint8).view(-1)
            probe[fqn] = {
                "pieces": len(pieces),
                "exact": torch.equal(served.tensor, mine),
                "same_file": mapped_inode(served.tensor) == mapped_inode(table),
                "holder_is_other": served.holder_pid != os.getpid(),
                "other_dtype_unserved": map_table_rows(
                    dict(key, dtype="torch.float32"), begin, rows
                ) is None,
            }  # fmt: skip
    dist.barrier()
    return probe


def _compare(out, *, adapters_exact: bool = True):
    """Every tensor equals the rank-0 path's (adapters: see the qwen4_exp test)."""
    loads = [torch.load(os.path.join(out, f"checkpoint_rank{r}.pt")) for r in range(WORLD)]
    for rank in range(WORLD):
        reference = torch.load(os.path.join(out, f"rank0_rank{rank}.pt"))["state"]
        ours = loads[rank]["state"]
        assert ours.keys() == reference.keys()
        for name, tensor in reference.items():
            if "lora_A" in name and not adapters_exact:
                assert ours[name].shape == tensor.shape and ours[name].std() > 0, name
                torch.testing.assert_close(ours[name], loads[0]["state"][name], atol=0, rtol=0)
                continue
            torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0, msg=name)
    return loads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_qwen4_exp_with_lora_equals_the_rank0_path(tmp_path, dtype):
    path = save_qwen4_exp(str(tmp_path / "qwen4"))
    for source in ("rank0", "checkpoint"):
        run_distributed(WORLD, _load, path, source, True, dtype, str(tmp_path), timeout_s=300)
    # qwen4_exp's _init_weights draws random numbers (for A_log) in a CPU-built from_pretrained even
    # for loaded weights, and none on meta: PEFT's lora_A init then starts elsewhere in the stream.
    # Everything from the checkpoint is exact; lora_A is rank 0's own draw, equal on every rank.
    loads = _compare(tmp_path, adapters_exact=False)
    # Only the adapters travel; the base (experts included) is copied per rank from the mapping.
    lora_bytes = sum(t.nbytes for n, t in loads[0]["state"].items() if "lora_" in n)
    assert 0 < loads[0]["sent"] <= lora_bytes
    file_inode = os.stat(os.path.join(path, "model.safetensors")).st_ino
    for load in loads:
        inodes = set(load["inodes"].values())
        assert inodes == ({file_inode} if dtype == torch.bfloat16 else {0}), inodes


def test_the_rank0_path_views_the_tables_whose_bytes_rank0_holds(tmp_path):
    """[Note: rank-0 tables from the checkpoint]: rank 0 built the model from the checkpoint that
    every rank opened, so each table becomes a view of the file (nothing sent), values exact.
    Negative control: a table rank 0 changed after its build is sent from rank 0, and every rank
    holds rank 0's values, not the file's."""
    path = save_qwen4_exp(str(tmp_path / "qwen4"))
    file_inode = os.stat(os.path.join(path, "model.safetensors")).st_ino
    runs = {"copied": (False, False), "viewed": (True, False), "changed": (True, True)}
    for tag, (knows, changes) in runs.items():
        out = tmp_path / tag
        out.mkdir()
        run_distributed(
            WORLD, _load, path, "rank0", True, torch.bfloat16, str(out), None, False, knows, changes
        )
    loads = {
        tag: [torch.load(tmp_path / tag / f"rank0_rank{r}.pt") for r in range(WORLD)]
        for tag in runs
    }
    tables = sorted(loads["copied"][0]["inodes"])
    assert len(tables) == 2, tables
    changed_name = tables[0].split("base_model.model.")[-1]
    for rank in range(WORLD):
        copied, viewed, changed = (loads[tag][rank] for tag in runs)
        assert set(copied["inodes"].values()) == {0}  # no checkpoint given: rank 0's copies
        assert set(viewed["inodes"].values()) == {file_inode}
        assert [changed["inodes"][t] for t in tables] == [0, file_inode]
        for name, tensor in copied["state"].items():
            torch.testing.assert_close(viewed["state"][name], tensor, atol=0, rtol=0, msg=name)
            expected = tensor
            if name.endswith(changed_name):
                expected = tensor.clone()
                expected[0] += 1
                assert not torch.equal(expected, tensor)
            torch.testing.assert_close(changed["state"][name], expected, atol=0, rtol=0, msg=name)


def test_the_rank0_path_judges_the_shared_directory_only_for_tables_it_sends(tmp_path):
    """VERL_NO_PLACEMENT_MMAP_DIR names a directory that does not exist. Every table a view of
    the checkpoint: no file is written, so the load proceeds (every table maps the file). A
    table rank 0 changed must go through that directory: every rank refuses, naming it, before
    any data moves."""
    path = save_qwen4_exp(str(tmp_path / "qwen4"))
    file_inode = os.stat(os.path.join(path, "model.safetensors")).st_ino
    missing = str(tmp_path / "no_such_directory")
    out = tmp_path / "viewed"
    out.mkdir()
    run_distributed(
        WORLD, _load, path, "rank0", True, torch.bfloat16, str(out), missing, False, True, False
    )
    for rank in range(WORLD):
        viewed = torch.load(out / f"rank0_rank{rank}.pt")
        assert set(viewed["inodes"].values()) == {file_inode}
    outcome = run_with_faults(
        WORLD, _load, path, "rank0", True, torch.bfloat16, str(tmp_path), missing, False, True, True
    )
    for rank in range(WORLD):
        kind, message, _ = outcome[rank]
        assert kind == "ValueError" and "does not exist" in message, outcome
        assert missing in message, message
    assert not os.path.exists(missing)


def test_tied_qwen2_equals_the_rank0_path(tmp_path):
    path = save_qwen2(str(tmp_path / "qwen2"))
    for source in ("rank0", "checkpoint"):
        run_distributed(WORLD, _load, path, source, True, torch.float32, str(tmp_path))
    loads = _compare(tmp_path)
    # The stages bench_cold_start.py breaks a load into (docs/BENCHMARKS.md), on every rank.
    per_kind = {"load.direct", "load.sliced", "load.from_rank0"}
    for load in loads:
        assert {"plan_and_verdict", "load", "adopt"} | per_kind <= load["stages"], load["stages"]


def test_a_table_in_shards_comes_from_rank0_exactly(tmp_path):
    """split_ngram_parts=2: the table is a concatenation, so no view: rank 0 builds it."""
    path = save_qwen4_exp(str(tmp_path / "qwen4"), split_ngram_parts=2)
    for source in ("rank0", "checkpoint"):
        run_distributed(WORLD, _load, path, source, True, torch.bfloat16, str(tmp_path))
    for load in _compare(tmp_path, adapters_exact=False):
        assert set(load["inodes"].values()) == {0}


def test_a_new_head_is_initialised_once_on_rank0_when_allowed(tmp_path):
    """A checkpoint of the base model alone (no lm_head), allow_missing naming the head: rank 0
    initialises it with Transformers' _init_weights, as from_pretrained does for a missing key;
    same values as the rank-0 path, where from_pretrained does it (neither draws other random
    numbers first)."""
    from transformers import Qwen2ForCausalLM

    from fsdp2_ext.testing.tiny_models import tiny_qwen2_config

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(False)).to(torch.bfloat16)
    path = str(tmp_path / "base")
    model.model.save_pretrained(path)
    run_distributed(WORLD, _load, path, "rank0", False, torch.float32, str(tmp_path))
    run_distributed(
        WORLD, _load, path, "checkpoint", False, torch.float32, str(tmp_path), None, ["lm_head.*"]
    )
    loads = _compare(tmp_path)
    head = loads[0]["state"]["lm_head.weight"]
    assert head.std() > 0 and "model.embed_tokens.weight" in loads[0]["state"]


def test_a_table_in_shards_is_written_piece_by_piece_into_the_host_shared_file(tmp_path):
    """With VERL_NO_PLACEMENT_MMAP_DIR, a table stored in shards goes from the mapped shards
    straight into the host's shared file: no rank concatenates it (the rank-0 path does)."""
    path = save_qwen4_exp(str(tmp_path / "qwen4"), split_ngram_parts=11)  # shard_10 after _9
    shared = tmp_path / "shared"
    shared.mkdir()
    for source in ("rank0", "checkpoint"):
        run_distributed(
            WORLD, _load, path, source, True, torch.bfloat16, str(tmp_path), str(shared),
            False, False, False, None, source == "checkpoint",  # the rollout's probe
        )  # fmt: skip
    loads = _compare(tmp_path, adapters_exact=False)
    inodes = {i for load in loads for i in load["inodes"].values()}
    assert len(inodes) == 1 and 0 not in inodes  # one host-shared file, mapped by both ranks
    # ... and served to the rollout: its rows found by the plugin's key, the trainer's file
    probe = torch.load(tmp_path / "checkpoint_rank1.pt", weights_only=False)["probe"]
    assert probe and all(p["pieces"] == 11 for p in probe.values()), probe
    assert all(all(p.values()) for p in probe.values()), probe
    tables = {tuple(t.shape) for n, t in loads[0]["state"].items() if "ngram_embedding" in n}
    assert tables and all(not tables & set(load["cat"]) for load in loads)
    assert not os.listdir(shared)  # unlinked once mapped


def _without_adapter_values(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.init.sharded_init import init_sharded

    model = build(path, on_meta=True, lora=True, dtype=torch.bfloat16, keep_adapters=False)
    init_sharded(
        model,
        None,
        mesh=init_device_mesh("cpu", (world_size,)),
        layer_class_names=model.get_base_model()._no_split_modules,
        source="checkpoint",
        checkpoint=path,
    )


def test_tensors_with_no_value_anywhere_fail_on_every_rank(tmp_path):
    """Negative control: adapters built on meta without ``adapters_kept_off_meta`` have no value
    on rank 0; every rank raises, naming them, before any data moves."""
    path = save_qwen2(str(tmp_path / "qwen2"))
    outcome = run_with_faults(WORLD, _without_adapter_values, path)
    for rank in range(WORLD):
        kind, message, _ = outcome[rank]
        assert kind == "ValueError" and "neither in checkpoint" in message, outcome
        assert "lora_A" in message and (rank == 0 or "(reported by rank 0)" in message), message


def _load_from_own_host_copy(rank, world_size, paths, out):
    """Rank r is host ``host{r}`` and loads from its own host's copy ``paths[r]``."""
    from fsdp2_ext.common.distributed import ENV_HOST_ID

    os.environ[ENV_HOST_ID] = f"host{rank}"
    _load(rank, world_size, paths[rank], "checkpoint", False, torch.float32, out)


def _copy_checkpoint(source: str, target: str, *, change_one_value: bool) -> str:
    """A node-local copy of ``source``; with ``change_one_value`` a stale one: the same keys,
    shapes and dtypes, one value of one tensor different."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    if change_one_value:
        (name,) = [f for f in os.listdir(target) if f.endswith(".safetensors")]
        tensors = load_file(os.path.join(target, name))
        key = max(tensors, key=lambda k: tensors[k].numel())  # most likely in a sampled page
        tensors[key].view(-1)[tensors[key].numel() // 2] += 1
        save_file(tensors, os.path.join(target, name), metadata={"format": "pt"})
    return target


def test_every_hosts_copy_of_the_checkpoint_must_be_rank0s(tmp_path):
    """[Note: checkpoint fingerprint]: two hosts, each loading from its own node-local copy. The
    same bytes load; a stale copy (same keys and shapes, one value changed) refuses on every rank
    before any data moves, naming the host whose copy differs. Negative control, run once: with
    the fingerprint gather removed, the stale copy loaded on both ranks (rank 1's rows from it)."""
    path = save_qwen2(str(tmp_path / "qwen2"))
    same = _copy_checkpoint(path, str(tmp_path / "host1_copy"), change_one_value=False)
    stale = _copy_checkpoint(path, str(tmp_path / "host1_stale"), change_one_value=True)
    out = tmp_path / "out"
    out.mkdir()
    loaded = run_with_faults(WORLD, _load_from_own_host_copy, [path, same], str(out))
    assert {r: o[0] for r, o in loaded.items()} == {0: "ok", 1: "ok"}, loaded
    refused = run_with_faults(WORLD, _load_from_own_host_copy, [path, stale], str(out))
    assert set(refused) == {0, 1}
    for rank, (kind, message, _) in refused.items():
        assert kind == "ValueError", (rank, message)
        assert "differ between hosts: the copy on host1 is not the one on host0" in message


def _table_stored_whole_on_two_hosts(rank, world_size, path, directory, dtype=torch.float32):
    """Untied Qwen2 whose ``model.embed_tokens.weight`` is declared a frozen no-placement table:
    stored whole in bf16, loaded into ``dtype`` (fp32: so not a view), rank r on host ``host{r}``
    (``path``: one path, or one per rank)."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.common.distributed import ENV_HOST_ID
    from fsdp2_ext.init.meta_build import build_on_meta
    from fsdp2_ext.init.sharded_init import init_sharded

    os.environ[ENV_HOST_ID] = f"host{rank}"
    path = path[rank] if isinstance(path, list) else path
    model = build_on_meta(transformers.AutoModelForCausalLM, path, dtype=dtype)
    declared = {"_no_placement_params": ["model.embed_tokens.weight"]}
    model.__class__ = type(f"{type(model).__name__}WithTable", (type(model),), declared)
    model.model.embed_tokens.weight.requires_grad_(False)
    report = init_sharded(
        model, None, mesh=init_device_mesh("cpu", (world_size,)),
        layer_class_names=model._no_split_modules, source="checkpoint", checkpoint=path,
        host_shared_dir=directory,
    )  # fmt: skip
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    share = report.host_share
    assert share is not None and share.bytes_received == 0 and share.bytes_sent == 0, share


def test_a_table_every_host_can_read_is_written_from_each_hosts_own_mapping(tmp_path):
    """A table stored whole but not viewable (bf16 in the file, fp32 in the model), two hosts:
    each host's leader converts it into its host's file from its own mapping of the checkpoint;
    nothing of it crosses between hosts. Negative control, run once: with such tables given on
    rank 0 only (as before), rank 1 received the table from rank 0 (bytes_received > 0)."""
    from fsdp2_ext.testing.tiny_models import save_tiny_qwen2

    path = save_tiny_qwen2(str(tmp_path / "qwen2"), tied=False)
    directory = tmp_path / "mmap"
    directory.mkdir()
    run_distributed(WORLD, _table_stored_whole_on_two_hosts, path, str(directory))
    assert os.listdir(directory) == []


@pytest.fixture
def fuse_copy(tmp_path):
    """A checkpoint directory seen through a FUSE mount (bindfs, Debian's package): what a host
    whose copy sits on a network or FUSE filesystem sees. Skips, saying why, where no FUSE mount
    can be made."""
    import shutil
    import subprocess

    if shutil.which("bindfs") is None:
        pytest.skip("bindfs is not installed (make deps installs it)")
    source, mount = tmp_path / "ckpt", tmp_path / "fuse"
    source.mkdir(), mount.mkdir()
    made = subprocess.run(["bindfs", str(source), str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"no FUSE mount here: {made.stderr.strip()[:200]}")
    try:
        yield str(source), str(mount)
    finally:
        subprocess.run(["fusermount", "-u", str(mount)], capture_output=True)


def test_a_view_on_one_host_and_not_on_another_is_agreed_not_split(fuse_copy, tmp_path):
    """The model's dtype (bf16) as stored: a view of the checkpoint on a local disk. Host0 reads
    the files from local disk, host1 the same files through FUSE (not a local disk, so it cannot
    view them). The view decision is agreed: neither host views it, both write their host's file
    from their own mapping, and both load the checkpoint's values. Negative control, run once:
    without the agreement host0 took the view (no host file: its assertion failed) while host1
    went into host sharing's collectives alone, where nobody would join it."""
    from fsdp2_ext import _fsdp2_ext
    from fsdp2_ext.testing.tiny_models import save_tiny_qwen2

    local, through_fuse = fuse_copy
    save_tiny_qwen2(local, tied=False)
    assert _fsdp2_ext.network_filesystem_of(through_fuse) == "FUSE"
    assert _fsdp2_ext.network_filesystem_of(local) == ""
    directory = tmp_path / "mmap"
    directory.mkdir()
    run_distributed(
        WORLD, _table_stored_whole_on_two_hosts, [local, through_fuse], str(directory),
        torch.bfloat16, timeout_s=180,
    )  # fmt: skip
    assert os.listdir(directory) == []
