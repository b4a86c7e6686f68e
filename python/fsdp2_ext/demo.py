"""The main job on an embedded default: meta -> sharded FSDP2 init on 2 CPU ranks (Gloo).

    python -m fsdp2_ext.demo                 # what `make demo` runs
    python -m fsdp2_ext.demo --world-size 4

A tiny decoder-shaped model with everything the library handles: tied input/output embeddings,
an nn.Embedding nested inside each wrapped block, a frozen no-placement table that must stay on
CPU, and a non-persistent bf16 buffer. Rank 0 builds it on CPU, the other ranks on meta; then
``init_sharded`` loads it, the frozen table becomes one file-backed copy shared by the ranks
(``VERL_NO_PLACEMENT_MMAP_DIR`` pointed at a fresh temporary directory), and every check is
reported. Stage 2 (``fsdp2_ext.verl_cpu.recipe_run``): the recipe's CPU variant through VERL's own
entry point, ``python -m verl.trainer.main_ppo --config-name recipe_cpu`` (Ray, the agent loop,
the ``hf`` rollout servers, GRPO steps on a tiny ``qwen4_exp`` with LoRA 16, validation,
checkpoints), then checked from outside: the command is printed, VERL's metrics summarised, its
full log kept. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
from torch import nn

from fsdp2_ext.testing.spawn import gather_results

VOCAB, DIM, LAYERS = 101, 24, 4


class DemoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.position_table = nn.Embedding(
            VOCAB, DIM
        )  # nested embedding: must not get its own unit
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, hidden, ids):
        return hidden + torch.tanh(self.proj(hidden) + self.position_table(ids))


class DemoModel(nn.Module):
    _no_split_modules = ["DemoBlock"]
    _no_placement_params = ["ngram_table.weight"]

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(DemoBlock() for _ in range(LAYERS))
        self.ngram_table = nn.Embedding(4 * VOCAB, DIM).requires_grad_(False)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied
        self.register_buffer(
            "inv_freq", torch.linspace(1.0, 0.01, DIM, dtype=torch.bfloat16), persistent=False
        )

    def forward(self, ids):
        hidden = self.embed_tokens(ids) + self.ngram_table(
            ids.to(self.ngram_table.weight.device)
        ).to(ids.device)
        for layer in self.layers:
            hidden = layer(hidden, ids)
        return self.lm_head(hidden * self.inv_freq.float())


def _run_rank(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_ext.init.sharded_init import init_sharded

    torch.manual_seed(0)
    reference = DemoModel()
    if rank == 0:
        model = DemoModel()
        model.load_state_dict(reference.state_dict())
        model.lm_head.weight = model.embed_tokens.weight
    else:
        with torch.device("meta"):
            model = DemoModel()
    start = time.perf_counter()
    report = init_sharded(
        model,
        model.state_dict() if rank == 0 else None,
        mesh=init_device_mesh("cpu", (world_size,)),
    )
    seconds = time.perf_counter() - start
    exact = all(
        torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p, reference.get_parameter(n))
        for n, p in model.named_parameters()
    )
    ids = torch.arange(12).view(2, 6) % VOCAB
    logits = model(ids)
    logits.sum().backward()
    table = model.ngram_table.weight
    share = report.host_share
    return {
        "inode": share.inode if share else 0,
        "table_bytes": table.nbytes,
        "dir_empty": share is not None and not os.listdir(os.path.dirname(share.path)),
        "seconds": seconds,
        "local_shard_bytes": report.local_shard_bytes,
        "bytes_received": report.bytes_received,
        "exact": exact,
        "forward_exact": torch.equal(logits, reference(ids)),
        "tied": model.lm_head.weight is model.embed_tokens.weight,
        "table_on_cpu": table.device.type == "cpu" and type(table.data) is torch.Tensor,
        "table_exact": torch.equal(table, reference.ngram_table.weight),
        "buffer": f"{model.inv_freq.dtype} on {model.inv_freq.device}",
        "buffer_exact": torch.equal(model.inv_freq, reference.inv_freq),
        "wrap": report.wrap.selected,
        "skipped": report.wrap.skipped,
        "tied_groups": report.tied_groups,
        "no_placement": report.no_placement_fqns,
    }


def _quiet_third_party() -> None:
    """The demo's own process prints what a user should read: known third-party noise (Transformers'
    kernel fallbacks and deprecations, torch's DeviceMesh pickling note) is not it."""
    import logging
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)


def _run_grpo_stage(config_dir: str, steps: int = 4) -> bool:
    """Stage 2: the recipe's CPU variant through main_ppo; returns False if a check failed."""
    import shlex

    import transformers

    if not hasattr(transformers, "Qwen4ExpTextConfig"):
        print("\nstage 2 skipped: the installed Transformers has no qwen4_exp")
        return True
    from fsdp2_ext.verl_cpu.recipe_run import check_run, main_ppo_command, parse_steps, run_main_ppo

    _quiet_third_party()
    overrides = [f"trainer.total_training_steps={steps}"]
    print("\nstage 2: the recipe's CPU variant through VERL's own entry point (2 CPU ranks, Ray):")
    print("  " + shlex.join(main_ppo_command(config_dir, overrides)))
    directory = tempfile.mkdtemp(prefix="fsdp2_ext_toy_")  # kept: the user may read it all
    run = run_main_ppo(directory, config_dir=config_dir, overrides=overrides)
    print(f"  ran {run.seconds:.0f} s, exit status {run.returncode}; full log {run.log_path}")
    metrics = parse_steps(run.log())
    print(f"{'step':>6} {'reward':>7} {'pg_loss':>9} {'grad_norm':>10} {'lr':>8} {'val acc':>8}")
    for step in sorted(metrics):
        row = metrics[step]
        val = next((v for k, v in row.items() if k.startswith("val-core/")), None)
        cells = [row.get(k) for k in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm",
                                      "actor/lr")]  # fmt: skip
        print(f"{step:>6} " + " ".join(
            f"{c:>{w}.4g}" if isinstance(c, float) else f"{'-':>{w}}"
            for c, w in zip([*cells, val], (7, 9, 10, 8, 8))
        ))  # fmt: skip
    checks = check_run(run, steps=steps)
    for name, (passed, seen) in checks.items():
        print(f"  {name}: {'ok' if passed else 'FAIL'} ({seen})")
    ok = all(passed for passed, _ in checks.values())
    if not ok:
        print(run.log()[-6000:])
    print("stage 2 checks passed" if ok else "STAGE 2 CHECKS FAILED")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--recipe-dir",
        default=os.path.join("recipes", "qwen38_flash_next_bf16_lora_grpo"),
        help="the recipe directory (stage 2 runs its recipe_cpu.yaml); default: of this checkout",
    )
    parser.add_argument("--stage", choices=["1", "2", "all"], default="all")
    args = parser.parse_args(argv)
    if args.stage == "2":
        return 0 if _run_grpo_stage(args.recipe_dir) else 1
    with tempfile.TemporaryDirectory(prefix="fsdp2_ext_demo_") as shared_dir:
        by_rank = gather_results(
            args.world_size, _run_rank, env={"VERL_NO_PLACEMENT_MMAP_DIR": shared_dir}
        )
    first = by_rank[0]
    print(f"\nfsdp2_ext demo: meta -> sharded FSDP2 init on {args.world_size} CPU ranks (Gloo)")
    print("wrap units (outermost wins):")
    for path, reason in first["wrap"]:
        print(f"  {path:<28} {reason}")
    for path, reason, covered in first["skipped"]:
        print(f"  {path:<28} skipped ({reason}; covered by {covered})")
    print(f"tied groups: {first['tied_groups']}")
    print(f"no-placement parameters: {first['no_placement']} -> CPU, plain tensor, ignored by FSDP")
    checks = (
        "exact",
        "forward_exact",
        "tied",
        "table_on_cpu",
        "table_exact",
        "buffer_exact",
        "dir_empty",
    )
    print(
        f"{'rank':>4} {'shard bytes':>12} {'received':>10} {'init s':>8}  "
        + " ".join(f"{c:>13}" for c in checks)
    )
    failed = False
    for rank in sorted(by_rank):
        row = by_rank[rank]
        if "error" in row:
            print(f"{rank:>4} ERROR {row['error']}")
            failed = True
            continue
        failed |= not all(row[c] for c in checks)
        print(
            f"{rank:>4} {row['local_shard_bytes']:>12} {row['bytes_received']:>10} {row['seconds']:>8.3f}  "
            + " ".join(f"{'ok' if row[c] else 'FAIL':>13}" for c in checks)
        )
    print(f"non-persistent buffer restored as {first['buffer']}")
    inodes = {by_rank[r].get("inode") for r in by_rank}
    one_copy = len(inodes) == 1 and 0 not in inodes
    failed |= not one_copy
    print(
        f"frozen table: one file-backed copy (inode {sorted(inodes)}) mapped by {len(by_rank)} ranks, "
        f"{'ok' if one_copy else 'FAIL'}; {first['table_bytes'] * (len(by_rank) - 1)} bytes of "
        "per-rank copies avoided; the file is unlinked once every rank has mapped it"
    )
    print("all checks passed" if not failed else "SOME CHECKS FAILED")
    if args.stage == "all":
        failed |= not _run_grpo_stage(args.recipe_dir)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
