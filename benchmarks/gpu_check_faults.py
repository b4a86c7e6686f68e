"""GPU check of a fault: an HSDP leader that dies before its replicas' first broadcast.

    python benchmarks/gpu_check_faults.py             # one GPU is enough (see below), ~1 min
    python benchmarks/gpu_check_faults.py --on-cpu    # the script itself, here (Gloo)

[Note: HSDP loads] sends what a replica cannot read itself from its leader along ``ddp``. On
NCCL the ``ddp`` group's communicator is made lazily, inside its first collective
(``ProcessGroupNCCL::getNCCLComm`` -> ``ncclCommInitRank``, which blocks until every rank has
joined; rank 0 of the group publishes the unique id through the store, the others wait for it),
before any ``Work`` exists whose ``wait(timeout)`` could bound it. So a leader that dies during
its own load leaves a replica blocked for the group's timeout (30 minutes under VERL) in a plain
``dist.broadcast(...).wait(timeout)``; ``broadcast_to_replicas`` first runs
``bounded_first_collective`` on the group, on a helper thread, bounded as a whole.

Two processes on VERL's group form (``cpu:gloo,cuda:nccl``), each on GPU 0 (the leader never
reaches NCCL, so one GPU serves: the replica's ``ncclCommInitRank`` waits for the leader's
unique id in the store and never sees a second device). Rank 0, the leader, stops (``SIGSTOP``)
before its broadcast; rank 1 runs, in order:

1. ``control``: a plain ``dist.broadcast(..., async_op=True)`` and ``work.wait(timeout=bound)``
   on a fresh group, on a thread, observed for 3 x the bound: on NCCL expected still blocked
   (the call never returned a ``Work``), on Gloo expected to raise within the bound;
2. ``fsdp2_ext``: ``broadcast_to_replicas`` on another fresh group with the same bound: expected
   to raise within the bound plus a margin, naming rank 0 as the leader.

Writes benchmarks/results/gpu_check_faults.json; exits 1 if ``fsdp2_ext`` did not raise within
the bound. ``--on-cpu`` runs the same code on ``cpu:gloo`` with CPU tensors.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "gpu_check_faults.json")
BOUND_S = 5.0
MARGIN_S = 10.0


def _rank(rank: int, port: int, on_cpu: bool, queue) -> None:
    from fsdp2_ext.init.replica_broadcast import broadcast_to_replicas

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "cpu:gloo" if on_cpu else "cpu:gloo,cuda:nccl"  # verl/utils/distributed.py
    # The group's own timeout is VERL's 30 minutes: only fsdp2_ext's bound may end the wait.
    dist.init_process_group(
        backend, rank=rank, world_size=2, timeout=datetime.timedelta(minutes=30)
    )
    device = torch.device("cpu") if on_cpu else torch.device("cuda", 0)
    if not on_cpu:
        torch.cuda.set_device(device)
    control_group = dist.new_group([0, 1], backend=backend)
    ddp_group = dist.new_group([0, 1], backend=backend)
    dist.barrier()  # on Gloo (the CPU backend): both ranks are up
    if rank == 0:  # the leader dies during its own load, before its first broadcast
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    tensor = torch.zeros(1 << 20, device=device)
    outcome: dict = {}

    def control() -> None:
        start = time.monotonic()
        try:
            work = dist.broadcast(tensor, src=0, group=control_group, async_op=True)
            outcome["control_returned_work_s"] = time.monotonic() - start
            work.wait(timeout=datetime.timedelta(seconds=BOUND_S))
            outcome["control"] = "completed"
        except Exception as error:  # noqa: BLE001 (any failure is the answer)
            outcome["control"] = f"raised: {type(error).__name__}: {str(error)[:200]}"
        outcome["control_s"] = time.monotonic() - start

    thread = threading.Thread(target=control, daemon=True)
    thread.start()
    thread.join(3 * BOUND_S)
    if thread.is_alive():
        outcome["control"] = f"still blocked after {3 * BOUND_S:.0f} s (3 x the bound)"
    start = time.monotonic()
    try:
        broadcast_to_replicas([tensor], group=ddp_group, bucket_bytes=64 << 20, timeout_s=BOUND_S)
        outcome["fsdp2_ext"] = "completed"
    except RuntimeError as error:
        outcome["fsdp2_ext"] = f"raised: {str(error)[:400]}"
    outcome["fsdp2_ext_s"] = time.monotonic() - start
    queue.put(outcome)
    sys.stdout.flush()
    os._exit(0)  # never wait on the stopped leader


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--on-cpu", action="store_true")
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    if not args.on_cpu and not torch.cuda.is_available():
        print("no GPU: run with --on-cpu to check the script itself", file=sys.stderr)
        return 1
    from fsdp2_ext.testing.spawn import free_port

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(r, port, args.on_cpu, queue)) for r in (0, 1)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 3 * BOUND_S + BOUND_S + MARGIN_S + 60
    while queue.empty() and time.monotonic() < deadline and processes[1].is_alive():
        time.sleep(0.2)
    outcome = queue.get() if not queue.empty() else {"fsdp2_ext": "no report from rank 1"}
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        process.join()
    outcome.update(
        device="cpu (gloo)" if args.on_cpu else torch.cuda.get_device_name(0),
        torch=torch.__version__,
        bound_s=BOUND_S,
    )
    ok = outcome["fsdp2_ext"].startswith("raised") and "rank 0" in outcome["fsdp2_ext"]
    ok = ok and outcome.get("fsdp2_ext_s", 1e9) < BOUND_S + MARGIN_S
    outcome["goal_met"] = ok
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(outcome, f, indent=2)
    print(json.dumps(outcome, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
