"""Before a launch, on paper: per-GPU memory (``planner``), the whole host against its memory
(``host_plan``), a recipe's settings as ``main_ppo`` composes them (``recipe_settings``), and the
trainer's cold start at the recipe's scale (``cold_start``); what ``fsdp2-ext plan`` prints.

May import: ``common``, ``model``, ``checkpoint``, ``tables``, ``init``, ``vllm``.
"""
