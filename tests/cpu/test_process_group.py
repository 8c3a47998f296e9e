"""`jax_moe_publish.memory.process_group` without processes: host identity and the bounded exchange, on a fake store."""

from __future__ import annotations

import pytest

from jax_moe_publish.memory import process_group


class FakeStore:
    """The calls of the distributed client that `process_group.Exchange` uses, in memory."""

    def __init__(self):
        self.values: dict[str, bytes] = {}
        self.barriers: list[str] = []

    def key_value_set_bytes(self, key, value):
        assert key not in self.values, f"{key} set twice"
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        if key not in self.values:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key} after {timeout_ms} ms")
        return self.values[key]

    def key_value_dir_get_bytes(self, prefix):
        return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]

    def key_value_delete(self, key):
        del self.values[key]

    def wait_at_barrier(self, name, timeout_ms, process_ids=None):
        if name.endswith("/never"):
            raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {name} timed out after {timeout_ms} ms")
        self.barriers.append(name)


def _exchange(store, process=0):
    return process_group.Exchange("ns/mailbox/3/setup", [0, 1], process, timeout_s=2.5, client=store,
                                  process_count=2)


def test_host_identity_names_the_host_and_can_be_overridden_for_tests(monkeypatch):
    monkeypatch.delenv(process_group.TEST_HOST_ID_ENV, raising=False)
    import socket

    assert process_group.host_identity().startswith(socket.gethostname())
    assert process_group.host_identity() == process_group.host_identity()
    monkeypatch.setenv(process_group.TEST_HOST_ID_ENV, "host-b")
    assert process_group.host_identity() == "host-b"


def test_published_values_are_fetched_and_forgotten():
    store = FakeStore()
    mine, theirs = _exchange(store, 0), _exchange(store, 1)
    theirs.publish(theirs.key("group", 0, "rank", 1), b"payload")
    assert mine.fetch(mine.key("group", 0, "rank", 1), 1, "a handle") == b"payload"
    theirs.forget()
    assert store.values == {}


def test_a_missing_value_times_out_naming_the_process_and_the_key():
    exchange = _exchange(FakeStore())
    with pytest.raises(process_group.ProcessGroupError) as caught:
        exchange.fetch(exchange.key("process", 1), 1, "its record")
    assert caught.value.timed_out
    message = str(caught.value)
    assert "process 1 never sent its record (ns/mailbox/3/setup/process/1)" in message
    assert "within 2.5 s" in message and "same order" in message


def test_an_abandoned_step_reaches_every_waiting_process_with_its_message():
    store = FakeStore()
    failing, waiting = _exchange(store, 1), _exchange(store, 0)
    record = failing.key("process", 1)
    handle = failing.key("group", 0, "rank", 1)
    failing.publish(record, b"{}")
    failing.abandon("SharingError: pidfd_getfd failed: EPERM", owed=[record, handle])
    assert store.values[record] == b"{}", "a published value was overwritten"
    with pytest.raises(process_group.ProcessGroupError) as caught:
        waiting.fetch(handle, 1, "a handle")
    assert not caught.value.timed_out
    assert str(caught.value) == "process 1: SharingError: pidfd_getfd failed: EPERM"
    assert waiting.failures() == ["process 1: SharingError: pidfd_getfd failed: EPERM"]


def test_values_cannot_pose_as_failures():
    exchange = _exchange(FakeStore())
    with pytest.raises(ValueError, match="failure marker"):
        exchange.publish(exchange.key("x"), b"!jax_moe_publish failed: no")


def test_a_barrier_that_never_passes_names_the_step_and_the_likely_cause():
    store = FakeStore()
    exchange = _exchange(store)
    exchange.barrier("setup")
    assert store.barriers == ["ns/mailbox/3/setup/barrier/setup"]
    with pytest.raises(process_group.ProcessGroupError) as caught:
        exchange.barrier("never")
    assert caught.value.timed_out
    assert "barrier 'never' of processes [0, 1] did not pass within 2.5 s" in str(caught.value)
    assert "a process has died" in str(caught.value)
