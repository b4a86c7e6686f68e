"""The rollout's side, in vLLM's workers and as the trainer plans for it: the plugin that gives
every inference rank its PLE rows from one copy per host (``vllm_plugin``, ``cuda_host``), the
trainer's adapter loaded from tensors and checked (``vllm_lora``, ``lora_fingerprint``,
``adapter_sync``), what fsdp2_ext and VERL read of vLLM, per release (``vllm_contract``), and the
host memory the rollout and a sync hold (``rollout_memory``, ``sync_memory``).

May import: ``common``, ``model``, ``checkpoint``, ``tables``, ``init``. Imports no vLLM at module
level: vLLM's own modules are read where a function runs inside a vLLM process.
"""
