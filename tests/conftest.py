"""Test setup: virtual CPU devices for the sharded CPU tests, and GPU discovery for ``gpu`` tests.

The tiers are folders: ``cpu/`` (CI), ``compile/`` (needs CuTe DSL, no GPU), ``gpu/``
(marked ``gpu``); ``support/`` holds the modules and child programs they share, importable
by name from every test.

GPU tests are marked ``@pytest.mark.gpu`` and declare how many GPUs they need
with the ``gpus`` fixture's parameter (``@pytest.mark.gpus(2)``); they skip,
with the reason, where there are fewer.

With ``JAX_MOE_PUBLISH_REQUIRE_GPU=1`` (``tools/gpu_check.sh`` sets it) a run must run
GPU tests (`RequireGpuTests`): a test that needs more GPUs than were found still skips,
but a run that selects no GPU test, finds no GPU, or skips every GPU test it selected fails.
"""

from __future__ import annotations

import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "support"))

# Before JAX starts: four virtual CPU devices for shard_map tests on the CPU.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import pytest

from jax_moe_publish.testing.local_processes import local_gpu_count

REQUIRE_GPU = "JAX_MOE_PUBLISH_REQUIRE_GPU"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs at least n NVIDIA GPUs (implies gpu)")
    if os.environ.get(REQUIRE_GPU, "0") not in ("", "0") and not config.option.collectonly:
        config.pluginmanager.register(RequireGpuTests(), "require-gpu-tests")


def pytest_collection_modifyitems(config, items):
    available = local_gpu_count()
    for item in items:
        needs = item.get_closest_marker("gpus")
        if needs is None and item.get_closest_marker("gpu") is None:
            continue
        required = needs.args[0] if needs is not None else 1
        if needs is not None:
            item.add_marker(pytest.mark.gpu)
        if available < required:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {required} NVIDIA GPU(s), found {available}"
            ))


def _why_no_gpu() -> str:
    """The driver's answer where `local_gpu_count` found no GPU (it returns only 0)."""
    try:
        from cuda.bindings import driver

        (error,) = driver.cuInit(0)
        if error != driver.CUresult.CUDA_SUCCESS:
            return f"cuInit(0) returned {error.name}"
        error, count = driver.cuDeviceGetCount()
        return f"cuDeviceGetCount returned {error.name} and {count} device(s)"
    except Exception as error:  # the bindings raise when libcuda itself is missing
        return f"the CUDA driver did not load: {type(error).__name__}: {error}"


class RequireGpuTests:
    """The checks of ``JAX_MOE_PUBLISH_REQUIRE_GPU=1``, so that a GPU run cannot pass without
    running a GPU test.

    * After the selection (``-m``, ``-k``, paths): no ``gpu`` test selected, or no GPU found,
      stops the run with a usage error, before any test runs.
    * At the end: the run fails if no ``gpu`` test ran its body (every one skipped).
    """

    def __init__(self) -> None:
        self.selected = 0
        self.ran = 0
        self.failure: str | None = None

    @pytest.hookimpl(trylast=True)  # after -m and -k have deselected
    def pytest_collection_modifyitems(self, items):
        gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
        self.selected = len(gpu_items)
        if not gpu_items:
            raise pytest.UsageError(
                f"{REQUIRE_GPU}=1, but the selection holds no GPU test ({len(items)} test(s) selected)"
            )
        if local_gpu_count() == 0:
            raise pytest.UsageError(
                f"{REQUIRE_GPU}=1, but CUDA finds no GPU ({_why_no_gpu()}): all {len(gpu_items)} "
                "selected GPU test(s) would skip"
            )

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and "gpu" in report.keywords:
            self.ran += 1

    def pytest_sessionfinish(self, session):
        if self.ran == 0 and session.exitstatus == pytest.ExitCode.OK:
            self.failure = (f"{REQUIRE_GPU}=1, but none of the {self.selected} selected GPU test(s) ran: "
                            "all skipped (see the skip reasons)")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        if self.failure is not None:
            terminalreporter.section("GPU tests required", sep="=", red=True)
            terminalreporter.line(self.failure)


@pytest.fixture(scope="session")
def devices():
    """The kernel harness's GPUs (`gpu_harness.DevicePool`), shared by every test that launches
    cubins: a group of tp ranks runs on real GPUs where there are tp, else with virtual ranks."""
    import gpu_harness

    pool = gpu_harness.DevicePool()
    yield pool
    pool.close()
