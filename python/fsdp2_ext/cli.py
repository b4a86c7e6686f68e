"""The ``fsdp2-ext`` command.

fsdp2-ext plan MODEL_DIR_OR_CONFIG --recipe RECIPE_DIR_OR_YAML [--json]
fsdp2-ext plan MODEL_DIR_OR_CONFIG --world-size 16 --nodes 2 --lora-rank 16 [--json]
fsdp2-ext plan MODEL_DIR_OR_CONFIG --world-size 32 --nodes 4 --fsdp-size 8 ...   # HSDP
fsdp2-ext demo [--world-size 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict


def _resolve(args: argparse.Namespace):
    """The recipe's settings (``--recipe``) with the explicit flags over them; None without one."""
    settings = None
    if args.recipe:
        from fsdp2_ext.plan.recipe_settings import read_recipe

        settings = read_recipe(args.recipe, args.recipe_override)
        if args.world_size is None:
            args.world_size = settings.world_size
        if args.nodes is None:
            args.nodes = settings.nodes
        if args.fsdp_size is None:
            args.fsdp_size = settings.fsdp_size
        if args.lora_rank is None:
            args.lora_rank = settings.lora_rank
        if args.target_modules is None:
            args.target_modules = settings.target_modules
        if args.target_parameters is None:
            args.target_parameters = settings.target_parameters
        if args.dtype is None:
            args.dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(
                settings.model_dtype, settings.model_dtype
            )
        settings.nodes, settings.gpus_per_node = args.nodes, args.world_size // max(1, args.nodes)
        settings.lora_rank = args.lora_rank
        settings.target_modules, settings.target_parameters = (
            args.target_modules,
            args.target_parameters,
        )
        if args.tensor_parallel_size is not None:
            settings.tensor_parallel_size = args.tensor_parallel_size
        if args.sleep_level is not None:
            settings.sleep_level = args.sleep_level
    if args.world_size is None:
        raise SystemExit("fsdp2-ext plan: pass --world-size, or --recipe to read it from a recipe")
    args.nodes = args.nodes or 1
    args.lora_rank = args.lora_rank or 0
    args.dtype = args.dtype or "bfloat16"
    if args.target_modules is None:  # VERL's default (model.target_modules: all-linear)
        args.target_modules = ["all-linear"] if args.lora_rank else []
    args.target_parameters = args.target_parameters or []
    return settings


def _plan(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from fsdp2_ext.plan.cold_start import (
        HardwareRates,
        estimate_cold_start,
        estimate_tables,
        format_cold_start,
        format_tables,
    )
    from fsdp2_ext.plan.planner import format_plan, plan_memory

    settings = _resolve(args)
    where = args.model if os.path.isdir(args.model) else os.path.dirname(args.model) or "."
    if not os.path.isfile(os.path.join(where, "config.json")):
        print(
            f"fsdp2-ext plan: {args.model} is neither a model directory with a config.json nor a "
            "config.json (nothing is downloaded: pass a local path)",
            file=sys.stderr,
        )
        return 2
    config = transformers.AutoConfig.from_pretrained(where, local_files_only=True)
    overrides = dict(item.split("=", 1) for item in args.override)
    for key, value in overrides.items():
        target = config.get_text_config() if hasattr(config, "get_text_config") else config
        setattr(target, key, json.loads(value))
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = transformers.AutoModelForImageTextToText.from_config(config)
    plan = plan_memory(
        model,
        world_size=args.world_size,
        nodes=args.nodes,
        dtype=getattr(torch, args.dtype),
        lora_rank=args.lora_rank,
        target_modules=args.target_modules,
        target_parameters=args.target_parameters,
        bucket_bytes=args.bucket_mib << 20,
        fsdp_size=args.fsdp_size,
    )
    host = None
    if settings is not None:
        from fsdp2_ext.plan.host_plan import plan_host

        gib = lambda value: None if value is None else int(value * (1 << 30))  # noqa: E731
        host = plan_host(
            model, plan, settings,
            host_memory_bytes=gib(args.host_memory_gib),
            threshold=args.ray_threshold,
            backup_bytes_per_rank=gib(args.rollout_backup_gib),
            process_resident_bytes=gib(args.process_resident_gib),
            tables_are_views={"yes": True, "no": False}.get(args.tables_are_views),
        )  # fmt: skip
    rates = HardwareRates(args.disk_gibps, args.copy_gibps, args.link_gibps)
    cold_start = estimate_cold_start(
        plan.shard_bytes_per_gpu,
        args.world_size,
        args.nodes,
        rates=rates,
        results_path=args.cold_start_results,
        fsdp_size=plan.fsdp_size,
    )
    from fsdp2_ext.plan.host_plan import tables_stored_in_pieces

    views_flag = {"yes": True, "no": False}.get(args.tables_are_views)
    init_source = settings.init_source if settings is not None else "rank0"
    if views_flag is None:
        views_flag = init_source == "checkpoint" and not tables_stored_in_pieces(
            model, list(plan.no_placement)
        )
    tables = estimate_tables(
        sum(plan.no_placement.values()), world_size=args.world_size, nodes=args.nodes,
        init_source=init_source,
        shared_directory=bool(settings and settings.shared_directory),
        views=views_flag, rates=rates,
    )  # fmt: skip
    if args.json:
        out = {
            **plan.to_dict(), "cold_start": cold_start and asdict(cold_start),
            "tables": tables and asdict(tables),
        }  # fmt: skip
        if host is not None:
            out.update(recipe=settings.to_dict(), host=host.to_dict())
        print(json.dumps(out, indent=2))
        return _exit_code(host, args.fail_if_over)
    print(format_plan(plan))
    if cold_start is not None:
        print(format_cold_start(cold_start))
    else:
        print(f"  cold start: no benchmark results at {args.cold_start_results} to estimate from")
    if tables is not None:
        print(format_tables(tables))
    if host is not None:
        from fsdp2_ext.plan.host_plan import format_host_plan

        print(
            f"  recipe {settings.source}: {settings.rollout_name} TP {settings.tensor_parallel_size}"
            f", sleep level {settings.sleep_level} (VERL's rule), init source "
            f"{settings.init_source}, host sharing "
            f"{settings.shared_directory or 'off (VERL_NO_PLACEMENT_MMAP_DIR unset)'}"
        )
        print(format_host_plan(host))
        return _exit_code(host, args.fail_if_over)
    return 0


def _exit_code(host, fail_if_over: bool) -> int:
    """``--fail-if-over``: 3 when the host plan does not fit, 4 when it fits only if its unknown
    lines stay small (a warning the launcher makes the user acknowledge); else 0."""
    if host is None or not fail_if_over or host.fits:
        return 0
    return 4 if host.conditional else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fsdp2-ext", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="per-GPU / per-host memory of a model under fsdp2_ext")
    plan.add_argument("model", help="local HF model directory or config.json (never downloaded)")
    plan.add_argument("--recipe", metavar="DIR_OR_YAML",
                      help="a VERL recipe (a directory: its recipe.yaml), composed as main_ppo "
                           "composes it: world size, hosts, TP, LoRA, sleep level, offload, host "
                           "sharing; adds the per-host table. The flags below override it")  # fmt: skip
    plan.add_argument("--recipe-override", nargs="*", default=[], metavar="KEY=VALUE",
                      help="Hydra overrides for --recipe, e.g. trainer.nnodes=4")  # fmt: skip
    plan.add_argument("--world-size", type=int, default=None,
                      help="trainer ranks (GPUs) in all; required without --recipe")  # fmt: skip
    plan.add_argument("--nodes", type=int, default=None, help="hosts (default 1)")
    plan.add_argument("--fsdp-size", type=int, default=None,
                      help="VERL's actor fsdp_size: the shard group (default: the recipe's, else "
                           "every GPU); below the world size, HSDP replicas of that size")  # fmt: skip
    plan.add_argument("--dtype", default=None,
                      help="the trainer's parameter dtype (default bfloat16, or the recipe's "
                           "model_dtype)")  # fmt: skip
    plan.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (0: none)")
    plan.add_argument("--target-modules", nargs="*", default=None,
                      help="LoRA target modules (default: VERL's all-linear, or the recipe's)")  # fmt: skip
    plan.add_argument("--target-parameters", nargs="*", default=None,
                      help="LoRA target parameters, e.g. mlp.experts.gate_up_proj")  # fmt: skip
    plan.add_argument("--bucket-mib", type=int, default=64,
                      help="the rank-0 load's bucket size, MiB")  # fmt: skip
    plan.add_argument("--tensor-parallel-size", type=int, default=None,
                      help="the rollout's TP size (default: the recipe's)")  # fmt: skip
    plan.add_argument("--sleep-level", type=int, choices=(1, 2), default=None,
                      help="vLLM's sleep level (default: VERL's rule on the recipe)")  # fmt: skip
    plan.add_argument("--host-memory-gib", type=float, default=None,
                      help="each host's memory (default: this host's MemTotal)")  # fmt: skip
    plan.add_argument("--ray-threshold", type=float, default=None,
                      help="Ray's kill threshold (default: RAY_memory_usage_threshold, else 0.95)")  # fmt: skip
    plan.add_argument("--rollout-backup-gib", type=float, default=None,
                      help="vLLM's level-1 backup per inference rank as measured (replaces the "
                           "estimate from the model)")  # fmt: skip
    plan.add_argument("--process-resident-gib", type=float, default=None,
                      help="each worker process's own resident memory, counted for 2H processes")  # fmt: skip
    plan.add_argument("--tables-are-views", choices=("yes", "no"), default=None,
                      help="whether the frozen tables are views of the checkpoint (default: yes "
                           "with the checkpoint init source unless the model's checkpoint stores "
                           "them in pieces; a network filesystem or another dtype: no)")  # fmt: skip
    plan.add_argument("--fail-if-over", action="store_true",
                      help="exit 3 when the host plan does not fit, 4 when it fits only if its "
                           "unknown lines stay small (the launcher's check)")  # fmt: skip
    plan.add_argument(
        "--override",
        nargs="*",
        default=[],
        metavar="KEY=JSON",
        help="config overrides on the text config, e.g. num_hidden_layers=2",
    )
    plan.add_argument("--json", action="store_true", help="the same figures as JSON")
    from fsdp2_ext.plan.cold_start import BENCHMARK_RESULTS, HardwareRates

    assumed = HardwareRates()
    plan.add_argument("--disk-gibps", type=float, default=assumed.disk_gibps,
                      help="cold-start estimate: one host's disk read rate, GiB/s")  # fmt: skip
    plan.add_argument("--copy-gibps", type=float, default=assumed.copy_gibps,
                      help="cold-start estimate: one rank's copy rate into its shards, GiB/s")  # fmt: skip
    plan.add_argument("--link-gibps", type=float, default=assumed.link_gibps,
                      help="cold-start estimate: rank 0's send rate to the others, GiB/s")  # fmt: skip
    plan.add_argument("--cold-start-results", default=BENCHMARK_RESULTS,
                      help="bench_cold_start.py's results, for the measured efficiencies")  # fmt: skip
    plan.set_defaults(run=_plan)
    demo = commands.add_parser("demo", help="the 2-rank CPU demo (same as `make demo`)")
    demo.add_argument("--world-size", type=int, default=2)
    demo.set_defaults(
        run=lambda a: __import__("fsdp2_ext.demo").demo.main(["--world-size", str(a.world_size)])
    )
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
