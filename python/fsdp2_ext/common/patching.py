"""Replacing VERL functions everywhere they are reachable, atomically, in any import order.

[Note: rebinding every holder]
VERL imports several of the functions we replace by name (``from verl.utils.tensordict_utils
import maybe_fix_3d_position_ids`` in ``engine_workers``, ``engine_workers_tinker`` and
``workers/engine/base.py``; ``from verl.utils.fsdp_utils import apply_fsdp2`` in the engines).
Patching the defining module alone therefore depends on import order: a module imported before the
patch keeps VERL's original. So a patch is applied to the defining module *and* to every loaded
module whose globals hold the original object (found by identity, under any name), and modules
imported later read the patched defining module. The plan is computed in full before anything is
written, and a failure while writing undoes what was written: VERL is never half-patched, and a
retry still sees (and records) VERL's own functions as the originals.

[Note: a replaced method keeps its registration]
VERL's worker methods carry their dispatch registration as a function attribute (``register``
sets ``attrs_3141562937`` on the wrapper; ``RayWorkerGroup`` binds only methods that have it). A
replacement of such a method takes every public attribute of VERL's function that it does not set
itself, so the worker group binds it as it bound VERL's; the replacement calls VERL's function
(which keeps its own wrapper: futures materialised, dispatch as before).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Patch", "PatchSet", "Patcher", "holders_of", "when_imported"]


@dataclass(frozen=True)
class Patch:
    """Replace ``module.name`` (where VERL defines it) with ``replacement``. A dotted ``name``
    (``Class.method``) names a method, replaced on its class (the one object every caller reads)."""

    module: str
    name: str
    replacement: Callable[..., Any]

    @property
    def key(self) -> str:
        return f"{self.module}.{self.name}"


def holders_of(objects: Iterable[Any], *, prefix: str = "") -> list[tuple[str, str, Any]]:
    """``(module, attribute, object)`` for every loaded module global that is one of ``objects``."""
    wanted = {id(o): o for o in objects}
    found = []
    for module_name, module in list(sys.modules.items()):
        if not isinstance(module, types.ModuleType) or not module_name.startswith(prefix):
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attribute, value in list(namespace.items()):
            if id(value) in wanted and value is wanted[id(value)]:
                found.append((module_name, attribute, value))
    return found


def _lookup(root: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        root = vars(root).get(part) if isinstance(root, type) else getattr(root, part, None)
        if root is None:
            return None
    return root


def _keep_registration(replacement: Any, original: Any) -> None:
    """[Note: a replaced method keeps its registration]: ``original``'s own attributes (not
    ``functools.wraps``' dunders) onto ``replacement``, where it has none of that name."""
    for name, value in vars(original).items() if hasattr(original, "__dict__") else ():
        if not name.startswith("__") and name not in vars(replacement):
            setattr(replacement, name, value)


class Patcher:
    """Applies a set of ``Patch`` es; ``originals`` maps ``module.name`` to VERL's function."""

    def __init__(self, patches: list[Patch]) -> None:
        self.patches = patches
        self.originals: dict[str, Any] = {}
        self.rebound: list[str] = []  # "module.attribute" of every holder we wrote

    def _resolve_originals(self) -> dict[str, Any]:
        """Imports every defining module and reads the originals, writing nothing."""
        modules = {p.module: importlib.import_module(p.module) for p in self.patches}
        missing = [p.key for p in self.patches if _lookup(modules[p.module], p.name) is None]
        if missing:
            raise ImportError(f"missing {missing}")
        ours = {id(p.replacement) for p in self.patches}
        originals = {}
        for patch in self.patches:
            current = _lookup(modules[patch.module], patch.name)
            if id(current) in ours:  # applied before (an earlier install in this process)
                current = self.originals[patch.key]
            originals[patch.key] = current
        return originals

    def apply(self) -> list[str]:
        """Writes the replacements into every holder of an original (idempotent, atomic)."""
        originals = self._resolve_originals()
        replacement_of = {id(originals[p.key]): p.replacement for p in self.patches}
        plan = [
            (sys.modules[module_name], attribute, value, replacement_of[id(value)], module_name)
            for module_name, attribute, value in holders_of(originals.values())
        ]
        for patch in self.patches:
            if (
                "." in patch.name
                and _lookup(sys.modules[patch.module], patch.name) is not patch.replacement
            ):
                owner_path, attribute = patch.name.rsplit(".", 1)
                owner = _lookup(sys.modules[patch.module], owner_path)
                plan.append(
                    (
                        owner,
                        attribute,
                        originals[patch.key],
                        patch.replacement,
                        f"{patch.module}.{owner_path}",
                    )
                )
        written: list[tuple[Any, str, Any]] = []
        try:
            for owner, attribute, original, replacement, _ in plan:
                setattr(owner, attribute, replacement)
                written.append((owner, attribute, original))
        except BaseException:
            for owner, attribute, original in reversed(written):
                setattr(owner, attribute, original)
            raise
        for patch in self.patches:  # only once written: a failed install leaves ours untouched
            _keep_registration(patch.replacement, originals[patch.key])
        self.originals.update(originals)
        labels = [f"{label}.{attribute}" for _, attribute, _, _, label in plan]
        self.rebound.extend(label for label in labels if label not in self.rebound)
        return labels

    def remaining_originals(self) -> list[str]:
        """``module.attribute`` of every loaded global still holding a VERL original."""
        return [f"{m}.{a}" for m, a, _ in holders_of(self.originals.values())]


class PatchSet:
    """Replacements declared where they are written: ``@patches.replaces(module, name)`` next to
    each one, ``patches.original(module, name)`` for VERL's function inside it, ``install()`` to
    apply them all (idempotent, atomic: ``Patcher``)."""

    def __init__(self) -> None:
        self.patches: list[Patch] = []
        self.patcher = Patcher(self.patches)

    def replaces(
        self, module: str, name: str
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Declares the decorated function as the replacement of ``module.name``."""

        def declare(replacement: Callable[..., Any]) -> Callable[..., Any]:
            self.patches.append(Patch(module, name, replacement))
            return replacement

        return declare

    def original(self, module: str, name: str) -> Callable[..., Any]:
        """VERL's own ``module.name``, as it was before ``install``."""
        return self.patcher.originals[f"{module}.{name}"]

    @property
    def originals(self) -> dict[str, Any]:
        return self.patcher.originals

    def install(self) -> list[str]:
        return self.patcher.apply()

    def remaining_originals(self) -> list[str]:
        return self.patcher.remaining_originals()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module has executed ([Note: patches that wait for
    their module])."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[], Any]]] = {}
        self.lock = threading.Lock()

    def find_spec(self, name, path, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        with self.lock:
            callbacks = self.pending.pop(name, [])
        exec_module = spec.loader.exec_module

        def exec_then_run(module):
            exec_module(module)
            for callback in callbacks:
                callback()

        spec.loader.exec_module = exec_then_run  # this module's own loader object
        return spec


_AFTER_IMPORT = _AfterImport()


def when_imported(module: str, callback: Callable[[], Any]) -> None:
    """Calls ``callback`` once ``module`` is imported: now if it is loaded already, else right
    after it executes, before its importer sees it.

    [Note: patches that wait for their module]
    Some of VERL's modules import packages that may be missing from a process or an environment
    (``verl.workers.rollout.vllm_rollout`` imports vLLM): the shim cannot import them to patch
    them. Their patches wait on ``sys.meta_path`` for the module's first import, in whichever
    process imports it (a vLLM worker that resolves VERL's worker extension, the server actor), and
    are applied as it finishes executing, so no caller ever reads the unpatched class. A failing
    patch fails that import, with its own message.
    """
    if module in sys.modules:
        callback()
        return
    with _AFTER_IMPORT.lock:
        _AFTER_IMPORT.pending.setdefault(module, []).append(callback)
    if _AFTER_IMPORT not in sys.meta_path:
        sys.meta_path.insert(0, _AFTER_IMPORT)
