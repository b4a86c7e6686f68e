"""Checks the ground, then runs the recipe with VERL's own entry point.

    export VERL_NO_PLACEMENT_MMAP_DIR=/local_nvme/fsdp2_ext   # node-local disk, same path per host
    export MODEL_PATH=/ckpt/qwen38-flash-next-bf16 TRAIN_FILES=/data/train.parquet VAL_FILES=/data/aime24.parquet
    python recipes/qwen38_flash_next_bf16_lora_grpo/launch.py --dry-run     # print the command
    python recipes/qwen38_flash_next_bf16_lora_grpo/launch.py [extra hydra overrides...]

It runs exactly ``python -m verl.trainer.main_ppo --config-path <this directory> --config-name
recipe`` (``--variant cpu``: ``recipe_cpu``); the configuration is those Hydra files, nothing is
templated here. It refuses to start when an environment variable the files read (``oc.env``) is
unset, or when VERL_NO_PLACEMENT_MMAP_DIR is missing, not writable or on a network filesystem
(without host sharing each of the 8 ranks per host keeps its own ~95.37 GiB table: ~763 GiB of
host RAM). It then plans the whole host as the run will fill it (``fsdp2-ext plan MODEL_PATH
--recipe <the variant's file>``: the trainer's tables and offload, vLLM's level-1 weights backup,
against the host's memory and Ray's kill threshold) and refuses a plan that does not fit, naming
the figure; ``--skip-host-check`` goes on anyway. The Ray workers' environment (``ray_kwargs.ray_init.runtime_env.env_vars``) is exported
to the driver too, so ``import verl`` loads the same modules everywhere.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ENTRYPOINT = "verl.trainer.main_ppo"
VARIANTS = {"default": "recipe", "cpu": "recipe_cpu", "cpu_vllm": "recipe_cpu_vllm"}
ALWAYS_REQUIRED = ("VERL_NO_PLACEMENT_MMAP_DIR",)  # read by fsdp2_ext in the workers
_OC_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\}")


def recipe_files(variant: str = "default") -> list[str]:
    """The variant's config file and the recipe files in its defaults list (depth first), base
    first: the order Hydra merges them in."""

    def chain(name: str) -> list[str]:
        path = os.path.join(HERE, f"{name}.yaml")
        with open(path) as handle:
            defaults = (yaml.safe_load(handle) or {}).get("defaults", [])
        files: list[str] = []
        for entry in defaults:
            if isinstance(entry, str) and os.path.exists(os.path.join(HERE, f"{entry}.yaml")):
                files += [f for f in chain(entry) if f not in files]
        return files + [path]

    return chain(VARIANTS[variant])


def required_environment(variant: str = "default") -> list[str]:
    """Every variable the files read with ``oc.env``, plus VERL_NO_PLACEMENT_MMAP_DIR."""
    names = list(ALWAYS_REQUIRED)
    for path in recipe_files(variant):
        with open(path) as handle:
            names += [n for n in _OC_ENV.findall(handle.read()) if n not in names]
    return names


def recipe_environment(variant: str = "default") -> dict[str, str]:
    """``ray_kwargs.ray_init.runtime_env.env_vars`` of the variant (later files win)."""
    merged: dict[str, str] = {}
    for path in recipe_files(variant):
        with open(path) as handle:
            config = yaml.safe_load(handle) or {}
        runtime_env = (config.get("ray_kwargs") or {}).get("ray_init", {}).get("runtime_env", {})
        merged.update({k: str(v) for k, v in (runtime_env.get("env_vars") or {}).items()})
    return merged


def check_environment(required: list[str], environ=os.environ) -> list[str]:
    """Problems that stop the launch (empty: fine)."""
    problems = [f"{name} is not set" for name in required if not environ.get(name)]
    directory = environ.get("VERL_NO_PLACEMENT_MMAP_DIR")
    if directory:
        from fsdp2_ext import _fsdp2_ext

        check = _fsdp2_ext.check_shared_directory(directory, 0)
        if check.verdict:
            problems.append(check.verdict)
        elif check.note:
            print(f"launch.py: note: {check.note}", file=sys.stderr)
    return problems


def check_host(variant: str, extra: list[str], environ=os.environ, plan_args=()) -> tuple[str, str]:
    """``fsdp2-ext plan MODEL_PATH --recipe <variant> --fail-if-over``: ("fits" | "conditional"
    | "over" | "failed", its host table or why)."""
    import subprocess

    model = environ.get("MODEL_PATH", "")
    if not os.path.isfile(os.path.join(model, "config.json")):
        return "failed", (
            f"MODEL_PATH={model} has no config.json: the host plan needs the model's config "
            "(--skip-host-check to go on without it)"
        )
    recipe = os.path.join(HERE, f"{VARIANTS[variant]}.yaml")
    argv = [sys.executable, "-m", "fsdp2_ext.cli", "plan", model, "--recipe", recipe,
            "--fail-if-over", *plan_args]  # fmt: skip
    if extra:
        argv += ["--recipe-override", *extra]
    result = subprocess.run(argv, env=dict(environ), capture_output=True, text=True)
    text = result.stdout[result.stdout.find("  recipe ") :] if "  recipe " in result.stdout else ""
    outcome = {0: "fits", 3: "over", 4: "conditional"}.get(result.returncode)
    if outcome is None:
        return (
            "failed",
            f"fsdp2-ext plan failed (exit {result.returncode}): {result.stderr[-2000:]}",
        )
    return outcome, text


def command(variant: str = "default", extra: list[str] | None = None) -> list[str]:
    """VERL's entry point on the variant's config file."""
    return [
        sys.executable, "-m", ENTRYPOINT, "--config-path", HERE, "--config-name", VARIANTS[variant],
        *(extra or []),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variant", default="default", choices=sorted(VARIANTS))
    parser.add_argument(
        "--dry-run", action="store_true", help="print the resolved command and exit"
    )
    parser.add_argument(
        "--skip-host-check", action="store_true",
        help="start even when the host plan does not fit (or cannot be made)",
    )  # fmt: skip
    parser.add_argument(
        "--accept-unknown-host-memory", action="store_true",
        help="start when the host plan fits only if its unknown lines stay small (a warning)",
    )  # fmt: skip
    parser.add_argument(
        "--host-memory-gib", type=float, default=None,
        help="the host plan's memory per host (default: this host's MemTotal)",
    )  # fmt: skip
    parser.add_argument(
        "--process-resident-gib", type=float, default=None,
        help="each worker process's own resident memory (Python, torch, CUDA context, NCCL, the "
        "vLLM engine), as measured on this cluster: the host plan's one line it cannot size "
        "itself; with it, a plan can say 'fits'",
    )  # fmt: skip
    parser.add_argument("extra", nargs="*", help="extra Hydra overrides, appended last")
    args = parser.parse_args(argv)
    problems = check_environment(required_environment(args.variant))
    if problems:
        print("launch.py: refusing to start:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    given = {"--host-memory-gib": args.host_memory_gib,
             "--process-resident-gib": args.process_resident_gib}  # fmt: skip
    plan_args = [a for flag, v in given.items() if v is not None for a in (flag, str(v))]
    outcome, table = check_host(args.variant, args.extra, plan_args=plan_args)
    verdict = next((ln.strip() for ln in table.splitlines() if ln.strip().startswith("total")), "")
    if outcome == "conditional":
        message = f"the host plan fits only on its known lines: {verdict}\n{table}"
        if not (args.accept_unknown_host_memory or args.skip_host_check):
            print(f"launch.py: refusing to start: {message}\n  (--accept-unknown-host-memory to "
                  "go on, having sized the unknown lines yourself)", file=sys.stderr)  # fmt: skip
            return 2
        print(f"launch.py: warning, going on (acknowledged): {message}", file=sys.stderr)
    elif outcome != "fits":
        message = f"the host plan does not fit: {verdict}\n{table}" if verdict else table
        if not args.skip_host_check:
            print(f"launch.py: refusing to start: {message}\n  (--skip-host-check to go on)",
                  file=sys.stderr)  # fmt: skip
            return 2
        print(f"launch.py: going on (--skip-host-check): {message}", file=sys.stderr)
    else:
        print(f"launch.py: host plan:\n{table}", file=sys.stderr)
    argv_out = command(args.variant, args.extra)
    exported = recipe_environment(args.variant)
    os.environ.update(exported)
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in exported.items()), shlex.join(argv_out))
    if args.dry_run:
        return 0
    os.execvp(argv_out[0], argv_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
