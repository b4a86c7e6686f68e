"""The Transformers versions fsdp2_ext supports, checked when ``fsdp2_ext`` is imported.

[Note: the Transformers range]
From 5.19.0, the Transformers vLLM 0.32 pins and ``make vllm-check`` runs on (the trainer with the
shim included, in ``test_vllm_main_ppo``; ``qwen4_exp`` ships there), to 5.25.x, the newest, where
``from_pretrained`` kernelizes by default ([Note: hub kernels once the weights are real]). The
default environment (``make test``) runs 5.25.0; the lowest is proven by ``make compat``'s
Transformers run (``COMPAT_TRANSFORMERS``, recorded in the README and ``docs/compat/``). A
Transformers outside the range is refused at import with this message, before any model is
built: the meta build, the checkpoint's conversions and the hub-kernels rule are read from these
releases' sources, and a newer one may change any of them. Without Transformers installed the
core (``init_sharded`` on a plain module) needs nothing from it: no check.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["BELOW", "LOWEST", "check_transformers_version", "problem"]

LOWEST = "5.19.0"
BELOW = "5.26"  # every 5.25.x; not 5.26's pre-releases


def problem(version: str) -> str:
    """Why ``version`` is not supported, or "" when it is."""
    from packaging.version import Version  # a dependency of Transformers

    found = Version(version)
    if Version(LOWEST) <= found and found.release < Version(BELOW).release:
        return ""
    return (
        f"fsdp2_ext supports Transformers {LOWEST} up to (not including) {BELOW}, found "
        f"{version}: install 'transformers>={LOWEST},<{BELOW}' or update fsdp2_ext "
        "([Note: the Transformers range])"
    )


def check_transformers_version() -> str | None:
    """The installed Transformers' version (None when absent); ImportError outside the range."""
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    reason = problem(version)
    if reason:
        from fsdp2_ext.common.verl_version import (
            refuse,  # logged too: VERL's plugin loader swallows it
        )

        raise refuse(reason)
    return version
