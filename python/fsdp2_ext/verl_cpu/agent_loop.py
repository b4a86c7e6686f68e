"""VERL's single-turn agent loop with a reproducible sampling seed per sample.

Registered as ``seeded_single_turn`` (``rollout.agent.default_agent_loop``) by
``fsdp2_ext.verl_cpu.plugin``. VERL's own loop sends no seed, and under ``full_determinism`` the
v1 trainer's requests all share the id ``det-0`` (it sets no per-sample priority): every response
of a prompt would be drawn alike. This loop adds ``seed`` to the sampling parameters (a key
vLLM's ``SamplingParams`` and the ``hf`` server both honour) from what identifies a sample across
runs: the rollout seed, the global step, the prompt's dataset index and the response's session
(``0 .. n-1``). A resumed run draws the same responses as the run it continues.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from fsdp2_ext.verl_cpu.hf_server import derive_seed

__all__ = ["AGENT_NAME", "SeededSingleTurnAgentLoop"]

AGENT_NAME = "seeded_single_turn"


class SeededSingleTurnAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        seed = derive_seed(
            self.rollout_config.seed,
            int(kwargs.get("global_steps", 0)),
            kwargs.get("index", 0),
            int(kwargs.get("session_id", 0)),
        )
        return await super().run(dict(sampling_params, seed=seed), **kwargs)
