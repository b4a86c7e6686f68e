"""Scale models of the recipe's run: the toy's bytes against time constants shrunk by the same
ratio, so that a distributed path meets its waits as the real run meets them.

    scale = ScaleModel.of_table(toy_table_bytes)   # the recipe's table, from its real settings
    env = scale.env()                              # {"FSDP2_EXT_WAIT_FLOOR_S": "0.63"} for 1 GiB

The recipe's run moves the n-gram table (320,001,536 x 160 bf16 = 95.37 GiB, from the spec's
n-gram settings on Transformers' ``Qwen4ExpTextConfig``, computed here on meta as the planner
does) under the 60 s floor of [Note: bounded waits]. A toy that moves ``toy_bytes`` keeps the
ratio work / floor when its floor is ``60 s x toy_bytes / real_bytes``. The bandwidth floor is
not shrunk: bytes and seconds shrink by the same ratio, so the rate a bound allows is the real
one. The fixture sets the floor through the user's own knob (``FSDP2_EXT_WAIT_FLOOR_S``, [Note:
wait knobs]), nothing internal, so a scale-model test runs the code a user runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from fsdp2_ext import _fsdp2_ext

__all__ = ["ScaleModel", "recipe_rows_per_rank_bytes", "recipe_table_bytes"]

# The spec's measured level-1 backup per TP-4 inference rank (docs/SPEC.md): that rank's quarter
# of the base in bf16, plus its LoRA slots and drafter.
SPEC_BACKUP_PER_TP4_RANK_GIB = 90.30


def recipe_rows_per_rank_bytes() -> int:
    """A trainer rank's rows of the base at FSDP 16, from the spec's own figure: 4 x 90.30 GiB /
    16 = 22.57 GiB (an upper bound: the backup also holds the LoRA slots and the drafter; the
    real config is not at hand). What a resume of a full save reads per rank."""
    return int(4 * SPEC_BACKUP_PER_TP4_RANK_GIB * 2**30 / 16)


# The spec's n-gram settings (3-grams x 8 heads, base 20,000,000 rows rounded to 128, 2560
# columns over 16 heads), on one PLE layer: the recipe's table.
SPEC_NGRAM_SETTINGS = dict(
    ple_layer_ids=[1], ple_embed_dim=2560, heads_per_ngram=8,
    ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128,
)  # fmt: skip


@cache
def recipe_table_bytes() -> int:
    """The recipe's n-gram table in bytes (bf16), from the real settings on a meta model."""
    import transformers

    from fsdp2_ext.plan.planner import plan_memory
    from fsdp2_ext.testing.tiny_models import tiny_qwen4_exp_kwargs

    kwargs = {**tiny_qwen4_exp_kwargs(), **SPEC_NGRAM_SETTINGS}
    with torch.device("meta"):
        model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**kwargs))
    (table_bytes,) = plan_memory(model, world_size=16, nodes=2).no_placement.values()
    return table_bytes


@dataclass(frozen=True)
class ScaleModel:
    """A toy that moves ``toy_bytes`` where the real run moves ``real_bytes``."""

    toy_bytes: int
    real_bytes: int
    real_floor_s: float = _fsdp2_ext.DEFAULTS["timeout_s"]

    @classmethod
    def of_table(cls, toy_bytes: int) -> ScaleModel:
        return cls(toy_bytes, recipe_table_bytes())

    @classmethod
    def of_rows_per_rank(cls, toy_bytes: int) -> ScaleModel:
        return cls(toy_bytes, recipe_rows_per_rank_bytes())

    @property
    def ratio(self) -> float:
        return self.toy_bytes / self.real_bytes

    @property
    def floor_s(self) -> float:
        """The real floor shrunk by the ratio: the toy's work weighs against it as the real
        run's weighs against 60 s."""
        return self.real_floor_s * self.ratio

    def env(self) -> dict[str, str]:
        """The environment of a scale-model rank: the shrunk floor through the user's knob."""
        return {_fsdp2_ext.DEFAULTS["wait_floor_env"]: f"{self.floor_s:.4f}"}
