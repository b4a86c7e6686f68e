"""The VERL versions fsdp2_ext supports, checked by everything that patches or extends VERL.

Side-effect free: the shim (``fsdp2_ext.verl``) and the CPU support (``fsdp2_ext.verl_cpu``) call
``check_verl_version`` before touching VERL, so an unsupported VERL fails at import, naming the
version and what supports it, logged at error level too (VERL's plugin loader swallows import
errors): never a silent no-op, never a half-patched VERL.
"""

from __future__ import annotations

from fsdp2_ext.common import log

__all__ = ["SUPPORTED_VERSIONS", "check_verl_version", "refuse"]

SUPPORTED_VERSIONS = ("0.9.1",)


def refuse(message: str, cause: BaseException | None = None) -> ImportError:
    """An ImportError with ``message``, logged at error level first."""
    log.error(message)
    error = ImportError(message)
    error.__cause__ = cause
    return error


def check_verl_version(who: str) -> str:
    """VERL's version; ImportError (logged) when VERL is missing or not a supported version."""
    try:
        import verl
    except ImportError as error:
        raise refuse(
            f"{who} needs VERL installed (supported: {SUPPORTED_VERSIONS})", error
        ) from error
    version = getattr(verl, "__version__", "unknown")
    if version not in SUPPORTED_VERSIONS:
        raise refuse(
            f"{who} supports verl {', '.join(SUPPORTED_VERSIONS)}, found {version}; pin a "
            "supported verl or update fsdp2_ext"
        )
    return version
