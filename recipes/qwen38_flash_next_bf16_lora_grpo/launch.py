"""Launcher for the Qwen3.8-Flash-Next BF16 LoRA GRPO recipe (VERL, FSDP2 + fsdp2_ext, vLLM TP4).

    export VERL_NO_PLACEMENT_MMAP_DIR=/local_nvme/fsdp2_ext   # node-local disk, same path per host
    export MODEL_PATH=/ckpt/qwen38-flash-next-bf16 TRAIN_FILES=/data/train.parquet VAL_FILES=/data/aime24.parquet
    python recipes/qwen38_flash_next_bf16_lora_grpo/launch.py --dry-run     # print the command
    python recipes/qwen38_flash_next_bf16_lora_grpo/launch.py [extra hydra overrides...]
    python recipes/qwen38_flash_next_bf16_lora_grpo/launch.py --variant cpu_smoke --dry-run

Refuses to start without VERL_NO_PLACEMENT_MMAP_DIR, or when that directory is missing, not
writable or on a network filesystem (without host sharing each of the 8 ranks per host keeps its
own ~95.37 GiB table: ~763 GiB of host RAM). Ray scheduling and checkpoint preparation are
outside this recipe.
"""

from __future__ import annotations

import argparse
import os
import shlex
import string
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))


def load_overrides(variant: str = "default") -> tuple[str, list[str], list[str]]:
    """(entrypoint, required environment variables, overrides) of a variant, base first."""
    name = "recipe.yaml" if variant == "default" else f"recipe_{variant}.yaml"
    with open(os.path.join(HERE, name)) as handle:
        recipe = yaml.safe_load(handle)
    overrides: list[str] = []
    if recipe.get("base"):
        _, _, overrides = load_overrides("default")
    return (
        recipe["entrypoint"],
        list(recipe.get("required_env", [])),
        overrides + list(recipe["overrides"]),
    )


def recipe_environment(variant: str = "default") -> dict[str, str]:
    """The ``env`` the recipe exports for VERL (base first, then the variant's)."""
    name = "recipe.yaml" if variant == "default" else f"recipe_{variant}.yaml"
    with open(os.path.join(HERE, name)) as handle:
        recipe = yaml.safe_load(handle)
    base = recipe_environment("default") if recipe.get("base") else {}
    return {**base, **{k: str(v) for k, v in (recipe.get("env") or {}).items()}}


def check_environment(required: list[str], environ=os.environ) -> list[str]:
    """Problems that stop the launch (empty: fine)."""
    problems = [f"{name} is not set" for name in required if not environ.get(name)]
    directory = environ.get("VERL_NO_PLACEMENT_MMAP_DIR")
    if directory:
        from fsdp2_ext import _fsdp2_ext

        verdict, note = _fsdp2_ext.check_shared_directory(directory, 0)
        if verdict:
            problems.append(verdict)
        elif note:
            print(f"launch.py: note: {note}", file=sys.stderr)
    return problems


def resolve(overrides: list[str], environ=os.environ) -> list[str]:
    """Fills ${NAME} from the environment (only the recipe's own placeholders)."""
    return [string.Template(item).safe_substitute(environ) for item in overrides]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="default", choices=["default", "cpu_smoke"])
    parser.add_argument(
        "--dry-run", action="store_true", help="print the resolved command and exit"
    )
    parser.add_argument("extra", nargs="*", help="extra Hydra overrides, appended last")
    args = parser.parse_args(argv)
    entrypoint, required, overrides = load_overrides(args.variant)
    problems = check_environment(required)
    if problems:
        print("launch.py: refusing to start:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    command = [sys.executable, "-m", entrypoint, *resolve(overrides), *args.extra]
    exported = recipe_environment(args.variant)
    os.environ.update(exported)
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in exported.items()), shlex.join(command))
    if args.dry_run:
        return 0
    os.execvp(command[0], command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
