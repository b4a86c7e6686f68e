"""fsdp2_ext.verl with the real VERL (CPU, Gloo): VERL's own functions, called as its FSDP2
engine calls them, give exact shards, kept ties and restored buffers."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from distributed import run_distributed

if importlib.util.find_spec("verl") is None or importlib.util.find_spec("ray") is None:
    pytest.skip("verl (and ray, which it imports) are not installed", allow_module_level=True)

import test_fsdp2_full_state_load as checks  # noqa: E402

pytestmark = pytest.mark.distributed


def _verl():
    import verl.utils.fsdp_utils as fsdp_utils
    import verl.utils.tensordict_utils as tensordict_utils
    import verl.workers.engine.fsdp.transformer_impl as transformer_impl

    import fsdp2_ext.verl as shim

    return shim, fsdp_utils, tensordict_utils, transformer_impl


def test_install_is_idempotent_and_names_what_it_replaced():
    shim, fsdp_utils, tensordict_utils, transformer_impl = _verl()
    assert shim.install() == shim.install()
    replaced = shim.installed()
    for name in ("apply_fsdp2", "fsdp2_load_full_state_dict"):
        assert f"verl.utils.fsdp_utils.{name}" in replaced
        assert f"verl.workers.engine.fsdp.transformer_impl.{name}" in replaced
        assert getattr(transformer_impl, name) is getattr(fsdp_utils, name)  # by-name import too
    assert "verl.utils.tensordict_utils.maybe_fix_3d_position_ids" in replaced


def test_verl_wrap_selection_is_non_overlapping_after_install():
    from test_fsdp2_peft_wrapping import NestedModel, paths

    shim, fsdp_utils, _, _ = _verl()
    model = NestedModel()
    model.config = SimpleNamespace(tie_word_embeddings=False)  # VERL reads the tie from the config
    ours = paths(model, fsdp_utils._select_fsdp2_wrap_targets(model, ["BlockWithEmbedding"]))
    theirs = paths(
        model,
        shim.ORIGINALS["verl.utils.fsdp_utils._select_fsdp2_wrap_targets"](
            model, ["BlockWithEmbedding"]
        ),
    )
    assert ours == ["embed", "blocks.0", "blocks.1"]
    assert "blocks.0.table" in theirs  # VERL's own selection nests (the negative control)


def _engine_build(rank, world_size):
    """The FSDP2 branch of VERL's FSDPEngine._build_fsdp_module, with VERL's own functions."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _, fsdp_utils, _, transformer_impl = _verl()
    reference, module = checks.build_qwen2(rank, tied=True)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    fsdp_kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
        ),
        "offload_policy": None,
        "reshard_after_forward": True,
    }
    full_state = module.state_dict()  # real on rank 0, meta elsewhere: exactly what VERL passes
    with checks.module_to_forbidden():
        transformer_impl.apply_fsdp2(module, fsdp_kwargs, {"wrap_policy": {}})
        transformer_impl.fsdp2_load_full_state_dict(module, full_state, mesh, None)
    assert module.lm_head.weight is module.model.embed_tokens.weight
    for name, param in module.named_parameters():
        torch.testing.assert_close(
            param.full_tensor(), reference.get_parameter(name), atol=0, rtol=0, msg=name
        )
    assert torch.equal(module.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    checks.adamw_step(module)
    assert module.lm_head.weight is module.model.embed_tokens.weight
    with checks.module_to_forbidden():
        fsdp_utils.offload_fsdp2_model_to_cpu(module)
        fsdp_utils.load_fsdp2_model_to_gpu(module)  # stays on the CPU without an accelerator
    dist.barrier()


def test_verl_engine_flow_gives_exact_shards_ties_and_buffers():
    run_distributed(2, _engine_build, timeout_s=240)


def test_protocol_round_trip_of_equal_length_four_row_position_ids():
    from tensordict import TensorDict
    from verl.protocol import deserialize_tensordict, serialize_tensordict

    from fsdp2_ext import positions

    _, _, tensordict_utils, _ = _verl()
    samples = [torch.arange(4 * 6).view(4, 6) + 100 * b for b in range(3)]  # equal lengths
    batch = TensorDict({"position_ids": positions.nested_from_list(samples)}, batch_size=[3])
    restored = deserialize_tensordict(serialize_tensordict(batch))  # VERL re-infers: ragged@1
    assert restored["position_ids"]._ragged_idx == 1
    tensordict_utils.maybe_fix_3d_position_ids(restored)  # ours: a real repair, not a relabel
    fixed = restored["position_ids"]
    assert fixed._ragged_idx == 2 and fixed.values().shape == (4, 18)
    for got, expected in zip(positions.unbind(fixed), samples):
        assert torch.equal(got, expected)
