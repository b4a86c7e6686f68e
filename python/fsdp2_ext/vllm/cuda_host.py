"""The CUDA runtime's host-memory facts the vLLM plugin decides by: whether this GPU can register
a read-only mapping, and whether a registered range has the device pointer vLLM will ask for.

[Note: registering a table the GPU reads from the host]
vLLM reads a CPU-offloaded PLE table through UVA: ``get_cuda_view_from_cpu_tensor`` calls
``cudaHostGetDevicePointer`` on the pinned rows (vLLM 0.34 ``csrc/cuda_view.cu:28-39``). The
trainer's table is served read-only (``PROT_READ``), which only ``cudaHostRegisterReadOnly``
registers, and only where the device reports ``cudaDevAttrHostRegisterReadOnlySupported``
(attribute 113): discrete GPUs behind x86 without ATS report 0 (vllm-project/vllm-omni PR #6240:
``cudaErrorNotSupported`` on B300; the same mapping with default flags fails with
``cudaErrorInvalidValue``), so an HGX H200 may be such a GPU. The plugin reads the attribute
first: where it is 0 the trainer's table is not used, and the rank takes its rows from the
rollout's own host copy (shared memory, writable, registered with default flags: one copy per
host for both replicas), which the plan counts as its fallback; where it is 1, the read-only
registration. After any registration the device pointer is asked for as vLLM will ask, so a
range vLLM cannot view fails here, at the plugin's choice, not in vLLM's first lookup.
Attributes 100 (``PageableMemoryAccessUsesHostPageTables``) and 91
(``CanUseHostPointerForRegisteredMem``) are read and logged with it: the GPU check records them
(``benchmarks/gpu_check_ple_host_copy.py``). None of this runs without CUDA; the choice itself is
``served_rows_choice``, tested here.
"""

from __future__ import annotations

import ctypes
import os

__all__ = [
    "ATTRIBUTES",
    "HOST_REGISTER_READ_ONLY",
    "attributes",
    "device_pointer_problem",
    "served_rows_choice",
]

HOST_REGISTER_READ_ONLY = 113  # cudaDevAttrHostRegisterReadOnlySupported
ATTRIBUTES = {
    HOST_REGISTER_READ_ONLY: "HostRegisterReadOnlySupported",
    100: "PageableMemoryAccessUsesHostPageTables",
    91: "CanUseHostPointerForRegisteredMem",
}


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime this process has loaded (torch's), found as vLLM finds it
    (``find_loaded_library``: ``/proc/self/maps``), else the dynamic linker's."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcudart.so"):
                return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so")  # OSError where there is none


def attributes(device: int) -> dict[int, int]:
    """``{attribute: value}`` of ``ATTRIBUTES`` for CUDA device ``device``."""
    runtime = _cudart()
    values = {}
    for attribute in ATTRIBUTES:
        value = ctypes.c_int(0)
        error = runtime.cudaDeviceGetAttribute(ctypes.byref(value), attribute, device)
        values[attribute] = value.value if error == 0 else -error
    return values


def device_pointer_problem(pointer: int) -> str:
    """ "" where ``cudaHostGetDevicePointer`` gives a device pointer for the registered host
    address ``pointer`` (what vLLM's UVA view asks), else the runtime's error."""
    runtime = _cudart()
    device = ctypes.c_void_p()
    error = runtime.cudaHostGetDevicePointer(ctypes.byref(device), ctypes.c_void_p(pointer), 0)
    if error == 0 and device.value:
        return ""
    runtime.cudaGetLastError()  # clears the (non-sticky) error the call left
    return f"cudaHostGetDevicePointer failed (error {error})"


def served_rows_choice(values: dict[int, int] | None) -> tuple[str, str]:
    """(``"read-only"``: register the trainer's read-only rows, or ``"host copy"``: use the
    rollout's writable shared copy instead; why) for a device's ``attributes`` (None: no CUDA,
    nothing is registered: the trainer's rows)."""
    if values is None:
        return "read-only", "no CUDA device: nothing to register"
    said = ", ".join(f"{ATTRIBUTES[a]} ({a}) = {v}" for a, v in sorted(values.items()))
    if values.get(HOST_REGISTER_READ_ONLY, 0) == 1:
        return "read-only", said
    return "host copy", (
        f"this GPU cannot register a read-only mapping ({said}): the trainer's table, mapped "
        "read-only, cannot be read by the GPU"
    )
