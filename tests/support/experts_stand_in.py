"""The experts op's kernel path with the kernels stood in for, on a machine without GPUs: the
CUDA branch is traced (its FFI call names `STAND_IN`), the CPU runs the reference branch."""

from __future__ import annotations

import jax
import pytest

from jax_moe_publish import _launch, experts

STAND_IN = "jax_moe_publish_experts_stand_in"


@pytest.fixture
def stood_in(monkeypatch):
    """The kernel path with the kernels stood in for: GPUs claimed, `_launch.load` recording the
    configs, the FFI target one no handler serves (the CPU runs the reference branch)."""
    loads = []

    class Gpu:
        local_hardware_id = 3

    local_devices = jax.local_devices
    monkeypatch.setattr(experts, "_has_gpus", lambda: True)
    monkeypatch.setattr(experts.jax, "local_devices",
                        lambda *a, backend=None, **k: [Gpu()] if backend == "gpu" else local_devices(*a, **k))

    def load(config, ordinals):
        loads.append((config, list(ordinals)))
        _launch._targets[-len(loads)] = STAND_IN
        return -len(loads)

    monkeypatch.setattr(_launch, "load", load)
    return loads
