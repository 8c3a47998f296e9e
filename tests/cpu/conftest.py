"""Real kernel sets and the CUDA tools that read them, for the CPU tests of the resource check
(`tools/kernel_resources.py`) and of the steps of `tools/multi_gpu_run.sh` that run it."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import kernel_resources  # noqa: E402

# Two small configs of `python -m jax_moe_publish.aot build`: one kernel, and two (publish, reduce).
KERNEL_SET_FLAGS = (
    ("--hidden", "2048", "--top-k", "1", "--tp", "1", "--algorithm", "direct"),
    ("--hidden", "2048", "--top-k", "8", "--tp", "2", "--algorithm", "oneshot"),
)


@pytest.fixture
def cuda_tools():
    """Skips where the resource check cannot run: cuobjdump, and the nvdisasm its ``-sass`` runs."""
    missing = [tool for tool in ("cuobjdump", "nvdisasm") if kernel_resources.cuda_tool(tool) is None]
    if missing:
        pytest.skip(f"the resource check needs {' and '.join(missing)} (the CUDA toolkit, or the "
                    "nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels), on PATH or in this Python")


@pytest.fixture(scope="session")
def kernel_sets(tmp_path_factory) -> pathlib.Path:
    """A folder of real kernel sets (cubin, PTX and sidecar each), as the AOT build writes them."""
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("building kernel sets needs CuTe DSL (the compile extra)")
    folder = tmp_path_factory.mktemp("kernel-sets")
    for flags in KERNEL_SET_FLAGS:
        subprocess.run([sys.executable, "-m", "jax_moe_publish.aot", "build", "--out", str(folder), *flags],
                       check=True, capture_output=True, timeout=600)
    return folder
