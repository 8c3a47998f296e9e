"""Where the processes of a multi-process JAX job run, and bounded collective steps between them.

A Mailbox whose mesh spans processes is set up and closed collectively through
the key-value store and barriers of JAX's distributed runtime
(``jax.distributed.initialize``). Every wait here has a timeout. A process
whose part of a step fails says so in the store, under every key the others
wait for, so that they raise at once with its message instead of timing out.

Nothing here touches CUDA or imports JAX: the caller passes the distributed runtime's
client.
"""

from __future__ import annotations

import os
import socket

TEST_HOST_ID_ENV = "JAX_MOE_PUBLISH_TEST_HOST_ID"
"""For tests only: replaces `host_identity`, to play processes of one machine on several hosts."""

_FAILED = b"!jax_moe_publish failed: "


class ProcessGroupError(RuntimeError):
    """A collective Mailbox step failed in another process, or a process never arrived."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def host_identity() -> str:
    """Processes with the same identity can map each other's mailboxes.

    That takes one kernel (the boot id) and one PID namespace, since memory
    handles are passed by process id (`sharing`); the host name leads, for
    messages. `TEST_HOST_ID_ENV` overrides it, in tests only.
    """
    override = os.environ.get(TEST_HOST_ID_ENV)
    if override:
        return override
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "pid:unknown"
    return f"{socket.gethostname()} (boot {_read('/proc/sys/kernel/random/boot_id')}, {namespace})"


class Exchange:
    """One collective setup or close: keys under ``namespace``, among ``processes`` of the
    ``process_count`` processes of the job, through ``client`` (``jax.distributed``'s).

    Keys this process publishes are remembered, so that `abandon` can mark the
    rest of what it owes as failed and `forget` can delete them once read.
    """

    def __init__(self, namespace: str, processes: list[int], process: int, timeout_s: float, client,
                 process_count: int) -> None:
        self.namespace = namespace
        self.processes = sorted(processes)
        self.process = process
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self.client = client
        self.process_count = process_count
        self._published: list[str] = []

    def key(self, *parts) -> str:
        return "/".join([self.namespace, *map(str, parts)])

    def publish(self, key: str, value: bytes) -> None:
        if value.startswith(_FAILED):
            raise ValueError(f"{key}: value collides with the failure marker")
        self.client.key_value_set_bytes(key, value)
        self._published.append(key)

    def fetch(self, key: str, owner: int, what: str) -> bytes:
        """The value process ``owner`` publishes under ``key``; raises if it failed or never came."""
        try:
            value = self.client.blocking_key_value_get_bytes(key, self.timeout_ms)
        except Exception as error:  # the client raises XLA runtime errors
            timed_out = "DEADLINE_EXCEEDED" in str(error)
            reason = (f"not published within {self.timeout_ms / 1000:g} s" if timed_out else
                      f"the key-value store failed: {error}")
            raise ProcessGroupError(
                f"process {owner} never sent {what} ({key}): {reason}. Every process must create "
                "its Mailboxes in the same order, and every process of the mesh must take part",
                timed_out=timed_out,
            ) from error
        if value.startswith(_FAILED):
            raise ProcessGroupError(value[len(_FAILED):].decode(errors="replace"))
        return value

    def barrier(self, name: str) -> None:
        """Wait for every process; ProcessGroupError names the step if one never arrives."""
        everyone = self.processes == list(range(self.process_count))
        kwargs = {} if everyone else {"process_ids": self.processes}
        try:
            self.client.wait_at_barrier(self.key("barrier", name), self.timeout_ms, **kwargs)
        except Exception as error:
            timed_out = "DEADLINE_EXCEEDED" in str(error)
            raise ProcessGroupError(
                f"{self.namespace}: barrier {name!r} of processes {self.processes} did not pass "
                f"within {self.timeout_ms / 1000:g} s ({error}); a process has died, hangs, or "
                "skipped the step",
                timed_out=timed_out,
            ) from error

    def abandon(self, message: str, owed: list[str]) -> None:
        """Publish ``message`` as this process's failure, under every key of ``owed`` not yet
        published and under ``failed/<process>``, so that no process waits for it."""
        marker = _FAILED + f"process {self.process}: {message}".encode()
        for key in [k for k in owed if k not in self._published] + [self.key("failed", self.process)]:
            try:
                self.client.key_value_set_bytes(key, marker)
            except Exception:  # best effort: the store itself may be what failed
                pass

    def failures(self) -> list[str]:
        """Messages of the processes that abandoned this step (read after its barrier)."""
        try:
            found = self.client.key_value_dir_get_bytes(self.key("failed") + "/")
        except Exception:
            return []
        return [value[len(_FAILED):].decode(errors="replace") for _, value in sorted(found)]

    def forget(self) -> None:
        """Delete this process's keys (call once no process reads them any more)."""
        for key in self._published:
            try:
                self.client.key_value_delete(key)
            except Exception:
                pass
        self._published = []
