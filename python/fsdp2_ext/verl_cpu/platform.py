"""A CPU platform for VERL's platform plugins: VERL's own engine on CPU ranks with Gloo.

VERL resolves its device once, through ``verl.plugin.platform.get_platform()``; registering
``PlatformCPU`` as ``cpu`` before that first call (``fsdp2_ext.verl_cpu.plugin`` does, at the end
of ``import verl``) with ``VERL_PLATFORM=cpu`` makes every ``get_device_name()`` /
``get_torch_device()`` call site see the CPU. Importing this module registers nothing.

[Note: VERL on a CPU platform]
- ``current_device()`` is ``"cpu"``: VERL builds ``torch.device(get_device_name(), current)`` and
  meshes from it; an integer index would name a CPU device that collectives refuse.
- ``is_available()`` is False: VERL's checkpoint manager saves an accelerator RNG state whenever the
  platform says it is available, and ``torch.cpu`` has none to give.
- ``torch.cpu`` lacks the memory counters VERL's timing and logging code reads; ``device_module``
  adds them, reading the process's own peak resident set (``ru_maxrss``) and current RSS.
- VERL's engine registry knows only cuda/npu: set ``VERL_ENGINE_DEVICE=cuda`` to select the FSDP
  engine class (its code then follows this platform), and initialise the default process group
  with ``"cpu:gloo"`` before building a worker (``main_ppo``'s workers: see
  ``fsdp2_ext.verl_cpu.patches``).
- ``ray_resource_name()`` is ``"CPU"``: a worker's placement-group bundle asks for one CPU and no
  accelerator; ``ray_resource_options`` adds nothing to an actor's request.
"""

from __future__ import annotations

import contextlib
import resource
import types
from typing import Any, Optional

import torch
from verl.plugin.platform import PlatformBase

__all__ = ["PLATFORM_NAME", "PlatformCPU", "cpu_device_module"]

PLATFORM_NAME = "cpu"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _build_device_module() -> types.ModuleType:
    module = types.ModuleType("fsdp2_ext.verl_cpu.platform.cpu")
    module.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    module.is_available = lambda: False
    module.current_device = lambda: "cpu"
    module.device_count = lambda: 1
    module.set_device = lambda device: None
    module.empty_cache = lambda: None  # CPU memory goes back to the allocator on free
    module.ipc_collect = lambda: None
    module.memory_allocated = lambda device=None: _rss_bytes()
    module.memory_reserved = lambda device=None: _rss_bytes()
    module.max_memory_allocated = lambda device=None: _peak_rss_bytes()
    module.max_memory_reserved = lambda device=None: _peak_rss_bytes()
    module.reset_peak_memory_stats = lambda device=None: None
    module.mem_get_info = lambda device=None: _meminfo()
    module.get_device_name = lambda device=None: "cpu"
    module.get_rng_state = torch.get_rng_state
    module.set_rng_state = torch.set_rng_state
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    return module


def _meminfo() -> tuple[int, int]:
    fields = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)


cpu_device_module = _build_device_module()


class PlatformCPU(PlatformBase):
    """VERL platform for CPU-only runs (Gloo); see [Note: VERL on a CPU platform]."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return cpu_device_module

    def is_available(self) -> bool:
        return False

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # never auto-detected: chosen with VERL_PLATFORM=cpu

    def current_device(self) -> Any:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {}

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        from fsdp2_ext.verl_cpu.vllm_cpu import rollout_env

        return rollout_env()  # [Note: VERL's vLLM rollout on a CPU host], item 4

    def cudart(self) -> Any:
        return None
