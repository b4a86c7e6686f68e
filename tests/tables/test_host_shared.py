"""Host-shared frozen tables: one file-backed copy per host, mapped by every local rank."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp2_ext.common.distributed import ENV_HOST_ID
from fsdp2_ext.init.sharded_init import init_sharded
from fsdp2_ext.model.no_placement import offload, onload
from fsdp2_ext.tables import host_shared
from fsdp2_ext.testing.spawn import run_distributed, run_with_faults
from fsdp2_ext.testing.tiny_models import ToyModel, build_toy
from tests.special_distributed import test_fsdp2_full_state_load as checks

pytestmark = pytest.mark.distributed


def mapped_files(directory: str) -> set[tuple[str, int]]:
    """(device, inode) of every mapping of a file in ``directory`` (unlinked ones included)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(directory + "/"):
                found.add((fields[3], int(fields[4])))
    return found


def _share_worker(rank, world_size, directory, results_dir):
    table = torch.arange(3000, dtype=torch.float32).view(300, 10)
    mine = table.clone() if rank == 0 else torch.empty_like(table, device="meta")
    mapped, report = host_shared.share_tables_on_host(
        ["t.weight"], [mine], group=dist.group.WORLD, directory=directory
    )
    assert torch.equal(mapped[0], table)
    assert mapped[0].device.type == "cpu"
    files = mapped_files(os.path.realpath(directory))
    assert len(files) == 1
    ((device, inode),) = files
    assert inode != 0 and inode == report.inode
    dist.barrier()
    assert os.listdir(directory) == []  # unlinked once everyone mapped; the mapping stays valid
    assert torch.equal(mapped[0], table)
    with open(os.path.join(results_dir, f"rank{rank}"), "w") as out:
        out.write(f"{report.host} {device} {inode} {report.path}")


def _read_results(results_dir, world_size):
    return [open(os.path.join(results_dir, f"rank{r}")).read().split() for r in range(world_size)]


@pytest.mark.parametrize("backend", ["cpu:gloo", "gloo"])
def test_two_ranks_one_host_map_the_same_inode(tmp_path, backend):
    """On VERL's device-qualified group form (``cpu:gloo``; ``cpu:gloo,cuda:nccl`` on the cluster)
    and on plain ``gloo``: torch 2.11-2.13's ``monitored_barrier`` refused the first on every rank."""
    directory, results = tmp_path / "mmap", tmp_path / "results"
    directory.mkdir(), results.mkdir()
    run_distributed(2, _share_worker, str(directory), str(results), backend=backend)
    rows = _read_results(results, 2)
    assert rows[0][1:3] == rows[1][1:3]  # same device and inode on both ranks


def test_four_ranks_two_simulated_hosts_use_two_files(tmp_path):
    directory, results = tmp_path / "mmap", tmp_path / "results"
    directory.mkdir(), results.mkdir()
    run_distributed(
        4,
        _host_worker,
        str(directory),
        str(results),
        timeout_s=180,
    )
    rows = _read_results(results, 4)
    by_host = {}
    for host, device, inode, path in rows:
        by_host.setdefault(host, set()).add((device, inode, path))
    assert len(by_host) == 2  # exactly two files, one per host
    assert all(len(files) == 1 for files in by_host.values())
    assert len({next(iter(f))[2] for f in by_host.values()}) == 2


def _host_worker(rank, world_size, directory, results_dir):
    os.environ[ENV_HOST_ID] = f"host{rank // 2}"
    _share_worker(rank, world_size, directory, results_dir)


def _init_worker(rank, world_size, directory, results_dir):
    os.environ[host_shared.ENV_DIRECTORY] = directory
    checks.check_toy_model(
        rank, world_size
    )  # exact values, fully_shard, fwd/bwd, Module.to forbidden
    # A second, independent initialisation maps a new file: nothing is reused.
    reference, model = build_toy(rank)
    report = init_sharded(
        model,
        reference.state_dict() if rank == 0 else None,
        mesh=init_device_mesh("cpu", (world_size,)),
    )
    table = model.frozen.weight
    files = mapped_files(os.path.realpath(directory))
    assert report.host_share.inode in {inode for _, inode in files}
    assert torch.equal(table, reference.frozen.weight)
    pointer = table.data_ptr()
    offload(model)
    onload(model, "cpu")
    assert model.frozen.weight is table and table.data_ptr() == pointer  # same mapping
    with open(os.path.join(results_dir, f"rank{rank}"), "w") as out:
        out.write(
            f"{report.host_share.host} {report.host_share.inode} {report.host_share.inode} {report.host_share.path}"
        )
    dist.barrier()
    assert os.listdir(directory) == []


def test_init_sharded_maps_the_frozen_table_per_host(tmp_path):
    directory, results = tmp_path / "mmap", tmp_path / "results"
    directory.mkdir(), results.mkdir()
    run_distributed(2, _init_worker, str(directory), str(results), timeout_s=180)
    rows = _read_results(results, 2)
    assert rows[0][1] == rows[1][1]


def _bad_directory_worker(rank, world_size, directory, expected, uid=None):
    if uid is not None:  # root writes anywhere: the ranks run as an unprivileged user instead
        os.setuid(uid)
    table = torch.zeros(10)
    with pytest.raises(RuntimeError, match=expected):
        host_shared.share_tables_on_host(
            ["t"], [table], group=dist.group.WORLD, directory=directory
        )
    dist.barrier()


@pytest.mark.parametrize("case", ["missing", "not_a_directory", "not_writable"])
def test_bad_directory_fails_on_every_rank(tmp_path, case):
    directory = tmp_path / "mmap"
    expected = {
        "missing": "does not exist",
        "not_a_directory": "is not a directory",
        "not_writable": "not writable",
    }[case]
    uid = None
    if case == "not_a_directory":
        directory.write_text("a file")
    elif case == "not_writable":
        if os.geteuid() == 0:  # as root (CI here): the ranks drop to nobody, who can reach it
            uid = 65534
            directory = Path(tempfile.mkdtemp(prefix="fsdp2_ext_not_writable_")) / "mmap"
            directory.parent.chmod(0o755)
        directory.mkdir(mode=0o555)
    try:
        run_distributed(2, _bad_directory_worker, str(directory), expected, uid, timeout_s=120)
        if case != "not_a_directory":
            assert not directory.exists() or os.listdir(directory) == []
    finally:
        if uid is not None:
            shutil.rmtree(directory.parent)


def _disk_full_worker(rank, world_size, directory):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
    if rank == 0:
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )
    table = torch.ones(256, 1024) if rank == 0 else torch.empty(256, 1024, device="meta")
    with pytest.raises(RuntimeError, match="File too large"):
        host_shared.share_tables_on_host(
            ["t"], [table], group=dist.group.WORLD, directory=directory
        )
    dist.barrier()


def test_disk_full_is_an_error_everywhere_and_leaves_no_file(tmp_path):
    run_distributed(2, _disk_full_worker, str(tmp_path), timeout_s=120)
    assert os.listdir(tmp_path) == []


def _dies_before_mapping(rank, world_size, directory):
    if rank == 1:
        host_shared._map_manifest = lambda manifest: os._exit(3)  # dies after the file exists
    table = torch.ones(64) if rank == 0 else torch.empty(64, device="meta")
    host_shared.share_tables_on_host(
        ["t"], [table], group=dist.group.WORLD, directory=directory, timeout_s=5
    )


def test_rank_that_dies_before_mapping_is_named_and_the_file_removed(tmp_path):
    directory = tmp_path / "mmap"
    directory.mkdir()
    outcome = run_with_faults(2, _dies_before_mapping, str(directory), timeout_s=60)
    assert 1 not in outcome  # died (exit 3) before reporting
    kind, message, _ = outcome[0]
    assert kind == "RuntimeError", outcome
    assert "rank 1" in message and "failed" in message.lower(), message
    assert os.listdir(directory) == []


def test_mapping_is_read_only(tmp_path):
    """A stray in-place write faults (SIGSEGV) instead of diverging silently."""
    code = (
        "import torch, fsdp2_ext;"
        "from fsdp2_ext import _fsdp2_ext as C;"
        f"m = C.SharedManifest.plan('{tmp_path}/t.bin', ['t'], [torch.zeros(4)]);"
        "C.SharedFile.create(m).close();"
        "(t,) = C.map_shared_file(m); print(t.sum().item(), flush=True); t.add_(1)"
    )
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "0.0"
    assert result.returncode == -signal.SIGSEGV


def _other_hosts_receive_rank0_tables(rank, world_size, directory):
    os.environ[ENV_HOST_ID] = f"host{rank // 2}"
    os.environ[host_shared.ENV_DIRECTORY] = directory
    torch.manual_seed(1234)
    reference = ToyModel()
    torch.manual_seed(100 + rank)  # every rank builds a real model with its own random table
    model = ToyModel()
    init_sharded(
        model,
        reference.state_dict() if rank == 0 else None,
        mesh=init_device_mesh("cpu", (world_size,)),
    )
    assert torch.equal(model.frozen.weight, reference.frozen.weight)  # rank 0's values everywhere
    dist.barrier()


def test_leaders_of_other_hosts_take_rank0_values_not_their_own(tmp_path):
    run_distributed(4, _other_hosts_receive_rank0_tables, str(tmp_path), timeout_s=180)
    assert os.listdir(tmp_path) == []


def test_a_truncated_shared_file_is_refused_not_mapped(tmp_path):
    """A manifest that promises more bytes than the file holds would map, then SIGBUS on the
    first page past the end; it is a ValueError naming the file before anything is mapped."""
    from fsdp2_ext import _fsdp2_ext

    manifest = _fsdp2_ext.SharedManifest.plan(str(tmp_path / "t.bin"), ["t"], [torch.zeros(4)])
    _fsdp2_ext.SharedFile.create(manifest).close()
    os.truncate(manifest.path, 8)
    with pytest.raises(ValueError, match=r"t\.bin'.*reach past the end of the 8-byte file"):
        _fsdp2_ext.map_shared_file(manifest)


def _own_copies(rank, world_size, directory, differ_at):
    """Two hosts, each leader writing its table from its own values (as from its own copy of the
    checkpoint); host1's differs in one byte at ``differ_at`` when it is not None."""
    os.environ[ENV_HOST_ID] = f"host{rank}"
    table = torch.arange(1 << 20, dtype=torch.int32).view(torch.float32).clone()
    if rank == 1 and differ_at is not None:
        table.view(torch.uint8)[differ_at] ^= 1
    (mapped,), _ = host_shared.share_tables_on_host(
        ["ngram.weight"], [table], group=dist.group.WORLD, directory=directory, timeout_s=30
    )
    assert torch.equal(mapped.view(torch.uint8), table.view(torch.uint8))


@pytest.mark.parametrize("differ_at", [None, 0, (1 << 22) - 1])
def test_hosts_whose_tables_differ_in_one_byte_refuse_on_every_rank(tmp_path, differ_at):
    """[Note: hosts agree on every byte of their tables]: a 4 MiB table, the two hosts' copies
    equal, or different in its first or last byte (no sample of a fingerprint needed): every rank
    raises the same error naming both hosts, and nothing is left in the directory. Without the
    agreement both load, each with its own bytes."""
    outcome = run_with_faults(2, _own_copies, str(tmp_path), differ_at, timeout_s=120)
    assert os.listdir(tmp_path) == []
    if differ_at is None:
        assert all(kind == "ok" for kind, _, _ in outcome.values()), outcome
        return
    assert set(outcome) == {0, 1}, outcome
    for rank, (kind, message, _) in outcome.items():
        assert kind == "RuntimeError", (rank, outcome)
        assert "the hosts' tables are not the same bytes" in message, message
        assert "host0 (ranks [0])" in message and "host1 (ranks [1])" in message, message
