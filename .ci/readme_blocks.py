"""Runs every ```python block of README.md, each in a fresh interpreter, so the README cannot rot.

    python .ci/readme_blocks.py README.md

Each block must be self-contained. They run with 8 host CPU devices (the
sharding block splits over them) from a temporary directory, so the
installed jax_marlin is imported. Exits 1 if any block fails.
"""

import os
import re
import subprocess
import sys
import tempfile
import time


def main(readme: str) -> int:
    text = open(readme).read()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, code in enumerate(blocks, 1):
            first = code.strip().splitlines()[0]
            t0 = time.perf_counter()
            run = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp, env=env,
                                 capture_output=True, text=True)
            status = "ok" if run.returncode == 0 else "FAILED"
            print(f"README block {i} ({first}): {status} in {time.perf_counter() - t0:.1f} s")
            if run.returncode:
                failed += 1
                print(run.stdout[-3000:], run.stderr[-3000:], sep="\n")
            elif run.stdout.strip():
                print("  " + run.stdout.strip().replace("\n", "\n  "))
    print(f"{len(blocks)} README blocks, {failed} failed")
    return 1 if failed or not blocks else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "README.md"))
