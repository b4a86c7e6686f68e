"""One host copy among processes that share no group ([Note: a host copy without a group]).

Real processes stand for the rollout's engines: engine A's and engine B's rank i ask for the same
rows, each writes them as its weight loader would, and the host holds one copy of each range (PSS
summed over the processes = the bytes once). vLLM's own class on top of this is tested in
``tests/vllm/test_vllm_plugin.py`` (``make vllm-check``).
"""

import multiprocessing as mp
import os
import signal
import time
import uuid

import pytest
import torch

from fsdp2_ext.tables.host_copy import HostCopy, HostCopyRefused, key_digest

ROWS, DIM = 4096, 64  # fp32: 1 MiB per rank range
NBYTES = ROWS * DIM * 4
# The longest a child waits on its peers at a barrier: their work before it is an attach (bounded
# by 30 s) and a 1 MiB copy. A peer that died breaks the wait (BrokenBarrierError after this) and
# the child exits with the error, so the test fails instead of hanging CI.
BARRIER_S = 120


def _key(rank: int, checkpoint: str = "ckpt-a") -> dict:
    return {"kind": "test.rows", "checkpoint": checkpoint, "rows": [rank * ROWS, (rank + 1) * ROWS]}


def _rows(rank: int, checkpoint: str) -> torch.Tensor:
    seed = rank * 1000 + sum(map(ord, checkpoint))
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))


def _engine_rank(host, name, rank, checkpoint, barrier, results):
    os.environ["FSDP2_EXT_HOST_ID"] = host
    from fsdp2_ext.common.procfs import mapping_memory

    copy = HostCopy.attach(_key(rank, checkpoint), NBYTES, timeout_s=30)
    table = copy.tensor.view(torch.float32).view(ROWS, DIM)
    table.copy_(_rows(rank, checkpoint))  # what the weight loader does: the same bytes in each
    barrier.wait(timeout=BARRIER_S)  # every process has mapped and written
    memory = mapping_memory(copy.tensor)
    exact = torch.equal(table.view(torch.int32), _rows(rank, checkpoint).view(torch.int32))
    results.put((name, copy.holder, copy.holder_pid, os.getpid(), memory, exact))
    barrier.wait(timeout=BARRIER_S)  # measured everywhere before anyone unmaps


def _names_left(host: str) -> list[str]:
    with open("/proc/net/unix") as table:
        return [line.split()[-1] for line in table if f"@fsdp2_ext/host_copy/{host}/" in line]


@pytest.mark.distributed
def test_two_engines_ranks_hold_one_copy_per_range_and_leave_nothing():
    """Engines A and B (two ranks each) and engine C on another checkpoint, five processes on one
    host: A's rank i and B's rank i map one copy (one holder, one memfd inode, PSS summed = the
    bytes once, every process's rows exact); C's rows are a copy of their own (another key);
    nothing is left once they exit (no name, nothing in /dev/shm)."""
    host = f"hc-{uuid.uuid4().hex[:8]}"
    members = [("A0", 0, "ckpt-a"), ("A1", 1, "ckpt-a"), ("B0", 0, "ckpt-a"), ("B1", 1, "ckpt-a"),
               ("C0", 0, "ckpt-c")]  # fmt: skip
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(members)), ctx.Queue()
    procs = [ctx.Process(target=_engine_rank, args=(host, n, r, c, barrier, results))
             for n, r, c in members]  # fmt: skip
    for p in procs:
        p.start()
    got = {}
    for _ in members:
        name, holder, holder_pid, pid, memory, exact = results.get(timeout=120)
        got[name] = dict(holder=holder, holder_pid=holder_pid, pid=pid, exact=exact, **memory)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert all(g["exact"] for g in got.values()), got
    for group in (("A0", "B0"), ("A1", "B1")):
        a, b = (got[n] for n in group)
        assert a["inode"] == b["inode"] and a["name"] == b["name"], (a, b)
        assert "memfd:fsdp2_ext_host_copy_" in a["name"]
        assert [a["holder"], b["holder"]].count(True) == 1
        assert a["holder_pid"] == b["holder_pid"] in (a["pid"], b["pid"])
        assert a["Rss"] == b["Rss"] == NBYTES  # each process reads all its rows ...
        assert abs(a["Pss"] + b["Pss"] - NBYTES) <= 8192, (a, b)  # ... and the host holds them once
    assert got["C0"]["inode"] != got["A0"]["inode"] and got["C0"]["holder"]
    assert got["C0"]["Pss"] == NBYTES
    assert len({got[n]["inode"] for n in got}) == 3  # three keys, three copies on the host
    assert _names_left(host) == []
    assert not [f for f in os.listdir("/dev/shm") if "fsdp2_ext_host_copy" in f]


def _holder_then_crash(host, barrier):
    os.environ["FSDP2_EXT_HOST_ID"] = host
    copy = HostCopy.attach(_key(0), NBYTES, timeout_s=30)
    copy.tensor.view(torch.float32).view(ROWS, DIM).copy_(_rows(0, "ckpt-a"))
    barrier.wait(timeout=BARRIER_S)
    signal.pause()  # killed by the test


@pytest.mark.distributed
def test_a_crashed_holder_leaves_the_mappers_their_rows_and_a_new_holder_a_new_copy(monkeypatch):
    """The holder dies (SIGKILL) after another process mapped its copy: that process keeps the
    rows, intact; the next process finds no holder and creates a copy of its own; nothing is
    left once all are gone."""
    host = f"hc-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FSDP2_EXT_HOST_ID", host)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    holder = ctx.Process(target=_holder_then_crash, args=(host, barrier))
    holder.start()
    barrier.wait(timeout=120)
    mapped = HostCopy.attach(_key(0), NBYTES, timeout_s=30)
    assert not mapped.holder and mapped.holder_pid == holder.pid
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(30)
    rows = mapped.tensor.view(torch.float32).view(ROWS, DIM)
    assert torch.equal(rows.view(torch.int32), _rows(0, "ckpt-a").view(torch.int32))
    assert _names_left(host) == []  # the name went with its holder
    fresh = HostCopy.attach(_key(0), NBYTES, timeout_s=30)  # the next engine to start
    assert fresh.holder and fresh.holder_pid == os.getpid()
    from fsdp2_ext.common.procfs import mapping_memory

    assert mapping_memory(fresh.tensor)["inode"] != mapping_memory(mapped.tensor)["inode"]
    fresh.stop_serving()  # the name goes with the socket
    assert _names_left(host) == []


def test_a_holder_refuses_a_key_that_differs_naming_the_fields(monkeypatch):
    """A process never maps another table: the holder compares the whole key (a digest is never
    trusted alone) and refuses, naming each field that differs; its own copy is untouched."""
    monkeypatch.setenv("FSDP2_EXT_HOST_ID", f"hc-{uuid.uuid4().hex[:8]}")
    held = HostCopy.attach(_key(0), NBYTES)
    held.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    from fsdp2_ext.tables.host_copy import _socket_name

    other = dict(_key(0), checkpoint="ckpt-b")  # asked at the name of the held key
    with pytest.raises(
        HostCopyRefused, match=r"differ in checkpoint \(held 'ckpt-a', asked 'ckpt-b'\)"
    ):
        HostCopy._connect(_socket_name(_key(0)), other, NBYTES, 10)
    with pytest.raises(HostCopyRefused, match=r"held 1,048,576 B, asked 2097152"):
        HostCopy._connect(_socket_name(_key(0)), _key(0), 2 * NBYTES, 10)
    assert held.tensor[:4].tolist() == [1, 2, 3, 4]
    again = HostCopy.attach(_key(0), NBYTES)  # the same key maps the same pages
    assert again.tensor[:4].tolist() == [1, 2, 3, 4] and not again.holder
    assert key_digest(_key(0)) != key_digest(other)
    held.stop_serving()


@pytest.mark.distributed
def test_the_gpu_check_runs_on_cpu(tmp_path):
    """``benchmarks/gpu_check_ple_host_copy.py`` stays runnable where no GPU is lent: ``--on-cpu``
    runs the same two engines on the rollout's memfd copy (one memfd, one holder, rows once, exact
    lookups) and on the trainer's file served read-only, without the registrations and the UVA
    read that only a GPU can prove."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    output = tmp_path / "check.json"
    result = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "gpu_check_ple_host_copy.py"),
         "--on-cpu", "--output", str(output)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["on_cpu"] and all(report["goals"].values()), report["goals"]
    common = ["no errors", "lookups exact", "one copy (inode)", "rows once on the host"]
    assert set(report["goals"]) == {
        *(f"memfd: {g}" for g in [*common, "one holder"]),
        *(f"trainer-file: {g}" for g in common),  # the trainer's file, served read-only
    }  # fmt: skip


def _as_another_user(name, results):
    from fsdp2_ext.tables import host_copy

    os.setuid(65534)  # nobody
    for own_check in (True, False):  # without its own check, the holder's refuses it
        if not own_check:
            host_copy._same_user = lambda connection, peer: None
        try:
            mapped = HostCopy._connect(name, _key(0), NBYTES, 10)
            results.put(f"mapped: {mapped}")
        except HostCopyRefused as error:
            results.put(str(error))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a process as another user")
def test_another_user_s_process_is_never_served(monkeypatch):
    """An abstract name is reachable by every user of the host and the copy is mapped
    read-write. Names carry the user, and both ends check the other (``SO_PEERCRED``): a process
    of another user that asks at this user's name refuses the holder, and, its own check removed,
    is refused by the holder, never served a descriptor."""
    from fsdp2_ext.tables.host_copy import _socket_name

    monkeypatch.setenv("FSDP2_EXT_HOST_ID", f"hc-{uuid.uuid4().hex[:8]}")
    held = HostCopy.attach(_key(0), NBYTES)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    other = ctx.Process(target=_as_another_user, args=(_socket_name(_key(0)), results))
    other.start()
    answers = [results.get(timeout=120) for _ in range(2)]
    other.join(30)
    held.stop_serving()
    assert "the holder runs as uid 0, this process as 65534" in answers[0], answers
    assert "the process asking runs as uid 65534, this process as 0" in answers[1], answers


def test_the_vllm_plugin_is_off_by_default_and_never_breaks_vllm_s_start(monkeypatch, caplog):
    """vLLM calls every general plugin unguarded in every process it starts: off, the entry point
    does nothing (not even an import of vLLM); on where vLLM has no Qwen4Exp PLE class (here: no
    vLLM at all), it logs the error and returns."""
    import importlib.util
    import logging
    import sys

    from fsdp2_ext.vllm import vllm_plugin

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here: tests/vllm/test_vllm_plugin.py covers the plugin")
    # Without vLLM installed an import of it leaves nothing in sys.modules: a finder first on the
    # import path records every attempt instead (and finds nothing, as the machine would).
    asked = []

    class Recorder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                asked.append(name)

    monkeypatch.setattr(sys, "meta_path", [Recorder, *sys.meta_path])
    monkeypatch.delenv(vllm_plugin.ENV_PLE_HOST_COPY, raising=False)
    vllm_plugin.register()
    assert asked == [], asked  # off: not even an attempt to import vLLM
    monkeypatch.setenv(vllm_plugin.ENV_PLE_HOST_COPY, "1")
    with caplog.at_level(logging.ERROR, logger="fsdp2_ext"):
        vllm_plugin.register()
    assert asked, "on, the plugin looks for vLLM (what the recorder must see)"
    assert "has no Qwen4Exp PLE allocation to replace" in caplog.text
    assert "every rank keeps its own rows" in caplog.text


def _holder_that_forks(host, results):
    os.environ["FSDP2_EXT_HOST_ID"] = host
    HostCopy.attach(_key(0), NBYTES, timeout_s=30)
    child = os.fork()  # a compile worker, a dataloader: it outlives its parent here
    if child == 0:
        time.sleep(60)
        os._exit(0)
    results.put(child)
    results.close()
    results.join_thread()  # written before the exit
    os._exit(0)  # the holder exits; its forked child lives on


@pytest.mark.distributed
def test_a_forked_child_never_keeps_a_holder_s_name_unserved(monkeypatch):
    """The holder forks a child and exits: the child closed the inherited socket at the fork, so
    the name went with the holder and the next process becomes a holder at once, instead of
    connecting to a socket nobody serves and waiting out its bound."""
    host = f"hc-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("FSDP2_EXT_HOST_ID", host)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    holder = ctx.Process(target=_holder_that_forks, args=(host, results))
    holder.start()
    child = results.get(timeout=BARRIER_S)
    while holder.is_alive():  # (not join: the forked child holds the sentinel's pipe)
        time.sleep(0.05)
    try:
        fresh = HostCopy.attach(_key(0), NBYTES, timeout_s=5)
        assert fresh.holder
        fresh.stop_serving()
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_served_file_is_mapped_read_only_by_range_and_never_as_a_copy(tmp_path, monkeypatch):
    """``serve_file`` (the trainer's side, [Note: the trainer's table served to the rollout]):
    a range is mapped read-only from the served file itself (its inode), also one that runs into
    the file's bytes after the table; a range past the file's end is refused; the name is served
    once; ``HostCopy.attach`` never takes a served file for a copy to write."""
    from fsdp2_ext.common.procfs import mapped_inode
    from fsdp2_ext.tables.host_copy import ServedRange, serve_file

    monkeypatch.setenv("FSDP2_EXT_HOST_ID", f"sf-{uuid.uuid4().hex[:8]}")
    rows = _rows(0, "ckpt-a")
    path = tmp_path / "table.bin"
    offset, table_bytes = 8192, NBYTES - 4 * DIM * 4  # the table: all rows but the last 4
    path.write_bytes(b"\0" * offset + rows.numpy().tobytes())
    key = {"kind": "test.file", "rows": ROWS - 4}
    server = serve_file(key, os.open(path, os.O_RDONLY), offset, table_bytes)
    assert server is not None
    assert serve_file(key, os.open(path, os.O_RDONLY), offset, table_bytes) is None  # once
    try:
        row = DIM * 4
        served = ServedRange.map(key, table_bytes, 1000 * row, (ROWS - 1000) * row)  # 4 past
        assert served.tensor.numel() == (ROWS - 1000) * row
        assert torch.equal(served.tensor.view(torch.float32).view(-1, DIM), rows[1000:])
        assert served.inode == os.stat(path).st_ino == mapped_inode(served.tensor)
        assert not served.owner.flags.writeable  # PROT_READ
        with pytest.raises(HostCopyRefused, match="served file"):
            ServedRange.map(key, table_bytes, 1000 * row, (ROWS - 999) * row)  # past the end
        assert ServedRange.map(dict(key, rows=ROWS), table_bytes, 0, row) is None  # another key
        with pytest.raises(HostCopyRefused, match="held .* B, asked"):
            ServedRange.map(key, table_bytes + row, 0, row)  # the same key, another size
        with pytest.raises(HostCopyRefused, match="serves a file"):
            HostCopy.attach(key, table_bytes)
    finally:
        server.stop()
    assert _names_left(os.environ["FSDP2_EXT_HOST_ID"]) == []


def test_a_layer_finds_its_table_by_its_path_from_layers_on(tmp_path):
    """``checkpoint_table_pieces``: vLLM's module name maps to the checkpoint's table whose name
    ends with the layer's path from ``layers`` on (vLLM's mappers rename the root only), shards in
    index order; two tables with that path (a drafter's beside the model's) are no answer."""
    from safetensors.torch import save_file

    from fsdp2_ext.tables.table_service import checkpoint_table_pieces

    def save(names):
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        directory.mkdir()
        save_file({n: torch.zeros(1, 2) for n in names}, str(directory / "model.safetensors"))
        return str(directory)

    table = "model.language_model.layers.3.ple.ple_embedding.ngram_embedding"
    shards = [f"{table}.shard_{k}.weight" for k in (0, 1, 2, 10, 11)]
    plain = save([*shards, f"{table}.weight_scale", "model.language_model.layers.3.x.weight"])
    for vllm_name in ("language_model.model.", "model.", ""):  # the mappers' roots, and none
        prefix = vllm_name + "layers.3.ple.ple_embedding.ngram_embedding"
        assert checkpoint_table_pieces(plain, prefix) == shards  # 10 after 2: by index
    assert (
        checkpoint_table_pieces(plain, "model.layers.4.ple.ple_embedding.ngram_embedding") is None
    )
    whole = save([f"{table}.weight"])
    assert checkpoint_table_pieces(whole, "model.layers.3.ple.ple_embedding.ngram_embedding") == [
        f"{table}.weight"
    ]
    twice = save([*shards, "mtp.layers.3.ple.ple_embedding.ngram_embedding.shard_0.weight"])
    assert (
        checkpoint_table_pieces(twice, "model.layers.3.ple.ple_embedding.ngram_embedding") is None
    )


# -- the review's smaller findings (#53), each failing without its fix


def test_the_peer_s_uid_is_read_unsigned():
    """``struct ucred`` holds ``uid_t``, unsigned: a uid of 2**31 or more (LDAP/IdM ranges, user
    namespaces) read as a signed int is negative and never equals ``os.getuid()``, so every
    process of that user would be refused as "another user" and fall back."""
    import struct

    from fsdp2_ext.tables.host_copy import _ucred

    raw = struct.pack("iII", 4242, 4_294_967_294, 4_000_000_000)
    assert _ucred(raw) == (4242, 4_294_967_294, 4_000_000_000)
    assert struct.unpack("3i", raw)[1] == -2  # what "3i" read: the bug


def _big_key(shards: int) -> dict:
    """A PLE key as the recipe's real checkpoint makes it: every shard file's name and identity
    (the recipe's 512 shards are ~57 KB of JSON; 1,500 here)."""
    return {
        "kind": "test.big_key", "run": str(uuid.uuid4()),
        "pieces": [f"model.language_model.layers.1.ngram_embedding.shard_{k}.weight"
                   for k in range(shards)],
        "files": [[f"model-{k:05d}-of-{shards:05d}.safetensors", 2049, 10_000_000 + k,
                   123_456_789_012, 1_765_000_000.123456] for k in range(shards)],
    }  # fmt: skip


def test_a_key_of_any_size_is_served():
    """Before: the holder read 64 KiB of a request and dropped the rest, so a key over it never
    matched and the asker timed out into its own copy."""
    import json

    key = _big_key(1500)
    assert len(json.dumps(key)) > 3 * (1 << 16)
    holder = HostCopy.attach(key, 4096, timeout_s=5)
    other = HostCopy.attach(key, 4096, timeout_s=5)
    try:
        assert holder.holder and not other.holder
        holder.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert other.tensor[:4].tolist() == [1, 2, 3, 4]  # one copy
        assert holder._server.served_to == [os.getpid()]  # whom it served, logged as it went
    finally:
        holder.stop_serving()


def test_a_garbled_reply_is_a_refusal_not_a_crash():
    """Another program holding the name and answering anything else: ``HostCopyRefused`` (the
    plugin falls back, naming it), not the ``ValueError`` of a JSON decode."""
    import socket
    import threading

    from fsdp2_ext.tables.host_copy import _socket_name

    key = {"kind": "test.garbled", "run": str(uuid.uuid4())}
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(_socket_name(key))
    squatter.listen(1)

    def answer():
        connection, _ = squatter.accept()
        with connection:
            while connection.recv(1 << 16):  # reads the request whole, as the protocol does
                pass
            connection.sendall(b"\x00not json at all")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        with pytest.raises(HostCopyRefused, match="not the protocol's"):
            HostCopy.attach(key, 4096, timeout_s=5)
    finally:
        thread.join(timeout=5)
        squatter.close()


def test_the_copy_is_sealed_not_executable():
    """``MFD_NOEXEC_SEAL`` (Linux 6.3+): where ``vm.memfd_noexec=2`` a memfd without it is refused;
    sealed, the copy's mode has no execute bit (a plain memfd is 0777)."""
    if tuple(int(p) for p in os.uname().release.split(".")[:2]) < (6, 3):
        pytest.skip("kernel before 6.3: no MFD_NOEXEC_SEAL")
    copy = HostCopy.attach({"kind": "test.noexec", "run": str(uuid.uuid4())}, 4096, timeout_s=5)
    try:
        assert copy.holder
        assert os.fstat(copy._server._fd).st_mode & 0o111 == 0
    finally:
        copy.stop_serving()
