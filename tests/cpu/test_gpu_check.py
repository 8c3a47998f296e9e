"""The checks that a GPU run and the compile tier cannot pass by skipping everything.

`tests/conftest.py` under ``JAX_MOE_PUBLISH_REQUIRE_GPU=1`` (which ``tools/gpu_check.sh``
sets) and `tests/compile/conftest.py` under ``JAX_MOE_PUBLISH_REQUIRE_CUTE_DSL=1`` (which
``.ci/run`` sets), each run in a pytest of its own on a tiny selection.

The GPU runs need no GPU: the plugin `FAKE_GPUS` tells the project's conftest how many GPUs
there are, and marks `test_stand_in_for_a_gpu_test` ``gpus(needs)``. The CuTe DSL runs hide
the installed package, or replace it with one that fails to import.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
STAND_IN = "tests/cpu/test_gpu_check.py::test_stand_in_for_a_gpu_test"
FAKE_GPUS = '''
"""The GPUs the project's conftest finds ($FAKE_GPUS), and gpus(needs) on the stand-in tests."""
import os

import pytest


@pytest.hookimpl(tryfirst=True)  # before the conftest's own hook reads the marks and counts
def pytest_collection_modifyitems(config, items):
    found = int(os.environ["FAKE_GPUS"])
    for plugin in config.pluginmanager.get_plugins():
        if hasattr(plugin, "RequireGpuTests"):
            plugin.local_gpu_count = lambda: found
    for item in items:
        if "needs" in getattr(getattr(item, "callspec", None), "params", {}):
            item.add_marker(pytest.mark.gpus(item.callspec.params["needs"]))
'''
# A CuTe DSL that is installed but broken, as a missing native part of it would be.
BROKEN_CUTLASS = 'raise ModuleNotFoundError("No module named \'cutlass._mlir\'", name="cutlass._mlir")\n'
# Runs pytest with the installed CuTe DSL (on sys.path by a .pth of nvidia-cutlass-dsl) hidden,
# and the folder argv[1] (where a broken one may be) first on sys.path.
HIDE_CUTE_DSL = '''
import sys
sys.path[:] = [sys.argv[1]] + [p for p in sys.path if not p.endswith("dsl_packages")]
import pytest
raise SystemExit(pytest.main(sys.argv[2:]))
'''


@pytest.mark.parametrize("needs", [1, 2])
def test_stand_in_for_a_gpu_test(needs):
    """A test that passes; the runs below mark it ``gpus(needs)``, so that it counts as a GPU test."""
    assert needs in (1, 2)


@pytest.mark.parametrize("needs", [1])
def test_stand_in_that_skips_inside_its_body(needs):
    """A GPU test (``gpus(needs)`` in the runs below) that finds what it needs missing only once
    it runs."""
    pytest.skip("stand-in: skipped inside the body")


def _environment(tmp_path, **variables) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("JAX_MOE_PUBLISH_REQUIRE_") and k != "JAX_MOE_PUBLISH_INSTALLED"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    env.update({k: str(v) for k, v in variables.items()})
    return env


def _gpu_run(tmp_path, *args, gpus: int, require: bool) -> subprocess.CompletedProcess:
    """pytest on ``args`` where the conftest finds ``gpus`` GPUs, with or without the switch."""
    (tmp_path / "fake_gpus.py").write_text(FAKE_GPUS)
    env = _environment(tmp_path, FAKE_GPUS=gpus, **({"JAX_MOE_PUBLISH_REQUIRE_GPU": 1} if require else {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "fake_gpus", "-q", "-rs",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def _output(run: subprocess.CompletedProcess) -> str:
    return f"exit code {run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"


def test_without_the_switch_a_gpu_test_skips_where_there_is_no_gpu(tmp_path):
    run = _gpu_run(tmp_path, "-m", "gpu", f"{STAND_IN}[1]", gpus=0, require=False)
    assert run.returncode == 0 and "1 skipped" in run.stdout, _output(run)
    assert "needs 1 NVIDIA GPU(s), found 0" in run.stdout, _output(run)


def test_the_switch_stops_a_run_that_finds_no_gpu(tmp_path):
    run = _gpu_run(tmp_path, "-m", "gpu", STAND_IN, gpus=0, require=True)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, _output(run)
    assert "CUDA finds no GPU" in run.stderr and "all 2 selected GPU test(s) would skip" in run.stderr, _output(run)


def test_the_switch_stops_a_run_that_selects_no_gpu_test(tmp_path):
    run = _gpu_run(tmp_path, "tests/cpu/test_gpu_check.py::test_without_the_switch_a_gpu_test_skips_where_there_is_no_gpu",
                   gpus=1, require=True)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, _output(run)
    assert "the selection holds no GPU test (1 test(s) selected)" in run.stderr, _output(run)


def test_the_switch_fails_a_run_whose_gpu_tests_all_skipped(tmp_path):
    """One GPU found, and the one test selected needs two: a skip, and with the switch a failure."""
    selection = ("-m", "gpu", f"{STAND_IN}[2]")
    run = _gpu_run(tmp_path, *selection, gpus=1, require=False)
    assert run.returncode == 0 and "needs 2 NVIDIA GPU(s), found 1" in run.stdout, _output(run)
    run = _gpu_run(tmp_path, *selection, gpus=1, require=True)
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, _output(run)
    assert "none of the 1 selected GPU test(s) passed its body: all skipped" in run.stdout, _output(run)


def test_the_switch_fails_a_run_whose_gpu_test_skipped_inside_its_body(tmp_path):
    """A skip inside the body is a report of the test's call too: it must not count as a run."""
    run = _gpu_run(tmp_path, "-m", "gpu", "tests/cpu/test_gpu_check.py::test_stand_in_that_skips_inside_its_body",
                   gpus=1, require=True)
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, _output(run)
    assert "none of the 1 selected GPU test(s) passed its body" in run.stdout, _output(run)


def test_with_the_switch_a_test_that_needs_more_gpus_still_skips(tmp_path):
    run = _gpu_run(tmp_path, "-m", "gpu", STAND_IN, gpus=1, require=True)
    assert run.returncode == 0 and "1 passed, 1 skipped" in run.stdout, _output(run)
    assert "needs 2 NVIDIA GPU(s), found 1" in run.stdout, _output(run)


def _gpu_check(tmp_path, *args, gpus: int, **variables) -> subprocess.CompletedProcess:
    """``bash tools/gpu_check.sh args`` with stand-ins for pip (which leaves ``pip-ran`` behind),
    nvidia-smi and the resource check (they need the GPU machine), and pytest run by this Python."""
    (tmp_path / "fake_gpus.py").write_text(FAKE_GPUS)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(f'#!/usr/bin/env bash\ncase "$1 ${{2:-}}" in "-m pip") touch {tmp_path}/pip-ran; exit 0;; esac\n'
                      f'case "$1" in */kernel_resources.py) exit 0;; esac\nexec {sys.executable} "$@"\n')
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, a stand-in GPU, 0'\n")
    for program in (python, smi):
        program.chmod(0o755)
    (tmp_path / "kernels").mkdir()
    env = _environment(tmp_path, FAKE_GPUS=gpus, PYTHON=python, JAX_MOE_PUBLISH_KERNEL_DIR=tmp_path / "kernels",
                       PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **variables)
    return subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "-p", "fake_gpus", "-p", "no:cacheprovider",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_gpu_check_fails_where_no_gpu_test_can_run(tmp_path):
    run = _gpu_check(tmp_path, STAND_IN, gpus=0)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, _output(run)
    assert "CUDA finds no GPU" in run.stderr, _output(run)


def test_gpu_check_passes_where_a_gpu_test_ran(tmp_path):
    run = _gpu_check(tmp_path, STAND_IN, gpus=1)
    assert run.returncode == 0 and "1 passed, 1 skipped" in run.stdout, _output(run)
    assert (tmp_path / "pip-ran").exists(), "gpu_check.sh did not install the package"


def test_gpu_check_leaves_the_install_to_the_caller_when_told(tmp_path):
    """Checks run side by side after one install must not install again."""
    run = _gpu_check(tmp_path, STAND_IN, gpus=1, JAX_MOE_PUBLISH_INSTALLED=1)
    assert run.returncode == 0 and "1 passed, 1 skipped" in run.stdout, _output(run)
    assert not (tmp_path / "pip-ran").exists(), "gpu_check.sh installed although told not to"


def _compile_tier_run(tmp_path, *, cutlass: str, require: bool) -> subprocess.CompletedProcess:
    """pytest on the compile tier's first module, with CuTe DSL "missing" or "broken"."""
    if cutlass == "broken":
        (tmp_path / "cutlass").mkdir()
        (tmp_path / "cutlass" / "__init__.py").write_text(BROKEN_CUTLASS)
    driver = tmp_path / "hide_cute_dsl.py"
    driver.write_text(HIDE_CUTE_DSL)
    env = _environment(tmp_path, **({"JAX_MOE_PUBLISH_REQUIRE_CUTE_DSL": 1} if require else {}))
    return subprocess.run([sys.executable, str(driver), str(tmp_path), "-p", "no:cacheprovider", "-q", "-rs",
                           "tests/compile/test_metadata.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_compile_tier_skips_without_cute_dsl_unless_required(tmp_path):
    run = _compile_tier_run(tmp_path, cutlass="missing", require=False)
    # A module-level skip leaves no test collected (exit code 5); nothing failed.
    assert run.returncode == pytest.ExitCode.NO_TESTS_COLLECTED and "1 skipped" in run.stdout, _output(run)
    run = _compile_tier_run(tmp_path, cutlass="missing", require=True)
    assert run.returncode == pytest.ExitCode.INTERRUPTED, _output(run)
    assert "CuTe DSL is not installed" in run.stdout and "1 error" in run.stdout, _output(run)


def test_the_compile_tier_fails_where_cute_dsl_is_installed_but_broken(tmp_path):
    run = _compile_tier_run(tmp_path, cutlass="broken", require=False)
    assert run.returncode == pytest.ExitCode.INTERRUPTED, _output(run)
    assert "CuTe DSL is installed, but 'import cutlass' fails" in run.stdout, _output(run)
    assert "cutlass._mlir" in run.stdout, _output(run)
