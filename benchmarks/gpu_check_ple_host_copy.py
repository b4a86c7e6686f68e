"""GPU check of the PLE host copy: two engines' ranks read one registered copy through UVA.

    python benchmarks/gpu_check_ple_host_copy.py            # one GPU, ~1 min
    python benchmarks/gpu_check_ple_host_copy.py --on-cpu   # the script itself, here

What ``make vllm-check`` cannot prove on a CPU ([Note: the PLE rows in a host copy]): that a
memfd host copy, mapped by two processes, each ``cudaHostRegister``ing it as the plugin does
(``fsdp2_ext.vllm.vllm_plugin._register_for_device``), is pinned (``is_pinned()``, which vLLM's
``get_accelerator_view_from_cpu_tensor`` needs) and read by the GPU in place: a CUDA tensor over
the device pointer ``cudaHostGetDevicePointer`` returns for it (read through ctypes from the
CUDA runtime torch loads; with ``cudaDevAttrCanUseHostPointerForRegisteredMem`` it is the host
address itself, both reported), indexed by a kernel on the device as vLLM's
``_lookup_ple_embedding_from_pinned_kernel`` reads the rows (vLLM is not on the lent machine;
``F.embedding`` on the view is the same read: rows of host memory loaded by a GPU kernel). Lookups must equal the same lookups on an unshared device copy, bit for bit; the host
must hold the rows once (PSS summed over the two processes).

Two processes ("engines" A and B), spawned, twice: (1) ``memfd``, the rollout's own host copy:
each maps the copy (one holder), writes the same rows (as each engine's weight loader does) and
registers it; (2) ``trainer-file``, [Note: the trainer's table served to the rollout]: this
process writes the rows to a file in ``--directory`` (default ``$VERL_NO_PLACEMENT_MMAP_DIR``,
else the temp directory: put it on the disk the recipe uses), serves it read-only and unlinks it;
each engine maps its range read-only and registers it with ``cudaHostRegisterReadOnly``. Each
looks up 65,536 random ids, and reports.
On a GPU it first records the device's attributes 113, 100 and 91 and the plugin's choice from
them ([Note: registering a table the GPU reads from the host]); where read-only registration is
not supported the trainer-file case is skipped, as the plugin skips it, and the memfd case is the
path the rollout takes.
Writes benchmarks/results/gpu_check_ple_host_copy.json; exits 1 if a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "gpu_check_ple_host_copy.json")
ROWS, DIM = 1 << 18, 256  # bf16: 128 MiB, one rank's range of a (small) PLE layer


def _rows() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _cudart():
    """The CUDA runtime library torch uses (its wheel's ``nvidia/cuda_runtime``, or the system's)."""
    import ctypes
    import glob

    candidates = ["libcudart.so"]
    for root in sys.path:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_runtime", "lib",
                                                    "libcudart.so*")))  # fmt: skip
        candidates += sorted(glob.glob(os.path.join(root, "torch", "lib", "libcudart*.so*")))
    for candidate in candidates:
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    raise OSError(f"no CUDA runtime library found (tried {candidates[:4]} ...)")


def _device_pointer(host_pointer: int) -> tuple[int, int]:
    """(``cudaHostGetDevicePointer``'s pointer, ``cudaDevAttrCanUseHostPointerForRegisteredMem``)."""
    import ctypes

    lib = _cudart()
    device_pointer, attribute = ctypes.c_void_p(), ctypes.c_int()
    error = lib.cudaHostGetDevicePointer(
        ctypes.byref(device_pointer), ctypes.c_void_p(host_pointer), 0
    )
    if error != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer failed: error {error}")
    error = lib.cudaDeviceGetAttribute(ctypes.byref(attribute), 91, 0)  # ...RegisteredMem = 91
    if error != 0:
        raise RuntimeError(f"cudaDeviceGetAttribute failed: error {error}")
    return int(device_pointer.value), int(attribute.value)


def _engine(name: str, host: str, on_cpu: bool, source: str, barrier, queue) -> None:
    os.environ["FSDP2_EXT_HOST_ID"] = host
    from fsdp2_ext.common.procfs import mapping_memory
    from fsdp2_ext.tables.host_copy import HostCopy, ServedRange
    from fsdp2_ext.vllm.vllm_plugin import _HOST_REGISTER_READ_ONLY, _register_for_device

    report = {"engine": name, "pid": os.getpid(), "source": source}
    try:
        if source == "memfd":  # the rollout's own host copy: every engine writes the rows
            copy = HostCopy.attach(_key(source), ROWS * DIM * 2)
            table = copy.tensor.view(torch.bfloat16).view(ROWS, DIM)
            table.copy_(_rows())  # each engine's loader writes the same bytes
            owner, flags, report["holder"] = copy.owner, 0, copy.holder
        else:  # the trainer's file, served read-only: nothing is written
            served = ServedRange.map(_key(source), ROWS * DIM * 2, 0, ROWS * DIM * 2)
            table = served.tensor.view(torch.bfloat16).view(ROWS, DIM)
            owner, flags, report["holder"] = served.owner, _HOST_REGISTER_READ_ONLY, False
        ids = torch.randint(0, ROWS, (1 << 16,), generator=torch.Generator().manual_seed(1))
        if on_cpu:
            looked_up, reference = table[ids], _rows()[ids]
            report.update(pinned=None, uva=None)
        else:
            _register_for_device(owner, table, flags)
            report["pinned"] = bool(table.is_pinned())
            device = torch.device("cuda", 0)
            attribute = torch.cuda.get_device_properties(device)
            report["device"] = attribute.name

            pointer, same_address = _device_pointer(table.data_ptr())
            report["device_pointer_is_host_address"] = pointer == table.data_ptr()
            report["can_use_host_pointer_for_registered_mem"] = same_address

            class _HostRows:  # a CUDA tensor over the device pointer of the registered rows
                __cuda_array_interface__ = {
                    "shape": (ROWS, DIM), "typestr": "<i2", "version": 3,
                    "data": (pointer, False),
                }  # fmt: skip

            view = torch.as_tensor(_HostRows(), device=device).view(torch.bfloat16)
            report["uva"] = view.data_ptr() == pointer and view.is_cuda
            looked_up = torch.nn.functional.embedding(ids.to(device), view).cpu()
            reference = torch.nn.functional.embedding(ids.to(device), _rows().to(device)).cpu()
            torch.cuda.synchronize()
        report["exact"] = torch.equal(looked_up.view(torch.int16), reference.view(torch.int16))
        barrier.wait()
        report.update(mapping_memory(table))
        barrier.wait()
    except Exception as error:  # reported, never a hang of the other engine
        report["error"] = f"{type(error).__name__}: {error}"
        barrier.abort()
    queue.put(report)


def _key(source: str) -> dict:
    return {"kind": f"gpu_check.{source}", "rows": ROWS, "dim": DIM, "dtype": "bfloat16"}


def _serve_trainer_file(directory: str):
    """The trainer's side ([Note: the trainer's table served to the rollout]): the rows written to
    a file in ``directory`` (the recipe's ``VERL_NO_PLACEMENT_MMAP_DIR`` is a disk), served
    read-only, unlinked."""
    from fsdp2_ext.tables.host_copy import serve_file

    path = os.path.join(directory, f"gpu_check_ple_{uuid.uuid4().hex[:8]}.bin")
    with open(path, "wb") as f:
        f.write(_rows().view(torch.int16).numpy().tobytes())
    server = serve_file(_key("trainer-file"), os.open(path, os.O_RDONLY), 0, ROWS * DIM * 2)
    os.unlink(path)
    return server


def _check(source: str, args, ctx) -> dict:
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    engines = [
        ctx.Process(target=_engine, args=(n, args.host, args.on_cpu, source, barrier, queue))
        for n in "AB"
    ]
    for p in engines:
        p.start()
    reports = sorted((queue.get(timeout=600) for _ in engines), key=lambda r: r["engine"])
    for p in engines:
        p.join(60)
    nbytes = ROWS * DIM * 2
    goals = {
        "no errors": all("error" not in r for r in reports),
        "lookups exact": all(r.get("exact") for r in reports),
        "one copy (inode)": len({r.get("inode") for r in reports}) == 1,
        "rows once on the host": abs(sum(r.get("Pss", 0) for r in reports) - nbytes) <= 16384,
    }
    if source == "memfd":
        goals["one holder"] = [r.get("holder") for r in reports].count(True) == 1
    if not args.on_cpu:
        goals["registered copy pinned"] = all(r.get("pinned") for r in reports)
        goals["device reads the host pointer"] = all(r.get("uva") for r in reports)
    return {"reports": reports, "goals": goals}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--on-cpu", action="store_true", help="no registration, CPU lookups")
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument("--directory", default=os.environ.get("VERL_NO_PLACEMENT_MMAP_DIR")
                        or tempfile.gettempdir(), help="where the trainer's file is written")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.on_cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --on-cpu", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    args.host = f"gpu-check-{uuid.uuid4().hex[:8]}"
    os.environ["FSDP2_EXT_HOST_ID"] = args.host
    attributes, choice = None, ("read-only", "on the CPU")
    if not args.on_cpu:  # [Note: registering a table the GPU reads from the host]
        from fsdp2_ext.vllm.cuda_host import ATTRIBUTES, served_rows_choice
        from fsdp2_ext.vllm.cuda_host import attributes as read_attributes

        torch.cuda.init()
        attributes = {ATTRIBUTES[a]: v for a, v in read_attributes(0).items()}
        choice = served_rows_choice(read_attributes(0))
        print(f"device attributes: {attributes}; the plugin's choice: {choice[0]}")
    server = _serve_trainer_file(args.directory)
    sources = ("memfd", "trainer-file") if choice[0] == "read-only" else ("memfd",)
    results = {source: _check(source, args, ctx) for source in sources}
    server.stop()
    goals = {f"{source}: {g}": ok for source, r in results.items() for g, ok in r["goals"].items()}
    result = {"on_cpu": args.on_cpu, "bytes": ROWS * DIM * 2, "directory": args.directory,
              "filesystem": _filesystem(args.directory), "attributes": attributes,
              "plugin_choice": choice, "results": results, "goals": goals}  # fmt: skip
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(goals, indent=1))
    print("goals met" if all(goals.values()) else "GOALS MISSED")
    return 0 if all(goals.values()) else 1


def _filesystem(directory: str) -> str:
    from fsdp2_ext.checkpoint.model_checkpoint import filesystem_type

    return filesystem_type(directory)


if __name__ == "__main__":
    sys.exit(main())
