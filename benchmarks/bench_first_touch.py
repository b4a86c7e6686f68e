"""What fresh memory costs on this host: first touch of newly allocated pages, chunk by chunk.

    python benchmarks/bench_first_touch.py                  # 6 GiB in 64 MiB chunks, twice
    python benchmarks/bench_first_touch.py --gib 4 --settle-s 0

Every load ends in fresh memory (a rank's shards), so its per-byte cost includes the kernel's page
faults on first touch. On a VM with free page reporting (virtio-balloon; ``page_reporting_order``
below) the guest hands free memory back to the host, and touching it again also takes a host
fault: the same allocation runs at two rates, depending on how much free memory the host still
backs, which this guest cannot see. One process allocates ``--gib`` in chunks and writes each
once (``fill_``, one thread), after ``--settle-s`` seconds in which memory freed earlier is
reported; printed: the rate of every chunk, the fast and slow rates, and how much of the pass
ran fast. Writes benchmarks/results/first_touch.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "first_touch.json")
REPORTING_ORDER = "/sys/module/page_reporting/parameters/page_reporting_order"
CHUNK = 64 << 20


def page_reporting_order() -> int | None:
    """The smallest free block (as a page order) the guest reports to the host; None: no reporting."""
    try:
        with open(REPORTING_ORDER) as f:
            return int(f.read())
    except OSError:
        return None


def touch_rates(gib: float) -> list[float]:
    """GB/s of allocating and writing each chunk once, chunks kept alive to the end."""
    torch.set_num_threads(1)
    kept, rates = [], []
    for _ in range(int(gib * 2**30 // CHUNK)):
        start = time.perf_counter()
        chunk = torch.empty(CHUNK, dtype=torch.uint8)
        chunk.fill_(1)
        rates.append(CHUNK / (time.perf_counter() - start) / 1e9)
        kept.append(chunk)
    return rates


def summarise(rates: list[float]) -> dict:
    """Fast and slow rates split at half the best chunk's rate."""
    split = max(rates) / 2
    fast = [r for r in rates if r >= split]
    slow = [r for r in rates if r < split]
    return {
        "fast_gb_s": statistics.median(fast),
        "slow_gb_s": statistics.median(slow) if slow else None,
        "slow_share": len(slow) / len(rates),
        "fast_gib": len(fast) * CHUNK / 2**30,
        "chunk_gb_s": rates,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=6.0, help="fresh memory per pass, GiB")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--settle-s", type=float, default=30.0,
                        help="idle seconds before each pass (freed memory gets reported)")  # fmt: skip
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    order = page_reporting_order()
    print(f"free page reporting: {'off' if order is None else f'on, blocks of order >= {order}'}")
    passes = []
    for index in range(args.passes):
        time.sleep(args.settle_s)
        result = summarise(touch_rates(args.gib))
        passes.append(result)
        slow = "none" if result["slow_gb_s"] is None else f"{result['slow_gb_s']:.2f} GB/s"
        print(
            f"pass {index + 1}: fast {result['fast_gb_s']:.2f} GB/s, slow {slow}, "
            f"{result['slow_share']:.0%} of chunks slow ({result['fast_gib']:.2f} GiB fast)"
        )
        print("  " + " ".join(f"{r:.1f}" for r in result["chunk_gb_s"]))
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"page_reporting_order": order, "gib": args.gib, "passes": passes}, f, indent=2)
        f.write("\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
