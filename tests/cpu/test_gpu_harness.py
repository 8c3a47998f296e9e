"""The kernel harness (``tests/support/gpu_harness.py``) on CPU: it fills every value of the
launch contract, so that a new value it misses fails here rather than on a GPU."""

from __future__ import annotations

import types

import pytest

import gpu_harness
from jax_moe_publish import _abi
from jax_moe_publish.testing import gpu_matrix


class _Buffer:
    def __init__(self, device, nbytes):
        self.address = 0x1000 + nbytes


@pytest.mark.parametrize("config", [gpu_matrix.variants(1)[0], *gpu_matrix.variants(2)[:3]], ids=lambda c: c.key)
def test_the_harness_fills_every_value_of_the_contract(config, monkeypatch):
    monkeypatch.setattr(gpu_harness, "Buffer", _Buffer)
    buffers = gpu_harness.RankBuffers(None, config, max_m=5, max_rows=9)
    launcher = object.__new__(gpu_harness.GroupLauncher)
    launcher.timeout_ns = 10**9
    launcher.memory = None if config.tp == 1 else types.SimpleNamespace(
        capacity_m=8, ranks=[types.SimpleNamespace(mailbox=1, peer_table=2, stage_state=3, status=4)] * config.tp)
    values = launcher.values(0, buffers, 5)
    assert values.keys() == _abi.VALUES.keys()
    for operand in _abi.call_operands(config):
        if operand["rows"] != "zero":
            assert values[operand["name"]] != 0, operand
