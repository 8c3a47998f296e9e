"""Where an example runs: on NVIDIA GPUs where the driver finds one, else on virtual CPU
devices. Call `choose` before JAX is imported: the CPU device count is an XLA flag."""

from __future__ import annotations

import os


def gpu_present() -> bool:
    """True where the CUDA driver initializes and finds a GPU."""
    try:
        from cuda.bindings import driver

        (error,) = driver.cuInit(0)
        return error == driver.CUresult.CUDA_SUCCESS and driver.cuDeviceGetCount()[1] > 0
    except Exception:  # no bindings or no libcuda: a CPU machine
        return False


def choose(cpu_devices: int) -> bool:
    """True on a GPU machine; elsewhere asks XLA for ``cpu_devices`` virtual CPU devices and
    returns False."""
    if gpu_present():
        return True
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cpu_devices}"
    return False
