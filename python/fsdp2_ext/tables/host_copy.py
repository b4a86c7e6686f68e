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
  checkpoint's fingerprint and files, the layer, its row range, shape and dtype); its SHA-256
  names an abstract Unix socket ``@fsdp2_ext/host_copy/<host>/<uid>/<digest>`` (abstract names
  live in the network namespace, i.e. per host, and vanish with the process that bound them);
- **one holder, elected by ``bind``**: the process whose ``bind`` succeeds creates the memfd and
  serves its descriptor (``SCM_RIGHTS``) from a daemon thread for its whole life; every other
  process ``connect``s, sends its key, and receives the descriptor only if the holder's key is
  the same, field for field (a digest is never trusted alone): a process never maps another
  table. Both ends check the other runs as the same user (``SO_PEERCRED``): an abstract name is
  reachable by every user of the host. Neither side waits for the other's loading, so no engine's progress depends on another's
  (no deadlock through either engine's own collectives);
- **filled by every process with the same bytes**: each engine's weight loader writes its rows as
  it would into its own tensor. The key is what makes those bytes the same: for the PLE rows,
  the same checkpoint files (device, inode, size, modification time) read with a load format that
  writes the checkpoint's bytes ([Note: the PLE rows in a host copy]). While one engine writes,
  another reads rows that are the same before and after each write.
- **never fatal to its user**: a refusal, a timeout or a failed ``memfd_create`` raises to the
  caller, which keeps a copy of its own (the plugin falls back to vLLM's allocation); a forked
  child closes the holder's socket and descriptor (``os.register_at_fork``), so it never keeps a
  name bound that nobody serves.

Pages are placed where they are first touched (the first writer's NUMA node) and charged to the
first toucher's memory cgroup for the whole copy: on a two-socket host the other socket's GPUs read
the rows across the interconnect (each rank's own pinned rows sit on its own node today). Not
measured here; ``benchmarks/gpu_check_ple_host_copy.py`` on such a host would tell.

If the holder exits while others still map the copy, those keep it; a process that starts after
that becomes a new holder with a new copy (logged: "holder ... gone"). Without a reachable socket
(another network namespace) each process holds its own copy, as without this module, and says so.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import socket
import struct
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from fsdp2_ext.common import log

__all__ = ["HostCopy", "HostCopyRefused", "ServedRange", "key_digest", "serve_file"]

# Bytes of one request's or reply's JSON: a key of any size the project makes (the recipe's real
# checkpoint, 512 shard names, is ~57 KB; the limit allows for 1,000 times that), a bound against
# a peer that never stops sending.
_MESSAGE_LIMIT = 64 << 20
_MFD_NOEXEC_SEAL = getattr(os, "MFD_NOEXEC_SEAL", 0x0008)  # Linux 6.3+; Python 3.12+ names it
_RETRY_S = 0.05
_SERVING: weakref.WeakSet = weakref.WeakSet()  # this process's holders, closed in a forked child


class HostCopyRefused(RuntimeError):
    """The holder of this name serves other bytes than the key asks for, or runs as another
    user: the caller keeps a copy of its own."""


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:40]


def _socket_name(key: dict) -> bytes:
    """Per host (the network namespace; ``FSDP2_EXT_HOST_ID`` simulates hosts in tests, as
    ``host_shared`` does), per user, per key."""
    host = os.environ.get("FSDP2_EXT_HOST_ID", "")
    return f"\0fsdp2_ext/host_copy/{host}/{os.getuid()}/{key_digest(key)}".encode()


_UCRED = "iII"  # struct ucred: pid_t pid (signed), uid_t uid, gid_t gid (unsigned 32-bit)


def _ucred(raw: bytes) -> tuple[int, int, int]:
    """(pid, uid, gid) of a ``SO_PEERCRED`` reply; a uid of 2**31 or more stays what it is (read
    as a signed int it would be negative and never equal this process's)."""
    return struct.unpack(_UCRED, raw)


def _same_user(connection: socket.socket, peer: str) -> int:
    """The peer's pid, once it is known to run as this process's user (``SO_PEERCRED``): an
    abstract name is reachable by every user of the host, and the copy is mapped read-write."""
    pid, uid, _ = _ucred(
        connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize(_UCRED))
    )
    if uid != os.getuid():
        raise HostCopyRefused(f"host copy: the {peer} runs as uid {uid}, this process as "
                              f"{os.getuid()}: not shared across users (another user holds "
                              "this name on this host)")  # fmt: skip
    return pid


def _read_all(connection: socket.socket, first: bytes = b"") -> bytes:
    """Everything the peer sends until it shuts its side, at most ``_MESSAGE_LIMIT`` bytes."""
    message = first
    while True:
        chunk = connection.recv(1 << 16)
        if not chunk:
            return message
        message += chunk
        if len(message) > _MESSAGE_LIMIT:
            raise HostCopyRefused(f"host copy: a message over {_MESSAGE_LIMIT:,} B: refused")


def _memfd(name: str) -> int:
    """``memfd_create`` sealed not executable where the kernel has ``MFD_NOEXEC_SEAL`` (a host
    with ``vm.memfd_noexec=2`` refuses a memfd without it); without, on older kernels (EINVAL)."""
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC | _MFD_NOEXEC_SEAL)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return os.memfd_create(name, os.MFD_CLOEXEC)


def _close_in_child() -> None:
    """A forked child (a compile worker, a dataloader) must not keep a holder's name bound
    without serving it, nor its descriptor: both stay the parent's."""
    for server in list(_SERVING):
        server._lock = threading.Lock()  # the parent's sending thread is not in the child
        server.close()


os.register_at_fork(after_in_child=_close_in_child)


def _owned_view(mapping: mmap.mmap) -> tuple[np.ndarray, torch.Tensor]:
    """A ``uint8`` tensor over the mapping whose storage keeps a numpy owner alive: a finalizer on
    the owner (the device registration's) runs only once no tensor uses the memory, as vLLM's
    ``DPSharedEngramStorage`` ties its ``cudaHostUnregister`` (engram.py:812-817, 845-850)."""
    owner = np.frombuffer(mapping, dtype=np.uint8)
    return owner, torch.from_numpy(owner)


class _Server:
    """Serves one descriptor under one name to every process that asks with the same key, field
    for field, and the same size, from a daemon thread for this process's life (or until
    ``close``). The reply carries the holder's pid, where the bytes begin in the descriptor and
    whether they are served read-only (a file other processes only read:
    [Note: the trainer's table served to the rollout])."""

    def __init__(self, server: socket.socket, key: dict, nbytes: int, fd: int, *,
                 offset: int = 0, read_only: bool = False) -> None:  # fmt: skip
        self.key, self.nbytes, self.offset, self.read_only = key, nbytes, offset, read_only
        self.served_to: list[int] = []  # the pids it sent the descriptor to, in order
        self._socket, self._fd = server, fd
        self._lock = threading.Lock()  # the descriptor is never closed while it is being sent
        _SERVING.add(self)
        self._thread = threading.Thread(target=self._serve, name="fsdp2_ext-host-copy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Frees the name: ``shutdown`` wakes the thread's ``accept``, which a bare ``close`` would
        not; the name is gone once the thread has left ``accept`` and the socket is closed."""
        if self._socket is not None:
            try:
                self._socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=10.0)
        self.close()

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _serve(self) -> None:
        """A bad request is answered or dropped, never fatal to the thread."""
        server = self._socket
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            with connection:
                try:
                    connection.settimeout(10.0)
                    reply = {"pid": os.getpid(), "offset": self.offset, "read_only": self.read_only}
                    try:  # the request read whole first: a reply to an unread one is a reset
                        request = _read_all(connection)
                        peer = _same_user(connection, "process asking")
                        asked = json.loads(request or b"{}")
                    except (HostCopyRefused, ValueError) as refused:
                        connection.sendall(json.dumps(dict(reply, error=str(refused))).encode())
                        log.warn(f"host copy {key_digest(self.key)}: {refused}")
                        continue
                    differs = self._differs(asked if isinstance(asked, dict) else {})
                    if differs:
                        reply["error"] = differs
                        connection.sendall(json.dumps(reply).encode())
                        log.warn(f"host copy {key_digest(self.key)}: refused a process: {differs}")
                        continue
                    with self._lock:
                        if self._fd < 0:
                            return
                        socket.send_fds(connection, [json.dumps(reply).encode()], [self._fd])
                    self.served_to.append(peer)
                    log.info(f"host copy {key_digest(self.key)}: {self.nbytes:,} B served"
                             f"{' read-only' if self.read_only else ''} to pid {peer} "
                             f"({len(self.served_to)} so far: {self.served_to})")  # fmt: skip
                except Exception as error:  # noqa: BLE001 - one request, never the server
                    log.warn(f"host copy {key_digest(self.key)}: a request failed: {error}")

    def _differs(self, asked: dict) -> str:
        theirs, mine = asked.get("key", {}), self.key
        if not isinstance(theirs, dict):
            return "the request carries no key"
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


def _bind(name: bytes) -> socket.socket | None:
    """The name's listening socket, or None when another process holds the name."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(name)
    except OSError:  # another process holds the name (or is about to listen)
        server.close()
        return None
    return server


def _ask(name: bytes, key: dict, nbytes: int, timeout_s: float) -> tuple[dict, int] | None:
    """(the holder's reply, the descriptor it sent) for ``key``; None when no process holds the
    name, or its holder went away mid-request (the caller may retry). Raises
    ``HostCopyRefused`` when the holder refuses."""
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(timeout_s)
    try:
        try:
            client.connect(name)
        except (ConnectionRefusedError, FileNotFoundError):
            return None
        _same_user(client, "holder")
        try:
            client.sendall(json.dumps({"key": key, "nbytes": nbytes}).encode())
            client.shutdown(socket.SHUT_WR)
            message, fds, _, _ = socket.recv_fds(client, 1 << 16, 1)
        except (BrokenPipeError, ConnectionResetError):
            return None
        try:
            message = _read_all(client, message) if message else message
        except ConnectionResetError:
            pass  # the holder closed on its reply: what came is the reply
    finally:
        client.close()
    if not message and not fds:
        return None  # the holder closed without a word: it is exiting
    try:
        reply = json.loads(message or b"{}")
        if not isinstance(reply, dict):
            raise ValueError(f"a {type(reply).__name__}, not an object")
    except ValueError as garbled:
        for fd in fds:
            os.close(fd)
        raise HostCopyRefused(
            f"host copy {key_digest(key)}: the holder's reply is not the protocol's ({garbled}): "
            "another program holds this name"
        ) from garbled
    if not fds:
        raise HostCopyRefused(
            f"host copy {key_digest(key)}: the holder (pid {reply.get('pid', '?')}) refused: "
            f"{reply.get('error', 'no reason given')}"
        )
    return reply, fds[0]


@dataclass(eq=False)  # compared and hashed by identity
class HostCopy:
    """``nbytes`` of shared memory for ``key``, mapped read-write in this process (``tensor``: a
    ``uint8`` view of it; ``owner``: the numpy array its storage keeps alive). ``holder``: this
    process created it and serves it."""

    key: dict
    nbytes: int
    tensor: torch.Tensor
    holder: bool
    holder_pid: int
    owner: np.ndarray | None = field(default=None, repr=False)
    _server: _Server | None = field(default=None, repr=False)

    @classmethod
    def attach(cls, key: dict, nbytes: int, *, timeout_s: float = 60.0) -> HostCopy:
        """This host's copy for ``key``: served by its holder, or created here if none holds it.
        Raises ``HostCopyRefused`` when the holder of the name serves another key or size, or runs
        as another user; ``TimeoutError`` when a name stays bound and unserved for ``timeout_s``
        (its holder's set-up is a ``memfd_create`` and a ``listen``: microseconds)."""
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
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"host copy {key_digest(key)}: a process holds the name but did not serve it "
                    f"within {timeout_s:g} s"
                )
            time.sleep(_RETRY_S)

    @classmethod
    def _connect(cls, name: bytes, key: dict, nbytes: int, timeout_s: float) -> HostCopy | None:
        asked = _ask(name, key, nbytes, timeout_s)
        if asked is None:
            return None
        reply, fd = asked
        try:
            if reply.get("read_only") or reply.get("offset"):
                raise HostCopyRefused(f"host copy {key_digest(key)}: the holder serves a file, "
                                      "not a copy to write")  # fmt: skip
            if os.fstat(fd).st_size != nbytes:
                raise HostCopyRefused(f"host copy {key_digest(key)}: served {os.fstat(fd).st_size} "
                                      f"bytes, {nbytes} asked")  # fmt: skip
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        log.info(f"host copy {key_digest(key)}: {nbytes:,} B mapped from holder pid {reply['pid']}")
        owner, tensor = _owned_view(mapping)
        return cls(key, nbytes, tensor, False, reply["pid"], owner)

    @classmethod
    def _create(cls, name: bytes, key: dict, nbytes: int) -> HostCopy | None:
        server = _bind(name)
        if server is None:
            return None
        fd = -1
        try:
            fd = _memfd(f"fsdp2_ext_host_copy_{key_digest(key)}")
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            server.listen(64)
        except BaseException:  # the name and the descriptor go with the failure
            server.close()
            if fd >= 0:
                os.close(fd)
            raise
        owner, tensor = _owned_view(mapping)
        copy = cls(key, nbytes, tensor, True, os.getpid(), owner, _Server(server, key, nbytes, fd))
        log.info(f"host copy {key_digest(key)}: {nbytes:,} B created; this process (pid "
                 f"{os.getpid()}) holds and serves it")  # fmt: skip
        return copy

    def stop_serving(self) -> None:
        """Frees the name (the mapping stays): the next process to ask creates a copy of its own."""
        if self._server is not None:
            self._server.stop()


def serve_file(key: dict, fd: int, offset: int, nbytes: int) -> _Server | None:
    """Serves ``nbytes`` at ``offset`` of the open file ``fd`` read-only under ``key`` (the
    server owns ``fd`` from here on, and closes it if it cannot serve); None when another process
    of this user already serves the name (logged)."""
    key = json.loads(json.dumps(key, sort_keys=True))
    server = _bind(_socket_name(key))
    if server is None:
        os.close(fd)
        log.warn(f"host copy {key_digest(key)}: another process already serves this table; "
                 "this one is not served twice")  # fmt: skip
        return None
    try:
        server.listen(64)
        return _Server(server, key, nbytes, fd, offset=offset, read_only=True)
    except BaseException:
        server.close()
        os.close(fd)
        raise


@dataclass(eq=False)
class ServedRange:
    """``length`` bytes from ``begin`` of a file another process serves read-only
    (``serve_file``), mapped read-only here: ``tensor`` a ``uint8`` view, ``owner`` the numpy
    array its storage keeps alive, ``inode`` the served file's."""

    key: dict
    tensor: torch.Tensor
    holder_pid: int
    inode: int
    owner: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def map(cls, key: dict, nbytes: int, begin: int, length: int, *,
            timeout_s: float = 60.0) -> ServedRange | None:  # fmt: skip
        """Bytes ``[begin, begin + length)`` of the ``nbytes`` served under ``key``; ``length``
        may run past ``nbytes`` into the file's bytes after them (a layer's padding rows, never
        read) but never past the file's end. None when no process serves the key; raises
        ``HostCopyRefused`` when the server refuses or the range leaves its file."""
        key = json.loads(json.dumps(key, sort_keys=True))
        asked = _ask(_socket_name(key), key, nbytes, timeout_s)
        if asked is None:
            return None
        reply, fd = asked
        try:
            status = os.fstat(fd)
            first = int(reply.get("offset", 0)) + begin
            if not reply.get("read_only") or begin < 0 or first + length > status.st_size:
                raise HostCopyRefused(
                    f"host copy {key_digest(key)}: bytes [{first:,}, {first + length:,}) of a "
                    f"{status.st_size:,}-byte served file"
                    + ("" if reply.get("read_only") else " (served as a copy to write, not a file)")
                )
            aligned = first - first % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, first + length - aligned, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ, offset=aligned)  # fmt: skip
        finally:
            os.close(fd)
        owner = np.frombuffer(mapping, dtype=np.uint8)
        with warnings.catch_warnings():  # "not writable": it is not, by design (PROT_READ)
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(owner[first - aligned :])
        log.info(f"host copy {key_digest(key)}: {length:,} B mapped read-only from the file "
                 f"pid {reply['pid']} serves")  # fmt: skip
        return cls(key, tensor, reply["pid"], status.st_ino, owner)
