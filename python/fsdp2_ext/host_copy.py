"""One copy per host of bytes that several processes with no group in common all need.

[Note: a host copy without a group]
vLLM's engines (VERL's rollout replicas: two TP-4 engines per 8-GPU host) share no process group,
start in any order and may outlive or restart without one another, so the trainer's protocol
(``host_shared``: leaders elected over the group, verdicts agreed, the file unlinked once all have
mapped) has no group to run on. A host copy is instead:

- **anonymous shared memory** (``memfd_create``): shmem pages, the same kind vLLM's own
  ``DPSharedEngramStorage`` backs with a ``/dev/shm`` file and ``cudaHostRegister``s
  (``vllm/models/deepseek_v41/common/engram.py:772-873``), but with no name in any filesystem and
  no ``/dev/shm`` size limit (Docker's default 64 MiB would refuse a table). The kernel frees it when
  the last process that maps it exits: **nothing is ever left behind**, crash or not;
- **named by its key**: a JSON object that says exactly what the bytes are (for a PLE table: the
  checkpoint's fingerprint, the layer, its row range, shape and dtype); its SHA-256 names an
  abstract Unix socket ``@fsdp2_ext/host_copy/<host>/<digest>`` (abstract names live in the
  network namespace, i.e. per host, and vanish with the process that bound them);
- **one holder, elected by ``bind``**: the process whose ``bind`` succeeds creates the memfd and
  serves its descriptor (``SCM_RIGHTS``) from a daemon thread for its whole life; every other
  process ``connect``s, sends its key, and receives the descriptor only if the holder's key is
  the same, field for field (a digest is never trusted alone): a process never maps another
  table. Both ends check the other runs as the same user (``SO_PEERCRED``): an abstract name is
  reachable by every user of the host. Neither side waits for the other's loading, so no engine's progress depends on another's
  (no deadlock through either engine's own collectives);
- **filled by every process with the same bytes**: each engine's weight loader writes its rows as
  it would into its own tensor. The key's fingerprint is what makes those bytes the same; its
  claim is [Note: checkpoint fingerprint]'s (two checkpoints that differ only between the sampled
  pages would share one copy: the last writer's rows). While one engine writes, another reads
  rows that are the same before and after each write.

If the holder exits while others still map the copy, those keep it; a process that starts after
that becomes a new holder with a new copy (logged: "holder ... gone"). Without a reachable socket
(another network namespace) each process holds its own copy, as without this module, and says so.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import torch

from fsdp2_ext import log

__all__ = ["HostCopy", "HostCopyRefused", "key_digest"]

_REQUEST_LIMIT = 1 << 16  # bytes of one key's JSON
_RETRY_S = 0.05


class HostCopyRefused(RuntimeError):
    """The holder of this name serves other bytes than the key asks for."""


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]


def _socket_name(key: dict) -> bytes:
    host = os.environ.get("FSDP2_EXT_HOST_ID", "")  # tests simulate hosts, as host_shared does
    return f"\0fsdp2_ext/host_copy/{host}/{key_digest(key)}".encode()


def _same_user(connection: socket.socket, peer: str) -> None:
    """The peer runs as this process's user (``SO_PEERCRED``): an abstract name is reachable by
    every user of the host, and the copy is mapped read-write."""
    _, _, uid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))  # fmt: skip
    if uid != os.getuid():
        raise HostCopyRefused(f"host copy: the {peer} runs as uid {uid}, this process as "
                              f"{os.getuid()}: not shared across users")  # fmt: skip


@dataclass
class HostCopy:
    """``nbytes`` of shared memory for ``key``, mapped read-write in this process (``tensor``: a
    ``uint8`` view of it). ``holder``: this process created it and serves it."""

    key: dict
    nbytes: int
    tensor: torch.Tensor
    holder: bool
    holder_pid: int
    _mapping: mmap.mmap | None = field(default=None, repr=False)
    _fd: int = field(default=-1, repr=False)
    _server: socket.socket | None = field(default=None, repr=False)

    @classmethod
    def attach(cls, key: dict, nbytes: int, *, timeout_s: float = 60.0) -> HostCopy:
        """This host's copy for ``key``: served by its holder, or created here if none holds it.
        Raises ``HostCopyRefused`` when the holder of the name serves another key or size."""
        key = json.loads(json.dumps(key, sort_keys=True))  # what the wire carries, compared as such
        name = _socket_name(key)
        deadline = time.monotonic() + timeout_s
        while True:
            attached = cls._connect(name, key, nbytes, timeout_s)
            if attached is not None:
                return attached
            created = cls._create(name, key, nbytes)
            if created is not None:
                return created
            if time.monotonic() > deadline:  # bound but never listening: a holder stuck in set-up
                raise TimeoutError(
                    f"host copy {key_digest(key)}: a process holds the name but did not serve it "
                    f"within {timeout_s:g} s"
                )
            time.sleep(_RETRY_S)

    @classmethod
    def _connect(cls, name: bytes, key: dict, nbytes: int, timeout_s: float) -> HostCopy | None:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(timeout_s)
        try:
            try:
                client.connect(name)
            except (ConnectionRefusedError, FileNotFoundError):
                return None
            _same_user(client, "holder")
            client.sendall(json.dumps({"key": key, "nbytes": nbytes}).encode())
            client.shutdown(socket.SHUT_WR)
            message, fds, _, _ = socket.recv_fds(client, _REQUEST_LIMIT, 1)
        finally:
            client.close()
        reply = json.loads(message or b"{}")
        if not fds:
            raise HostCopyRefused(
                f"host copy {key_digest(key)}: the holder (pid {reply.get('pid', '?')}) refused: "
                f"{reply.get('error', 'no reply')}"
            )
        fd = fds[0]
        try:
            if os.fstat(fd).st_size != nbytes:
                raise HostCopyRefused(f"host copy {key_digest(key)}: served {os.fstat(fd).st_size} "
                                      f"bytes, {nbytes} asked")  # fmt: skip
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        log.info(f"host copy {key_digest(key)}: {nbytes:,} B mapped from holder pid {reply['pid']}")
        return cls(key, nbytes, torch.frombuffer(mapping, dtype=torch.uint8), False, reply["pid"],
                   mapping)  # fmt: skip

    @classmethod
    def _create(cls, name: bytes, key: dict, nbytes: int) -> HostCopy | None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            server.bind(name)
        except OSError:  # another process holds the name (or is about to listen)
            server.close()
            return None
        fd = os.memfd_create(f"fsdp2_ext_host_copy_{key_digest(key)}", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        server.listen(64)
        copy = cls(key, nbytes, torch.frombuffer(mapping, dtype=torch.uint8), True, os.getpid(),
                   mapping, fd, server)  # fmt: skip
        threading.Thread(target=copy._serve, name="fsdp2_ext-host-copy", daemon=True).start()
        log.info(f"host copy {key_digest(key)}: {nbytes:,} B created; this process (pid "
                 f"{os.getpid()}) holds and serves it")  # fmt: skip
        return copy

    def stop_serving(self) -> None:
        """Frees the name (the mapping stays): the next process to ask creates a copy of its own.
        ``shutdown`` wakes the server thread's ``accept``, which a bare ``close`` would not."""
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
            self._server = None

    def _serve(self) -> None:
        """Serves the descriptor to every process that asks with the same key, for this process's
        life (a daemon thread)."""
        server = self._server
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                try:
                    connection.settimeout(10.0)
                    _same_user(connection, "process asking")
                    request = b""
                    while len(request) < _REQUEST_LIMIT:
                        chunk = connection.recv(_REQUEST_LIMIT)
                        if not chunk:
                            break
                        request += chunk
                    asked = json.loads(request or b"{}")
                    differs = self._differs(asked)
                    reply = {"pid": os.getpid()}
                    if differs:
                        reply["error"] = differs
                        connection.sendall(json.dumps(reply).encode())
                        log.warn(f"host copy {key_digest(self.key)}: refused a process: {differs}")
                        continue
                    socket.send_fds(connection, [json.dumps(reply).encode()], [self._fd])
                except (OSError, ValueError, HostCopyRefused) as error:
                    log.warn(f"host copy {key_digest(self.key)}: a request failed: {error}")

    def _differs(self, asked: dict) -> str:
        theirs, mine = asked.get("key", {}), self.key
        fields = sorted(
            k for k in set(theirs) | set(mine) if theirs.get(k, None) != mine.get(k, None)
        )
        if fields:
            return "the keys differ in " + ", ".join(
                f"{k} (held {mine.get(k)!r}, asked {theirs.get(k)!r})" for k in fields
            )
        if asked.get("nbytes") != self.nbytes:
            return f"held {self.nbytes:,} B, asked {asked.get('nbytes')!r}"
        return ""
