"""``run_main_ppo`` starts main_ppo again only when VERL lost its master-port race, nothing else.

[Note: VERL's master-port race on a local Ray cluster] (``fsdp2_ext.verl_cpu.recipe_run``) names
the race; here the failure text comes from the installed torch, provoked the way the race ends:
VERL's port picked and released, then taken by another server before rank 0's store binds it.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from fsdp2_ext.verl_cpu.recipe_run import lost_the_port_race

# What main_ppo printed when it happened in CI (resuming from step 2), VERL's frames trimmed.
CI_TAIL = """\
ray.exceptions.RayTaskError(DistNetworkError): ray::WorkerDict.actor_rollout_init_model() (pid=23696)
  File ".../verl/utils/distributed.py", line 93, in initialize_global_process_group_ray
    torch.distributed.init_process_group(
  File ".../torch/distributed/rendezvous.py", line 199, in _create_c10d_store
    return TCPStore(
torch.distributed.DistNetworkError: The server socket has failed to listen on any local network \
address. port: 43131, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use
Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
"""
A_STEP = "(TaskRunnerV1 pid=1) step:3 - actor/pg_loss:np.float64(0.25) - actor/lr:1e-05\n"


def store_on_a_taken_port() -> str:
    """The error torch raises when rank 0's store finds VERL's chosen port taken meanwhile."""
    with socket.socket() as probe:  # as VERL's get_master_addr_port: bind port 0, close
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    with socket.socket() as squatter:  # a Ray worker's gRPC server, started in the window
        squatter.bind(("", port))
        squatter.listen()
        with pytest.raises(dist.DistNetworkError) as failure:
            dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=5))
    return f"torch.distributed.DistNetworkError: {failure.value}\n"


def test_the_race_as_torch_reports_it_is_recognised():
    assert lost_the_port_race(store_on_a_taken_port())


def test_the_race_as_ci_saw_it_is_recognised():
    assert lost_the_port_race(CI_TAIL)


def test_a_run_that_trained_is_never_started_again():
    assert not lost_the_port_race(A_STEP + CI_TAIL)


def test_other_failures_are_the_runs_own():
    other = [
        "torch.distributed.DistNetworkError: Connection reset by peer\n",
        "OSError: [Errno 98] Address already in use (EADDRINUSE) in the rollout's HTTP server\n",
        "KeyError: 'model.layers.0.mlp.experts.gate_up_proj'\n",
        "",
    ]
    assert not any(lost_the_port_race(text) for text in other)
