"""Compile tier (no GPU): every `benchmarks/*.cu` program compiles with the nvcc line its header
gives, and the CuTe DSL probe that `routing_time.cu` loads builds with the parameters it passes.

nvcc is taken from ``PATH``, else from ``$CUDA_HOME/bin`` or ``/usr/local/cuda/bin``, where the
CUDA toolkit installs it without always putting it on ``PATH``. Without it these tests skip and
say that the benchmark programs were not compiled, unless ``JAX_MOE_PUBLISH_REQUIRE_NVCC=1``
(``.ci/run`` sets it: the CI machine has the toolkit) says that this run must compile them; then
they fail.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SOURCES = sorted(BENCHMARKS.glob("*.cu"))
REQUIRE_NVCC = "JAX_MOE_PUBLISH_REQUIRE_NVCC"


@pytest.fixture(scope="module")
def nvcc() -> str:
    cuda_home = os.environ.get("CUDA_HOME")
    search = [os.environ.get("PATH"), cuda_home and f"{cuda_home}/bin", "/usr/local/cuda/bin"]
    found = shutil.which("nvcc", path=os.pathsep.join(filter(None, search)))
    if found is None:
        missing = ("the benchmark programs (benchmarks/*.cu) were not compiled: no nvcc on PATH, in $CUDA_HOME/bin "
                   f"(CUDA_HOME={cuda_home or 'unset'}) or in /usr/local/cuda/bin")
        if os.environ.get(REQUIRE_NVCC, "0") not in ("", "0"):
            pytest.fail(f"{missing}, and {REQUIRE_NVCC}=1 requires them: install the CUDA toolkit", pytrace=False)
        pytest.skip(f"{missing}; install the CUDA toolkit to compile them")
    return found


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}"


def _documented_build(source: pathlib.Path) -> list[str]:
    """The arguments of the ``//   nvcc ... -o NAME`` line in the program's header, without ``-o NAME``."""
    line = re.search(r"^//\s+nvcc (.+) -o \S+$", source.read_text(), re.MULTILINE)
    assert line, f"{source.name} gives no '//   nvcc ... -o NAME' build line in its header"
    return shlex.split(line.group(1))


@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_compiles_with_its_documented_line(nvcc, source, tmp_path):
    _run([nvcc, *_documented_build(source), "-o", str(tmp_path / source.stem)])


def test_pingpong_ptx_has_system_scope_acquire_and_release(nvcc, tmp_path):
    ptx = tmp_path / "nvlink_pingpong.ptx"
    _run([nvcc, "-std=c++17", "-arch=sm_90a", "-ptx", str(BENCHMARKS / "nvlink_pingpong.cu"), "-o", str(ptx)])
    text = ptx.read_text()
    for instruction in ("ld.acquire.sys", "st.release.sys"):
        assert instruction in text, f"{instruction} missing from the ping-pong's PTX"


def test_routing_probe_compiles_with_the_parameters_routing_time_passes():
    """`routing_probe.py` builds the kernel that ``routing_time.cu`` launches with (ids, totals, m)."""
    pytest.importorskip("cutlass")
    import jax_moe_publish as jmp
    from jax_moe_publish.aot.compile import ptx_entry_params

    spec = importlib.util.spec_from_file_location("routing_probe", BENCHMARKS / "routing_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    config = jmp.ExpertsConfig.for_shape(**probe.SHARDS["qwen3-30b-a3b"])
    cubin, symbol, threads, smem, ptx = probe.compile_probe(config)
    assert cubin and threads == config.gemm("gate_up").threads and smem > 0
    assert ptx_entry_params(ptx)[symbol] == ["u64", "u64", "u32"]
