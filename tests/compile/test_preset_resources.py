"""Compile tier (CPU, CI): no experts kernel that a preset ships spills or uses local memory
(``tools/kernel_resources.py`` on the preset builds' cubins). ptxas chooses the experts kernels'
register budget itself, and at some shard shapes it chose one that spilled (benchmarks/EXPERIMENTS.md);
`ExpertsConfig.for_shape` steers around those, and this check keeps it so."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import kernel_resources  # noqa: E402


def test_no_preset_experts_kernel_spills(preset_folder):
    if kernel_resources.cuda_tool("cuobjdump") is None or kernel_resources.cuda_tool("nvdisasm") is None:
        pytest.skip("the resource check needs cuobjdump and nvdisasm (the nvidia-cuda-cuobjdump and "
                    "nvidia-cuda-nvdisasm wheels, or the CUDA toolkit)")
    run = subprocess.run([sys.executable, str(REPO / "tools" / "kernel_resources.py"), str(preset_folder),
                          "--filter", "experts-"], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "checked" in run.stdout and " of 0 " not in run.stdout
