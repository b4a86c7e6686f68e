"""The recipe's CPU-scale variant, run by VERL's own worker: LoRA GRPO on a tiny qwen4_exp, 2 CPU ranks.

    python -m fsdp2_ext.verl_cpu_grpo            # `make demo` stage 2
    python -m fsdp2_ext.verl_cpu_grpo --steps 3 --keep /tmp/run   # keep checkpoint and adapter

The configuration is ``recipes/qwen38_flash_next_bf16_lora_grpo/recipe_cpu.yaml``, composed by
Hydra on VERL's ``ppo_trainer`` exactly as ``python -m verl.trainer.main_ppo --config-path ...
--config-name recipe_cpu`` composes it. Each rank builds VERL's ``ActorRolloutRefWorker``
(role ``actor_rollout``) from ``actor_rollout_ref`` and the step is VERL's trainer step, one
function at a time: prompts from VERL's ``RLHFDataset``, rollouts by the worker's rollout
(``fsdp2_ext.verl_hf_rollout``, [Note: in-process HF rollout]), rewards by VERL's reward
manager with the recipe's custom score, GRPO advantages by VERL's ``compute_advantage``,
old log-probs by ``compute_log_prob``, the policy update by ``update_actor`` (VERL's
``ppo_loss``), and the adapter-only weight sync by the worker's own ``update_weights``.

[Note: where main_ppo stops on CPU]
``verl.trainer.main_ppo`` itself does not run on a CPU-only host in verl 0.9.1. With Ray given
CPUs for the transfer queue and pretend GPUs for the resource check, it stops in
``verl.utils.distributed.initialize_global_process_group_ray``: the backend string
``"cpu:gloo,{device}:{ccl}"`` becomes ``"cpu:gloo,cpu:gloo"`` on a CPU platform and torch refuses
it ("Duplicate device type cpu"); past that, ``LLMServerManager`` starts server replicas
(``verl/workers/rollout/replica.py``) that exist only for vLLM, SGLang and TensorRT-LLM. So this
module plays the driver's part (batching, reward, advantage, the gather a dispatch does) on every
rank, with the same functions the driver calls, and each rank calls the worker's methods on its
own slice as VERL's dispatch would.

The toy task is verifiable: a prompt asks for digits, the reward is the share of the response's
characters that are digits (``compute_score``, named in ``recipe_cpu.yaml``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

RECIPE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "recipes",
    "qwen38_flash_next_bf16_lora_grpo",
)
# What VERL needs in every process, before `import verl`, to run its engine on CPU ranks.
CPU_ENV = {
    "VERL_USE_EXTERNAL_MODULES": "fsdp2_ext.verl_cpu_platform,fsdp2_ext.verl_hf_rollout,fsdp2_ext.verl",
    "VERL_PLATFORM": "cpu",
    "VERL_ENGINE_DEVICE": "cuda",  # VERL's engine registry knows cuda/npu; the platform is the CPU
    "FSDP2_EXT_INIT_SOURCE": "checkpoint",  # as the recipe
    "VERL_LOGGING_LEVEL": "WARN",
    "TOKENIZERS_PARALLELISM": "false",
}
TASK_SOURCE = "fsdp2_ext/digits"
DIGITS = "0123456789"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """The toy task's verifiable reward: the share of the response's characters in
    ``ground_truth`` (the digits). VERL's reward manager calls it with the decoded response."""
    if data_source != TASK_SOURCE:
        raise ValueError(
            f"compute_score: unknown data_source {data_source!r} (expected {TASK_SOURCE!r})"
        )
    text = solution_str.replace(" ", "")
    return sum(ch in ground_truth for ch in text) / len(text) if text else 0.0


def tiny_qwen4_exp_kwargs() -> dict:
    """``Qwen4ExpTextConfig`` keywords of the smallest model with every part of the real one
    (linear + indexed attention, MoE, PLE n-gram tables on layers 1 and 2)."""
    return dict(
        vocab_size=128, hidden_size=32, num_hidden_layers=3,
        layer_types=["linear_attention", "linear_attention", "indexed_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=8,
        ple_layer_ids=[1, 2], ple_embed_dim=32, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=11, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=1,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
        indexer_budget=8, indexer_compress_ratio=4, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        eos_token_id=1, bos_token_id=0, pad_token_id=2,
    )  # fmt: skip


def save_tiny_tokenizer(directory: str, vocab_size: int = 128) -> None:
    """A character-level tokenizer with exactly ``vocab_size`` ids (every id the model can sample
    decodes) and a plain chat template, saved with ``save_pretrained``."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    chars = list(DIGITS + string.ascii_letters + string.punctuation + " ")
    chars += [chr(0x100 + i) for i in range(vocab_size - len(specials) - len(chars))]
    vocab = {token: i for i, token in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>",
    )  # fmt: skip
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}={% endif %}"
    )
    tokenizer.save_pretrained(directory)


def write_toy_run(directory: str, prompts: int = 8) -> dict[str, str]:
    """Checkpoint (``save_pretrained``, n-gram tables included), tokenizer and the task's
    train/val parquet files in ``directory``; returns the recipe's environment for them."""
    import pandas
    import transformers

    model_dir = os.path.join(directory, "tiny_qwen4_exp")
    config = transformers.Qwen4ExpTextConfig(**tiny_qwen4_exp_kwargs())
    torch.manual_seed(0)
    transformers.Qwen4ExpForCausalLM(config).save_pretrained(model_dir)
    save_tiny_tokenizer(model_dir, config.vocab_size)
    rows = [
        {
            "data_source": TASK_SOURCE,
            "prompt": [{"role": "user", "content": f"digits {i}?"}],
            "reward_model": {"style": "rule", "ground_truth": DIGITS},
            "extra_info": {"index": i},
        }
        for i in range(prompts)
    ]
    paths = {}
    for split in ("train", "val"):
        paths[split] = os.path.join(directory, f"{split}.parquet")
        pandas.DataFrame(rows).to_parquet(paths[split])
    return {"MODEL_PATH": model_dir, "TRAIN_FILES": paths["train"], "VAL_FILES": paths["val"]}


def compose_recipe(variant: str = "recipe_cpu", overrides: list[str] | None = None):
    """The recipe composed by Hydra on VERL's ``ppo_trainer``, as main_ppo composes it; the
    ``oc.env`` values are resolved from the current environment."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    if not os.path.isdir(RECIPE_DIR):
        raise FileNotFoundError(
            f"compose_recipe: the recipe directory {RECIPE_DIR} does not exist; the CPU run reads "
            "the recipe from a checkout of fsdp2_ext (pip install --no-build-isolation -e .)"
        )
    with initialize_config_dir(config_dir=RECIPE_DIR, version_base=None):
        config = compose(config_name=variant, overrides=list(overrides or []))
    OmegaConf.resolve(config)
    return config


def _pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as smaps:
        for line in smaps:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def mapped_inode(tensor: torch.Tensor) -> int:
    """The inode of the file mapping that holds ``tensor``'s data (0: anonymous memory)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return int(fields[4])
    return 0


def _gather(obj) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class RecipeRun:
    """One rank of the run: VERL's worker plus the driver's part of a trainer step."""

    def __init__(self, config) -> None:
        from verl.utils.dataset.rl_dataset import RLHFDataset
        from verl.utils.tokenizer import hf_tokenizer
        from verl.workers.engine_workers import ActorRolloutRefWorker

        self.config = config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor_rollout")
        self.worker.init_model()
        self.tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
        self.dataset = RLHFDataset(config.data.train_files, self.tokenizer, config.data)
        from verl.trainer.ppo.reward import load_reward_manager

        self.reward_manager = load_reward_manager(config, self.tokenizer)
        self.cursor = 0

    def sync_weights(self, step: int) -> tuple[int, int, bool]:
        """VERL's own weight sync (``update_weights``, naive backend); (tensors, bytes, adapter only)."""
        import asyncio

        asyncio.run(self.worker.update_weights(global_steps=step))
        rollout = self.worker.rollout
        return rollout.synced_tensors, rollout.synced_bytes, rollout.peft_config is not None

    def next_prompts(self):
        """The next ``train_batch_size`` prompts as VERL's trainer holds them: left-padded ids
        (the chat template applied as VERL's agent loop applies it), one uid per prompt."""
        import numpy as np
        from verl import DataProto

        size = self.config.data.train_batch_size
        rows = [self.dataset[(self.cursor + i) % len(self.dataset)] for i in range(size)]
        self.cursor += size
        encoded = [
            self.tokenizer.apply_chat_template(
                row["raw_prompt"], add_generation_prompt=True, tokenize=True
            )
            for row in rows
        ]
        encoded = [e["input_ids"] if hasattr(e, "keys") else e for e in encoded]
        width = max(len(e) for e in encoded)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(e)) + list(e) for e in encoded])
        attention_mask = (
            torch.arange(width) >= width - torch.tensor([[len(e)] for e in encoded])
        ).long()
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        batch = DataProto.from_dict(
            tensors={
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
            },
            non_tensors={
                "data_source": np.array([r["data_source"] for r in rows], dtype=object),
                "reward_model": np.array([r["reward_model"] for r in rows], dtype=object),
                "extra_info": np.array([r["extra_info"] for r in rows], dtype=object),
                "uid": np.array(
                    [f"prompt-{self.cursor - size + i}" for i in range(size)], dtype=object
                ),
            },
        )
        return batch.repeat(repeat_times=self.config.actor_rollout_ref.rollout.n, interleave=True)

    def generate(self, batch, seed: int):
        """This rank's slice through the worker's rollout; every rank gets the whole batch back."""
        from verl import DataProto

        mine = batch.chunk(self.world)[self.rank]
        mine.meta_info.update(
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id
        )
        torch.manual_seed(seed + self.rank)
        out = self.worker.rollout.generate_sequences(mine)
        parts = _gather({k: v for k, v in out.batch.items()})
        merged = DataProto.from_dict(
            tensors={k: torch.cat([p[k] for p in parts]) for k in parts[0]},
            non_tensors=dict(batch.non_tensor_batch),
            # as VERL's agent loop labels its output: the sampling temperature travels with it
            meta_info={"temperature": self.config.actor_rollout_ref.rollout.temperature},
        )
        return merged

    def score(self, batch) -> torch.Tensor:
        """VERL's reward manager per sample; the score sits on the last response token."""
        from verl.trainer.ppo.ray_trainer import compute_response_mask

        batch.batch["response_mask"] = compute_response_mask(batch)
        loop = self.reward_manager.loop
        scores = torch.tensor(
            [loop.run_until_complete(self.reward_manager.run_single(batch[i : i + 1]))["reward_score"]
             for i in range(len(batch))]
        )  # fmt: skip
        token_scores = torch.zeros_like(batch.batch["response_mask"], dtype=torch.float32)
        last = (batch.batch["response_mask"].sum(-1) - 1).clamp(min=0)
        token_scores[torch.arange(len(batch)), last] = scores
        batch.batch["token_level_scores"] = token_scores
        batch.batch["token_level_rewards"] = token_scores
        return scores

    def advantages(self, batch):
        from verl.trainer.ppo.ray_trainer import compute_advantage

        algorithm = self.config.algorithm
        return compute_advantage(
            batch,
            adv_estimator=algorithm.adv_estimator,
            gamma=algorithm.gamma,
            lam=algorithm.lam,
            num_repeat=self.config.actor_rollout_ref.rollout.n,
            norm_adv_by_std_in_grpo=algorithm.norm_adv_by_std_in_grpo,
            config=algorithm,
        )

    def _my_slice(self, td):
        from verl.utils import tensordict_utils as tu

        return tu.chunk_tensordict(td, self.world)[self.rank]

    def old_log_probs(self, batch) -> None:
        """``_compute_old_log_prob`` of VERL's trainer, the dispatch's gather included."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

        td = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(
            td, calculate_entropy=True, calculate_sum_pi_squared=False, compute_loss=False
        )
        mine = self._my_slice(td)
        log_probs = no_padding_2_padding(
            tu.get(self.worker.compute_log_prob(mine), "log_probs"), mine
        )
        batch.batch["old_log_probs"] = torch.cat(_gather(log_probs.float())).float()

    def update_actor(self, batch) -> dict:
        """``_update_actor`` of VERL's trainer on this rank's slice; the worker's metrics."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        actor, rollout = self.config.actor_rollout_ref.actor, self.config.actor_rollout_ref.rollout
        batch.meta_info.update(
            multi_turn=rollout.multi_turn.enable, temperature=rollout.temperature
        )
        td = left_right_2_no_padding(batch.to_tensordict())
        mini_batch = actor.ppo_mini_batch_size * rollout.n
        tu.assign_non_tensor(
            td,
            calculate_entropy=actor.calculate_entropy or actor.entropy_coeff != 0.0,
            distillation_use_topk=False,
            distillation_only=False,
            global_batch_size=mini_batch,
            mini_batch_size=mini_batch,
            epochs=actor.ppo_epochs,
            seed=actor.data_loader_seed,
            dataloader_kwargs={"shuffle": actor.shuffle},
            compute_loss=True,
        )
        return tu.get(self.worker.update_actor(self._my_slice(td)), "metrics")

    def step(self, step: int) -> dict:
        start = time.perf_counter()
        synced = self.sync_weights(step)
        batch = self.next_prompts()
        batch = self.generate(batch, seed=1000 * step)
        scores = self.score(batch)
        batch = self.advantages(batch)
        self.old_log_probs(batch)
        metrics = self.update_actor(batch)
        seconds = time.perf_counter() - start
        return {
            "step": step,
            "reward": float(scores.mean()),
            "pg_loss": _scalar(metrics.get("actor/pg_loss", metrics.get("pg_loss"))),
            "grad_norm": _scalar(metrics.get("actor/grad_norm", metrics.get("grad_norm"))),
            "seconds": seconds,
            "pss_bytes_sum": sum(_gather(_pss_bytes())),
            "synced_tensors": synced[0],
            "synced_bytes": synced[1],
            "adapter_only": synced[2],
        }


def _scalar(value) -> float:
    if isinstance(value, list | tuple):
        value = sum(value) / len(value) if value else float("nan")
    return float(value) if value is not None else float("nan")


def run_rank(rank: int, world_size: int, config_yaml: str, steps: int, export_dir: str) -> dict:
    """The run on one rank (the default process group is up); a report for the printout."""
    from omegaconf import OmegaConf

    from fsdp2_ext.no_placement import find_no_placement_params

    config = OmegaConf.create(config_yaml)
    # VERL leaves the process RNG unseeded (LoRA's A matrices come from it): seed it with the
    # recipe's seed so that a run is reproducible.
    torch.manual_seed(config.actor_rollout_ref.actor.fsdp_config.seed)
    build_start = time.perf_counter()
    run = RecipeRun(config)
    build_seconds = time.perf_counter() - build_start
    rows = [run.step(step) for step in range(1, steps + 1)]
    final_sync = run.sync_weights(steps + 1)
    if rank == 0:
        run.worker.rollout.export_adapter(export_dir)
    dist.barrier()
    reload_diff, base_diff = adapter_reload_diff(run, export_dir) or (None, None)
    module = run.worker.actor.engine.module
    trainer_tables = find_no_placement_params(module)
    replica_tables = find_no_placement_params(run.worker.rollout.module)
    return {
        "build_seconds": build_seconds,
        "steps": rows,
        "final_sync": final_sync,
        "reload_max_abs_diff": reload_diff,
        "base_max_abs_diff": base_diff,
        "tables": [t.fqn.removeprefix("base_model.model.") for t in trainer_tables],
        "trainer_table_inodes": sorted({mapped_inode(t.param) for t in trainer_tables}),
        "replica_table_inodes": sorted({mapped_inode(t.param) for t in replica_tables}),
        "tables_on_cpu": all(t.param.device.type == "cpu" for t in trainer_tables),
        "only_lora_trainable": all(
            "lora_" in n for n, p in module.named_parameters() if p.requires_grad
        ),
        "trainable": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "architecture": type(run.worker.rollout.module.get_base_model()).__name__,
    }


@torch.no_grad()
def adapter_reload_diff(run: RecipeRun, export_dir: str) -> tuple[float, float] | None:
    """Max |logit difference| between the trained FSDP model (VERL's engine) and the checkpoint
    with the exported adapter loaded by ``PeftModel.from_pretrained``, and (negative control)
    the checkpoint alone; on rank 0, else None. Collective: the FSDP forward runs on every rank."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 33, 9, 60, 4, 71, 12]])
    trained = run.worker.actor.engine.module(input_ids=ids).logits.float()
    if dist.get_rank() != 0:
        return None
    base = AutoModelForCausalLM.from_pretrained(
        run.config.actor_rollout_ref.model.path, dtype=torch.float32
    )
    base_diff = float((base(input_ids=ids).logits.float() - trained).abs().max())
    reloaded = PeftModel.from_pretrained(base, export_dir).eval()
    return float((reloaded(input_ids=ids).logits.float() - trained).abs().max()), base_diff


def _rank_main(rank: int, world_size: int, port: int, results, config_yaml, steps, export_dir, env):
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results.put((rank, run_rank(rank, world_size, config_yaml, steps, export_dir)))
    except BaseException as error:
        import traceback

        results.put(
            (rank, {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()})
        )
        dist.destroy_process_group()
        raise
    from fsdp2_ext.demo import leave_cleanly

    leave_cleanly()


def run(world_size: int = 2, steps: int = 3, keep: str | None = None) -> tuple[bool, dict]:
    """Writes the toy run, composes ``recipe_cpu``, runs it on ``world_size`` spawned ranks and
    prints a report; returns (all checks passed, rank -> report)."""
    from omegaconf import OmegaConf

    from fsdp2_ext.demo import spawn

    with tempfile.TemporaryDirectory(prefix="fsdp2_ext_recipe_") as scratch:
        root = keep or scratch
        os.makedirs(root, exist_ok=True)
        shared_dir = os.path.join(root, "host_shared")
        export_dir = os.path.join(root, "adapter")
        os.makedirs(shared_dir, exist_ok=True)
        env = {**CPU_ENV, **write_toy_run(root), "VERL_NO_PLACEMENT_MMAP_DIR": shared_dir}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            # VERL's trainer sets the optimizer's step count from its dataloader; here, from steps
            config = compose_recipe(
                "recipe_cpu",
                [
                    f"trainer.n_gpus_per_node={world_size}",
                    f"trainer.total_training_steps={steps}",
                    f"actor_rollout_ref.actor.optim.total_training_steps={steps}",
                ],
            )
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        by_rank = spawn(_rank_main, world_size, OmegaConf.to_yaml(config), steps, export_dir, env)
        ok = _report(config, by_rank, export_dir, shared_dir)
    return ok, by_rank


def _report(config, by_rank: dict, export_dir: str, shared_dir: str) -> bool:
    errors = {r: row for r, row in by_rank.items() if "error" in row}
    model = config.actor_rollout_ref.model
    print(
        f"\nstage 2: the recipe's CPU variant in VERL (recipe_cpu.yaml on ppo_trainer), "
        f"{len(by_rank)} CPU ranks, LoRA {model.lora_rank}/{model.lora_alpha}"
    )
    if errors:
        for rank, row in sorted(errors.items()):
            print(f"  rank {rank}: ERROR {row['error']}\n{row.get('trace', '')}")
        print("STAGE 2 CHECKS FAILED")
        return False
    first = by_rank[0]
    print(
        f"  {first['architecture']}: worker built in {first['build_seconds']:.1f} s; "
        f"{first['trainable']} trainable (LoRA) parameters; no-placement tables {first['tables']}"
    )
    print(
        f"{'step':>4} {'reward':>7} {'pg_loss':>9} {'grad_norm':>10} {'step s':>7} "
        f"{'host PSS MiB':>13} {'synced':>14}"
    )
    for row in first["steps"]:
        print(
            f"{row['step']:>4} {row['reward']:>7.3f} {row['pg_loss']:>9.4f} {row['grad_norm']:>10.4f} "
            f"{row['seconds']:>7.2f} {row['pss_bytes_sum'] / 2**20:>13.1f} "
            f"{row['synced_tensors']:>5} / {row['synced_bytes']:>6} B"
        )
    trainer_inodes = {i for row in by_rank.values() for i in row["trainer_table_inodes"]}
    replica_inodes = {i for row in by_rank.values() for i in row["replica_table_inodes"]}
    checks = {
        "every rank saw the same steps": all(
            [(s["reward"], s["pg_loss"]) for s in row["steps"]]
            == [(s["reward"], s["pg_loss"]) for s in first["steps"]]
            for row in by_rank.values()
        ),
        "only LoRA parameters train": all(row["only_lora_trainable"] for row in by_rank.values()),
        "tables on CPU in the trainer": all(row["tables_on_cpu"] for row in by_rank.values()),
        "trainer's tables: one file mapping for all ranks": len(trainer_inodes) == 1
        and 0 not in trainer_inodes,
        "rollout replicas' tables: the trainer's mapping": replica_inodes == trainer_inodes,
        "adapter-only sync": all(s["adapter_only"] for s in first["steps"]),
        "shared directory left empty": not os.listdir(shared_dir),
        "PEFT adapter exported": all(
            os.path.exists(os.path.join(export_dir, name))
            for name in ("adapter_config.json", "adapter_model.safetensors")
        ),
    }
    diff = first["reload_max_abs_diff"]
    checks["PeftModel.from_pretrained(checkpoint, adapter) gives the trained logits"] = diff == 0.0
    print(
        f"  adapter reloaded with PEFT: max |logit - trained logit| = {diff:.3g} "
        f"(checkpoint alone: {first['base_max_abs_diff']:.3g})"
    )
    for name, passed in checks.items():
        print(f"  {name}: {'ok' if passed else 'FAIL'}")
    ok = all(checks.values())
    print("stage 2 checks passed" if ok else "STAGE 2 CHECKS FAILED")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", help="write checkpoint, data and adapter here and keep them")
    args = parser.parse_args(argv)
    ok, _ = run(args.world_size, args.steps, args.keep)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
