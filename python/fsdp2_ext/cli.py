"""The ``fsdp2-ext`` command.

fsdp2-ext plan MODEL_DIR_OR_CONFIG --world-size 16 --nodes 2 --lora-rank 16 [--json]
fsdp2-ext demo [--world-size 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict


def _plan(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from fsdp2_ext.cold_start import HardwareRates, estimate_cold_start, format_cold_start
    from fsdp2_ext.planner import format_plan, plan_memory

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
    )
    rates = HardwareRates(args.disk_gibps, args.copy_gibps, args.link_gibps)
    cold_start = estimate_cold_start(
        plan.shard_bytes_per_gpu,
        args.world_size,
        args.nodes,
        rates=rates,
        results_path=args.cold_start_results,
    )
    if args.json:
        print(
            json.dumps(
                {**plan.to_dict(), "cold_start": cold_start and asdict(cold_start)}, indent=2
            )
        )
        return 0
    print(format_plan(plan))
    if cold_start is not None:
        print(format_cold_start(cold_start))
    else:
        print(f"  cold start: no benchmark results at {args.cold_start_results} to estimate from")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fsdp2-ext", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="per-GPU / per-host memory of a model under fsdp2_ext")
    plan.add_argument("model", help="local HF model directory or config.json (never downloaded)")
    plan.add_argument("--world-size", type=int, required=True)
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument("--dtype", default="bfloat16")
    plan.add_argument("--lora-rank", type=int, default=0)
    plan.add_argument("--target-modules", nargs="*", default=[])
    plan.add_argument("--target-parameters", nargs="*", default=[])
    plan.add_argument("--bucket-mib", type=int, default=64)
    plan.add_argument(
        "--override",
        nargs="*",
        default=[],
        metavar="KEY=JSON",
        help="config overrides on the text config, e.g. num_hidden_layers=2",
    )
    plan.add_argument("--json", action="store_true")
    from fsdp2_ext.cold_start import BENCHMARK_RESULTS, HardwareRates

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
