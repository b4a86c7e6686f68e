"""fsdp2_ext.verl inside VERL's own engine: TrainingWorker + FSDPEngine on 2 Gloo ranks.

The shim is loaded the way VERL loads it (``HFModelConfig.external_lib``); everything else is VERL's
(see ``verl_engine.py``). A tiny tied Qwen2 (full and LoRA) must come out bit-identical to VERL
without the shim; a tiny qwen4_exp + LoRA 16, which VERL alone cannot initialise (the negative
control), must train, infer, offload, checkpoint and sync adapters with its n-gram tables on CPU.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest
import torch

from fsdp2_ext.testing.compare import assert_states_equal
from fsdp2_ext.testing.spawn import gather_results, run_distributed
from fsdp2_ext.testing.tiny_models import save_tiny_qwen2, save_tiny_qwen4_exp

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed", allow_module_level=True)

import fsdp2_ext.testing.verl_engine as ve  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD = 2


def _save(tag: str, rank: int, value) -> None:
    torch.save(value, os.path.join(ve.test_dir(), f"{tag}_rank{rank}.pt"))


def _load(directory, tag: str, rank: int):
    return torch.load(os.path.join(directory, f"{tag}_rank{rank}.pt"), weights_only=False)


def _qwen2_run(rank, world_size, model_path, shim, lora_rank, tag):
    """Init, infer, one GRPO step, infer again; with the shim also offload/onload and a checkpoint
    round trip, which must change nothing."""
    import logging

    import verl.utils.fsdp_utils as fsdp_utils

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("fsdp2_ext").addHandler(handler)
    # A spy on from_pretrained (it runs unchanged): was this rank's model built on meta?
    from transformers import PreTrainedModel

    built_on_meta = []
    from_pretrained = PreTrainedModel.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        model = from_pretrained(cls, *args, **kwargs)
        built_on_meta.append(any(p.is_meta for p in model.parameters()))
        return model

    PreTrainedModel.from_pretrained = classmethod(spy)
    torch.manual_seed(0)  # torch seeds each process at random; LoRA's init draws from it
    worker = ve.build_worker(model_path, shim=shim, lora_rank=lora_rank)
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    from_checkpoint = any("loads its rows from" in m for m in messages)
    assert from_checkpoint == (tag == "shim_ckpt"), messages
    # Full copies of the tied model: VERL builds one on every rank, the shim on rank 0 only (from
    # the checkpoint: on none). A rank the shim builds on meta does not run from_pretrained at
    # all: it is built from the config, nothing read ([Note: a meta build that reads nothing]).
    full_copy = {"verl": True, "shim": rank == 0, "shim_ckpt": False}[tag]
    assert built_on_meta == ([False] if full_copy else []), (tag, rank, built_on_meta)
    module = worker.engine.module
    base = module.base_model.model if lora_rank else module
    assert base.lm_head.weight is base.model.embed_tokens.weight  # the tie survived init
    record = {"init": ve.full_state(worker)}
    data = ve.grpo_batch(4, 64, seed=1, equal_lengths=False)
    record["log_probs_before"] = ve.infer_log_probs(worker, ve.rank_slice(data, rank, world_size))
    metrics = ve.train_step(worker, ve.rank_slice(ve.grpo_batch(4, 64, seed=2), rank, world_size))
    record["metrics"] = {k: metrics[k] for k in ("loss", "grad_norm")}
    assert base.lm_head.weight is base.model.embed_tokens.weight  # and the optimizer step
    record["trained"] = ve.full_state(worker)
    record["log_probs_after"] = ve.infer_log_probs(worker, ve.rank_slice(data, rank, world_size))
    if shim:
        fsdp_utils.offload_fsdp2_model_to_cpu(module)
        fsdp_utils.load_fsdp2_model_to_gpu(module)
        checkpoint = os.path.join(ve.test_dir(), "checkpoint")
        worker.save_checkpoint(checkpoint, global_step=1)
        ve.train_step(worker, ve.rank_slice(ve.grpo_batch(4, 64, seed=3), rank, world_size))
        worker.load_checkpoint(checkpoint)
        assert_states_equal(ve.full_state(worker), record["trained"], "after load_checkpoint")
    _save(f"qwen2_{tag}", rank, record)


@pytest.mark.parametrize("lora_rank", [0, 16], ids=["full", "lora16"])
def test_tied_qwen2_is_bit_identical_to_verl_alone(tmp_path, lora_rank):
    """VERL alone builds a tied model in full on every rank; with the shim only rank 0 does
    (``rank0``), or no rank at all (``checkpoint``): the same values, bit for bit."""
    model_path = save_tiny_qwen2(str(tmp_path / "qwen2"), tied=True)
    runs = {"verl": (False, "rank0"), "shim": (True, "rank0"), "shim_ckpt": (True, "checkpoint")}
    for tag, (shim, source) in runs.items():
        env = dict(ve.env_for(str(tmp_path)), FSDP2_EXT_INIT_SOURCE=source)
        run_distributed(WORLD, _qwen2_run, model_path, shim, lora_rank, tag, env=env, timeout_s=300)
    for rank in range(WORLD):
        verl = _load(tmp_path, "qwen2_verl", rank)
        for tag in ("shim", "shim_ckpt"):
            ours = _load(tmp_path, f"qwen2_{tag}", rank)
            for stage in ("init", "trained"):
                assert_states_equal(ours[stage], verl[stage], f"{tag} {stage} (rank {rank})")
            for key in ("log_probs_before", "log_probs_after"):
                assert torch.equal(ours[key].values(), verl[key].values()), (tag, key)
            assert ours["metrics"] == verl["metrics"], tag


def _engine_run(rank, world_size, model_path, shim, tag):
    """Init (with its tie partition), log probs, one GRPO step, log probs again."""
    worker = ve.build_worker(model_path, shim=shim, lora_rank=0)
    module = worker.engine.module
    groups: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    record = {
        "ties": sorted(sorted(g) for g in groups.values() if len(g) > 1),
        "init": ve.full_state(worker),
    }
    data = ve.grpo_batch(4, 64, seed=1, equal_lengths=False)
    record["log_probs_before"] = ve.infer_log_probs(worker, ve.rank_slice(data, rank, world_size))
    metrics = ve.train_step(worker, ve.rank_slice(ve.grpo_batch(4, 64, seed=2), rank, world_size))
    record["metrics"] = {k: metrics[k] for k in ("loss", "grad_norm")}
    record["trained"] = ve.full_state(worker)
    record["log_probs_after"] = ve.infer_log_probs(worker, ve.rank_slice(data, rank, world_size))
    _save(tag, rank, record)


def _outermost_verl_selection():
    """VERL's own ``_select_fsdp2_wrap_targets`` less what it nests inside another of its targets:
    an independent route to the non-overlapping units (VERL's code, none of the shim's)."""
    import verl.utils.fsdp_utils as fsdp_utils

    verl_own = fsdp_utils._select_fsdp2_wrap_targets

    def outermost(model, classes):
        chosen = verl_own(model, classes)
        inside = {id(sub) for m in chosen for sub in m.modules() if sub is not m}
        return [m for m in chosen if id(m) not in inside]

    fsdp_utils._select_fsdp2_wrap_targets = outermost


def _modules_to_save_run(rank, world_size, model_path, adapter_path, tag):
    """PEFT's real ModulesToSaveWrapper (embed_tokens, lm_head) through VERL's TrainingWorker:
    wrap targets, init, one GRPO step. ``verl``: VERL alone; ``verl_outermost``: VERL alone with
    its own selection made non-overlapping; ``shim``: the shim loaded as VERL loads it."""
    from peft.utils.other import ModulesToSaveWrapper
    from torch.distributed.fsdp import FSDPModule

    if tag == "verl_outermost":
        _outermost_verl_selection()
    torch.manual_seed(0)
    try:
        worker = ve.build_worker(
            model_path, shim=tag == "shim", lora_rank=4, lora_adapter_path=adapter_path
        )
    except RuntimeError as error:
        if tag != "verl":
            raise
        _save(f"mts_{tag}", rank, {"error": str(error)})
        return
    module = worker.engine.module
    record = {
        "units": [n for n, m in module.named_modules() if isinstance(m, FSDPModule)],
        "wrappers": sorted(
            n for n, m in module.named_modules() if isinstance(m, ModulesToSaveWrapper)
        ),
        "init": ve.full_state(worker),
    }
    metrics = ve.train_step(worker, ve.rank_slice(ve.grpo_batch(4, 64, seed=2), rank, world_size))
    record["metrics"] = {k: metrics[k] for k in ("loss", "grad_norm")}
    record["trained"] = ve.full_state(worker)
    _save(f"mts_{tag}", rank, record)


def _modules_to_save_refused(rank, world_size, model_path, adapter_path) -> str:
    try:
        ve.build_worker(model_path, shim=True, lora_rank=4, lora_adapter_path=adapter_path)
    except ValueError as error:
        return str(error)
    return "loaded"


def test_peft_modules_to_save_equals_verl_with_non_overlapping_units(tmp_path):
    """An untied model whose adapter keeps ``embed_tokens`` and ``lm_head`` trainable (PEFT's
    ``modules_to_save``), loaded by VERL's engine from the saved adapter. VERL alone cannot
    initialise it: its selection nests ``original_module`` and ``modules_to_save.default`` inside
    the wrapper it selects by name, and ``fully_shard`` refuses the second unit (the negative
    control). With the shim: the wrappers wrapped by name as VERL's rule says, outermost wins, and
    the same parameters after init and after a GRPO step, the same loss and grad norm, bit for bit,
    as VERL alone given its own selection less what it nests."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_path = save_tiny_qwen2(str(tmp_path / "qwen2"), tied=False)
    torch.manual_seed(1)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_path),
        LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
            modules_to_save=["embed_tokens", "lm_head"], init_lora_weights=False,
        ),
    )  # fmt: skip
    adapter_path = str(tmp_path / "adapter")
    peft_model.save_pretrained(adapter_path)
    for tag, source in (("verl", "rank0"), ("verl_outermost", "rank0"), ("shim", "rank0")):
        env = dict(ve.env_for(str(tmp_path)), FSDP2_EXT_INIT_SOURCE=source)
        run_distributed(
            WORLD, _modules_to_save_run, model_path, adapter_path, tag, env=env, timeout_s=300
        )
    # From the checkpoint, rank 0 is built on meta and PEFT's copies of embed and head (and the
    # adapter file's values for them) land on meta: refused on every rank, naming them.
    env = dict(ve.env_for(str(tmp_path)), FSDP2_EXT_INIT_SOURCE="checkpoint")
    refused = gather_results(
        WORLD, _modules_to_save_refused, model_path, adapter_path, env=env, timeout_s=300
    )
    for rank in range(WORLD):
        assert "modules_to_save.default.weight" in refused[rank], refused
        assert "load from rank 0" in refused[rank], refused
    for rank in range(WORLD):
        assert "overlapping meshes" in _load(tmp_path, "mts_verl", rank)["error"]
        verl = _load(tmp_path, "mts_verl_outermost", rank)
        ours = _load(tmp_path, "mts_shim", rank)
        assert verl["wrappers"] == ours["wrappers"] and len(ours["wrappers"]) == 2, ours
        assert ours["units"] == verl["units"], (ours["units"], verl["units"])
        assert any(u.endswith("embed_tokens") for u in ours["units"]), ours["units"]
        assert any(u.endswith("lm_head") for u in ours["units"]), ours["units"]
        for stage in ("init", "trained"):
            assert_states_equal(ours[stage], verl[stage], f"modules_to_save {stage} (rank {rank})")
        assert ours["metrics"] == verl["metrics"]


def _write_engine_checkpoint(kind: str, directory: str) -> str:
    """``moe``: a tiny qwen3_moe (experts stored per expert, merged by Transformers' conversion).
    ``untied``: a tied config whose checkpoint stores a different head (from_pretrained unties)."""
    from fsdp2_ext.testing.tiny_checkpoints import tiny_config, write_tiny_checkpoint

    if kind == "moe":
        return write_tiny_checkpoint("qwen3_moe", directory, dtype=torch.float32)
    config = tiny_config("qwen2")
    config.tie_word_embeddings = False
    write_tiny_checkpoint("qwen2", directory, dtype=torch.float32, config=config)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        values = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(values, tie_word_embeddings=True), f)
    return directory


@pytest.mark.parametrize("kind", ["moe", "untied"])
def test_moe_and_a_checkpoint_untying_its_config_equal_verl_alone(tmp_path, kind):
    """Through VERL's engine, both init sources give what VERL alone gives, bit for bit: the
    values, the tie partition (the untied head stays untied, as from_pretrained leaves it), the
    log probs and the first step."""
    model_path = _write_engine_checkpoint(kind, str(tmp_path / kind))
    runs = {"verl": (False, "rank0"), "shim": (True, "rank0"), "shim_ckpt": (True, "checkpoint")}
    for tag, (shim, source) in runs.items():
        env = dict(ve.env_for(str(tmp_path)), FSDP2_EXT_INIT_SOURCE=source)
        run_distributed(WORLD, _engine_run, model_path, shim, tag, env=env, timeout_s=300)
    for rank in range(WORLD):
        verl = _load(tmp_path, "verl", rank)
        assert verl["ties"] == [], verl["ties"]  # both kinds: nothing tied under VERL either
        for tag in ("shim", "shim_ckpt"):
            ours = _load(tmp_path, tag, rank)
            assert ours["ties"] == verl["ties"], tag
            for stage in ("init", "trained"):
                assert_states_equal(ours[stage], verl[stage], f"{tag} {stage} (rank {rank})")
            for key in ("log_probs_before", "log_probs_after"):
                assert torch.equal(ours[key].values(), verl[key].values()), (tag, key)
            assert ours["metrics"] == verl["metrics"], tag


def _qwen4_run(rank, world_size, model_path, source):
    import verl.utils.fsdp_utils as fsdp_utils
    from transformers import AutoModelForCausalLM

    from fsdp2_ext.common.procfs import mapped_inode
    from fsdp2_ext.model.no_placement import no_placement_params

    worker = ve.build_worker(
        model_path,
        shim=True,
        lora_rank=16,
        save_contents=("model", "optimizer", "extra", "hf_model"),
    )
    module = worker.engine.module
    tables = no_placement_params(module)
    assert len(tables) == 2 and all(t.param.device.type == "cpu" for t in tables)
    reference = AutoModelForCausalLM.from_pretrained(model_path)  # Transformers' own key mapping
    for table in tables:
        expected = reference.get_parameter(table.fqn.removeprefix("base_model.model."))
        assert torch.equal(table.param, expected.to(table.param.dtype)), table.fqn
        assert not table.param.requires_grad
    lora = {n for n, p in module.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    # Each table is a view of the checkpoint file itself (zero-copy): in the rank-0 path too, as
    # rank 0's values are the file's bytes ([Note: rank-0 tables from the checkpoint]).
    checkpoint_inode = os.stat(os.path.join(model_path, "model.safetensors")).st_ino
    inodes = {mapped_inode(t.param) for t in tables}
    assert inodes == {checkpoint_inode}, inodes
    _save(f"qwen4_init_{source}", rank, ve.full_state(worker))

    # mRoPE position IDs (C = 4 rows, as VERL's agent loop builds them) through VERL's own
    # left_right_2_no_padding, dispatch chunking, train_mini_batch and infer_batch.
    for equal in (True, False):
        batch = ve.grpo_batch(4, 128, seed=5, position_rows=4, equal_lengths=equal)
        part = ve.rank_slice(batch, rank, world_size)
        assert part["position_ids"]._ragged_idx == 2
        metrics = ve.train_step(worker, part)
        assert torch.isfinite(torch.tensor(metrics["loss"])).all()
        log_probs = ve.infer_log_probs(worker, ve.rank_slice(batch, rank, world_size))
        assert torch.isfinite(log_probs.values()).all()

    objects = [t.param for t in tables]
    fsdp_utils.offload_fsdp2_model_to_cpu(module)
    fsdp_utils.load_fsdp2_model_to_gpu(module)
    assert [t.param for t in no_placement_params(module)] == objects

    trained = ve.full_state(worker)
    checkpoint = os.path.join(ve.test_dir(), "checkpoint")
    worker.save_checkpoint(checkpoint, global_step=1)
    model_file = os.path.join(checkpoint, f"model_world_size_{world_size}_rank_{rank}.pt")
    saved = torch.load(model_file, weights_only=False)
    assert not [k for k in saved if "ngram_embedding" in k]  # the frozen tables: not per rank
    assert len([k for k in saved if "ngram_heads_offsets" in k]) == 2  # everything else: there
    _save("checkpoint_bytes", rank, {"model_file": os.path.getsize(model_file),
                                      "tables": sum(t.param.nbytes for t in tables)})  # fmt: skip
    with open(os.path.join(checkpoint, "no_placement_tables.json")) as record:
        assert [t["fqn"] for t in json.load(record)["tables"]] == [t.fqn for t in tables]
    ve.train_step(worker, ve.rank_slice(ve.grpo_batch(4, 128, seed=6), rank, world_size))
    worker.load_checkpoint(checkpoint)  # strict for everything but the tables
    assert_states_equal(ve.full_state(worker), trained, "after load_checkpoint")
    assert [t.param for t in no_placement_params(module)] == objects
    if rank == 0:  # the hf_model export (rank 0 alone) keeps each table, once
        from safetensors import safe_open

        exported = {}
        for file in glob.glob(os.path.join(checkpoint, "huggingface", "*.safetensors")):
            with safe_open(file, "pt") as handle:
                names = [k for k in handle.keys() if "ngram_embedding" in k]  # noqa: SIM118
                exported.update({k: handle.get_tensor(k) for k in names})
        assert len(exported) == len(tables), sorted(exported)
        for table in tables:
            layer = table.fqn.split(".layers.")[1].split(".")[0]
            (key,) = [k for k in exported if f".layers.{layer}." in k]
            assert torch.equal(exported[key], table.param.to(exported[key].dtype)), key

    # Adapter-only weight sync: VERL's own export path yields adapters only, tables untouched.
    params, peft_config = worker.engine.get_per_tensor_param(
        layered_summon=False, base_sync_done=True
    )
    names = [name for name, _ in params]
    assert names and all("lora_" in n for n in names) and peft_config["r"] == 16
    assert [t.param for t in no_placement_params(module)] == objects

    # Base sync (checkpoint engines, the first sync): tables once, rank 0, checkpoint's names.
    params, _ = worker.engine.get_per_tensor_param(layered_summon=False, base_sync_done=False)
    sent = [name for name, _ in params if "ngram_embedding" in name]
    expected = [
        f"model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_0.weight" for i in (0, 1)
    ]
    assert sorted(sent) == (expected if rank == 0 else []), sent
    assert [t.param for t in no_placement_params(module)] == objects
    assert all(t.param.device.type == "cpu" for t in tables)


@pytest.mark.parametrize("source", ["rank0", "checkpoint"])
def test_qwen4_exp_lora_trains_through_verl_engine(tmp_path, source):
    model_path = save_tiny_qwen4_exp(str(tmp_path / "qwen4"))
    env = dict(ve.env_for(str(tmp_path)), FSDP2_EXT_INIT_SOURCE=source)
    run_distributed(WORLD, _qwen4_run, model_path, source, env=env, timeout_s=400)
    sizes = [_load(tmp_path, "checkpoint_bytes", rank) for rank in range(WORLD)]
    ours = sum(size["model_file"] for size in sizes)
    print(f"model files per save: {ours} bytes with fsdp2_ext; VERL alone would add "
          f"{sum(size['tables'] for size in sizes)} bytes of tables ({WORLD} copies)")  # fmt: skip
    if source == "checkpoint":  # the same base as the rank-0 path (qwen4_exp's adapters: see
        # test_model_checkpoint_load: its CPU-built from_pretrained draws random numbers, meta does not)
        model_path = save_tiny_qwen4_exp(str(tmp_path / "qwen4_rank0"))
        env = dict(env, FSDP2_EXT_INIT_SOURCE="rank0")
        run_distributed(WORLD, _qwen4_init, model_path, env=env, timeout_s=400)
        for rank in range(WORLD):
            ours = _load(tmp_path, "qwen4_init_checkpoint", rank)
            reference = _load(tmp_path, "qwen4_init_rank0", rank)
            base = {n: t for n, t in reference.items() if "lora_A" not in n}
            assert_states_equal({n: ours[n] for n in base}, base, f"rank {rank}")


def _qwen4_init(rank, world_size, model_path):
    worker = ve.build_worker(model_path, shim=True, lora_rank=16)
    _save("qwen4_init_rank0", rank, ve.full_state(worker))


def _qwen4_without_shim(rank, world_size, model_path):
    ve.build_worker(model_path, shim=False, lora_rank=16)


def test_negative_control_verl_alone_cannot_initialise_qwen4_exp(tmp_path):
    model_path = save_tiny_qwen4_exp(str(tmp_path / "qwen4"))
    with pytest.raises(Exception, match="Cannot concatenate overlapping meshes"):
        run_distributed(
            WORLD, _qwen4_without_shim, model_path, env=ve.env_for(str(tmp_path)), timeout_s=300
        )


def _bf16_init(rank, world_size, model_path):
    worker = ve.build_worker(model_path, shim=True, lora_rank=16, model_dtype="bf16")
    module = worker.engine.module
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}, "not a bf16 run"


def test_the_plan_s_bf16_figures_are_what_verl_s_bf16_worker_holds(tmp_path):
    """The planner in the recipe's dtype against a real process: VERL's TrainingWorker with
    ``model_dtype=bf16`` (the recipe's; the CPU recipe's ``main_ppo`` runs fp32), qwen4_exp with
    LoRA 16 on every linear layer, 2 ranks. Each rank's own record (the engine's, as in the
    recipe run: the storages its tensors sit on) holds, to the byte, the plan's padded base
    shards, its adapter shards (VERL casts the adapters to the base's dtype: the bf16 rule) and
    its tables."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2_ext.common.run_report import REPORT_ENV, read_records
    from fsdp2_ext.plan.planner import plan_memory

    model_path = save_tiny_qwen4_exp(str(tmp_path / "qwen4"))
    reports = str(tmp_path / "reports")
    env = dict(ve.env_for(str(tmp_path)), **{REPORT_ENV: reports})
    run_distributed(WORLD, _bf16_init, model_path, env=env, timeout_s=400)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    plan = plan_memory(
        model, world_size=WORLD, dtype=torch.bfloat16, lora_rank=16, target_modules="all-linear"
    )
    records = read_records(reports, "trainer-")
    assert len(records) == WORLD, records
    for record in records:
        held = record["held"]
        assert held["shard_bytes"] == plan.shard_bytes_per_gpu, (held, plan.shard_bytes_per_gpu)
        assert held["lora_bytes"] == plan.lora_bytes_per_gpu, (held, plan.lora_bytes_per_gpu)
        assert held["table_bytes"] == sum(plan.no_placement.values()), held
    assert (
        plan.lora_bytes_per_gpu
        == plan_memory(
            model, world_size=WORLD, dtype=torch.float32, lora_rank=16, target_modules="all-linear"
        ).lora_bytes_per_gpu
        // 2
    )  # the rule this holds: half the fp32 run's adapter bytes
