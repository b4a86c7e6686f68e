"""Imported, VERL runs on a CPU-only host: the CPU platform, the ``hf`` rollout server, and what
``main_ppo`` lacks there ([Note: main_ppo on a CPU host]). Importing it is installing it.

    VERL_USE_EXTERNAL_MODULES=fsdp2_ext.verl_cpu.plugin,fsdp2_ext.verl VERL_PLATFORM=cpu \\
    VERL_ENGINE_DEVICE=cuda python -m verl.trainer.main_ppo ...

``VERL_USE_EXTERNAL_MODULES`` imports it at the end of ``import verl`` in every process (the
driver, the TaskRunner, the workers, the servers), before VERL resolves its platform. It is
independent of the shim (``fsdp2_ext.verl``): VERL alone runs on it too, for comparison.
"""

from __future__ import annotations

import os

from fsdp2_ext.common import log
from fsdp2_ext.common.verl_version import check_verl_version, refuse

__all__ = ["install"]


def _register() -> None:
    from verl.experimental.agent_loop.agent_loop import register
    from verl.plugin.platform import PlatformRegistry
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from fsdp2_ext.verl_cpu import agent_loop, hf_replica
    from fsdp2_ext.verl_cpu.hf_server import ROLLOUT_NAME
    from fsdp2_ext.verl_cpu.platform import PLATFORM_NAME, PlatformCPU

    if PlatformRegistry.get(PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: hf_replica.HFReplica)
    adapter = hf_replica.HFServerAdapter
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = (
        f"{adapter.__module__}.{adapter.__qualname__}"
    )
    register(agent_loop.AGENT_NAME)(agent_loop.SeededSingleTurnAgentLoop)


def install() -> None:
    """Registers the platform and the ``hf`` rollout, and patches VERL (idempotent)."""
    version = check_verl_version("fsdp2_ext.verl_cpu")
    from fsdp2_ext.verl_cpu.patches import CPU_SUPPORT
    from fsdp2_ext.verl_cpu.platform import PLATFORM_NAME
    from fsdp2_ext.verl_cpu.vllm_cpu import install_version_alias

    if (
        os.environ.get("VERL_PLATFORM") == PLATFORM_NAME
    ):  # before VERL's vLLM modules read the version
        install_version_alias()

    try:
        _register()
        CPU_SUPPORT.install()
    except (ImportError, AttributeError) as error:
        raise refuse(
            f"fsdp2_ext.verl_cpu: verl {version} does not have what the CPU support extends "
            f"({error})",
            error,
        ) from error
    log.debug(f"fsdp2_ext.verl_cpu installed into verl {version}")


install()
