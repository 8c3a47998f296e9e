"""`tools/kernel_resources.py` on real cubins: a folder without its PTX (as
``tools/multi_gpu_run.sh build`` leaves it) is checked, a kernel that spills fails, and what
cannot be checked is said so, with its own exit status, never as spills."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import kernel_resources
import pytest

# A kernel that ptxas must spill (48 live floats in at most 32 registers) beside one that need not.
SPILLING_CUDA = r"""
extern "C" __global__ void __launch_bounds__(1024, 2) spills(float *out, const float *in) {
    float acc[48];
#pragma unroll
    for (int j = 0; j < 48; ++j) acc[j] = in[threadIdx.x * 48 + j];
#pragma unroll
    for (int k = 0; k < 8; ++k)
#pragma unroll
        for (int j = 0; j < 48; ++j) acc[j] = acc[j] * acc[(j + k) % 48] + in[j * k];
    float sum = 0;
#pragma unroll
    for (int j = 0; j < 48; ++j) sum += acc[j];
    out[threadIdx.x] = sum;
}
extern "C" __global__ void clean(float4 *out) { out[threadIdx.x] = make_float4(1, 2, 3, 4); }
"""


def check(folder, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, kernel_resources.__file__, str(folder), *args], capture_output=True,
                          text=True, timeout=300)


def output(run: subprocess.CompletedProcess) -> str:
    return f"exit code {run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"


def without_ptx(kernel_sets, folder):
    """A copy of the kernel sets with their PTX deleted, as the build step leaves them."""
    shutil.copytree(kernel_sets, folder)
    for ptx in folder.glob("*.ptx"):
        ptx.unlink()
    return folder


def test_a_folder_without_ptx_is_checked_from_its_cubins(cuda_tools, kernel_sets, tmp_path):
    folder = without_ptx(kernel_sets, tmp_path / "kernels")
    report = tmp_path / "report.json"
    run = check(folder, "--json", str(report))
    assert run.returncode == 0, output(run)
    sets = sorted(p.stem for p in folder.glob("*.json"))
    assert f"checked {len(sets)} of {len(sets)} kernel sets" in run.stdout, output(run)
    data = json.loads(report.read_text())
    assert sorted(data) == sets
    for entry in data.values():
        for kernel, usage in entry["resources"].items():
            assert usage["registers"] > 0 and usage["stack"] == usage["local"] == 0, (kernel, usage)
            assert any(op.startswith("STG") for op in entry["sass"][kernel]), (kernel, entry["sass"])
    assert "CANNOT CHECK" not in run.stdout and "SPILLS" not in run.stdout, output(run)


def test_a_spilling_kernel_fails_the_check(cuda_tools, tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("compiling the spilling kernel needs nvcc")
    source = tmp_path / "spills.cu"
    source.write_text(SPILLING_CUDA)
    folder = tmp_path / "kernels"
    folder.mkdir()
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-maxrregcount=32", str(source), "-o",
                    str(folder / "spills.cubin")], check=True, capture_output=True, timeout=300)
    (folder / "spills.json").write_text("{}")
    report = tmp_path / "report.json"
    run = check(folder, "--json", str(report))
    assert run.returncode == kernel_resources.SPILLS, output(run)
    findings = [line for line in run.stdout.splitlines() if line.startswith("SPILLS OR LOCAL MEMORY")]
    assert len(findings) == 1 and "spills spills:" in findings[0], output(run)
    assert "CANNOT CHECK" not in run.stdout, output(run)
    spills = json.loads(report.read_text())["spills"]
    assert spills["resources"]["spills"]["stack"] > 0 and spills["resources"]["clean"]["stack"] == 0, spills
    # Both opcodes, plain (32-bit) and wide: each alone fails a kernel, stack frame or not.
    assert {"STL.32-", "LDL.32-", "STL.64"} <= set(spills["sass"]["spills"]), spills["sass"]
    assert not any(op[:3] in ("LDL", "STL") for op in spills["sass"]["clean"]), spills["sass"]


def test_a_set_without_its_cubin_cannot_be_checked(cuda_tools, kernel_sets, tmp_path):
    folder = without_ptx(kernel_sets, tmp_path / "kernels")
    cubin = sorted(folder.glob("*.cubin"))[0]
    cubin.unlink()
    run = check(folder)
    assert run.returncode == kernel_resources.CANNOT_CHECK, output(run)
    assert f"CANNOT CHECK: {cubin.stem}.json has no {cubin.name}" in run.stdout, output(run)
    assert "SPILLS" not in run.stdout and " regs " in run.stdout, output(run)  # the other set is checked


@pytest.mark.parametrize("what, expected", [
    ("no cuobjdump", "CANNOT CHECK: cuobjdump not found"),
    ("no kernel set", "CANNOT CHECK: no kernel set"),
    ("cuobjdump failing", "CANNOT CHECK: cuobjdump -res-usage a.cubin failed (exit 1)"),
])
def test_what_cannot_be_checked_is_not_reported_as_spills(what, expected, tmp_path, monkeypatch, capsys):
    """In process, with ``false`` standing in for a cuobjdump that fails."""
    monkeypatch.setattr(kernel_resources, "cuda_tool", lambda name: None if what == "no cuobjdump" else "false")
    if what == "cuobjdump failing":
        (tmp_path / "a.json").write_text("{}")
        (tmp_path / "a.cubin").write_bytes(b"")
    monkeypatch.setattr(sys, "argv", ["kernel_resources.py", str(tmp_path)])
    assert kernel_resources.main() == kernel_resources.CANNOT_CHECK
    printed = capsys.readouterr().out
    assert expected in printed and "SPILLS" not in printed, printed
