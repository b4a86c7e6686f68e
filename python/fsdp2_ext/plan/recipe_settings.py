"""A recipe's settings as VERL's ``main_ppo`` composes them: what ``fsdp2-ext plan --recipe`` reads.

    settings = read_recipe("recipes/qwen38_flash_next_bf16_lora_grpo")          # recipe.yaml
    settings = read_recipe("recipes/.../recipe_cpu.yaml", overrides=["trainer.nnodes=4"])

The recipe is composed with Hydra exactly as ``python -m verl.trainer.main_ppo --config-path DIR
--config-name NAME`` composes it (``tests/verl/test_recipe.py`` checks the two are equal); only the
keys read here are resolved, so an ``oc.env`` variable the planner does not need (the data files)
may be unset. The rollout's sleep level is decided by VERL's own rule
([Note: VERL's sleep rule, run from its source]).

[Note: VERL's sleep rule, run from its source]
VERL 0.9.1 decides how deeply vLLM sleeps in ``vLLMHttpServer._resolve_sleep_level``
(``verl/workers/rollout/vllm_rollout/vllm_async_server.py``): level 1 when MTP rollout is on
(``rollout.mtp`` is ``${oc.select:actor_rollout_ref.model.mtp}``), when LoRA is served as an
adapter (the ``lora_as_adapter`` property: a LoRA rank and no ``lora.merge``) or on an NPU; else 2.
At level 1 vLLM's ``CuMemAllocator.sleep(offload_tags=("weights",))`` copies every "weights"
allocation into a pinned host tensor, kept until wake-up, i.e. for the whole run. That module
imports vLLM at its top, which a planning host (and this project's environment) need not have,
so the two functions are taken from the installed file's source (``ast``) and run on the
composed config: the rule that decides is VERL's own text, not a copy that could drift, and a
VERL whose file no longer has them is refused by name.
"""

from __future__ import annotations

import ast
import os
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

__all__ = ["RecipeSettings", "read_recipe", "verl_sleep_level"]

_SERVER_FILE = ("verl", "workers", "rollout", "vllm_rollout", "vllm_async_server.py")
_SERVER_CLASS = "vLLMHttpServer"
_RULE_FUNCTIONS = ("_resolve_sleep_level", "lora_as_adapter")


@dataclass
class RecipeSettings:
    """What the host plan needs of a composed recipe (each field: the key it comes from)."""

    source: str  # the recipe file
    nodes: int  # trainer.nnodes
    gpus_per_node: int  # trainer.n_gpus_per_node
    model_dtype: str  # actor.fsdp_config.model_dtype
    fsdp_size: int  # actor.fsdp_config.fsdp_size (-1: the world)
    param_offload: bool  # actor.fsdp_config.param_offload
    optimizer_offload: bool  # actor.fsdp_config.optimizer_offload
    lora_rank: int  # model.lora_rank (or model.lora.rank)
    lora_alpha: int  # model.lora_alpha
    lora_merge: bool  # model.lora.merge
    target_modules: list[str] = field(default_factory=list)  # model.target_modules
    target_parameters: list[str] = field(default_factory=list)  # model.target_parameters
    rollout_name: str = "vllm"  # rollout.name
    tensor_parallel_size: int = 1  # rollout.tensor_model_parallel_size
    rollout_dtype: str = "bfloat16"  # rollout.dtype
    load_format: str = "dummy"  # rollout.load_format (VERL's default: random rows, then a sync)
    # rollout.checkpoint_engine.update_weights_bucket_megabytes (VERL's default)
    bucket_megabytes: int = 2048
    device: str = "cuda"  # trainer.device
    free_cache_engine: bool = True  # rollout.free_cache_engine
    mtp_rollout: bool = False  # model.mtp.enable and model.mtp.enable_rollout
    num_speculative_tokens: int = 0  # model.mtp.num_speculative_tokens
    sleep_level: int | None = None  # VERL's rule (vLLM only; None for another rollout)
    init_source: str = "rank0"  # FSDP2_EXT_INIT_SOURCE in the workers' env (or here)
    shared_directory: str | None = None  # VERL_NO_PLACEMENT_MMAP_DIR in the workers' env (or here)
    object_store_bytes: int | None = None  # ray_kwargs.ray_init.object_store_memory
    vllm_engine_kwargs: dict = field(default_factory=dict)  # rollout.engine_kwargs.vllm
    vllm_version: str | None = None  # FSDP2_EXT_VLLM_VERSION: the vLLM the recipe is written for
    # the workers' allocator config (PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF), as they see it
    alloc_conf: dict = field(default_factory=dict)
    # FSDP2_EXT_PLE_HOST_COPY in the workers' env: the rollout's PLE rows from one host copy
    ple_host_copy: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_dict(self) -> dict:
        return dict(asdict(self), world_size=self.world_size)


def _verl_rule() -> dict:
    """VERL's ``_resolve_sleep_level`` and ``lora_as_adapter``, compiled from the installed file."""
    import importlib.util

    spec = importlib.util.find_spec("verl")  # locating VERL does not import it (nor Ray)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "fsdp2-ext plan --recipe: VERL is not installed (pip install verl==0.9.1)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], *_SERVER_FILE[1:])
    with open(path) as f:
        tree = ast.parse(f.read(), filename=path)
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == _SERVER_CLASS:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in _RULE_FUNCTIONS:
                    item.decorator_list = []  # the property becomes a plain function
                    found[item.name] = item
    missing = [name for name in _RULE_FUNCTIONS if name not in found]
    if missing:
        raise RuntimeError(
            f"fsdp2-ext plan: {path} has no {_SERVER_CLASS}.{missing[0]}; this VERL decides the "
            "rollout's sleep level elsewhere: pass --sleep-level"
        )
    from verl.utils.device import is_torch_npu_available

    namespace = {"is_torch_npu_available": is_torch_npu_available}
    module = ast.Module(body=list(found.values()), type_ignores=[])
    exec(compile(module, path, "exec"), namespace)  # noqa: S102 - VERL's own source text
    return namespace


def verl_sleep_level(rollout_config, model_config) -> int:
    """The level VERL's vLLM server sleeps at, by VERL's own rule, for these configs."""
    rule = _verl_rule()
    server = SimpleNamespace(config=rollout_config, model_config=model_config)
    server.lora_as_adapter = rule["lora_as_adapter"](server)
    return rule["_resolve_sleep_level"](server)


def _compose(recipe: str, overrides) -> tuple[object, str]:
    from hydra import compose, initialize_config_dir

    if os.path.isdir(recipe):
        directory, name = recipe, "recipe"
    else:
        directory, name = os.path.dirname(recipe) or ".", os.path.basename(recipe)
        name = name.removesuffix(".yaml").removesuffix(".yml")
    directory = os.path.abspath(directory)
    path = os.path.join(directory, f"{name}.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"fsdp2-ext plan --recipe: no {path}")
    with initialize_config_dir(config_dir=directory, version_base=None):
        return compose(config_name=name, overrides=list(overrides)), path


def read_recipe(recipe: str, overrides=(), environ=None) -> RecipeSettings:
    """The settings of ``recipe`` (a directory: its ``recipe.yaml``; or a YAML file) composed as
    ``main_ppo`` composes it, with Hydra ``overrides``; the workers' variables from
    ``ray_kwargs.ray_init.runtime_env.env_vars``, else from ``environ`` (default: this process's)."""
    from omegaconf import OmegaConf

    environ = os.environ if environ is None else environ
    config, path = _compose(recipe, overrides)
    arr = config.actor_rollout_ref
    model, actor, rollout = arr.model, arr.actor, arr.rollout
    fsdp = actor.fsdp_config
    lora_rank = int(model.get("lora_rank", 0) or 0) or int((model.get("lora") or {}).get("rank", 0))
    mtp = model.get("mtp") or {}
    ray_init = OmegaConf.select(config, "ray_kwargs.ray_init") or {}
    env_vars = dict(OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars") or {})

    def worker_env(name: str, default=None):
        return env_vars.get(name) or environ.get(name) or default

    name = str(rollout.name)
    store = ray_init.get("object_store_memory") if hasattr(ray_init, "get") else None
    return RecipeSettings(
        source=path,
        nodes=int(config.trainer.nnodes),
        gpus_per_node=int(config.trainer.n_gpus_per_node),
        model_dtype=str(fsdp.get("model_dtype", "fp32")),
        fsdp_size=int(fsdp.get("fsdp_size", -1)),
        param_offload=bool(fsdp.get("param_offload", False)),
        optimizer_offload=bool(fsdp.get("optimizer_offload", False)),
        lora_rank=lora_rank,
        lora_alpha=int(model.get("lora_alpha", 0) or 0),
        lora_merge=bool((model.get("lora") or {}).get("merge", False)),
        target_modules=_names(model.get("target_modules")),
        target_parameters=_names(model.get("target_parameters")),
        rollout_name=name,
        tensor_parallel_size=int(rollout.get("tensor_model_parallel_size", 1)),
        rollout_dtype=str(rollout.get("dtype", "bfloat16")),
        load_format=str(rollout.get("load_format", "dummy")),
        bucket_megabytes=int(
            OmegaConf.select(rollout, "checkpoint_engine.update_weights_bucket_megabytes") or 2048
        ),
        device=str(config.trainer.get("device", "cuda")),
        free_cache_engine=bool(rollout.get("free_cache_engine", True)),
        mtp_rollout=bool(mtp.get("enable", False) and mtp.get("enable_rollout", False)),
        num_speculative_tokens=int(mtp.get("num_speculative_tokens", 0) or 0),
        sleep_level=verl_sleep_level(rollout, model) if name == "vllm" else None,
        init_source=str(worker_env("FSDP2_EXT_INIT_SOURCE", "rank0")),
        shared_directory=worker_env("VERL_NO_PLACEMENT_MMAP_DIR"),
        object_store_bytes=int(store) if store else None,
        vllm_engine_kwargs=OmegaConf.to_container(
            OmegaConf.select(config, "actor_rollout_ref.rollout.engine_kwargs.vllm") or {},
            resolve=True,
        ),
        vllm_version=worker_env("FSDP2_EXT_VLLM_VERSION"),
        alloc_conf={
            n: worker_env(n)
            for n in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
            if worker_env(n)
        },
        ple_host_copy=_ple_host_copy(worker_env),
    )


def _ple_host_copy(worker_env) -> bool:
    from fsdp2_ext.vllm.vllm_plugin import ENV_PLE_HOST_COPY, enabled

    return enabled({ENV_PLE_HOST_COPY: str(worker_env(ENV_PLE_HOST_COPY, ""))})


def _names(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):  # VERL accepts "all-linear" and comma-free single names
        return [value]
    return [str(v) for v in value]
