"""A Mailbox whose mesh spans processes, on CPU devices: the collective setup without GPUs.

Two processes with one CPU device each, joined by ``jax.distributed`` on
localhost (gloo collectives). Nothing is allocated on CPUs, but creation is
still collective: host detection, the agreement check between processes and
the bounded waits run as they do on GPUs, and the op runs the reference
across processes.
"""

from __future__ import annotations

import numpy as np
import pytest

import processes

HOST_ENV = "JAX_MOE_PUBLISH_TEST_HOST_ID"


def _seed() -> str:
    return str(np.random.default_rng().integers(2**31))


@pytest.mark.parametrize("order", ["straight", "mesh-reversed"])
def test_reference_across_processes_matches_float64(order):
    results = processes.run("match", "--order", order, "--seed", _seed(), "--problems", "0", "2")
    for process, result in enumerate(results):
        assert result["platform"] == "cpu" and result["rank"] == (1 - process if order == "mesh-reversed" else process)
        for call in result["calls"]:
            assert call["failure"] is None, f"process {process}, {call}: {call['failure']}"
        assert all(m["status"] == [] for m in result["mailboxes"]), "a CPU mailbox allocated memory"
    for a, b in zip(results[0]["calls"], results[1]["calls"]):
        if a["result"] == "allreduce":
            assert a["sha256"] == b["sha256"], f"{a}: the processes' outputs differ bitwise"


def test_one_host_is_detected_as_one_host():
    results = processes.run("cross-host", "--seed", _seed(), expect_results=[0, 1])
    for result in results:
        assert not result["spans_hosts"], result
        assert len(set(result["hosts"][0])) == 1, result["hosts"]


@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
def test_groups_across_hosts_run_the_reference_and_refuse_the_kernels(result):
    env = [{HOST_ENV: f"host-{name}"} for name in "ab"]
    results = processes.run("cross-host", "--result", result, "--seed", _seed(), env=env)
    for result in results:
        assert result["spans_hosts"] and result["hosts"] == [["host-a", "host-b"]], result
        assert "spans hosts" in result["repr"], result["repr"]
        for call in result["calls"]:
            assert call["failure"] is None, f"process {result['process']}, {call}: {call['failure']}"
        # The reference is what CPUs run anyway: nothing to warn about (GPUs warn, see the GPU test).
        assert result["warnings"] == [], result["warnings"]
        message = result["kernel_error"]
        assert message and "rank 0: host-a, rank 1: host-b" in message and "NVLink" in message, message


def test_processes_that_create_different_mailboxes_both_raise_at_once():
    results = processes.run("mismatch", "--process-timeout", "30")
    for result in results:
        outcome = result["outcome"]
        assert outcome["raised"] == "ValueError", outcome
        assert "hidden: " in outcome["message"] and "same order" in outcome["message"], outcome["message"]
        assert result["elapsed_s"] < 10, "a mismatch waited for a timeout instead of failing at once"


def test_a_process_that_never_creates_the_mailbox_times_out_the_others():
    results = processes.run("missing", "--process-timeout", "2", expect_results=[0, 1])
    outcome = results[0]["outcome"]
    assert outcome["raised"] == "ProcessGroupError" and outcome["timed_out"], outcome
    assert "process 1 never sent its record of mailbox" in outcome["message"], outcome["message"]
    assert 2 <= results[0]["elapsed_s"] < 10, results[0]["elapsed_s"]


def test_kernels_load_only_on_this_processes_devices(monkeypatch):
    """A group's devices in other processes have ordinals of their own process: loading there
    would claim a GPU of this machine that is not ours."""
    import types
    import uuid

    import jax

    from jax_moe_publish import _extension, _launch
    from jax_moe_publish.mailbox import Mailbox

    here, there = jax.process_index(), jax.process_index() + 1
    mailbox = object.__new__(Mailbox)
    device = lambda process, ordinal: types.SimpleNamespace(process_index=process, local_hardware_id=ordinal)
    mailbox.groups = [[device(here, 0), device(there, 0)], [device(there, 1), device(here, 1)]]
    assert mailbox.local_ordinals == [0, 1]
    loaded = []
    monkeypatch.setattr(_extension, "load_kernel_set", lambda set_id, ordinal, *args: loaded.append(ordinal))
    artifact = types.SimpleNamespace(cubin=b"cubin", metadata={"key": f"k-{uuid.uuid4()}", "kernels": [],
                                                                "call": {"target": "a-target"}})
    store = types.SimpleNamespace(get=lambda config: artifact)
    monkeypatch.setattr(_launch, "default_store", lambda: store)
    set_id = _launch.load("a config", mailbox.local_ordinals)
    # Once per device, under one id.
    assert _launch.load("a config", [1, 0]) == set_id
    assert loaded == [0, 1]
