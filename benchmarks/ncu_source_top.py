"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's
source page exported as CSV (``ncu -i r.ncu-rep --page source --csv
--print-source sass``; several such exports may be concatenated).

For each kernel in the file: the stall samples by reason, the same for the
main loop alone (the instructions executed as often as the most executed
HGMMA, i.e. once per warp and stage in the prefill kernel), the samples by
kind of instruction, and the top lines.

    python ncu_source_top.py source.csv [lines]
"""
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def kernels(path):
    """[(name, header, rows)] for each kernel of the export."""
    out, name, header = [], "", None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                name = row[1]
            elif "Source" in row and SAMPLES in row:
                header = row
                out.append((name, header, []))
            elif header is not None and out:
                out[-1][2].append(row)
    return out


def kind(source, after_trywait):
    """A coarse class of a SASS line: what a stall there is waiting on.
    `after_trywait`: the line is at most 3 after an mbarrier try_wait (the
    branch that retries it sits there)."""
    op = re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split(" ")[0]
    if op.startswith("SYNCS") or (op == "BRA" and after_trywait):
        return "mbarrier wait"
    if op.startswith("HGMMA"):
        return "HGMMA"
    if op.startswith("HMMA"):
        return "HMMA"
    if op.startswith("WARPGROUP"):
        return "WARPGROUP arrive/depbar"
    if op.startswith("MEMBAR") or op in ("ERRBAR", "CCTL"):
        return "memory fence"
    if op in ("LOP3.LUT", "HADD2", "HFMA2", "HMUL2", "PRMT") or op.startswith("SHF"):
        return "dequantization ALU"
    if op.startswith("LDS") or op.startswith("LDSM"):
        return "shared load"
    if op.startswith(("LDG", "STG", "ATOMG", "RED")):
        return "global " + op.split(".")[0]
    if op.startswith("U"):
        return "uniform datapath"
    return "other"


def summarize(name, header, rows, top):
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

    def get(row, h):
        return number(row[col[h]]) if col.get(h, len(row)) < len(row) else 0.0

    total = sum(get(r, SAMPLES) for r in rows) or 1.0
    print(f"\n== {re.sub(r'^void ', '', name)[:110]}")
    executed = sum(get(r, EXECUTED) for r in rows)
    print(f"{len(rows)} SASS lines, {executed:.0f} warp instructions executed, {total:.0f} stall samples")

    def by_reason(subset):
        sums = collections.Counter({h[6:]: sum(get(r, h) for r in subset) for h in reasons})
        part = sum(sums.values()) or 1.0
        return ", ".join(f"{h} {v / part * 100:.0f}%" for h, v in sums.most_common(8) if v)

    print("  all samples by reason:", by_reason(rows))
    mma = [get(r, EXECUTED) for r in rows if re.search(r"\bHG?MMA", r[col["Source"]])]
    if mma:
        most = max(mma)
        where = [i for i, r in enumerate(rows) if get(r, EXECUTED) == most]
        loop = rows[min(where):max(where) + 1]
        part = sum(get(r, SAMPLES) for r in loop)
        print(f"  main loop: {len(loop)} instructions, executed {most:.0f} times each, "
              f"{part / total * 100:.0f}% of the samples; by reason: {by_reason(loop)}")
    kinds, since_trywait = collections.Counter(), 99
    for r in rows:
        since_trywait = 0 if "TRYWAIT" in r[col["Source"]] else since_trywait + 1
        kinds[kind(r[col["Source"]], since_trywait <= 3)] += get(r, SAMPLES)
    print("  by instruction: " + ", ".join(f"{k} {v / total * 100:.1f}%"
                                          for k, v in kinds.most_common(10)))
    for r in sorted(rows, key=lambda r: -get(r, SAMPLES))[:top]:
        why = sorted(((get(r, h), h[6:]) for h in reasons if get(r, h) > 0), reverse=True)[:4]
        print(f"  {get(r, SAMPLES) / total * 100:5.1f}%  {r[col['Source']].strip()[:64]:64s} "
              + " ".join(f"{h}={v:.0f}" for v, h in why))


def main(path, top):
    for name, header, rows in kernels(path):
        summarize(name, header, rows, top)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25)
