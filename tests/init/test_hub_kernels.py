"""Transformers' hub kernels on a sharded model ([Note: hub kernels once the weights are real]).

Transformers 5.25 kernelizes in ``from_pretrained`` by default, which raises on the meta model
VERL builds on every rank but 0; the shim builds on meta without kernelizing and applies rank 0's
choice on every rank once the weights are real. On the CPU no hub kernel maps a layer, so what
these tests see is the kernels' state on each rank and every call of kernels' ``kernelize``
(spied on in each rank: its device, its mode, whether the model still had meta parameters), not
a swapped forward. Skipped on a Transformers without hub kernels on by default (< 5.25).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from fsdp2_ext.testing.spawn import gather_results, run_distributed
from fsdp2_ext.testing.tiny_models import save_tiny_qwen2

pytest.importorskip("kernels")
from transformers.integrations import hub_kernels as _transformers_hub_kernels  # noqa: E402

if not callable(getattr(_transformers_hub_kernels, "_kernels_enabled", None)):  # < 5.25
    pytest.skip("this Transformers does not kernelize by default", allow_module_level=True)

import fsdp2_ext.testing.verl_engine as ve  # noqa: E402

WORLD = 2


def _spy_on_kernelize(calls: list) -> None:
    """Every call of kernels' kernelize as Transformers makes it: device, mode, meta left."""
    import transformers.integrations.hub_kernels as hk

    real = hk._kernels_kernelize

    def spied(model, *, device, mode, **kwargs):
        meta = any(p.is_meta for p in model.parameters())
        calls.append({"device": str(device), "mode": mode.value, "meta": meta})
        return real(model, device=device, mode=mode, **kwargs)

    hk._kernels_kernelize = spied


def _state(model) -> dict:
    from fsdp2_ext.init.hub_kernels import pretrained_of

    inner = pretrained_of(model)
    mode = getattr(inner, "_kernels_mode", None)
    return {
        "on": inner.use_kernels,
        "mode": None if mode is None else mode.value,
        "device": getattr(inner, "_kernels_device", None),
    }


def _run(rank, world_size, model_path, out, source, rank1_env, applied):
    os.environ["FSDP2_EXT_INIT_SOURCE"] = source
    if rank == 1 and rank1_env is not None:
        os.environ["USE_HUB_KERNELS"] = rank1_env
    if not applied:  # the negative control: no choice applied after the fill
        import fsdp2_ext.init.hub_kernels as hub

        hub.apply = lambda *args, **kwargs: False
    calls: list = []
    _spy_on_kernelize(calls)
    warnings = _warnings_of_fsdp2_ext()
    worker = ve.build_worker(model_path, shim=True, lora_rank=8, hub_kernels_off=False)
    module = worker.engine.module
    after_init = _state(module)
    module.train()  # what VERL's train_mode does first: kernels again, for the training mode
    after_train = _state(module)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {"init": after_init, "train": after_train, "calls": calls, "warnings": warnings}, f
        )


def _warnings_of_fsdp2_ext() -> list[str]:
    """The library's warnings in this rank, as they are logged."""
    import logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger("fsdp2_ext").addHandler(Keep(logging.WARNING))
    return seen


def _run_refused(rank, world_size, *args) -> str:
    try:
        _run(rank, world_size, *args)
    except ValueError as error:
        return str(error)
    return "not refused"


def _results(tmp_path, source, rank1_env=None, applied=True) -> list[dict]:
    model_path = save_tiny_qwen2(str(tmp_path / "q"), tied=False)
    out = tmp_path / "out"
    out.mkdir()
    env = ve.env_for(str(tmp_path))
    run_distributed(
        WORLD, _run, model_path, str(out), source, rank1_env, applied, env=env, timeout_s=300
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("source", ["rank0", "checkpoint"])
def test_every_rank_runs_rank_0_s_kernels_once_the_weights_are_real(tmp_path, source):
    """Both init sources: every rank ends with kernels on, in rank 0's mode, on the shards'
    device, and every rank's last kernelize saw no meta parameter; ``train()`` kernelizes again
    on every rank, for the training mode, on the same device."""
    from kernels import Mode

    results = _results(tmp_path, source)
    for r, result in enumerate(results):
        assert result["init"] == {"on": True, "mode": Mode.INFERENCE.value, "device": "cpu"}, r
        assert result["train"] == {"on": True, "mode": Mode.TRAINING.value, "device": "cpu"}, r
        assert result["calls"], f"rank {r}: kernelize never ran"
        assert not any(c["meta"] for c in result["calls"]), (r, result["calls"])
        assert result["calls"][-1] == {"device": "cpu", "mode": Mode.TRAINING.value, "meta": False}
    assert results[0]["init"] == results[1]["init"]


def test_without_the_choice_applied_the_ranks_differ(tmp_path):
    """The negative control: without ``hub_kernels.apply`` after the fill, rank 0 (``from_pretrained``) runs
    kernels and rank 1 (built on meta) does not."""
    results = _results(tmp_path, "rank0", applied=False)
    assert results[0]["init"]["on"] is True
    assert results[1]["init"]["on"] is False


def test_a_host_with_kernels_off_is_refused_on_every_rank(tmp_path):
    """``USE_HUB_KERNELS=0`` on rank 1's host only, rank 0 kernelized: both ranks refuse, naming
    rank 1 (it cannot follow: Transformers refuses to kernelize where the variable is off)."""
    model_path = save_tiny_qwen2(str(tmp_path / "q"), tied=False)
    out = tmp_path / "out"
    out.mkdir()
    env = ve.env_for(str(tmp_path))
    results = gather_results(
        WORLD, _run_refused, model_path, str(out), "checkpoint", "0", True, env=env, timeout_s=300
    )
    for rank in range(WORLD):
        assert "ranks [1] cannot run them" in results[rank], (rank, results[rank])


def test_ranks_follow_rank_0_where_they_can(tmp_path):
    """Rank 0's environment turning kernels off, rank 1's leaving them on: rank 1 follows rank 0
    (off), named in a warning."""
    model_path = save_tiny_qwen2(str(tmp_path / "q"), tied=False)
    out = tmp_path / "out"
    out.mkdir()
    run_distributed(
        WORLD, _run_rank0_off, model_path, str(out), env=ve.env_for(str(tmp_path)), timeout_s=300
    )
    for rank in range(WORLD):
        result = json.loads((out / f"rank{rank}.json").read_text())
        assert result["init"]["on"] is False and result["train"]["on"] is False, rank
        assert result["calls"] == [], rank
        assert any("ranks [1] follow rank 0's choice (off)" in w for w in result["warnings"])


def _run_rank0_off(rank, world_size, model_path, out):
    if rank == 0:
        os.environ["USE_HUB_KERNELS"] = "0"
    _run(rank, world_size, model_path, out, "checkpoint", None, True)


def test_kernels_off_everywhere_keeps_the_torch_forwards(tmp_path, monkeypatch):
    monkeypatch.setenv("USE_HUB_KERNELS", "0")
    results = _results(tmp_path, "rank0")
    for result in results:
        assert result["init"]["on"] is False and result["train"]["on"] is False
        assert result["calls"] == []


def _verl_alone(rank, world_size, model_path):
    ve.build_worker(model_path, shim=False, lora_rank=8, hub_kernels_off=False)


def test_verl_alone_cannot_build_with_the_default_kernels(tmp_path):
    """What the shim mends: VERL 0.9.1 alone on Transformers 5.25 (its non-zero ranks kernelize
    a meta model in from_pretrained)."""
    model_path = save_tiny_qwen2(str(tmp_path / "q"), tied=False)
    with pytest.raises(Exception, match="Unsupported device type 'meta'"):
        run_distributed(
            WORLD, _verl_alone, model_path, env=ve.env_for(str(tmp_path)), timeout_s=300
        )


def test_a_build_left_to_verl_names_the_fix(tmp_path):
    """A meta build the shim leaves to VERL (not an FSDP2 language model): kernels' error on
    meta becomes one naming USE_HUB_KERNELS."""
    from accelerate import init_empty_weights

    from fsdp2_ext.init.hub_kernels import KernelsOnMetaError, refusing_kernels_on_meta

    path = save_tiny_qwen2(str(tmp_path / "q"), tied=False)
    with pytest.raises(ValueError, match="Unsupported device type 'meta'"), init_empty_weights():
        transformers.AutoModelForCausalLM.from_pretrained(path)
    context = refusing_kernels_on_meta(init_empty_weights, "VERL's build on meta")
    with pytest.raises(KernelsOnMetaError, match="USE_HUB_KERNELS=0 on every host"), context():
        transformers.AutoModelForCausalLM.from_pretrained(path)
    with context():  # anything else passes unchanged
        model = transformers.AutoModelForCausalLM.from_pretrained(path, use_kernels=False)
    assert all(p.is_meta for p in model.parameters())
    assert torch.is_tensor(next(model.parameters()))


def _build_left_to_verl(rank, world_size, model_path) -> str:
    """VERL's own init context through the shim, outside an FSDP2 language-model build (as for
    FSDP1 or a value model): rank 0 builds on the CPU, rank 1 on meta."""
    from verl.utils import fsdp_utils

    import fsdp2_ext.verl  # noqa: F401  (the shim, as VERL loads it)

    context = fsdp_utils.get_init_weight_context_manager(use_meta_tensor=True, mesh=None)
    try:
        with context():
            transformers.AutoModelForCausalLM.from_pretrained(model_path)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "built"


def test_verl_s_own_meta_build_through_the_shim_names_the_fix(tmp_path):
    """The shim's ``get_init_weight_context_manager`` where it leaves the build to VERL: rank 0
    builds; rank 1's meta ``from_pretrained`` fails with the project's message, not kernels'."""
    model_path = save_tiny_qwen2(str(tmp_path / "q"), tied=False)
    results = gather_results(
        WORLD, _build_left_to_verl, model_path, env=ve.env_for(str(tmp_path)), timeout_s=300
    )
    assert results[0] == "built", results
    assert results[1].startswith("KernelsOnMetaError: VERL's build on meta"), results
    assert "USE_HUB_KERNELS=0 on every host" in results[1], results
