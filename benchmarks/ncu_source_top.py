"""The SASS instructions where a kernel's warps stall most, from an Nsight
Compute source-page CSV (``ncu -i r.ncu-rep --page source --csv --print-source
sass``): the top lines by warp-stall samples, with their stall reasons.

    python ncu_source_top.py source.csv [lines]
"""
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(path, top):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # The header is the first row naming the SASS text column.
    start = next(i for i, r in enumerate(rows) if "Source" in r)
    header, body = rows[start], rows[start + 1:]
    src = header.index("Source")
    samples = next(i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All"))
    # Per-reason sample columns, where the export has them.
    reasons = [i for i, h in enumerate(header) if "stall" in h.lower() and i != samples
               and "Sampling" not in h]
    total = sum(number(r[samples]) for r in body if len(r) > samples)
    print(f"{len(body)} SASS lines, {total:.0f} stall samples; columns: {len(header)}")
    print("reason columns:", [header[i] for i in reasons][:40])
    body.sort(key=lambda r: -number(r[samples]) if len(r) > samples else 0)
    for r in body[:top]:
        why = sorted(((number(r[i]), header[i]) for i in reasons if number(r[i]) > 0), reverse=True)[:4]
        print(f"{number(r[samples]) / total * 100:5.1f}%  {r[src][:70]:70s} "
              + " ".join(f"{h}={v:.0f}" for v, h in why))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
