"""Python's cyclic garbage collector, paused over the object-heavy stages of an init.

[Note: the collector paused during an init]
``fully_shard`` creates long-lived Python objects by the thousand (FSDPParams, DTensor specs,
the sharding-propagation caches of every new DTensor op), and those trip full (generation 2)
collections, each of which walks every object of the process. A VERL worker holds ~620k objects
before its model is built (Transformers, VERL, Ray), so a full collection there takes ~0.2 s on
this machine, and one init ran one or two of them at unpredictable points: measured on qwen4_exp's
checkpoint path inside VERL's worker, ``fully_shard`` took 0.51-0.73 s with the collector on and
0.18-0.25 s with it paused, at 0.55 and 2.04 GiB alike (docs/BENCHMARKS.md). The objects an init
creates are the model's own and outlive it (a ``gc.collect()`` before the load freed none); tensors
are freed by reference counting either way. The pause moves the full collection those objects
still trip out of the init (likely one, later in the process), it does not remove it. ``prepare_sharded`` and ``fill_sharded`` (so
``init_sharded``) and ``build_on_meta`` run with the collector paused and restore it as they
found it (still off if the caller had turned it off), on success and on error.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collection_paused"]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block; also usable as a decorator."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
