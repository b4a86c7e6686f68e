"""``run_main_ppo`` starts main_ppo again only when VERL lost its master-port race, nothing else.

[Note: VERL's master-port race on a local Ray cluster] (``fsdp2_ext.verl_cpu.recipe_run``) names
the race; here the failure text comes from the installed torch, provoked the way the race ends:
VERL's port picked and released, then taken by another server before rank 0's store binds it.
The retry itself runs a stand-in command in main_ppo's place (a race cannot be provoked in a real
run on demand): the real failure's text, a record written, then a second start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from fsdp2_ext.common.run_report import REPORT_ENV, read_records
from fsdp2_ext.verl_cpu import recipe_run
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
RANK1_WARNING = (
    "(WorkerDict pid=23697) [c10d] TCP client failed to connect/validate to host 192.0.2.2:43131 - "
    "retrying (try=0): Ping failed, invalid value returned from server. Expected: 23697, Got: "
    "68681728\n"
)
A_STEP = "(TaskRunnerV1 pid=1) step:3 - actor/pg_loss:np.float64(0.25) - actor/lr:1e-05\n"


def store_on_a_taken_port(use_libuv: bool) -> str:
    """The error torch raises when rank 0's store finds VERL's chosen port taken meanwhile."""
    with socket.socket() as probe:  # as VERL's get_master_addr_port: bind port 0, close
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    with socket.socket() as squatter:  # a Ray worker's gRPC server, started in the window
        squatter.bind(("", port))
        squatter.listen()
        with pytest.raises(dist.DistNetworkError) as failure:
            dist.TCPStore(
                "127.0.0.1", port, 2, True, timeout=timedelta(seconds=5), use_libuv=use_libuv
            )
    return f"torch.distributed.DistNetworkError: {failure.value}\n"


@pytest.mark.parametrize("use_libuv", [True, False])
def test_the_race_as_torch_reports_it_is_recognised(use_libuv):
    assert lost_the_port_race(store_on_a_taken_port(use_libuv))


def test_the_race_as_ci_saw_it_is_recognised():
    assert lost_the_port_race(CI_TAIL)
    assert lost_the_port_race(RANK1_WARNING)  # when rank 1's failure is the one reported


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


STAND_IN = """
import os, signal, sys
LINGER = '''
import os, sys, time
for _ in range(6):
    with open(os.path.join(sys.argv[1], f"probe-{os.getpid()}.json"), "w") as f:
        f.write('{"kind": "probe", "start": 1}')
    time.sleep(0.3)
'''
mode, directory = sys.argv[1], sys.argv[2]
starts = os.path.join(directory, "starts")
with open(starts, "a") as f:
    f.write("x")
first = os.path.getsize(starts) == 1
report = os.environ["FSDP2_EXT_REPORT_DIR"]
os.makedirs(report, exist_ok=True)
with open(os.path.join(report, f"probe-{os.getpid()}.json"), "w") as f:
    f.write('{"kind": "probe", "start": %d}' % os.path.getsize(starts))
if mode == "race" and first:  # and a process of it that outlives it, writing for a while
    import subprocess
    subprocess.Popen([sys.executable, "-c", LINGER, report], start_new_session=True)
    print("Traceback (most recent call last):")
    print(os.environ["TAIL"], flush=True)
    sys.exit(1)
if mode == "killed":
    print(os.environ["TAIL"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "outlive":  # a process of it that outlives the bound, detached
    import subprocess
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
if mode == "other":
    print("Traceback (most recent call last):\\nKeyError: 'lm_head.weight'", flush=True)
    sys.exit(1)
print("step:1 - actor/pg_loss:np.float64(0.25)", flush=True)
"""


def run_stand_in(tmp_path, monkeypatch, mode: str, **kwargs):
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / f"{recipe_run.CONFIG_NAME}.yaml").write_text("{}\n")
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    directory = str(tmp_path / "run")
    command = [sys.executable, str(script), mode, directory]
    monkeypatch.setattr(recipe_run, "main_ppo_command", lambda *_, **__: command)
    run = recipe_run.run_main_ppo(
        directory, config_dir=str(config_dir), write_toy=False, extra_env={"TAIL": CI_TAIL},
        **kwargs,
    )  # fmt: skip
    with open(os.path.join(directory, "starts")) as f:
        return run, len(f.read())


def test_a_lost_start_is_started_again_and_set_aside(tmp_path, monkeypatch):
    run, starts = run_stand_in(tmp_path, monkeypatch, "race")
    time.sleep(2.0)  # the lingering process's last write, had the run not waited for it
    assert (run.returncode, starts) == (0, 2)
    log = run.log()
    assert "Traceback" not in log and "EADDRINUSE" not in log  # the checks read one start
    assert log.count("starting the same command once more") == 1
    assert "actor/pg_loss" in recipe_run.parse_steps(log)[1]
    with open(f"{run.log_path}.lost-port-race") as f:
        assert "EADDRINUSE" in f.read()
    assert [r["start"] for r in read_records(run.report_dir, "probe-")] == [2]
    lost = read_records(os.path.join(run.report_dir, "lost-port-race"))
    assert [r["start"] for r in lost] == [1, 1]  # the start's and its lingering process's


@pytest.mark.parametrize("mode", ["killed", "other"])
def test_any_other_end_is_the_runs_own(tmp_path, monkeypatch, mode):
    run, starts = run_stand_in(tmp_path, monkeypatch, mode)
    assert starts == 1
    assert run.returncode == (-9 if mode == "killed" else 1)
    assert not os.path.exists(f"{run.log_path}.lost-port-race")


def test_the_processes_a_run_left_are_found_and_only_those(tmp_path):
    """``processes_left``, which ``test_main_ppo``'s teardown check asks: a process started with
    the run's environment and detached from it (a session of its own, as a Ray worker outliving
    its raylet would be) is found, and so is its child whose environment shows nothing of the
    run (as Ray's agents, which write their titles over it); one of another run beside it is
    not."""
    report = str(tmp_path / "run" / "report")
    child = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:], env={}); time.sleep(120)"
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    ours = subprocess.Popen(
        [sys.executable, "-c", child, *sleeper],
        env={**os.environ, REPORT_ENV: report},
        start_new_session=True,
    )
    theirs = subprocess.Popen(sleeper, env={**os.environ, REPORT_ENV: f"{report}-beside"})
    try:
        deadline = time.monotonic() + 60
        while len(left := recipe_run.processes_left(report)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # the child starting
        pids = list(left)
        assert ours.pid in pids and len(pids) == 2, left
        (child_pid,) = set(pids) - {ours.pid}
        with open(f"/proc/{child_pid}/environ", "rb") as f:
            assert REPORT_ENV.encode() not in f.read()  # found as a descendant alone
    finally:
        os.killpg(ours.pid, 9)
        theirs.kill()
        ours.wait(), theirs.wait()
    deadline = time.monotonic() + 60
    while recipe_run.processes_left(report) and time.monotonic() < deadline:
        time.sleep(0.1)  # the orphaned child reaped by init
    assert recipe_run.processes_left(report) == {}


def test_a_process_that_outlives_the_end_of_its_run_is_named_and_killed(tmp_path, monkeypatch):
    """[Note: the end of a run]: the run is over when its last process is; one still alive
    ``end_s`` after the driver is named in the log, killed, and fails ``check_run``'s check."""
    run, _ = run_stand_in(tmp_path, monkeypatch, "outlive", end_s=1.0)
    assert run.returncode == 0
    assert len(run.outlived) == 1 and "time.sleep(120)" in run.outlived[0], run.outlived
    assert "outlived its driver by 1 s (recipe_run.RUN_END_S), killed" in run.log()
    deadline = time.monotonic() + 30
    while recipe_run.processes_left(run.report_dir) and time.monotonic() < deadline:
        time.sleep(0.1)  # the killed process reaped by init
    assert recipe_run.processes_left(run.report_dir) == {}
    (tmp_path / "race").mkdir()
    race, _ = run_stand_in(tmp_path / "race", monkeypatch, "race")  # its process ends in ~2 s
    assert race.outlived == [] and "every process of the run ended" in race.log()
