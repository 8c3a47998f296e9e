"""How one process maps another process's mailbox memory (same host).

The exporter turns a local VMM allocation into a *payload*: a few bytes that
travel through JAX's distributed key-value store. The importer turns the
payload back into the same physical memory, mapped read-write for its own
devices. A payload is::

    header  "JMPB", version u16, mechanism u16, allocation size u64  (little-endian)
    body    what the mechanism needs

The mechanism used here is ``posix_fd``: the allocation is exported as a POSIX
file descriptor (``cuMemCreate`` must request that handle type), and the
importer copies the descriptor out of the exporting process with
``pidfd_open`` + ``pidfd_getfd`` (Linux 5.6), so no socket or helper process
is needed. That needs ptrace access to the exporter: the same user with Yama
``ptrace_scope`` 0, or ``CAP_SYS_PTRACE``. Its body is the exporter's pid and
descriptor number, so it only means something on the exporter's host.

Other mechanisms fit the same interface (a code in the header, ``export`` and
``open``): FABRIC handles for multi-node NVLink would carry the 64-byte
fabric handle, and need an IMEX channel; legacy CUDA IPC would carry a 64-byte
``cuIpcGetMemHandle`` of a ``cuMemAlloc`` allocation.

Physical memory is reference counted by the driver: an imported allocation
stays alive until its importer releases it, whatever the exporter does.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import struct
from typing import Protocol

from jax_moe_publish.memory import driver
from jax_moe_publish.memory.driver import check
from jax_moe_publish.memory.vmm import VmmMapping

MAGIC = b"JMPB"
VERSION = 1
_HEADER = struct.Struct("<4sHHQ")


class SharingError(RuntimeError):
    """A peer's memory could not be imported; ``errno`` is set for operating-system failures."""

    def __init__(self, message: str, errno_value: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_value


# --- pidfd: a file descriptor of another process ------------------------------------------------

SYS_PIDFD_OPEN = 434
"""Syscall numbers of the unified table (Linux >= 5.3 on every architecture but alpha)."""
SYS_PIDFD_GETFD = 438


def _syscall(number: int, *args: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(result)


def _ptrace_scope() -> str:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip()
    except OSError:
        return "absent (no Yama)"


def explain_fd_error(call: str, code: int, pid: int, fd: int) -> str:
    """Why ``call`` failed with ``code`` while taking descriptor ``fd`` of process ``pid``."""
    name = errno.errorcode.get(code, str(code))
    prefix = f"{call} for descriptor {fd} of process {pid} failed: {name} ({os.strerror(code)})"
    if code == errno.EPERM:
        return (f"{prefix}. pidfd_getfd needs ptrace access to the exporting process: the same "
                f"user and Yama ptrace_scope 0 (/proc/sys/kernel/yama/ptrace_scope is "
                f"{_ptrace_scope()}), or CAP_SYS_PTRACE (in a container: --cap-add SYS_PTRACE)")
    if code == errno.ENOSYS:
        return (f"{prefix}. The kernel lacks pidfd_open/pidfd_getfd (Linux >= 5.6 is needed), or a "
                "seccomp filter (a container's default profile) blocks them")
    if code == errno.ESRCH:
        return f"{prefix}. Process {pid} has exited, or runs in another PID namespace or on another host"
    if code == errno.EBADF:
        return (f"{prefix}. Process {pid} has no open descriptor {fd}: it already closed its export "
                "(was the payload from an earlier setup?)")
    return prefix


def fetch_fd(pid: int, fd: int) -> int:
    """A new descriptor, in this process, for the open file ``fd`` of process ``pid``."""
    try:
        pidfd = _syscall(SYS_PIDFD_OPEN, pid, 0)
    except OSError as error:
        raise SharingError(explain_fd_error("pidfd_open", error.errno, pid, fd), error.errno) from error
    try:
        return _syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
    except OSError as error:
        raise SharingError(explain_fd_error("pidfd_getfd", error.errno, pid, fd), error.errno) from error
    finally:
        os.close(pidfd)


# --- payloads ----------------------------------------------------------------------------------


def encode(mechanism: Mechanism, size: int, body: bytes) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, mechanism.code, size) + body


def decode(payload: bytes) -> tuple[Mechanism, int, bytes]:
    """(mechanism, allocation size, body) of a payload; ValueError says what is wrong with it."""
    if not isinstance(payload, bytes):
        raise TypeError(f"payload: expected bytes, got {type(payload).__name__}")
    if len(payload) < _HEADER.size or payload[:4] != MAGIC:
        raise ValueError(f"payload {payload[:16]!r}...: not a jax_moe_publish memory payload "
                         f"(expected {_HEADER.size}+ bytes starting with {MAGIC!r})")
    _, version, code, size = _HEADER.unpack_from(payload)
    if version != VERSION:
        raise ValueError(f"payload version {version}: expected {VERSION} (processes run different "
                         "jax_moe_publish versions)")
    if code not in MECHANISMS:
        known = {m.code: m.name for m in MECHANISMS.values()}
        raise ValueError(f"payload mechanism {code}: expected one of {known}")
    if size <= 0:
        raise ValueError(f"payload allocation size {size}: expected > 0")
    mechanism = MECHANISMS[code]
    body = payload[_HEADER.size:]
    if len(body) != mechanism.body_size:
        raise ValueError(f"payload body of {len(body)} bytes: mechanism {mechanism.name!r} expects "
                         f"{mechanism.body_size}")
    return mechanism, size, body


# --- mechanisms --------------------------------------------------------------------------------


@dataclasses.dataclass
class Exported:
    """A local allocation made importable; the resource behind it stays open until `close`."""

    payload: bytes
    fd: int = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Mechanism(Protocol):
    """One way of sharing an allocation; ``code`` names it in payloads."""

    name: str
    code: int
    body_size: int

    def export(self, handle, size: int) -> Exported:
        """Payload (and the resource kept open for importers) of the VMM allocation ``handle``."""

    def open(self, body: bytes):
        """The allocation handle in this process (a new reference; `cuMemRelease` it)."""


class PosixFd:
    """VMM allocation -> POSIX file descriptor, fetched by the importer with ``pidfd_getfd``."""

    name = "posix_fd"
    code = 1
    _BODY = struct.Struct("<qi")  # exporter pid, descriptor number
    body_size = _BODY.size

    @staticmethod
    def handle_type():
        return driver.api().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    def export(self, handle, size: int) -> Exported:
        fd = int(check(driver.api().cuMemExportToShareableHandle(handle, self.handle_type(), 0),
                       "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)"))
        return Exported(encode(self, size, self._BODY.pack(os.getpid(), fd)), fd)

    def open(self, body: bytes):
        pid, fd = self._BODY.unpack(body)
        local_fd = fetch_fd(pid, fd)
        try:
            return check(driver.api().cuMemImportFromShareableHandle(local_fd, self.handle_type()),
                         f"cuMemImportFromShareableHandle(descriptor {fd} of process {pid})")
        finally:
            os.close(local_fd)  # the imported handle holds its own reference


MECHANISMS: dict[int, Mechanism] = {m.code: m for m in (PosixFd(),)}
DEFAULT: Mechanism = MECHANISMS[PosixFd.code]


def allocation_handle_type():
    """What ``cuMemCreate`` must request so that `export` can share the allocation."""
    return DEFAULT.handle_type()


def export(handle, size: int) -> Exported:
    """Make the VMM allocation ``handle`` of ``size`` bytes importable by other local processes."""
    return DEFAULT.export(handle, size)


def import_mapping(payload: bytes, ordinals: list[int]) -> VmmMapping:
    """Map a peer's exported allocation, read-write for the devices ``ordinals`` of this process.

    Call with a context of one of those devices current; `VmmMapping.release` unmaps it.
    """
    mechanism, size, body = decode(payload)
    imported = VmmMapping(size, "imported")
    try:
        imported.map(mechanism.open(body), ordinals)
    except BaseException:
        imported.release()
        raise
    return imported
