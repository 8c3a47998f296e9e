"""Test setup: virtual CPU devices for the sharded CPU tests, and GPU discovery for ``gpu`` tests.

The tiers are folders: ``cpu/`` (CI), ``compile/`` (needs CuTe DSL, no GPU), ``gpu/``
(marked ``gpu``); ``support/`` holds the modules and child programs they share, importable
by name from every test.

GPU tests are marked ``@pytest.mark.gpu`` and declare how many GPUs they need
with the ``gpus`` fixture's parameter (``@pytest.mark.gpus(2)``); they skip,
with the reason, where there are fewer.
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



def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs at least n NVIDIA GPUs (implies gpu)")


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


@pytest.fixture(scope="session")
def devices():
    """The kernel harness's GPUs (`gpu_harness.DevicePool`), shared by every test that launches
    cubins: a group of tp ranks runs on real GPUs where there are tp, else with virtual ranks."""
    import gpu_harness

    pool = gpu_harness.DevicePool()
    yield pool
    pool.close()
