"""Distributed regression for fsdp2_ext.init_sharded (Gloo on CPU, NCCL when a GPU is present).

    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node=2 \
        tests/special_distributed/test_fsdp2_full_state_load.py

Checks, on every rank: exact reconstructed weights (atol=0, rtol=0) against the full state; a
non-persistent bf16 buffer restored; the frozen no-placement table on CPU with the right values;
forward/backward with an nn.Embedding nested inside a wrapped block; ``Module.to`` never called.
Then a tiny tied BF16 Qwen2: tie identity after meta conversion and load, one AdamW step,
full-state gather with ``embed == lm_head`` exactly, and an HF save/reload round trip compared
tensor by tensor; plus the negative control (torch's plain meta + assign-load path), which must
break the tie after the step. The same checks are run by pytest on 2 and 4 spawned ranks; the
models are ``fsdp2_ext.testing.tiny_models``'.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import fsdp2_ext
from fsdp2_ext.init.sharded_init import init_sharded
from fsdp2_ext.testing.tiny_models import build_qwen2, build_toy, tiny_qwen2_config


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def module_to_forbidden():
    original = nn.Module.to

    def forbidden(self, *args, **kwargs):
        raise AssertionError("Module.to was called on a module during init_sharded")

    nn.Module.to = forbidden
    try:
        yield
    finally:
        nn.Module.to = original


def _mesh(world_size: int, mesh_shape: tuple[int, ...] | None):
    """The 1-D shard mesh, or (``mesh_shape``: replicate x shard) VERL's 2-D HSDP mesh."""
    if mesh_shape is None:
        return init_device_mesh(device_type(), (world_size,))
    return init_device_mesh(device_type(), mesh_shape, mesh_dim_names=("ddp", "fsdp"))


def check_toy_model(
    rank: int, world_size: int, source: str = "rank0", mesh_shape: tuple[int, ...] | None = None
) -> None:
    reference, model = build_toy(rank)
    full_state = {k: v.clone() for k, v in reference.state_dict().items()}
    mesh = _mesh(world_size, mesh_shape)
    with module_to_forbidden():
        report = init_sharded(
            model,
            full_state if (rank == 0 or source == "local") else None,
            mesh=mesh,
            source=source,
            bucket_bytes=1 << 20,
        )
    selected = [path for path, _ in report.wrap.selected]
    assert selected == ["embed", "layers.0", "layers.1", "layers.2", "lm_head"], (
        report.wrap.selected
    )
    assert ("layers.0.inner", "untied nn.Embedding", "layers.0") in report.wrap.skipped
    assert report.no_placement_fqns == ["frozen.weight"]
    # Exact weights, every parameter, every rank.
    for name, param in model.named_parameters():
        expected = reference.get_parameter(name)
        actual = param.full_tensor() if hasattr(param, "full_tensor") else param
        torch.testing.assert_close(actual.cpu(), expected, atol=0, rtol=0, msg=name)
        assert actual.dtype == expected.dtype, name
    # The frozen table: same registered object, plain CPU tensor, exact values.
    frozen = model.frozen.weight
    assert frozen.device.type == "cpu" and not frozen.requires_grad
    assert type(frozen.data) is torch.Tensor, "the no-placement table must not be a DTensor"
    assert torch.equal(frozen, reference.frozen.weight)
    # The non-persistent bf16 buffer: restored on the device with its dtype.
    assert model.scale.dtype == torch.bfloat16 and model.scale.device.type == device_type()
    assert torch.equal(model.scale.cpu(), reference.scale)
    # Forward/backward through the nested embedding inside a wrapped block.
    ids = torch.tensor([[1, 5, 36, 7], [0, 2, 3, 4]], device=device_type())
    logits = model(ids)
    torch.testing.assert_close(logits.cpu(), reference(ids.cpu()), atol=0, rtol=0)
    logits.sum().backward()
    assert model.layers[0].inner.weight.grad is not None
    assert model.frozen.weight.grad is None
    dist.barrier()  # no rank tears the group down while another still reduces gradients


def adamw_step(model: nn.Module) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12, device=device_type()).view(2, 6) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def tie_mismatches(state: dict[str, torch.Tensor]) -> int:
    return int((state["model.embed_tokens.weight"] != state["lm_head.weight"]).sum())


def check_tied_qwen2(rank: int, world_size: int, mesh_shape: tuple[int, ...] | None = None) -> None:
    from transformers import Qwen2ForCausalLM

    reference, model = build_qwen2(rank)
    full_state = {k: v.clone() for k, v in reference.state_dict().items()}
    mesh = _mesh(world_size, mesh_shape)
    with module_to_forbidden():
        report = init_sharded(model, full_state if rank == 0 else None, mesh=mesh)
    assert report.tied_groups == [["model.embed_tokens.weight", "lm_head.weight"]]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.full_tensor(), full_state[name], atol=0, rtol=0, msg=name)
    adamw_step(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    gathered = gather_full_state(model)
    if rank == 0:
        assert tie_mismatches(gathered) == 0
        with tempfile.TemporaryDirectory() as directory:
            saved = Qwen2ForCausalLM(tiny_qwen2_config()).to(torch.bfloat16)
            saved.load_state_dict(gathered)
            saved.save_pretrained(directory)
            reloaded = Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)
        assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
        reloaded_state = reloaded.state_dict()
        assert set(reloaded_state) == set(gathered)
        for name, tensor in gathered.items():
            torch.testing.assert_close(reloaded_state[name], tensor, atol=0, rtol=0, msg=name)
    dist.barrier()


def check_negative_control(rank: int, world_size: int) -> int:
    """The plain path every FSDP2 full-state loader uses (meta model + ``load_state_dict(
    assign=True)``) gives each name its own tensor; after one AdamW step embed and head diverge.

    Runs on each rank's CPU without collectives; returns the number of differing embed/head
    elements, which must be > 0 for the fixed path's test to mean anything.
    """
    from transformers import Qwen2ForCausalLM

    reference, _ = build_qwen2(0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(tiny_qwen2_config()).to(torch.bfloat16)
    model.load_state_dict({k: v.clone() for k, v in reference.state_dict().items()}, assign=True)
    model.model.rotary_emb.inv_freq = reference.model.rotary_emb.inv_freq
    model.model.rotary_emb.original_inv_freq = reference.model.rotary_emb.original_inv_freq
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.arange(12).view(2, 6) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return tie_mismatches(model.state_dict())


def main() -> int:
    # The device-qualified form VERL makes ([Note: the tests' process group]).
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "cpu:gloo"
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        check_toy_model(rank, world_size)
        check_tied_qwen2(rank, world_size)
        mismatches = check_negative_control(rank, world_size)
        assert mismatches > 0, (
            "negative control: the plain path kept the tie; the test lost its teeth"
        )
        if rank == 0:
            print(
                f"fsdp2_ext {fsdp2_ext.__version__}: full-state load checks passed on {world_size} "
                f"ranks ({backend}); negative control: {mismatches} embed/head elements differ"
            )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
