"""fsdp2_ext.verl: plugs fsdp2_ext into VERL's FSDP2 engine (verl 0.9.1).

    VERL_USE_EXTERNAL_MODULES=fsdp2_ext.verl python -m verl.trainer.main_ppo ...   # the recipe's way
    actor_rollout_ref.model.external_lib=fsdp2_ext.verl                           # also works
    import fsdp2_ext.verl                                                          # in your own code

Any of these, in any import order, gives the same result: every VERL call site of a replaced
function resolves to the replacement ([Note: rebinding every holder] in ``fsdp2_ext/common/patching.py``).
Each replacement is declared next to its code (``@replaces(module, name)``); ``targets.py`` names
each VERL module once and lists what the shim reads there ([Note: what the shim assumes of
VERL]). What is replaced, and where it is explained:

- ``FSDPEngine._build_model_optimizer`` / ``_build_lora_module`` and ``verl.utils.fsdp_utils``'s
  ``get_init_weight_context_manager``: meta builds for tied models, and every rank loading its own
  rows from the checkpoint with ``FSDP2_EXT_INIT_SOURCE=checkpoint`` (``engine.py``, [Note: where
  an FSDP2 engine's values come from]);
- ``verl.utils.fsdp_utils``: wrap selection, ``apply_fsdp2``, ``fsdp2_load_full_state_dict`` and
  the FSDP2 offload/onload helpers (``engine.py``, [Note: do no harm]);
- ``verl.utils.tensordict_utils.maybe_fix_3d_position_ids``,
  ``verl.workers.utils.padding.left_right_2_no_padding``, ``verl.protocol.deserialize_tensordict``:
  explicit nested position IDs (``positions.py``, [Note: VERL position IDs]);
- ``FSDPCheckpointManager.save_checkpoint`` / ``load_checkpoint``, ``get_fsdp_full_state_dict``,
  ``collect_lora_params``: no-placement tables written once and never moved
  (``training_checkpoint.py``, [Note: frozen tables in checkpoints]);
- VERL's vLLM rollout, once VERL imports it: the adapter loader in the vLLM workers (VERL's
  raises on vLLM 0.32-0.34), and every adapter-only sync checked (``rollout_sync.py``, [Note:
  every adapter sync checked]).

An unsupported VERL version, or one that moved a replaced symbol, fails at import naming the
symbol and the supported versions, logged at error level as well (VERL's entry-point loader
swallows import errors): never a silent no-op, never a half-patched VERL.

May import every floor below it: ``common`` to ``plan`` ([Note: the packages' floors]).
"""

from __future__ import annotations

from typing import Any

from fsdp2_ext.common import log
from fsdp2_ext.common.verl_version import SUPPORTED_VERSIONS, check_verl_version, refuse
from fsdp2_ext.verl import engine, positions, rollout_sync, training_checkpoint  # noqa: F401
from fsdp2_ext.verl.targets import SHIM

__all__ = ["ORIGINALS", "PATCHES", "SUPPORTED_VERSIONS", "install", "installed"]

PATCHES = SHIM.patches
ORIGINALS: dict[str, Any] = SHIM.originals


def installed() -> list[str]:
    """``module.attribute`` of every holder rewritten so far (empty before ``install``)."""
    return list(SHIM.patcher.rebound)


def install() -> list[str]:
    """Patches VERL in this process: every loaded holder of an original, atomically.

    Idempotent; calling it again rebinds holders that appeared since (none, in practice: modules
    imported later read the patched defining modules). Returns every holder rewritten so far.
    """
    version = check_verl_version("fsdp2_ext.verl")
    first = not SHIM.originals
    try:
        rebound = SHIM.install()
    except (ImportError, AttributeError) as error:
        raise refuse(
            f"fsdp2_ext.verl: verl {version} does not have what this shim replaces ({error}); "
            f"VERL was left unpatched. Supported: verl {', '.join(SUPPORTED_VERSIONS)}",
            error,
        ) from error
    rollout_sync.install()  # VERL's vLLM modules, patched as they are imported
    if first or rebound:
        log.info(f"fsdp2_ext.verl installed into verl {version}: {len(rebound)} call sites rebound")
        log.debug(f"fsdp2_ext.verl rebound: {', '.join(rebound)}")
    return installed()


install()
