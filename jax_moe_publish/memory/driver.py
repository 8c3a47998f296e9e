"""CUDA driver calls through cuda-python: error checks and the devices' primary contexts.

The bindings import without a driver (``libcuda`` is loaded at the first call). Every call
goes through `api`, which tests replace with a recording driver.
"""

from __future__ import annotations

import contextlib

from cuda.bindings import driver as _driver


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


def api():
    """The ``cuda.bindings.driver`` module."""
    return _driver


def check(result, call: str):
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising `CudaError` on failure."""
    driver = api()
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(error)
        name = text.decode() if isinstance(text, bytes) else str(error)
        raise CudaError(f"{call} failed: {error.name}: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_initialized = False


def init() -> None:
    global _initialized
    if not _initialized:
        check(api().cuInit(0), "cuInit")
        _initialized = True


def retain_primary_context(ordinal: int):
    """Take a reference on device ``ordinal``'s primary context; returns the CUdevice."""
    driver = api()
    init()
    device = check(driver.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    check(driver.cuDevicePrimaryCtxRetain(device), f"cuDevicePrimaryCtxRetain({ordinal})")
    return device


def release_primary_context(device) -> None:
    check(api().cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease")


@contextlib.contextmanager
def primary_context(ordinal: int):
    """Make device ``ordinal``'s primary context current (the one JAX/XLA uses)."""
    driver = api()
    init()
    device = check(driver.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    context = check(driver.cuDevicePrimaryCtxRetain(device), f"cuDevicePrimaryCtxRetain({ordinal})")
    check(driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
    try:
        yield context
    finally:
        check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")
        check(driver.cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease")
