"""[Note: the packages' floors] (``fsdp2_ext/__init__.py``): every import inside fsdp2_ext, at
module level or inside a function, goes to its own package or to a floor below it."""

from __future__ import annotations

import ast
import os
import sys

import fsdp2_ext

ROOT = os.path.dirname(fsdp2_ext.__file__)

# Lowest first; each package may import the ones before it.
FLOORS = ["common", "model", "checkpoint", "tables", "init", "vllm", "plan", "verl", "verl_cpu",
          "testing"]  # fmt: skip
TOP_LEVEL = {"positions": "model", "cli": None, "demo": None}  # None: may import any package
# The one import that goes up, inside a function: the demo's toy model is the tests' tiny one.
ALLOWED_UP = {("verl_cpu.toy_run", "testing.tiny_models")}


def _floor(module: str) -> int | None:
    """The floor of ``fsdp2_ext.<module>`` (dotted below fsdp2_ext); None: above every floor."""
    head = module.split(".")[0]
    if head in TOP_LEVEL:
        return None if TOP_LEVEL[head] is None else FLOORS.index(TOP_LEVEL[head])
    if head in FLOORS:
        return FLOORS.index(head)
    raise AssertionError(f"fsdp2_ext.{module}: in no package of FLOORS and not a top-level module")


def _imports(path: str):
    """(line, module below fsdp2_ext) for every fsdp2_ext import in the file."""
    with open(path) as source:
        tree = ast.parse(source.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp2_ext"):
            below = node.module[len("fsdp2_ext") :].lstrip(".")
            for alias in node.names:
                yield node.lineno, f"{below}.{alias.name}" if below else alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fsdp2_ext."):
                    yield node.lineno, alias.name[len("fsdp2_ext.") :]


def _modules():
    for directory, _, files in os.walk(ROOT):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                module = os.path.relpath(path, ROOT)[: -len(".py")].replace(os.sep, ".")
                module = module.removesuffix(".__init__")
                if module != "__init__":
                    yield module, path


def upward_imports() -> list[str]:
    found = []
    for module, path in _modules():
        mine = _floor(module)
        if mine is None:
            continue
        for line, target in _imports(path):
            if target.split(".")[0] == "_fsdp2_ext":
                continue
            theirs = _floor(target)
            allowed = any(module == a and target.startswith(b) for a, b in ALLOWED_UP)
            if (theirs is None or theirs > mine) and not allowed:
                found.append(f"fsdp2_ext/{module.replace('.', '/')}.py:{line} imports {target}")
    return found


def test_every_import_goes_to_its_floor_or_below():
    assert upward_imports() == []


def test_every_module_is_on_a_floor():
    """A new module lands in a package of FLOORS (or is named a top-level one here)."""
    for module, _ in _modules():
        _floor(module)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The negative control: a ``common`` module importing ``init`` is found."""
    package = tmp_path / "fsdp2_ext"
    (package / "common").mkdir(parents=True)
    (package / "common" / "bad.py").write_text(
        "def f():\n    from fsdp2_ext.init.sharded_init import init_sharded\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(package))
    assert upward_imports() == ["fsdp2_ext/common/bad.py:2 imports init.sharded_init.init_sharded"]
