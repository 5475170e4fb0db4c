"""benchmarks/nvcc_cache/nvcc: the compile cache that GPU runs take prebuilt objects from.

A stale hit would time an old kernel under a new name, so the key must change
with every input that changes the object: the source, a header beside it or
in an -I folder, the arguments. Needs nvcc (skipped without it).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

WRAPPER = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "nvcc_cache" / "nvcc"


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc",
                      "/usr/local/cuda-13.0/bin/nvcc"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="no nvcc")


@pytest.fixture
def project(tmp_path):
    """A source with a header beside it and one in an -I folder, and the wrapper's environment."""
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "scale.cuh").write_text("#define SCALE 2.0f\n")
    (tmp_path / "offset.h").write_text("#define OFFSET 1.0f\n")
    (tmp_path / "k.cu").write_text(
        '#include "scale.cuh"\n#include "offset.h"\n'
        "__global__ void k(float *x) { x[threadIdx.x] = x[threadIdx.x] * SCALE + OFFSET; }\n")
    env = dict(os.environ, PATH=f"{WRAPPER.parent}{os.pathsep}{os.path.dirname(NVCC)}{os.pathsep}"
               f"{os.environ.get('PATH', '')}", NVCC_CACHE=str(tmp_path / "cache"),
               NVCC_CACHE_LOG=str(tmp_path / "log"), NVCC_CACHE_WRITE="1")
    return tmp_path, env


def compile_k(tmp_path, env, out="k.o", extra=()):
    args = [str(WRAPPER), "-arch=sm_90", "-Xptxas", "-v", "-Iinc", *extra, "-c", "k.cu", "-o", out]
    r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, check=True)
    return (tmp_path / out).read_bytes(), r.stderr


def log_kinds(tmp_path):
    return [line.split()[0] for line in (tmp_path / "log").read_text().splitlines()]


def test_hit_returns_the_compiled_object_and_its_report(project):
    tmp_path, env = project
    first, report = compile_k(tmp_path, env)
    assert b"registers" in report  # ptxas -v's report
    again, replayed = compile_k(tmp_path, env, out="k2.o")  # another output path: same object
    assert log_kinds(tmp_path) == ["miss", "hit"]
    # (Bit for bit the stored object: two real compiles differ in the temporary
    # file names nvcc embeds.)
    assert again == first and replayed == report


@pytest.mark.parametrize("edit", ["source", "header beside", "header in -I", "argument"])
def test_every_input_is_in_the_key(project, edit):
    tmp_path, env = project
    before, _ = compile_k(tmp_path, env)
    extra = ()
    if edit == "source":
        (tmp_path / "k.cu").write_text((tmp_path / "k.cu").read_text() + "__global__ void j() {}\n")
    elif edit == "header beside":
        (tmp_path / "offset.h").write_text("#define OFFSET 3.0f\n")
    elif edit == "header in -I":
        (tmp_path / "inc" / "scale.cuh").write_text("#define SCALE 4.0f\n")
    else:
        extra = ("-DUNUSED=1", "-O0")
    after, _ = compile_k(tmp_path, env, extra=extra)
    assert log_kinds(tmp_path) == ["miss", "miss"]
    assert len(list((tmp_path / "cache").iterdir())) == 2
    if edit != "argument":
        assert after != before


def test_nothing_stored_without_write_and_links_pass_through(project):
    tmp_path, env = project
    env = dict(env, NVCC_CACHE_WRITE="0")
    compile_k(tmp_path, env)
    compile_k(tmp_path, env)
    assert log_kinds(tmp_path) == ["miss", "miss"]
    assert not any(p.is_dir() for p in (tmp_path / "cache").iterdir())
    r = subprocess.run([str(WRAPPER), "--version"], env=env, capture_output=True, text=True, check=True)
    assert "Cuda compilation tools" in r.stdout and log_kinds(tmp_path)[-1] == "pass"
