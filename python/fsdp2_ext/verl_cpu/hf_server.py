"""An ``hf`` rollout server for VERL: Transformers generation on the CPU, driven by VERL's own
agent loop, for runs without vLLM or SGLang (``actor_rollout_ref.rollout.name=hf``).

Three classes, in the three places VERL puts a rollout ([Note: the hf rollout server]):

- ``HFReplica`` (VERL's ``RolloutReplica``, in the TaskRunner; ``hf_replica.py``): launches one
  ``HFServer`` per replica, named as VERL names server actors, for VERL's load balancer;
- ``HFServer`` (a Ray actor; here): holds the checkpoint's model and the synced LoRA adapter,
  answers VERL's ``generate(request_id, prompt_ids, sampling_params, ...)`` with a ``TokenOutput``;
- ``HFServerAdapter`` (VERL's ``BaseRollout``, in each trainer worker; ``hf_replica.py``):
  forwards the worker's ``update_weights`` (adapter tensors + PEFT config, VERL's checkpoint
  engine ``naive``) to its replica's server.

Registered as ``hf`` in VERL's ``RolloutReplicaRegistry`` and rollout-class registry by
``fsdp2_ext.verl_cpu.plugin``. This module imports no VERL at import time: a server process
unpickles ``HFServer`` before it has imported VERL, whose plugin loading then imports
``hf_replica``.

[Note: the hf rollout server]
- One server per replica (``tensor_model_parallel_size`` trainer ranks), as vLLM's: the model is
  loaded from the checkpoint (``model.path``) once per replica, its frozen no-placement tables
  viewed from the checkpoint file where it stores them as the model needs them ([Note: zero-copy
  tables]: the trainer's ranks and the servers share the page cache's one copy). Only the LoRA
  adapter travels from the trainer (``load_format`` without ``dummy``); a full-weight sync
  (``base_sync_done=False``) loads a whole state dict.
- Generation is reproducible: a request draws from the ``seed`` in its sampling parameters (the
  ``seeded_single_turn`` agent loop derives it from the rollout seed, the global step, the
  prompt's dataset index and the response's session), as vLLM honours ``SamplingParams.seed``.
  Requests run one at a time (the model's forward is not re-entrant), each after
  ``torch.manual_seed(its seed)``, so neither arrival order, replica nor a concurrent validation
  changes what a training sample draws. A request without a seed draws from (rollout seed,
  global step of its weights, arrival count). Temperature 0 is greedy (VERL's validation).
- The response length is vLLM's: ``min(response_length, prompt_length + response_length -
  len(prompt))``, within ``max_model_len``; log-probs are the model's raw log-softmax of each
  sampled token, as vLLM's default ``raw_logprobs``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from typing import Any

import torch

__all__ = ["ROLLOUT_NAME", "HFServer", "derive_seed", "server_name"]

ROLLOUT_NAME = "hf"


def server_name(replica_rank: int, node_rank: int = 0) -> str:
    """The Ray actor name of a replica's server, as VERL names server actors."""
    return f"{ROLLOUT_NAME}_server_{replica_rank}_{node_rank}"


def derive_seed(*parts) -> int:
    """A 63-bit seed from what identifies a sample: the same parts always give the same seed."""
    key = "/".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


class HFServer:
    """One replica's model: generation for VERL's agent loop, adapter updates from the trainer."""

    def __init__(self, config, model_config, replica_rank: int) -> None:
        from verl.utils.config import omega_conf_to_dataclass

        torch.set_num_threads(max(1, int(os.environ.get("FSDP2_EXT_SERVER_THREADS", "1"))))
        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config)  # HFModelConfig: local_path
        self.replica_rank = replica_rank
        self.module = self._load_checkpoint()
        self.peft_config = None
        self.global_steps = 0
        self.synced = {"updates": 0, "tensors": 0, "bytes": 0, "adapter_only": True}
        self._lock = threading.Lock()  # one forward at a time: generation is not re-entrant
        self._counter = 0  # requests without a deterministic id

    def _load_checkpoint(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        from fsdp2_ext.tables.table_placement import view_tables_from_checkpoint

        path = self.model_config.local_path
        dtype = getattr(torch, str(self.config.dtype).removeprefix("torch."))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model.requires_grad_(False).eval()
        view_tables_from_checkpoint(model, path, who=f"rollout server {self.replica_rank}")
        return model

    # What VERL's load balancer and agent loop call.
    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data=None,
        video_data=None,
        **kwargs,
    ):
        from verl.workers.rollout.replica import TokenOutput

        if image_data is not None or video_data is not None:
            raise ValueError("the hf rollout server generates text only (no image or video data)")
        sampling_params = dict(sampling_params)
        seed = sampling_params.pop("seed", None)
        if seed is None:
            self._counter += 1
            seed = derive_seed(self.config.seed, self.global_steps, "arrival", self._counter)
        tokens, log_probs = await asyncio.to_thread(
            self._generate, list(prompt_ids), sampling_params, int(seed)
        )
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if sampling_params.get("logprobs") else None,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _max_tokens(self, prompt_length: int) -> int:
        config = self.config
        budget = config.prompt_length + config.response_length - prompt_length
        room = config.max_model_len - prompt_length if config.max_model_len else budget
        if room < 1:
            raise ValueError(
                f"prompt of {prompt_length} tokens leaves no room within max_model_len "
                f"{config.max_model_len}"
            )
        return max(1, min(config.response_length, budget, room))

    @torch.no_grad()
    def _generate(
        self, prompt: list[int], params: dict, seed: int
    ) -> tuple[list[int], list[float]]:
        temperature = float(params.get("temperature", 1.0))
        top_k = int(params.get("top_k", -1))
        greedy = temperature == 0.0 or top_k == 1
        options = {
            "max_new_tokens": self._max_tokens(len(prompt)),
            "do_sample": not greedy,
            "return_dict_in_generate": True,
            "output_logits": True,
            "repetition_penalty": float(params.get("repetition_penalty", 1.0)),
        }
        if not greedy:
            options.update(temperature=temperature, top_p=float(params.get("top_p", 1.0)))
            options["top_k"] = top_k if top_k > 0 else None
        ids = torch.tensor([prompt])
        with self._lock:
            torch.manual_seed(seed)
            out = self.module.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), **options
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        log_probs = [
            float(torch.log_softmax(logits[0].float(), dim=-1)[token])
            for logits, token in zip(out.logits, tokens)
        ]
        return tokens, log_probs

    async def update_weights(
        self, tensors: dict[str, torch.Tensor], *, peft_config, base_sync_done, global_steps
    ) -> None:
        """Loads the trainer's adapter (``peft_config`` given, ``base_sync_done``) or a whole
        state dict; the weights are those of step ``global_steps`` from now on."""
        with self._lock:
            if peft_config is not None and base_sync_done:
                self._load_adapter(tensors, peft_config)
            else:
                self.synced["adapter_only"] = False
                _, unexpected = self._base_model().load_state_dict(tensors, strict=False)
                if unexpected:
                    raise KeyError(f"hf rollout server: unexpected weights {unexpected[:5]}")
            if global_steps is not None:
                self.global_steps = int(global_steps)
            self.synced["updates"] += 1
            self.synced["tensors"] += len(tensors)
            self.synced["bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
            self._report()

    PROBE_IDS = (5, 17, 33, 9, 60, 4, 71, 12)  # a fixed input whose logits the report keeps

    def _report(self) -> None:
        """With ``FSDP2_EXT_REPORT_DIR``: this server's record (tables, syncs), its adapter in
        PEFT's format and its logits on ``PROBE_IDS``, for checks from outside the run."""
        from fsdp2_ext.common.procfs import mapped_inode, status_bytes, storage_bytes
        from fsdp2_ext.common.run_report import report_dir, write_record
        from fsdp2_ext.model.no_placement import find_no_placement_params

        directory = report_dir()
        if directory is None:
            return
        name = f"rollout_server-{self.replica_rank}"
        adapter = os.path.join(directory, f"{name}-adapter")
        if self.peft_config is not None:
            self.module.save_pretrained(adapter, safe_serialization=True)
        with torch.no_grad():
            logits = self.module(input_ids=torch.tensor([self.PROBE_IDS])).logits
        torch.save(logits, os.path.join(directory, f"{name}-logits.pt"))
        tables = find_no_placement_params(self._base_model())
        frozen = {id(t.param) for t in tables}
        params = [(n, p) for n, p in self.module.named_parameters() if id(p) not in frozen]
        held = {  # what this server holds of the model, for the host plan's per-rank figures
            "weights_bytes": storage_bytes(
                [p for n, p in params if "lora_" not in n]
                + [b for _, b in self.module.named_buffers()]
            ),
            "lora_bytes": storage_bytes(p for n, p in params if "lora_" in n),
            "table_bytes": storage_bytes(t.param for t in tables),
        }
        write_record(
            name,
            {
                "kind": "rollout_server",
                "replica": self.replica_rank,
                "pid": os.getpid(),
                "architecture": type(self._base_model()).__name__,
                "sync": self.sync_record(),
                "tables": [{"fqn": t.fqn, "inode": mapped_inode(t.param)} for t in tables],
                "adapter": adapter if self.peft_config is not None else None,
                "probe_ids": list(self.PROBE_IDS),
                "held": held,
                "resident": status_bytes(),
            },
        )

    def _base_model(self) -> torch.nn.Module:
        return self.module.get_base_model() if self.peft_config is not None else self.module

    def _load_adapter(self, tensors: dict[str, torch.Tensor], peft_config) -> None:
        from peft import get_peft_config, get_peft_model, set_peft_model_state_dict

        if isinstance(peft_config, dict):  # the engine sends ``PeftConfig.to_dict()``
            peft_config = get_peft_config(dict(peft_config))
        if self.peft_config is None:
            self.peft_config = peft_config
            self.module = get_peft_model(self.module, peft_config).eval()
        result = set_peft_model_state_dict(self.module, tensors)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise KeyError(f"hf rollout server: unknown adapter keys {unexpected[:5]}")

    def sync_record(self) -> dict:
        """What the trainer has synced so far (updates, tensors, bytes, adapter only)."""
        return dict(self.synced, global_steps=self.global_steps)

    def export_adapter(self, directory: str) -> str:
        """Writes the synced adapter in PEFT's format; returns ``directory``."""
        if self.peft_config is None:
            raise RuntimeError("hf rollout server: no adapter has been synced yet")
        self.module.save_pretrained(directory, safe_serialization=True)
        return directory

    # VERL's replica lifecycle: the model lives in host memory, nothing to release or resume.
    async def sleep(self) -> None:
        return None

    async def wake_up(self) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None
