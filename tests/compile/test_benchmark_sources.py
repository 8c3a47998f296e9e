"""Compile tier (no GPU): every `benchmarks/*.cu` program compiles with nvcc for sm_90a."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
SOURCES = sorted(BENCHMARKS.glob("*.cu"))
NVCC_FLAGS = ["-O3", "-std=c++17", "-arch=sm_90a"]


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH: the benchmark programs need the CUDA toolkit to compile")
    return nvcc


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}"


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles(source, tmp_path):
    _run([_nvcc(), *NVCC_FLAGS, str(source), "-o", str(tmp_path / source.stem)])


def test_pingpong_ptx_has_system_scope_acquire_and_release(tmp_path):
    ptx = tmp_path / "nvlink_pingpong.ptx"
    _run([_nvcc(), "-std=c++17", "-arch=sm_90a", "-ptx", str(BENCHMARKS / "nvlink_pingpong.cu"), "-o", str(ptx)])
    text = ptx.read_text()
    for instruction in ("ld.acquire.sys", "st.release.sys"):
        assert instruction in text, f"{instruction} missing from the ping-pong's PTX"
