"""Python's cyclic garbage collector, paused over the object-heavy stages of an init.

[Note: the collector paused during an init]
``fully_shard`` creates long-lived Python objects by the thousand (FSDPParams, DTensor specs,
the sharding-propagation caches of every new DTensor op), and those trip full (generation 2)
collections, each of which walks every object of the process. A VERL worker holds ~620k objects
before its model is built (Transformers, VERL, Ray), so a full collection there takes 0.3-0.45 s on
this machine, and one init ran one or two of them at unpredictable points: measured on qwen4_exp's
checkpoint path inside VERL's worker, ``fully_shard`` took 0.51-0.73 s with the collector on and
0.18-0.25 s with it paused, at 0.55 and 2.04 GiB alike (docs/BENCHMARKS.md). The objects an init
creates are the model's own and outlive it (a ``gc.collect()`` before the load freed none); tensors
are freed by reference counting either way. So the pause moves the full collection those objects
trip out of the init, it does not remove it: measured in VERL's worker (qwen4_exp, 2 GiB), one
full collection either way, inside the init with the collector on (0.33-0.37 s) and in the first
training step with it paused (0.29-0.44 s). What it buys is an init whose time is its own work,
flat in size, not a faster run. ``prepare_sharded`` (where ``fully_shard`` runs) and
``build_on_meta`` run with the collector paused and restore it as they found it (still off if the
caller had turned it off), on success and on error. ``fill_sharded``, which moves the bytes and
creates few objects, does not: nothing measured a gain there, and six interleaved pairs of the
rank-0 path at 2 GiB had its transfer 0.7 s slower paused on average over the six, slower in four
(within this VM's spread of 3.5-6.1 s for the same transfer).
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
