"""Test setup: virtual CPU devices for the sharded CPU tests, and GPU discovery for ``gpu`` tests.

The tiers are folders: ``cpu/`` (CI), ``compile/`` (needs CuTe DSL, no GPU), ``gpu/``
(marked ``gpu``); ``support/`` holds the modules they share, importable by name from every
test, and ``programs/`` the child programs that tests and tools run in processes of their own
(no ``test_`` file names: pytest collects nothing there).

GPU tests are marked ``@pytest.mark.gpu`` and declare how many GPUs they need
with the ``gpus`` fixture's parameter (``@pytest.mark.gpus(2)``); they skip,
with the reason, where there are fewer.

A GPU test that is also marked ``rank_processes`` does not skip where it needs more GPUs than
there are: it runs as one process per rank on the GPUs there are (`rank_runs`). Each test's
random data comes from the ``rng`` fixture: fresh for every test, and the same in every rank
process of one run.

With ``JAX_MOE_PUBLISH_REQUIRE_GPU=1`` (``tools/gpu_check.sh`` sets it) a run must run
GPU tests (`RequireGpuTests`): a test that needs more GPUs than were found still skips,
but a run that selects no GPU test, finds no GPU, or passes no GPU test's body fails.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import sys
import zlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "support"))

import numpy as np
import pytest

import rank_runs
from jax_moe_publish.testing import rank_processes
from jax_moe_publish.testing.local_processes import local_gpu_count

# Before JAX starts: four virtual CPU devices for shard_map tests on the CPU (a rank process
# has one device).
if ("xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
        and rank_processes.RankProcess.from_environment() is None):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

REQUIRE_GPU = "JAX_MOE_PUBLISH_REQUIRE_GPU"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs at least n NVIDIA GPUs (implies gpu)")
    config.addinivalue_line("markers", f"{rank_runs.MARKER}: on fewer GPUs than it needs, runs as one "
                                       "process per rank (tests/support/rank_runs.py)")
    rank = rank_processes.join()
    if rank is not None:
        config.pluginmanager.register(rank_runs.Child(rank), "rank-process-child")
    elif not config.option.collectonly:
        config.pluginmanager.register(rank_runs.Batches(config), "rank-process-batches")
    if os.environ.get(REQUIRE_GPU, "0") not in ("", "0") and not config.option.collectonly:
        config.pluginmanager.register(RequireGpuTests(), "require-gpu-tests")


def pytest_collection_modifyitems(config, items):
    rank = rank_processes.current()
    # A rank process counts the group's processes as its GPUs; it never starts another group.
    available = rank.processes if rank is not None else local_gpu_count()
    share = rank is None and rank_processes.sharing_possible(available)
    for item in items:
        needs = item.get_closest_marker("gpus")
        if needs is None and item.get_closest_marker("gpu") is None:
            continue
        required = needs.args[0] if needs is not None else 1
        if needs is not None:
            item.add_marker(pytest.mark.gpu)
        if available >= required:
            continue
        if share and item.get_closest_marker(rank_runs.MARKER) is not None:
            rank_runs.run_as_processes(item, required)
        else:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {required} NVIDIA GPU(s), found {available}"
            ))


@pytest.fixture
def rng(request):
    """Fresh random data for every test: a new seed per test, except in a rank process, where
    every process of the run derives the same one from the run's seed and the test's id (each
    draws every rank's inputs). The seed is printed, to replay a failure."""
    rank = rank_processes.current()
    base = rank.seed if rank is not None else secrets.randbits(62)
    seed = [base, zlib.crc32(request.node.nodeid.encode())]
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


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
    * At the end: the run fails if no ``gpu`` test passed its body (every one skipped, before
      or inside its body, or failed).
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
        # A skip inside the body is a "call" report too: only a pass counts.
        if report.when == "call" and report.passed and "gpu" in report.keywords:
            self.ran += 1

    def pytest_sessionfinish(self, session):
        if self.ran == 0 and session.exitstatus == pytest.ExitCode.OK:
            self.failure = (f"{REQUIRE_GPU}=1, but none of the {self.selected} selected GPU test(s) passed its "
                            "body: all skipped (see the skip reasons)")
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
