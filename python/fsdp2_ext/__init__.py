"""fsdp2_ext: exact, lean FSDP2 initialisation for LoRA training of very large models.

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
