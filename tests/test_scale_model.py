"""Scale models of the recipe's run ([Note: bounded waits], ``fsdp2_ext.testing.scale_model``):
the toy's bytes against the floor shrunk by the toy's share of the real bytes, set through the
user's own knob (``FSDP2_EXT_WAIT_FLOOR_S``), on real Gloo ranks in fresh processes.

The host-sharing run is the one issue #43 reported: a 1 GiB bf16 table with values on rank 0
only (the path the tables take when the checkpoint sits on a network filesystem or in another
dtype), 4 ranks as 2 hosts, aligned by a barrier. Its floor is 60 s x 1 GiB / 95.37 GiB = 0.63 s;
rank 0 writes its host's file and sends the table to the other host's leader while 2 ranks wait
in the "fill" agreement. Before the waits allowed for that work, every rank raised "agreeing on
the verdict (all-reduce) failed within 2.0 s" even at a 2 s floor. The negative control is the
same run with the bandwidth floor raised so far that the bound allows for nothing but the floor
(``FSDP2_EXT_MIN_BANDWIDTH_MIB_S``): every rank raises, naming the stage and the bound.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from fsdp2_ext import host_shared
from fsdp2_ext.testing.scale_model import ScaleModel
from fsdp2_ext.testing.spawn import run_with_faults

pytestmark = pytest.mark.distributed

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen4ExpTextConfig"):
    pytest.skip(
        "the installed Transformers has no qwen4_exp (the recipe's table)", allow_module_level=True
    )

TABLE_ROWS, TABLE_COLS = 1 << 19, 1024  # 1 GiB of bf16
TABLE_BYTES = TABLE_ROWS * TABLE_COLS * 2
ROWS_PER_CHECK = 1 << 15
PERIOD = 512  # row r of the table is row r % PERIOD of a seeded random block


def _checked_rows() -> torch.Tensor:
    """ROWS_PER_CHECK rows of the table, the same for every aligned block of rows."""
    block = torch.randn(PERIOD, TABLE_COLS, generator=torch.Generator().manual_seed(43))
    return block.to(torch.bfloat16).repeat(ROWS_PER_CHECK // PERIOD, 1)


def _share_one_gib(rank, world_size, directory):
    os.environ[host_shared.ENV_HOST_ID] = f"host{rank // 2}"
    expected = _checked_rows()
    if rank == 0:
        table = expected.repeat(TABLE_ROWS // ROWS_PER_CHECK, 1)
    else:
        table = torch.empty(TABLE_ROWS, TABLE_COLS, dtype=torch.bfloat16, device="meta")
    dist.barrier()  # aligned: what follows is the fill's own skew
    (mapped,), report = host_shared.share_tables_on_host(
        ["ngram.weight"], [table], group=dist.group.WORLD, directory=directory
    )
    del table
    for begin in range(0, TABLE_ROWS, ROWS_PER_CHECK):
        if not torch.equal(
            mapped[begin : begin + ROWS_PER_CHECK].view(torch.int16),
            expected.view(torch.int16),
        ):
            raise AssertionError(f"rank {rank}: rows from {begin} differ")
    dist.barrier()
    return


@pytest.fixture(scope="module")
def scale():
    scale = ScaleModel.of_table(TABLE_BYTES)
    assert f"{scale.real_bytes / 2**30:.2f}" == "95.37"
    assert f"{scale.floor_s:.2f}" == "0.63"
    return scale


def _run(directory, env):
    directory.mkdir()
    reports = run_with_faults(4, _share_one_gib, str(directory), env=env, timeout_s=240)
    assert os.listdir(directory) == []  # nothing left behind, whatever happened
    return reports


def test_host_sharing_one_gib_from_rank0_at_the_recipes_ratio(tmp_path, scale):
    reports = _run(tmp_path / "mmap", scale.env())
    assert set(reports) == {0, 1, 2, 3}
    for rank, (kind, message, _) in reports.items():
        assert kind == "ok", (rank, message)


def test_negative_control_a_bound_without_the_work_fails_every_rank(tmp_path, scale):
    """The same run, the allowance for the work removed through the bandwidth knob: the bare
    floor. Every rank raises within the bound, and the error names the stage and the bound."""
    env = {**scale.env(), "FSDP2_EXT_MIN_BANDWIDTH_MIB_S": "1e12"}
    reports = _run(tmp_path / "mmap", env)
    assert set(reports) == {0, 1, 2, 3}
    failed = {rank: message for rank, (kind, message, _) in reports.items() if kind != "ok"}
    assert len(failed) >= 2, reports
    waiting = [m for m in failed.values() if "host-shared tables: fill" in m]
    assert waiting, failed
    assert all("failed within 0.63 s (floor 0.63 s" in m for m in waiting), waiting
