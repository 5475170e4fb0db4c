"""Fails if a decode-kernel instance that should run two blocks per SM uses more than 128 registers.

The decode kernel streams weights into registers; how many bytes are in
flight depends on how many blocks of 8 warps share an SM, which the register
count decides (65536 / (256 threads x 128) = 2). ffi/decode_kernel.cu holds
the instances that fit (`fits_128`: m <= 8 with g128, g-1, or g64 without
zero points) to 128 with their launch bounds; a change of those bounds once
let ptxas give the plain ones 141-155 registers, one block per SM, and every
decode call at m <= 8 ran up to 2x slower until a GPU run showed it
(benchmarks/NOTES.md, 2026-12-06). This check compiles the file with
`-Xptxas -v` (no GPU needed) and also fails on any spill.

    python .ci/decode_registers.py [nvcc]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile

# decode_kernel<scalar_t, group_blocks, m_halves, has_zeros, kStream, kFused, kEarly>, mangled.
INSTANCE = re.compile(
    r"decode_kernelI(6__half|13__nv_bfloat16)L(in?\d+)ELi(\d)ELb([01])ELb([01])ELb([01])ELb([01])E")


def group_blocks(mangled: str) -> int:
    """``i8`` -> 8, ``in1`` -> -1 (Itanium mangling of a negative int)."""
    return -int(mangled[2:]) if mangled.startswith("in") else int(mangled[1:])


def fits_128(groups: int, m_halves: int, zeros: bool) -> bool:
    """The rule of ffi/decode_kernel.cu's fits_128."""
    return m_halves == 1 and (groups in (8, -1) or (groups == 4 and not zeros))


def main() -> int:
    nvcc = sys.argv[1] if len(sys.argv) > 1 else "nvcc"
    with tempfile.NamedTemporaryFile(suffix=".o") as obj:
        run = subprocess.run([nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90",
                              "-Iffi", "-Xptxas", "-v", "-c", "ffi/decode_kernel.cu", "-o", obj.name],
                             capture_output=True, text=True)
    if run.returncode:
        print(run.stdout + run.stderr)
        return run.returncode
    bad, seen, instance = [], 0, None
    for line in run.stderr.splitlines():
        if m := INSTANCE.search(line):
            if "Compiling entry function" in line:
                scalar, g, mh, z, stream, fused, early = m.groups()
                instance = ("half" if scalar == "6__half" else "bf16", group_blocks(g), int(mh),
                            z == "1", stream == "1", fused == "1", early == "1")
            continue
        if instance and (spill := re.search(r"(\d+) bytes spill stores", line)) and int(spill.group(1)):
            bad.append(f"{instance}: {spill.group(1)} bytes of spill stores")
        if instance and (regs := re.search(r"Used (\d+) registers", line)):
            seen += 1
            if fits_128(instance[1], instance[2], instance[3]) and int(regs.group(1)) > 128:
                bad.append(f"{instance}: {regs.group(1)} registers, more than 128 "
                           "(one block per SM instead of two)")
            instance = None
    print(f"decode kernel: {seen} instances compiled; "
          "(scalar, group_blocks, m_halves, zeros, long-stream, fused, early weights)")
    for b in bad:
        print("  " + b)
    if seen == 0:
        print("  no instance found in ptxas's output: the check's pattern no longer matches")
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
