"""What /proc says about this process's memory: proportional set size, the file behind a tensor."""

from __future__ import annotations

import torch

__all__ = ["mapped_inode", "mapping_memory", "pss_bytes", "status_bytes", "storage_bytes"]


def pss_bytes(pid: int | str = "self") -> int:
    """The proportional set size of ``pid`` (default this process; shared pages counted once per
    host, split). It walks the process's page tables: read it between phases, not in a loop."""
    with open(f"/proc/{pid}/smaps_rollup") as smaps:
        for line in smaps:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def mapped_inode(tensor: torch.Tensor) -> int:
    """The inode of the file mapping that holds ``tensor``'s data (0: anonymous memory)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return int(fields[4])
    return 0


def mapping_memory(tensor: torch.Tensor) -> dict[str, int | str]:
    """The mapping (VMA) that holds ``tensor``'s data, from /proc/self/smaps: its ``inode``,
    ``name`` (a memfd's is ``/memfd:NAME (deleted)``), ``Rss`` and ``Pss`` (bytes: the pages this
    process touches, and its share of them when several processes map the same pages)."""
    address = tensor.data_ptr()
    found: dict[str, int | str] = {}
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                if found:
                    break
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    found = {"inode": int(fields[4]), "name": " ".join(fields[5:])}
            elif found and fields[0] in ("Rss:", "Pss:"):
                found[fields[0][:-1]] = int(fields[1]) * 1024
    return found


def status_bytes(pid: int | str = "self") -> dict[str, int]:
    """Resident memory of ``pid`` from /proc/PID/status: VmRSS and its anonymous, file-backed and
    shared-memory parts (RssAnon, RssFile, RssShmem), bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard's, FSDP2's
    padded buffer), each storage counted once: what a process holds for them."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
