"""A full state every rank can see: the checkpoint's ``*.safetensors`` files, mapped read-only.

    state = map_safetensors_state(glob.glob(f"{checkpoint}/*.safetensors"))
    init_sharded(model, state, mesh=mesh, source="local")   # each rank copies only its rows

The header is parsed in C++ (nlohmann_json) and tensors are zero-copy views of one shared mapping
per file, so the page cache holds each byte once per host. The views are read-only memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from fsdp2_ext import _fsdp2_ext

__all__ = ["map_safetensors_state"]


def map_safetensors_state(paths: Iterable[str | os.PathLike]) -> dict[str, torch.Tensor]:
    """Maps every file and merges their tensors; a name found in two files is an error."""
    if isinstance(paths, str | bytes | os.PathLike):
        raise TypeError(
            f"map_safetensors_state: paths must be a list of files, got the single path {paths!r} "
            "(pass [path], or glob.glob(f'{checkpoint}/*.safetensors'))"
        )
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for path in paths:
        for name, tensor in _fsdp2_ext.SafetensorsFile(os.fspath(path)).tensors().items():
            if name in state:
                raise ValueError(f"tensor '{name}' is in both {origin[name]} and {path}")
            state[name] = tensor
            origin[name] = os.fspath(path)
    if not state:
        raise ValueError(
            "map_safetensors_state: no tensors found (pass the checkpoint's *.safetensors files)"
        )
    return state
