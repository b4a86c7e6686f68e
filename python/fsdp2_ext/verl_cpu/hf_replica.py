"""VERL's side of the ``hf`` rollout: the replica (TaskRunner) and the adapter (trainer workers).

See [Note: the hf rollout server] in ``hf_server.py``. Importing this module imports VERL and
registers nothing (``fsdp2_ext.verl_cpu.plugin`` registers these classes).
"""

from __future__ import annotations

import os

import ray
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

from fsdp2_ext.common import log
from fsdp2_ext.verl_cpu.hf_server import HFServer, server_name

__all__ = ["HFReplica", "HFServerAdapter"]


class HFReplica(RolloutReplica):
    """VERL's ``RolloutReplica`` for ``hf``: one ``HFServer`` actor beside the replica's first
    trainer worker, on its node."""

    async def launch_servers(self) -> None:
        node_id = await self.workers[0].__ray_call__.remote(
            lambda worker: ray.get_runtime_context().get_node_id()
        )
        name = server_name(self.replica_rank)
        server = (
            ray.remote(HFServer)
            .options(
                name=name,
                num_cpus=0,  # it computes only when the trainer waits for it
                max_concurrency=64,  # VERL's control calls and generations, concurrently
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
            )
            .remote(self.config, self.model_config, self.replica_rank)
        )
        await server.sync_record.remote()  # raises here if the model does not load
        self.servers = [server]
        self._server_handle = server
        self._server_address = name  # unique per replica: VERL's router keys servers by it


class HFServerAdapter(BaseRollout):
    """VERL's ``BaseRollout`` for ``hf``, in each trainer worker: the replica's first rank sends
    the synced weights to its server; every rank drains them (a base sync gathers collectively)."""

    def __init__(self, config, model_config, device_mesh) -> None:
        super().__init__(config, model_config, device_mesh)
        world = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        world *= self.config.pipeline_model_parallel_size
        rank = int(os.environ["RANK"])
        self.replica_rank, self.rollout_rank = rank // world, rank % world
        self.sleep_level = 1
        self._server = None

    async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs) -> None:
        if wire_format != "named_tensors":
            raise ValueError(
                f"hf rollout: wire_format={wire_format!r} is not supported; use "
                "rollout.checkpoint_engine.backend=naive (named tensors)"
            )
        items = weights.items() if isinstance(weights, dict) else weights
        tensors = {name: tensor.detach().cpu() for name, tensor in items}  # drained on every rank
        if self.rollout_rank != 0:
            return
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        await self._server.update_weights.remote(
            tensors,
            peft_config=kwargs.get("peft_config"),
            base_sync_done=kwargs.get("base_sync_done", True),
            global_steps=kwargs.get("global_steps"),
        )
        log.debug(f"hf rollout: {len(tensors)} tensors sent to {server_name(self.replica_rank)}")

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None
