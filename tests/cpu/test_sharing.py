"""`jax_moe_publish.memory.sharing` without a GPU: payload encoding and validation, the pidfd helpers, and
the import's mapping steps and their undoing (against a recording driver)."""

from __future__ import annotations

import errno
import os
import re
import struct
import subprocess
import sys

import pytest

from jax_moe_publish.memory import driver as memory_driver
from jax_moe_publish.memory import sharing
from jax_moe_publish.memory.driver import CudaError

POSIX_FD = sharing.MECHANISMS[1]


def _payload(pid=1234, fd=7, size=2 << 20) -> bytes:
    return sharing.encode(POSIX_FD, size, struct.pack("<qi", pid, fd))


def test_payload_round_trips():
    mechanism, size, body = sharing.decode(_payload(pid=4321, fd=9, size=6 << 20))
    assert mechanism is POSIX_FD and size == 6 << 20
    assert struct.unpack("<qi", body) == (4321, 9)


@pytest.mark.parametrize("mutate,match", [
    (lambda p: b"XXXX" + p[4:], "not a jax_moe_publish memory payload"),
    (lambda p: p[:10], "not a jax_moe_publish memory payload"),
    (lambda p: p[:4] + struct.pack("<H", 99) + p[6:], "version 99"),
    (lambda p: p[:6] + struct.pack("<H", 42) + p[8:], "mechanism 42"),
    (lambda p: p[:8] + struct.pack("<Q", 0) + p[16:], "size 0"),
    (lambda p: p[:-1], "body of 11 bytes"),
    (lambda p: p + b"\0", "body of 13 bytes"),
])
def test_bad_payloads_are_refused_with_the_reason(mutate, match):
    with pytest.raises(ValueError, match=match):
        sharing.decode(mutate(_payload()))


def test_payload_must_be_bytes():
    with pytest.raises(TypeError, match="expected bytes"):
        sharing.decode("JMPB")


def test_fetch_fd_copies_a_descriptor_of_a_process():
    read, write = os.pipe()
    try:
        try:
            copy = sharing.fetch_fd(os.getpid(), write)
        except sharing.SharingError as error:
            if error.errno in (errno.ENOSYS, errno.EPERM):
                pytest.skip(f"pidfd_getfd is unavailable here: {error}")
            raise
        try:
            os.write(copy, b"ok")
            assert os.read(read, 2) == b"ok"
        finally:
            os.close(copy)
    finally:
        os.close(read)
        os.close(write)


def test_fetch_fd_of_a_closed_descriptor_says_it_was_closed():
    read, write = os.pipe()
    os.close(read)
    os.close(write)
    with pytest.raises(sharing.SharingError) as caught:
        sharing.fetch_fd(os.getpid(), write)
    if caught.value.errno in (errno.ENOSYS, errno.EPERM):
        pytest.skip(f"pidfd_getfd is unavailable here: {caught.value}")
    assert caught.value.errno == errno.EBADF and "already closed its export" in str(caught.value)


def test_fetch_fd_of_an_exited_process_says_it_exited():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now
    pid = child.pid
    with pytest.raises(sharing.SharingError) as caught:
        sharing.fetch_fd(pid, 0)
    assert caught.value.errno in (errno.ESRCH, errno.ENOSYS), caught.value
    if caught.value.errno == errno.ESRCH:
        assert f"Process {pid} has exited" in str(caught.value)


@pytest.mark.parametrize("code,words", [
    (errno.EPERM, ["EPERM", "ptrace access", "ptrace_scope", "CAP_SYS_PTRACE"]),
    (errno.ENOSYS, ["ENOSYS", "Linux >= 5.6", "seccomp"]),
])
def test_permission_and_kernel_errors_explain_the_fix(monkeypatch, code, words):
    calls = []

    def syscall(number, *args):
        calls.append(number)
        if number == sharing.SYS_PIDFD_GETFD or code == errno.ENOSYS:
            raise OSError(code, os.strerror(code))
        return os.open(os.devnull, os.O_RDONLY)  # a stand-in pidfd, closed by fetch_fd

    monkeypatch.setattr(sharing, "_syscall", syscall)
    with pytest.raises(sharing.SharingError) as caught:
        sharing.fetch_fd(777, 5)
    assert caught.value.errno == code
    message = str(caught.value)
    assert "descriptor 5 of process 777" in message
    for word in words:
        assert word in message, message


class _RecordingDriver:
    """The real driver's types, with the VMM calls recorded instead of made; the call named
    ``failing`` returns an error."""

    def __init__(self, failing: str | None = None):
        self._real = memory_driver.api()
        self.failing = failing
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _result(self, name, *values):
        self.calls.append(name)
        results = self._real.CUresult
        return (results.CUDA_ERROR_OUT_OF_MEMORY if name == self.failing else results.CUDA_SUCCESS, *values)

    def cuMemAddressReserve(self, size, alignment, address, flags):
        return self._result("cuMemAddressReserve", 0x7000_0000)

    def cuMemMap(self, address, size, offset, handle, flags):
        return self._result("cuMemMap")

    def cuMemSetAccess(self, address, size, descriptors, count):
        assert [d.location.id for d in descriptors] == [0, 1] and count == 2
        return self._result("cuMemSetAccess")

    def cuMemUnmap(self, address, size):
        return self._result("cuMemUnmap")

    def cuMemAddressFree(self, address, size):
        return self._result("cuMemAddressFree")

    def cuMemRelease(self, handle):
        assert handle == "imported handle"
        return self._result("cuMemRelease")

    def cuGetErrorString(self, error):
        return (self._real.CUresult.CUDA_SUCCESS, b"out of memory")


MAPPING_STEPS = ["cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"]


@pytest.mark.parametrize("failing", MAPPING_STEPS)
def test_a_failed_import_undoes_exactly_the_steps_taken(monkeypatch, failing):
    driver = _RecordingDriver(failing)
    monkeypatch.setattr(memory_driver, "api", lambda: driver)
    monkeypatch.setattr(type(POSIX_FD), "open", lambda self, body: "imported handle")
    with pytest.raises(CudaError, match=re.escape(f"{failing}(imported) failed")):
        sharing.import_mapping(_payload(), [0, 1])
    taken = MAPPING_STEPS[:MAPPING_STEPS.index(failing)]
    undo = {"cuMemAddressReserve": "cuMemAddressFree", "cuMemMap": "cuMemUnmap"}
    # Undone in reverse, the handle last; a failed step needs no undoing.
    assert driver.calls == [*taken, failing, *[undo[s] for s in reversed(taken) if s in undo], "cuMemRelease"]


def test_an_import_is_released_once(monkeypatch):
    driver = _RecordingDriver()
    monkeypatch.setattr(memory_driver, "api", lambda: driver)
    monkeypatch.setattr(type(POSIX_FD), "open", lambda self, body: "imported handle")
    mapping = sharing.import_mapping(_payload(size=4 << 20), [0, 1])
    assert (mapping.address, mapping.size, mapping.mapped) == (0x7000_0000, 4 << 20, True)
    mapping.release()
    mapping.release()
    assert driver.calls == [*MAPPING_STEPS, "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"]
