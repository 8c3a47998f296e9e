"""Device memory of one TP group's mailboxes, through the CUDA driver API (cuda-python).

For each rank of a group this allocates, in its device's primary context:

* the mailbox: bf16 ``[STAGES][tp][capacity_m][hidden]`` contribution slots,
  then ``[STAGES][capacity_m][hidden]`` two-shot gather slots, every lane set to
  the empty sentinel. It is a VMM allocation (``cuMemCreate`` + ``cuMemMap``)
  mapped read-write for every device of the group, so peers store into it
  directly over NVLink;
* the stage state: ``STAGE_STATE_WORDS`` int32, zero (stage 0, no calls yet,
  running) but for ``ON_TIMEOUT``;
* the peer table: ``tp`` u64, the mailbox address of each rank, by rank;
* the status block: ``STATUS_WORDS`` int32 of pinned host memory mapped into
  the device, so the host can read a diagnostic even after the context is lost.

When the group spans processes, each process allocates its own ranks only
(``shareable`` requests an exportable handle, see `sharing`) and writes the
peer tables once it has mapped the other processes' mailboxes.

`GroupMemory.close` halts the kernels before it frees the mailbox, and keeps
the stage state and status block (a few hundred bytes) for the life of the
process: an XLA command buffer recorded before the close can still launch the
kernels, which then find ``HALT_CLOSED`` there instead of freed memory.

Nothing here imports JAX.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import struct

from jax_moe_publish import protocol


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


def _driver():
    from cuda.bindings import driver

    return driver


def check(result, call: str):
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising `CudaError` on failure."""
    driver = _driver()
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
        check(_driver().cuInit(0), "cuInit")
        _initialized = True


def _retain_primary_context(ordinal: int):
    """Take a reference on device ``ordinal``'s primary context; returns the CUdevice."""
    driver = _driver()
    init()
    device = check(driver.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    check(driver.cuDevicePrimaryCtxRetain(device), f"cuDevicePrimaryCtxRetain({ordinal})")
    return device


@contextlib.contextmanager
def primary_context(ordinal: int):
    """Make device ``ordinal``'s primary context current (the one JAX/XLA uses)."""
    driver = _driver()
    init()
    device = check(driver.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
    context = check(driver.cuDevicePrimaryCtxRetain(device), f"cuDevicePrimaryCtxRetain({ordinal})")
    check(driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
    try:
        yield context
    finally:
        check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")
        check(driver.cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease")


@dataclasses.dataclass
class RankMemory:
    """Addresses of one rank's mailbox memory (device pointers as ints)."""

    ordinal: int
    rank: int
    mailbox: int
    mailbox_bytes: int
    stage_state: int
    peer_table: int
    status: int
    status_host: int
    vmm: VmmMapping | None = None  # the mailbox's allocation, mapped at ``mailbox``


@dataclasses.dataclass
class VmmMapping:
    """A VMM allocation mapped into this process: a rank's own mailbox, or one imported from
    another process (`sharing.import_mapping`). Filled step by step by `map`, so that
    `release` undoes a partial mapping."""

    size: int
    what: str  # names the mapping in error messages
    handle: object = None
    address: int = 0
    mapped: bool = False

    def map(self, handle, ordinals: list[int], alignment: int = 0) -> None:
        """Take ``handle``, reserve an address range, map the allocation there and give the
        devices ``ordinals`` read-write access. Call with a context of one of them current."""
        driver = _driver()
        self.handle = handle
        reserved = check(driver.cuMemAddressReserve(self.size, alignment, 0, 0), f"cuMemAddressReserve({self.what})")
        self.address = int(reserved)
        check(driver.cuMemMap(self.address, self.size, 0, handle, 0), f"cuMemMap({self.what})")
        self.mapped = True
        access = []
        for ordinal in ordinals:
            desc = driver.CUmemAccessDesc()
            desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = ordinal
            desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            access.append(desc)
        check(driver.cuMemSetAccess(self.address, self.size, access, len(access)), f"cuMemSetAccess({self.what})")

    def release(self) -> None:
        """Unmap, free the address range and drop this process's reference; safe to call twice."""
        driver = _driver()
        if self.mapped:
            check(driver.cuMemUnmap(self.address, self.size), f"cuMemUnmap({self.what})")
            self.mapped = False
        if self.address:
            check(driver.cuMemAddressFree(self.address, self.size), f"cuMemAddressFree({self.what})")
            self.address = 0
        if self.handle is not None:
            check(driver.cuMemRelease(self.handle), f"cuMemRelease({self.what})")
            self.handle = None


class GroupMemory:
    """The mailbox memory of one TP group in this process.

    ``ordinals[r]`` is the device of rank ``r``, or None for a rank of another
    process. With every rank local the peer tables are written at once;
    otherwise the caller maps the other processes' mailboxes and calls
    `write_peer_tables`. ``shareable`` makes the mailboxes exportable.
    """

    def __init__(self, ordinals: list[int | None], *, hidden: int, capacity_m: int,
                 on_timeout: int = protocol.ON_TIMEOUT_ABORT, shareable: bool = False) -> None:
        self.ordinals = list(ordinals)
        self.local_ordinals = [o for o in self.ordinals if o is not None]
        self.on_timeout = on_timeout
        self.tp = len(ordinals)
        self.hidden = hidden
        self.capacity_m = capacity_m
        self.shareable = shareable
        self.elements = protocol.mailbox_elements(self.tp, capacity_m, hidden)
        self.ranks: list[RankMemory] = []
        # Hold each primary context for the group's lifetime: the driver resets a
        # primary context (freeing everything in it) when its last reference goes.
        self._contexts = []
        try:
            for ordinal in self.local_ordinals:
                self._contexts.append(_retain_primary_context(ordinal))
            for rank, ordinal in enumerate(self.ordinals):
                if ordinal is None:
                    continue
                memory = RankMemory(ordinal, rank, 0, 0, 0, 0, 0, 0)
                self.ranks.append(memory)
                self._allocate(memory)
            if len(self.ranks) == self.tp:
                self.write_peer_tables([memory.mailbox for memory in self.ranks])
        except BaseException:
            self.free()
            raise

    def _allocate(self, memory: RankMemory) -> None:
        """Fill ``memory`` field by field, so that `free` can undo a partial allocation."""
        driver = _driver()
        ordinal = memory.ordinal
        with primary_context(ordinal):
            prop = driver.CUmemAllocationProp()
            prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = ordinal
            if self.shareable:
                from jax_moe_publish import sharing

                prop.requestedHandleTypes = sharing.allocation_handle_type()
            granularity = check(
                driver.cuMemGetAllocationGranularity(
                    prop,
                    driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                ),
                "cuMemGetAllocationGranularity",
            )
            memory.mailbox_bytes = self.elements * 2
            size = -(-memory.mailbox_bytes // granularity) * granularity
            memory.vmm = VmmMapping(size, f"mailbox of device {ordinal}")
            handle = check(driver.cuMemCreate(size, prop, 0), f"cuMemCreate({size} B, device {ordinal})")
            memory.vmm.map(handle, self.local_ordinals, granularity)
            memory.mailbox = memory.vmm.address
            check(driver.cuMemsetD16(memory.mailbox, protocol.EMPTY_BF16, self.elements), "cuMemsetD16")
            memory.stage_state = int(
                check(driver.cuMemAlloc(protocol.STAGE_STATE_WORDS * 4), "cuMemAlloc(stage_state)")
            )
            check(driver.cuMemsetD32(memory.stage_state, 0, protocol.STAGE_STATE_WORDS), "cuMemsetD32")
            self._set_word(memory, protocol.ON_TIMEOUT, self.on_timeout)
            memory.peer_table = int(check(driver.cuMemAlloc(self.tp * 8), "cuMemAlloc(peer_table)"))
            flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
            host = check(driver.cuMemHostAlloc(protocol.STATUS_WORDS * 4, flags), "cuMemHostAlloc(status)")
            memory.status_host = int(host)
            ctypes.memset(memory.status_host, 0, protocol.STATUS_WORDS * 4)
            memory.status = int(check(driver.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
            check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

    def write_peer_tables(self, addresses: list[int]) -> None:
        """Give every local rank the mailbox address of each rank, by rank (in this process)."""
        driver = _driver()
        if len(addresses) != self.tp or not all(addresses):
            raise ValueError(f"addresses={addresses}: expected {self.tp} non-null mailbox addresses")
        table = struct.pack(f"<{self.tp}Q", *addresses)
        for memory in self.ranks:
            with primary_context(memory.ordinal):
                check(driver.cuMemcpyHtoD(memory.peer_table, table, len(table)), "cuMemcpyHtoD(peer_table)")
                # A copy from pageable memory may return before it lands.
                check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

    @staticmethod
    def _set_word(memory: RankMemory, word: int, value: int) -> None:
        """Store one int32 of ``memory``'s stage state (its context current; synchronous)."""
        check(_driver().cuMemsetD32(memory.stage_state + 4 * word, value, 1), "cuMemsetD32(stage_state)")

    def status(self, rank: int) -> list[int]:
        """The status words of ``rank``, read from host memory (works after a device fault)."""
        memory = next(m for m in self.ranks if m.rank == rank)
        words = (ctypes.c_int32 * protocol.STATUS_WORDS).from_address(memory.status_host)
        return list(words)

    def close(self) -> list[int]:
        """Halt the group's kernels, then free its mailboxes and peer tables.

        The stage state and status block stay allocated, and the primary
        contexts retained, for the life of the process, so that a kernel
        launched later finds ``HALT_CLOSED`` and `status` keeps working.
        Returns the devices whose context was lost to an earlier fault: the
        driver can free nothing there, and that memory goes with the process.
        """
        lost = []
        for memory in self.ranks:
            with primary_context(memory.ordinal):
                try:
                    # Fails on a context that an earlier fault lost.
                    check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")
                    self._set_word(memory, protocol.HALT, protocol.HALT_CLOSED)
                except CudaError:
                    lost.append(memory.ordinal)
        live = [memory for memory in self.ranks if memory.ordinal not in lost]
        # Every rank's kernels store into every rank's mailbox: free none of them until
        # the kernels that read HALT before it was set have finished on every device.
        for memory in live:
            with primary_context(memory.ordinal):
                check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")
        for memory in live:
            with primary_context(memory.ordinal):
                self._free_rank(memory, keep_control_words=True)
        _quarantine.append(self)
        return lost

    def free(self) -> None:
        """Release everything (no kernel may run on this group again); safe to call twice."""
        for memory in self.ranks:
            with primary_context(memory.ordinal):
                check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")
                self._free_rank(memory, keep_control_words=False)
        self.ranks = []
        self._release_contexts()

    def _free_rank(self, memory: RankMemory, *, keep_control_words: bool) -> None:
        """Free what ``memory`` holds (its context current), field by field."""
        driver = _driver()
        if memory.vmm is not None:
            memory.vmm.release()
            memory.mailbox = 0
        if memory.peer_table:
            check(driver.cuMemFree(memory.peer_table), "cuMemFree")
            memory.peer_table = 0
        if keep_control_words:
            return
        if memory.stage_state:
            check(driver.cuMemFree(memory.stage_state), "cuMemFree")
            memory.stage_state = 0
        if memory.status_host:
            check(driver.cuMemFreeHost(memory.status_host), "cuMemFreeHost")
            memory.status_host = 0

    def _release_contexts(self) -> None:
        for device in self._contexts:
            check(_driver().cuDevicePrimaryCtxRelease(device), "cuDevicePrimaryCtxRelease")
        self._contexts = []


_quarantine: list[GroupMemory] = []
"""Closed groups: their control words outlive them (see `GroupMemory.close`)."""
