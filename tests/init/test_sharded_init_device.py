"""The device paths of the loaders, on a CUDA device (skipped without one; run on a GPU machine).

- rank 0's own rows are copied by a helper thread: they must be queued on the caller's current
  stream, so reading the shards on that stream right after ``init_sharded`` (no synchronize) sees
  them whole, also when the current stream is not the default one;
- pinned staging: ``CPUOffloadPolicy(pin_memory=True)`` on a CUDA mesh keeps the shards pinned;
- ``source="checkpoint"`` onto the device equals the CPU result bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp2_ext.testing.spawn import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Stack(nn.Module):
    _no_split_modules = ["Linear"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 515) for _ in range(6))  # uneven rows


def _full_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Stack().state_dict().items()}


def _side_stream(rank, world_size, offload):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    from fsdp2_ext._fsdp2_ext import shard_rows
    from fsdp2_ext.init.sharded_init import init_sharded

    torch.cuda.set_device(rank)
    full = _full_state()
    with torch.device("meta"):
        model = Stack()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        init_sharded(
            model,
            full if rank == 0 else None,
            mesh=init_device_mesh("cuda", (world_size,)),
            fsdp_kwargs={"offload_policy": CPUOffloadPolicy(pin_memory=True)} if offload else {},
        )
        for name, param in model.named_parameters():
            local = param.to_local()
            if offload:
                assert local.is_pinned(), name
            split = shard_rows(full[name].shape[0], world_size, rank)
            begin, rows = split.row_begin, split.rows
            # On the side stream, without a synchronize: ordered after the fill or not at all.
            assert torch.equal(local.to("cpu"), full[name][begin : begin + rows]), name


@pytest.mark.parametrize("offload", [False, True], ids=["device", "cpu_offload_pinned"])
def test_shards_are_whole_on_the_callers_stream(offload):
    world = min(torch.cuda.device_count(), 2)
    run_distributed(world, _side_stream, offload)


def _checkpoint_onto_device(rank, world_size, path):
    import transformers
    from accelerate import init_empty_weights
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.init.sharded_init import init_sharded

    torch.cuda.set_device(rank)
    results = {}
    for device in ("cpu", "cuda"):
        with init_empty_weights():  # kernels off on meta: they follow rank 0's after the load
            model = transformers.AutoModelForCausalLM.from_pretrained(path, use_kernels=False)
        model.tie_weights()
        init_sharded(
            model,
            None,
            mesh=init_device_mesh(device, (world_size,)),
            source="checkpoint",
            checkpoint=path,
        )
        results[device] = {n: p.to_local().cpu() for n, p in model.named_parameters()}
    for name, tensor in results["cpu"].items():
        assert torch.equal(results["cuda"][name], tensor), name


def test_model_checkpoint_onto_the_device_equals_the_cpu_result(tmp_path):
    from fsdp2_ext.testing.tiny_models import save_tiny_qwen2

    path = save_tiny_qwen2(str(tmp_path / "qwen2"), tied=True)
    run_distributed(min(torch.cuda.device_count(), 2), _checkpoint_onto_device, path)
