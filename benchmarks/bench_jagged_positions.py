"""Jagged position IDs: fsdp2_ext.positions vs the shape-inferring Python path, side by side.

    python benchmarks/bench_jagged_positions.py            # B = 64, C = 4, lengths ~ U(1k, 4k)

One round = build from a right-padded (B, C, L) batch + mask, split into samples, back to padded,
and a serialisation round trip through pickle. The shape-inferring path is what VERL does today
(list of mask slices -> as_nested_tensor, unbind, to_padded_tensor; serialised as a list of
unbound samples and rebuilt with as_nested_tensor); ours keeps (values, offsets, ragged_idx). Both must give identical
samples and padded tensors. Writes benchmarks/results/jagged_positions.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import time

import torch

from fsdp2_ext import positions

RESULTS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results", "jagged_positions.json"
)


def make_batch(batch: int, rows: int, low: int, high: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (batch,), generator=generator)
    width = int(lengths.max())
    padded = torch.zeros(batch, rows, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, length in enumerate(lengths.tolist()):
        padded[b, :, :length] = torch.arange(length).expand(rows, length) + b
        mask[b, :length] = 1
    return padded, mask


def ours(padded, mask):
    nested = positions.nested_from_padded(padded, mask)
    samples = positions.unbind(nested)
    back = positions.to_padded(nested, 0, max_len=padded.shape[-1])
    positions.deserialize(pickle.loads(pickle.dumps(positions.serialize(nested))))
    return samples, back


def shape_inferring(padded, mask):
    slices = [padded[b][:, mask[b].bool()] for b in range(padded.shape[0])]
    nested = torch.nested.as_nested_tensor(slices, layout=torch.jagged)
    samples = list(nested.unbind())
    back = torch.nested.to_padded_tensor(nested, 0, output_size=tuple(padded.shape))
    # VERL's serialize_tensordict / deserialize_tensordict: each unbound sample as contiguous bytes,
    # rebuilt with as_nested_tensor (which re-infers the ragged axis).
    payload = [
        (t.dtype, t.shape, t.flatten().contiguous().view(torch.uint8).numpy()) for t in samples
    ]
    restored = [
        torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)
        for dtype, shape, data in pickle.loads(pickle.dumps(payload))
    ]
    torch.nested.as_nested_tensor(restored, layout=torch.jagged)
    return samples, back


def timed(fn, padded, mask, repeats):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(padded, mask)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=1000)
    parser.add_argument("--max-len", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args()
    padded, mask = make_batch(args.batch, args.rows, args.min_len, args.max_len)
    ours(padded, mask), shape_inferring(padded, mask)  # warm-up
    ours_s, (ours_samples, ours_back) = timed(ours, padded, mask, args.repeats)
    theirs_s, (their_samples, their_back) = timed(shape_inferring, padded, mask, args.repeats)
    exact = torch.equal(ours_back, their_back) and torch.equal(
        ours_back, padded * mask.unsqueeze(1)
    )
    exact = exact and all(torch.equal(a, b) for a, b in zip(ours_samples, their_samples))
    print(
        f"jagged positions, B={args.batch}, C={args.rows}, L~U({args.min_len}, {args.max_len}), median of {args.repeats}"
    )
    print(f"  fsdp2_ext        {ours_s * 1e3:8.2f} ms")
    print(f"  shape_inferring  {theirs_s * 1e3:8.2f} ms   ({theirs_s / ours_s:.2f}x ours)")
    print(f"  identical results: {exact}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(
            {
                "methods": {
                    "fsdp2_ext": {"wall_s": ours_s},
                    "shape_inferring": {"wall_s": theirs_s},
                },
                "exact": exact,
            },
            handle,
            indent=2,
        )
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
