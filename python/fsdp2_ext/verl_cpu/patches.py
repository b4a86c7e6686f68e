"""What VERL 0.9.1 lacks to run ``main_ppo`` on a CPU-only host, supplied at run time.

[Note: main_ppo on a CPU host]
Nothing here edits VERL's files; ``fsdp2_ext.verl_cpu.plugin`` applies it in every process at the
end of ``import verl``, and each replacement defers to VERL's own function off the CPU platform:

1. ``verl.utils.distributed.initialize_global_process_group_ray`` builds the backend string
   ``"cpu:gloo,{device}:{ccl}"``, which is ``"cpu:gloo,cpu:gloo"`` on a CPU platform ("Duplicate
   device type cpu"): ``cpu:gloo`` there (``cpu_process_group``), still device-qualified as VERL's
   string is, so torch reports the group's backend as ``cpu:gloo`` (not ``gloo``) exactly as it
   reports ``cpu:gloo,cuda:nccl`` on the cluster ([Note: the tests' process group]).
2. ``verl.single_controller.ray.base.ResourcePoolManager._check_resource_available`` counts only
   ``GPU``/``NPU`` Ray resources and refuses a CPU-only cluster: on the CPU platform it counts the
   CPUs the pool's placement groups ask for (``check_cpu_resources``).
3. ``rollout.name=hf`` has no server replica in VERL (``verl/workers/rollout/replica.py`` knows
   vLLM, SGLang and TensorRT-LLM): ``fsdp2_ext.verl_cpu.hf_server`` is registered in
   ``RolloutReplicaRegistry`` and in ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` (the worker
   side, a private dict VERL offers no function to extend).
4. The transfer queue (``trainer.use_v1``) starts 1 + ``num_data_storage_units`` actors of one
   CPU each, and every trainer rank's placement group bundle asks for CPUs: ``recipe_cpu.yaml``
   gives Ray logical CPUs (``ray_kwargs.ray_init.num_cpus``) and one storage unit. Config only.
6. Ray's ``RuntimeContext.get_accelerator_ids``: VERL's vLLM replica looks a worker's device up
   there under the platform's resource name, ``CPU`` here ([Note: VERL's vLLM rollout on a CPU
   host], item 2): ``cpu_accelerator_ids`` adds it.
5. ``verl.trainer.ppo.v1.replay_buffer.ReplayBuffer._materialize_batch`` hands the trainer its
   samples in the order the agent loop finished them: a run and its resume (or two runs) then
   split the same samples differently over the data-parallel ranks, and a token-mean loss weighs
   them differently (a 1.5% different grad norm was seen). ``ordered_batch`` puts them in the
   order the prompts were submitted (the dataloader's), then session, then output: the batch
   depends only on the data, as a reproducible run needs. The samples are the same.

What the CPU support assumes of VERL (verl 0.9.1, checked by ``check_verl_version`` before
anything is registered or patched): the three functions above and their modules;
``verl.plugin.platform`` (``PlatformBase``, ``PlatformRegistry``, ``get_platform``);
``verl.workers.rollout.replica`` (``RolloutReplica``: ``workers``, ``replica_rank``, ``config``,
``model_config``, ``servers``, ``_server_handle``, ``_server_address``; ``RolloutReplicaRegistry``;
``TokenOutput``); ``verl.workers.rollout.base`` (``BaseRollout``, the private
``_ROLLOUT_REGISTRY``: VERL offers no function to extend it); the agent loop's ``register`` and
``SingleTurnAgentLoop`` (``rollout_config``, the ``global_steps``, ``index`` and ``session_id``
it is called with); ``ResourcePoolManager.resource_pool_spec``; ``ReplayBuffer.
prompt_global_steps``; ``verl.utils.config.omega_conf_to_dataclass``.
"""

from __future__ import annotations

import os

from fsdp2_ext.common.patching import PatchSet

__all__ = [
    "CPU_SUPPORT",
    "check_cpu_resources",
    "cpu_accelerator_ids",
    "cpu_process_group",
    "ordered_batch",
]

DISTRIBUTED = "verl.utils.distributed"
RAY_BASE = "verl.single_controller.ray.base"
REPLAY_BUFFER = "verl.trainer.ppo.v1.replay_buffer"
RAY_RUNTIME_CONTEXT = "ray.runtime_context"
CPU_SUPPORT = PatchSet()
replaces, original = CPU_SUPPORT.replaces, CPU_SUPPORT.original


def _on_cpu_platform() -> bool:
    from verl.plugin.platform import get_platform

    return get_platform().device_name == "cpu"


@replaces(DISTRIBUTED, "initialize_global_process_group_ray")
def cpu_process_group(timeout_second=None, backend=None):
    """VERL's ``initialize_global_process_group_ray``, with ``cpu:gloo`` on the CPU platform."""
    if backend is None and _on_cpu_platform():
        backend = "cpu:gloo"
    verl_init = original(DISTRIBUTED, "initialize_global_process_group_ray")
    return verl_init(timeout_second=timeout_second, backend=backend)


@replaces(RAY_BASE, "ResourcePoolManager._check_resource_available")
def check_cpu_resources(self) -> None:
    """VERL's resource check; on the CPU platform, against the cluster's CPUs."""
    if not _on_cpu_platform():
        return original(RAY_BASE, "ResourcePoolManager._check_resource_available")(self)
    import ray

    available = sum(
        node.get("CPU", 0) for node in ray._private.state.available_resources_per_node().values()
    )
    required = sum(sum(counts) for counts in self.resource_pool_spec.values())
    if available < required:
        raise ValueError(
            f"the Ray cluster has {available:g} CPUs for {required} CPU ranks; start Ray with "
            f"more (ray_kwargs.ray_init.num_cpus, logical CPUs) or lower "
            "trainer.n_gpus_per_node"
        )
    return None


@replaces(REPLAY_BUFFER, "ReplayBuffer._materialize_batch")
def ordered_batch(self, partition_id, selected_prompt_uids, partition_snapshot):
    """VERL's ``_materialize_batch``, its samples in submission order (prompt, session, output)."""
    submitted = {uid: i for i, uid in enumerate(self.prompt_global_steps.get(partition_id, {}))}
    meta = original(REPLAY_BUFFER, "ReplayBuffer._materialize_batch")(
        self, partition_id, selected_prompt_uids, partition_snapshot
    )

    def position(pair) -> tuple:
        uid, *rest = pair[0].split("_")
        numbers = [int(part) if part.isdigit() else 0 for part in rest]
        return (submitted.get(uid, len(submitted)), uid, *numbers)

    pairs = sorted(zip(meta.keys, meta.tags), key=position)
    meta.keys[:] = [key for key, _ in pairs]
    meta.tags[:] = [tag for _, tag in pairs]
    return meta


@replaces(RAY_RUNTIME_CONTEXT, "RuntimeContext.get_accelerator_ids")
def cpu_accelerator_ids(self) -> dict:
    """Ray's accelerator ids; on the CPU platform with ``CPU: [LOCAL_RANK]`` added (item 6)."""
    ids = original(RAY_RUNTIME_CONTEXT, "RuntimeContext.get_accelerator_ids")(self)
    if _on_cpu_platform():
        ids.setdefault("CPU", [os.environ.get("LOCAL_RANK", "0")])
    return ids
