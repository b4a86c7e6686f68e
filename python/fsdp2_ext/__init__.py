"""fsdp2_ext: exact, lean FSDP2 initialisation for LoRA training of very large models.

What it does, and where (docs/ARCHITECTURE.md has the data's path through each):

- sharded init from rank 0, a shared full state or a model checkpoint (``sharded_init``,
  ``state_load``, ``model_checkpoint``, ``model_checkpoint_load``);
- tied aliases and non-persistent buffers kept (``aliases``);
- FSDP2 wrap targets that never overlap (``wrap_targets``);
- no-placement tables on CPU through ``fully_shard`` and every transfer (``no_placement``), one
  copy per host (``host_shared``, ``table_placement``);
- jagged position IDs with an explicit layout (``positions``);
- the VERL shim (``fsdp2_ext.verl``) and VERL on CPU hosts (``fsdp2_ext.verl_cpu``);
- the memory planner (``planner``, ``fsdp2-ext plan``) and the demo (``demo``).

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
from fsdp2_ext import log  # noqa: E402, F401

# [Note: the Transformers range]: one outside it refused here, with the fix.
from fsdp2_ext.transformers_version import check_transformers_version  # noqa: E402

check_transformers_version()
