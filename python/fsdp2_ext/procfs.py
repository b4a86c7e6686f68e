"""What /proc says about this process's memory: proportional set size, the file behind a tensor."""

from __future__ import annotations

import torch

__all__ = ["mapped_inode", "pss_bytes"]


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
