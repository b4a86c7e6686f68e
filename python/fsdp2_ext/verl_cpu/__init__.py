"""VERL on CPU ranks: the recipe's real entry point (``main_ppo``) on a CPU-only host.

- ``plugin``: imported (``VERL_USE_EXTERNAL_MODULES=fsdp2_ext.verl_cpu.plugin``), it installs the
  rest into VERL in that process; the only module here with an effect on import;
- ``platform``: ``PlatformCPU``, VERL's device on CPU ranks ([Note: VERL on a CPU platform]);
- ``patches``: what ``main_ppo`` lacks on a CPU host ([Note: main_ppo on a CPU host]);
- ``hf_server``: the ``hf`` rollout server, Transformers generation for VERL's agent loop
  ([Note: the hf rollout server]);
- ``toy_run``: writes a toy run (tiny qwen4_exp with its n-gram tables, tokenizer, parquet
  files) and prints the environment ``main_ppo`` needs; the toy task's reward.

Apart from the shim (``fsdp2_ext.verl``): VERL alone runs on this too, for comparison.

May import every floor below it (``common`` to ``verl``) and, inside ``toy_run``, the tests'
tiny model (``testing.tiny_models``: the toy the demo trains) ([Note: the packages' floors]).
"""
