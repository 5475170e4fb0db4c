"""Where a profiled run's GPU time goes: kernels by name, busy time and idle gaps.

    python benchmarks/trace_summary.py TRACE [--per N] [--top 25]

``TRACE``: a ``perfetto_trace.json.gz`` written by
``jax.profiler.start_trace(dir, create_perfetto_trace=True)`` (for example by
``examples/smollm2/bench_decode.py --profile DIR``), or a directory searched
for one. ``--per N`` divides the times by N (the steps of the run) to give
time per step. Reads the kernels of the GPU processes (``/device:GPU:*``):
the span from the first kernel's start to the last one's end, the time some
kernel ran (the union of their intervals) and the rest (launch gaps, waits on
the host), then kernels grouped by name.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re


def load(path: pathlib.Path) -> list[dict]:
    if path.is_dir():
        found = sorted(path.rglob("perfetto_trace.json.gz"))
        if not found:
            raise SystemExit(f"no perfetto_trace.json.gz under {path}")
        path = found[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def kernel_events(events: list[dict]) -> list[dict]:
    """Complete ('X') events of the GPU processes, without the processes' own annotations."""
    gpu = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and e["args"]["name"].startswith("/device:GPU")}
    return [e for e in events if e.get("ph") == "X" and e["pid"] in gpu and e.get("dur", 0) > 0]


def group_name(name: str) -> str:
    """Fusion and loop names without their numeric suffixes (``fusion.123`` -> ``fusion``)."""
    return re.sub(r"[._]\d+$", "", name.split("(")[0].strip())[:80]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=pathlib.Path)
    parser.add_argument("--per", type=int, default=1, help="divide times by this (steps)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)

    kernels = kernel_events(load(args.trace))
    if not kernels:
        raise SystemExit("no GPU kernels in the trace (a CPU-only run?)")
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in kernels]
    span = max(b for _, b in intervals) - min(a for a, _ in intervals)
    busy = union_length(intervals)
    per = args.per
    print(f"{len(kernels) / per:.0f} kernels, span {span / per:.1f} us, busy {busy / per:.1f} us, "
          f"idle {(span - busy) / per:.1f} us ({(span - busy) / span:.0%}) per {per} step(s)"
          if per > 1 else
          f"{len(kernels)} kernels, span {span:.1f} us, busy {busy:.1f} us, "
          f"idle {span - busy:.1f} us ({(span - busy) / span:.0%})")
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        groups[group_name(e["name"])].append(e["dur"])
    print(f"{'kernel':80s} {'count':>7s} {'us':>9s} {'mean us':>8s} {'share':>6s}")
    total = sum(e["dur"] for e in kernels)
    for name, durs in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
        print(f"{name:80s} {len(durs) / per:7.1f} {sum(durs) / per:9.1f} "
              f"{sum(durs) / len(durs):8.2f} {sum(durs) / total:6.1%}")


if __name__ == "__main__":
    main()
