"""Loading from the checkpoint equals ``from_pretrained``, for every model type Transformers converts.

The matrix is generated from the installed Transformers (``fsdp2_ext.testing.tiny_checkpoints``):
every model type in its conversion mapping that builds tiny on the CPU, plus a handful without
conversions (dense, tied, MoE, VLM), as a random tiny checkpoint with distinct values written by
``save_pretrained`` in shards with an index. Two Gloo ranks each build the model on meta, load it
with ``init_sharded(source="checkpoint")`` and compare it with ``from_pretrained`` on the CPU, bit
for bit: every parameter in full and each rank's own rows, every buffer, and the tie partition.
Negative controls: a checkpoint missing a base weight refuses on every rank; a pair of tensors
swapped in the load is caught by the comparison.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from fsdp2_ext.testing.spawn import run_distributed, run_with_faults

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
WORLD = 2
# Without conversions: dense, tied dense, MoE and VLM layouts stored as the model holds them.
WITHOUT_CONVERSIONS = ("qwen2", "gemma2", "gpt_oss", "qwen2_vl")
# The model types this project's users run, and those the conversion bugs were first seen with.
MUST_LOAD = ("qwen4_exp_text", "lara_mini", "molmo2", "qwen3_moe", "qwen3_5_moe_text", "llava")


def _quiet_transformers() -> None:
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore")


def _tie_partition(model: torch.nn.Module, prefix: str = "") -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name.removeprefix(prefix))
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def compare_with_from_pretrained(model_path: str, rank: int, world: int, mesh, swap=None) -> dict:
    """Loads ``model_path`` both ways on this rank; returns what differs (empty lists: exact).
    Where ``from_pretrained`` reports missing keys (it would initialise them at random), the load
    must refuse instead, naming them."""
    import transformers

    from fsdp2_ext.init.meta_build import build_on_meta
    from fsdp2_ext.init.sharded_init import init_sharded

    config = transformers.AutoConfig.from_pretrained(model_path)
    cls = getattr(transformers, config.architectures[0])  # the class that wrote it
    reference, info = cls.from_pretrained(
        model_path, dtype=torch.bfloat16, output_loading_info=True
    )
    model = build_on_meta(cls, model_path, dtype=torch.bfloat16)  # reads no tensor
    if swap is not None:
        swap(model)
    suffixes = getattr(model, "_no_placement_params", None) or []
    for name, param in model.named_parameters():  # frozen, as LoRA leaves them
        if any(name.endswith(suffix) for suffix in suffixes):
            param.requires_grad_(False)
    try:
        report = init_sharded(
            model,
            None,
            mesh=mesh,
            layer_class_names=model._no_split_modules or [],
            source="checkpoint",
            checkpoint=model_path,
        )
    except ValueError as error:
        if "fully_shard doesn't support scalar parameters" in str(error):
            return {"fsdp2_cannot_shard": str(error)}
        missing = sorted(info["missing_keys"])
        said = str(error)
        if missing and f"{len(missing)} tensors" in said and any(k in said for k in missing):
            return {"refused_like_from_pretrained_missing": missing[:3]}
        raise
    if info["missing_keys"]:
        return {"loaded_what_from_pretrained_misses": sorted(info["missing_keys"])}
    expected = dict(reference.named_parameters(remove_duplicate=False))
    differs, rows_differ = [], []
    for name, param in model.named_parameters(remove_duplicate=False):
        want = expected.pop(name, None)
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        if want is None or full.dtype != want.dtype or not torch.equal(full.detach(), want):
            differs.append(name)
            continue
        if hasattr(param, "to_local") and want.numel():  # FSDP2's Shard(0): torch.chunk's rows
            chunks = torch.chunk(want, world, dim=0)
            rows = chunks[rank] if rank < len(chunks) else want[:0]
            if not torch.equal(param.to_local().detach(), rows):
                rows_differ.append(name)
    buffers = dict(reference.named_buffers())
    buffers_differ = [
        name
        for name, buffer in model.named_buffers()
        if name not in buffers
        or buffer.dtype != buffers[name].dtype
        or not torch.equal(buffer, buffers.pop(name))
    ]
    return {
        "parameters": differs + sorted(expected),
        "rows": rows_differ,
        "buffers": buffers_differ + sorted(buffers),
        "ties": _tie_partition(model) != _tie_partition(reference),
        "mode": model.training != reference.training,
        "generation_config": getattr(model, "generation_config", None) is not None
        and model.generation_config.to_dict() != reference.generation_config.to_dict(),
        "sent": report.bytes_sent,
        "kinds": report.checkpoint_kinds,
    }


def _matrix_worker(rank, world_size, root, names, out):
    from torch.distributed.device_mesh import init_device_mesh

    _quiet_transformers()
    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for name in names:
        try:
            results[name] = compare_with_from_pretrained(
                os.path.join(root, name), rank, world_size, mesh
            )
        except Exception as error:  # every rank raises alike: the verdict is agreed
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    with open(os.path.join(out, f"matrix_rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)


def _rewrite(directory: str, edit) -> None:
    """Applies ``edit(key, tensor) -> tensor | None`` (None: drop) to every stored tensor."""
    from safetensors.torch import load_file, save_file

    index_path = os.path.join(directory, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    for name in sorted(set(index["weight_map"].values())):
        path = os.path.join(directory, name)
        tensors = {k: edit(k, v) for k, v in load_file(path).items()}
        save_file({k: v for k, v in tensors.items() if v is not None}, path, {"format": "pt"})
        for key in [k for k, v in tensors.items() if v is None]:
            del index["weight_map"][key]
    with open(index_path, "w") as f:
        json.dump(index, f)


def _set_config(directory: str, **values) -> None:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **values}, f)


def _store_the_embedding_as_the_head(path: str) -> None:
    embedding = {}
    _rewrite(path, lambda k, v: embedding.setdefault("w", v) if "embed_tokens" in k else v)
    _rewrite(path, lambda k, v: embedding["w"] if k == "lm_head.weight" else v)


def _special_checkpoints(root) -> dict[str, str]:
    """Cases the generated matrix does not reach: qwen4_exp with its n-gram tables; a tied config
    whose checkpoint stores a different head (from_pretrained unties, warning) or the same head
    twice (it ties); a tensor the class initialises at load (``_keys_to_ignore_on_load_missing``)."""
    import transformers

    from fsdp2_ext.testing.tiny_checkpoints import tiny_config, write_tiny_checkpoint
    from fsdp2_ext.testing.tiny_models import tiny_qwen4_exp_kwargs

    made = {}
    config = transformers.Qwen4ExpTextConfig(**tiny_qwen4_exp_kwargs())
    made["qwen4_exp_text+tables"] = write_tiny_checkpoint(
        "qwen4_exp_text", str(root / "qwen4_exp_text+tables"), config=config
    )
    for name, same_values in (("untied_head", False), ("twice_stored_head", True)):
        config = tiny_config("qwen2")
        config.tie_word_embeddings = False
        path = write_tiny_checkpoint(
            "qwen2", str(root / f"qwen2+tied_config_{name}"), config=config
        )
        if same_values:
            _store_the_embedding_as_the_head(path)
        _set_config(path, tie_word_embeddings=True)
        made[f"qwen2+tied_config_{name}"] = path
    path = write_tiny_checkpoint("axk1", str(root / "axk1+load_time_init"))
    _rewrite(path, lambda k, v: None if k.endswith("e_score_correction_bias") else v)
    made["axk1+load_time_init"] = path
    return made


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """model type -> checkpoint directory, and model type -> why it does not build tiny."""
    from fsdp2_ext.testing.tiny_checkpoints import (
        NotTiny,
        conversion_model_types,
        write_tiny_checkpoint,
    )

    _quiet_transformers()
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    written, not_tiny = {}, {}
    for model_type in conversion_model_types() + list(WITHOUT_CONVERSIONS):
        try:
            written[model_type] = write_tiny_checkpoint(model_type, str(root / model_type))
        except NotTiny as error:
            not_tiny[model_type] = str(error)
    written.update(_special_checkpoints(root))
    return root, written, not_tiny


def test_every_model_type_loads_exactly_as_from_pretrained(tiny_checkpoints, tmp_path):
    root, written, not_tiny = tiny_checkpoints
    print(f"{len(written)} model types build tiny; {len(not_tiny)} do not:")
    for model_type, why in sorted(not_tiny.items()):
        print(f"  {model_type}: {why.splitlines()[0][:150]}")
    assert set(MUST_LOAD) <= set(written), set(MUST_LOAD) - set(written)
    assert set(WITHOUT_CONVERSIONS) <= set(written)
    with open(f"{written['qwen2+tied_config_untied_head']}/model.safetensors.index.json") as f:
        assert "lm_head.weight" in json.load(f)["weight_map"]
    run_distributed(
        WORLD, _matrix_worker, str(root), sorted(written), str(tmp_path), timeout_s=1800
    )
    failures = {}
    for rank in range(WORLD):
        with open(tmp_path / f"matrix_rank{rank}.json") as f:
            for model_type, result in json.load(f).items():
                if (
                    "fsdp2_cannot_shard" in result
                    or "refused_like_from_pretrained_missing" in result
                ):
                    print(f"  {model_type}: {result}")
                    continue
                wrong = {k: v for k, v in result.items() if k not in ("sent", "kinds") and v}
                if wrong:
                    failures[f"{model_type} (rank {rank})"] = wrong
    assert not failures, json.dumps(failures, indent=1)[:6000]


def _swap_two_views(model):
    """Makes the load swap two same-shape tensors (a resolution bug the matrix must catch)."""
    from fsdp2_ext.checkpoint import model_checkpoint

    original = model_checkpoint.ModelCheckpoint.open.__func__

    def open_swapped(cls, *args, **kwargs):
        source = original(cls, *args, **kwargs)
        first, second = (
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
        )
        source.direct[first], source.direct[second] = source.direct[second], source.direct[first]
        return source

    model_checkpoint.ModelCheckpoint.open = classmethod(open_swapped)


def _swap_worker(rank, world_size, path, out):
    from torch.distributed.device_mesh import init_device_mesh

    _quiet_transformers()
    mesh = init_device_mesh("cpu", (world_size,))
    result = compare_with_from_pretrained(path, rank, world_size, mesh, swap=_swap_two_views)
    with open(os.path.join(out, f"swap_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_negative_control_a_swapped_pair_is_caught(tiny_checkpoints, tmp_path):
    root, written, _ = tiny_checkpoints
    run_distributed(WORLD, _swap_worker, written["qwen2"], str(tmp_path))
    for rank in range(WORLD):
        with open(tmp_path / f"swap_rank{rank}.json") as f:
            result = json.load(f)
        assert result["parameters"] == [
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
        ], result


def _missing_worker(rank, world_size, path, source):
    import contextlib

    import transformers
    from accelerate import init_empty_weights
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.init.meta_build import build_on_meta
    from fsdp2_ext.init.sharded_init import init_sharded

    _quiet_transformers()
    if source == "checkpoint":  # as the shim builds: nothing read before the load
        model = build_on_meta(transformers.AutoModelForCausalLM, path, dtype=torch.bfloat16)
    else:  # rank 0's from_pretrained initialised it
        with init_empty_weights() if rank > 0 else contextlib.nullcontext():  # kernels: rank 0's
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.bfloat16, **({"use_kernels": False} if rank > 0 else {})
            )
    mesh = init_device_mesh("cpu", (world_size,))
    init_sharded(model, None, mesh=mesh, source=source, checkpoint=path)


@pytest.mark.parametrize("source", ["checkpoint", "rank0"])
def test_negative_control_a_missing_base_weight_refuses_on_every_rank(
    tiny_checkpoints, tmp_path, source
):
    """A shard that lost a tensor (the index still names it): refused, named, on every rank,
    from either init source (rank 0's from_pretrained would have drawn it at random)."""
    from safetensors.torch import load_file, save_file

    root, written, _ = tiny_checkpoints
    path = str(tmp_path / "qwen3_moe")
    shutil.copytree(written["qwen3_moe"], path)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    key = "model.layers.1.self_attn.o_proj.weight"
    shard = os.path.join(path, weight_map[key])
    tensors = load_file(shard)
    del tensors[key]
    save_file(tensors, shard, metadata={"format": "pt"})
    outcome = run_with_faults(WORLD, _missing_worker, path, source)
    for rank in range(WORLD):
        kind, message, _ = outcome[rank]
        assert kind == "ValueError", outcome
        assert key in message and "are not in checkpoint" in message, message
        assert "the index names" in message, message
