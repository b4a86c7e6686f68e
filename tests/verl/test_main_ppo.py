"""The recipe's real entry point on a CPU host: ``python -m verl.trainer.main_ppo --config-name
recipe_cpu`` runs to the end (Ray, 2 CPU ranks, VERL's agent loop, the ``hf`` rollout servers,
reward, GRPO, update, adapter-only sync, validation, checkpoints), with the shim in every actor.

One run (the session's ``main_ppo_uninterrupted``) serves every test here: its checkpoint is
stored in bf16 for the fp32 CPU run, so its tables cannot be views of the file (on the cluster: a
network filesystem, where ``table_view`` refuses) and the trainer's ranks map one host-shared copy
of each (``VERL_NO_PLACEMENT_MMAP_DIR``) on VERL's own process-group form (``cpu:gloo``). Tables
as views of the checkpoint are the resumes' (tests/verl/test_main_ppo_resume.py), on the same
values stored in fp32, which train to this run's bits.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from tests.verl import main_ppo_runs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(transformers, "Qwen4ExpTextConfig"), reason="no qwen4_exp"),
]


def test_every_check_of_the_run_passes(main_ppo_uninterrupted):
    from fsdp2_ext.verl_cpu.recipe_run import check_run

    checks = check_run(main_ppo_uninterrupted, steps=4, tables="shared")
    failed = {k: v for k, v in checks.items() if not v[0]}
    assert not failed, (failed, main_ppo_uninterrupted.log()[-5000:])


def test_the_shim_is_installed_in_every_actor_with_no_call_site_left_on_an_original(
    main_ppo_uninterrupted,
):
    from fsdp2_ext.common.run_report import read_records

    probes = read_records(main_ppo_uninterrupted.report_dir, "probe-")
    assert probes and not [p for p in probes if "error" in p], probes
    actors = sorted(p["actor"].rsplit(".", 1)[-1] for p in probes)
    for expected in ("TaskRunnerV1", "HFServer", "AgentLoopWorkerTQ", "driver"):
        assert expected in actors, actors
    assert actors.count("WorkerDict") == 2 and actors.count("HFServer") == 2, actors
    for probe in probes:
        assert probe["shim_installed"], probe
        assert probe["remaining_originals"] == [], probe
    workers = [p for p in probes if p["actor"].endswith("WorkerDict")]
    assert all(p["verl_modules"] > 100 for p in workers)  # the engine was loaded, then checked


def test_the_run_reads_as_a_user_should_read_it(main_ppo_uninterrupted):
    """Nothing fsdp2_ext says in the run is a warning or an error (the rollout servers ask for
    the tables only: no 'keys match no tensor'), and no traceback, at the end or anywhere."""
    log = re.sub(r"\x1b\[[0-9;]*m", "", main_ppo_uninterrupted.log())
    ours = [line for line in log.splitlines() if "fsdp2_ext" in line and "WARNING" in line]
    ours += [line for line in log.splitlines() if "fsdp2_ext" in line and "ERROR" in line]
    assert not ours, ours
    assert "match no tensor" not in log and "Traceback" not in log


def test_ray_and_the_process_groups_are_torn_down(main_ppo_uninterrupted):
    """The run ended cleanly and left no process behind: neither Ray's (GCS, raylet, workers) nor
    a rank's, nor a server's, within ``RUN_END_S`` of its driver ([Note: the end of a run];
    ``recipe_run.processes_left``: every process whose environment carries the run's report
    directory, this run's alone, so other tests' Rays may run beside it)."""
    from fsdp2_ext.common.run_report import read_records
    from fsdp2_ext.verl_cpu.recipe_run import processes_left

    run = main_ppo_uninterrupted
    assert run.returncode == 0
    assert read_records(run.report_dir, "trainer-")  # its Ray workers carried the marker
    assert run.outlived == [] and processes_left(run.report_dir) == {}
    assert re.search(r"every process of the run ended [\d.]+ s after its driver", run.log())


def test_the_host_plan_s_per_rank_figures_are_what_the_processes_hold(main_ppo_uninterrupted):
    """The plan of the CPU recipe on the run's own model (``fsdp2-ext plan MODEL_PATH --recipe
    recipe_cpu``) against each process's record: a trainer rank's padded shards and LoRA shards,
    an ``hf`` server's weights and adapter, the tables, to the byte (the storages the tensors sit
    on, FSDP2's padding included). The processes' resident memory is printed for
    docs/BENCHMARKS.md, not asserted: at this scale the model's bytes are KiB against hundreds of
    MiB of the process's own (Python, torch, Ray), so no bound on it could fail. The run's group
    form is checked in ``check_run`` (every trainer record carries it)."""
    from fsdp2_ext.common.run_report import read_records
    from fsdp2_ext.plan.host_plan import plan_host

    run = main_ppo_uninterrupted
    model, settings, memory = main_ppo_runs.recipe_plan(run)
    plan = plan_host(model, memory, settings, host_memory_bytes=1 << 40, threshold=0.95)
    trainers = read_records(run.report_dir, "trainer-")
    servers = read_records(run.report_dir, "rollout_server-")
    assert len(trainers) == 2 and len(servers) == 2
    planned = plan.per_rank
    for trainer in trainers:
        held = trainer["held"]
        assert held["shard_bytes"] == planned["trainer"]["shard_bytes"], held
        assert held["lora_bytes"] == planned["trainer"]["lora_bytes"], held
        assert held["table_bytes"] == planned["trainer"]["table_bytes"], held
    for server in servers:
        held = server["held"]
        assert held["weights_bytes"] == planned["inference"]["weights_bytes"], held
        assert held["lora_bytes"] == planned["inference"]["lora_bytes"], held
        assert held["table_bytes"] == planned["trainer"]["table_bytes"], held
    print(
        "resident per process (MiB, VmRSS/RssAnon/RssFile/RssShmem):",
        {
            r["_file"]: [round(v / 2**20) for v in r["resident"].values()]
            for r in trainers + servers
        },
    )


def test_the_planned_save_is_what_verl_wrote(main_ppo_uninterrupted):
    """The planner's one-save figure (``save_bytes_lora_only``: every adapter and its two AdamW
    moments, in the parameters' dtype) against the step directory VERL's checkpoint manager
    wrote in this run: the tensor payload of every rank's model and optimizer files, to the byte
    (the pickling around it is the files' own, printed)."""
    import glob
    import os

    run = main_ppo_uninterrupted
    _, settings, memory = main_ppo_runs.recipe_plan(run)
    step = sorted(glob.glob(os.path.join(run.checkpoint_dir, "global_step_*")))[-1]
    payload, files = 0, 0
    for path in glob.glob(os.path.join(step, "actor", "*_world_size_*_rank_*.pt")):
        name = os.path.basename(path)
        if not name.startswith(("model_", "optim_")):
            continue
        state = torch.load(path, map_location="cpu", weights_only=False)
        tensors = state.values() if name.startswith("model_") else [
            value for per_param in state["state"].values()
            for key, value in per_param.items() if key != "step"
        ]  # fmt: skip
        for value in tensors:
            local = value.to_local() if hasattr(value, "to_local") else value
            payload += local.nbytes
        files += 1
    assert files == 2 * settings.world_size, files
    assert payload == memory.save_bytes_lora_only, (payload, memory.save_bytes_lora_only)
    print(f"one save: {payload} B of tensors planned and written, in {files} files")
