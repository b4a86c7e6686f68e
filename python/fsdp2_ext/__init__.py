"""fsdp2_ext: exact, lean FSDP2 initialisation for LoRA training of very large models.

[Note: the packages' floors]
The package is built in floors; a module imports its own package and the floors below it, never
one above (``tests/common/test_layout.py`` checks every import, also those inside functions):

- ``common``: the logger, the bounded agreement between ranks (``distributed``), patching, the
  supported versions, the FSDP2 internals relied on, small tools;
- ``model``: what the init learns of a model before meta: tied aliases and buffers, the
  no-placement declarations, the wrap targets;
- ``checkpoint``: a Transformers checkpoint directory and its safetensors files;
- ``tables``: the frozen tables' placement, one copy per host, and the host copy served to the
  rollout;
- ``init``: meta to sharded FSDP2 (``init.sharded_init.init_sharded``), from rank 0, a shared full
  state or the checkpoint; HSDP; hub kernels;
- ``vllm``: the rollout's side: the vLLM plugin, the adapter loaded and checked in vLLM's
  workers, what VERL and fsdp2_ext read of each vLLM release, the rollout's host memory;
- ``plan``: the memory planner and the host plan (``fsdp2-ext plan``);
- ``verl``: the shim in VERL's FSDP2 engine (``fsdp2_ext.verl``); ``verl_cpu``: VERL on CPU hosts
  (it takes its toy model from ``testing``, the one import that goes up); ``testing``: the
  fixtures of the tests, the benchmarks and the demo.

Beside them: ``positions`` (jagged position IDs; imports ``common`` at most), ``cli`` (the
``fsdp2-ext`` command) and ``demo``. docs/ARCHITECTURE.md follows the data through each.

Import order matters: torch first (it loads libtorch and registers its pybind11 types), then the
compiled core `_fsdp2_ext`, which refuses to load under a torch other than the one it was built
against (see [Note: one torch] in cmake/TorchFromPython.cmake).
"""

import torch

from fsdp2_ext import _fsdp2_ext

if _fsdp2_ext.__torch_version__ != torch.__version__:
    raise ImportError(
        f"fsdp2_ext was compiled against torch {_fsdp2_ext.__torch_version__} but torch "
        f"{torch.__version__} is imported; rebuild it in this environment with "
        "`pip install --no-build-isolation -e .`"
    )

__version__ = _fsdp2_ext.__version__

# The C++ core's messages go to logging.getLogger("fsdp2_ext") from here on.
from fsdp2_ext.common import log  # noqa: E402, F401

# [Note: the Transformers range]: one outside it refused here, with the fix.
from fsdp2_ext.common.transformers_version import check_transformers_version  # noqa: E402

check_transformers_version()
