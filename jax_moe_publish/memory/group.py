"""Device memory of one TP group's mailboxes, through the CUDA driver API (``docs/design.md``).

For each rank: the mailbox (a VMM allocation of `protocol.mailbox_elements`, every lane the
empty sentinel, mapped read-write for every device of the group), the stage state, the peer
table and the status block (pinned host memory mapped into the device, readable after a
fault). When the group spans processes each process allocates its own ranks only, and writes
the peer tables once it has mapped the others' mailboxes. `GroupMemory.close` halts the
kernels before it frees, and keeps the stage state and status block for the life of the
process, so that a replayed command buffer finds ``HALT_CLOSED`` instead of freed memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import struct

from jax_moe_publish import protocol
from jax_moe_publish.memory import driver, sharing
from jax_moe_publish.memory.driver import (CudaError, check, primary_context, release_primary_context,
                                           retain_primary_context)
from jax_moe_publish.memory.vmm import VmmMapping


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
                self._contexts.append(retain_primary_context(ordinal))
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
        cuda = driver.api()
        ordinal = memory.ordinal
        with primary_context(ordinal):
            prop = cuda.CUmemAllocationProp()
            prop.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = ordinal
            if self.shareable:
                prop.requestedHandleTypes = sharing.allocation_handle_type()
            granularity = check(
                cuda.cuMemGetAllocationGranularity(
                    prop,
                    cuda.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                ),
                "cuMemGetAllocationGranularity",
            )
            memory.mailbox_bytes = self.elements * 2
            size = -(-memory.mailbox_bytes // granularity) * granularity
            memory.vmm = VmmMapping(size, f"mailbox of device {ordinal}")
            handle = check(cuda.cuMemCreate(size, prop, 0), f"cuMemCreate({size} B, device {ordinal})")
            memory.vmm.map(handle, self.local_ordinals, granularity)
            memory.mailbox = memory.vmm.address
            check(cuda.cuMemsetD16(memory.mailbox, protocol.EMPTY_BF16, self.elements), "cuMemsetD16")
            memory.stage_state = int(
                check(cuda.cuMemAlloc(protocol.STAGE_STATE_WORDS * 4), "cuMemAlloc(stage_state)")
            )
            check(cuda.cuMemsetD32(memory.stage_state, 0, protocol.STAGE_STATE_WORDS), "cuMemsetD32")
            self._set_word(memory, protocol.ON_TIMEOUT, self.on_timeout)
            memory.peer_table = int(check(cuda.cuMemAlloc(self.tp * 8), "cuMemAlloc(peer_table)"))
            flags = cuda.CU_MEMHOSTALLOC_DEVICEMAP | cuda.CU_MEMHOSTALLOC_PORTABLE
            host = check(cuda.cuMemHostAlloc(protocol.STATUS_WORDS * 4, flags), "cuMemHostAlloc(status)")
            memory.status_host = int(host)
            ctypes.memset(memory.status_host, 0, protocol.STATUS_WORDS * 4)
            memory.status = int(check(cuda.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
            check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")

    def write_peer_tables(self, addresses: list[int]) -> None:
        """Give every local rank the mailbox address of each rank, by rank (in this process)."""
        cuda = driver.api()
        if len(addresses) != self.tp or not all(addresses):
            raise ValueError(f"addresses={addresses}: expected {self.tp} non-null mailbox addresses")
        table = struct.pack(f"<{self.tp}Q", *addresses)
        for memory in self.ranks:
            with primary_context(memory.ordinal):
                check(cuda.cuMemcpyHtoD(memory.peer_table, table, len(table)), "cuMemcpyHtoD(peer_table)")
                # A copy from pageable memory may return before it lands.
                check(cuda.cuCtxSynchronize(), "cuCtxSynchronize")

    @staticmethod
    def _set_word(memory: RankMemory, word: int, value: int) -> None:
        """Store one int32 of ``memory``'s stage state (its context current; synchronous)."""
        check(driver.api().cuMemsetD32(memory.stage_state + 4 * word, value, 1), "cuMemsetD32(stage_state)")

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
                    check(driver.api().cuCtxSynchronize(), "cuCtxSynchronize")
                    self._set_word(memory, protocol.HALT, protocol.HALT_CLOSED)
                except CudaError:
                    lost.append(memory.ordinal)
        live = [memory for memory in self.ranks if memory.ordinal not in lost]
        # Every rank's kernels store into every rank's mailbox: free none of them until
        # the kernels that read HALT before it was set have finished on every device.
        for memory in live:
            with primary_context(memory.ordinal):
                check(driver.api().cuCtxSynchronize(), "cuCtxSynchronize")
        for memory in live:
            with primary_context(memory.ordinal):
                self._free_rank(memory, keep_control_words=True)
        _quarantine.append(self)
        return lost

    def free(self) -> None:
        """Release everything (no kernel may run on this group again); safe to call twice."""
        for memory in self.ranks:
            with primary_context(memory.ordinal):
                check(driver.api().cuCtxSynchronize(), "cuCtxSynchronize")
                self._free_rank(memory, keep_control_words=False)
        self.ranks = []
        self._release_contexts()

    def _free_rank(self, memory: RankMemory, *, keep_control_words: bool) -> None:
        """Free what ``memory`` holds (its context current), field by field."""
        cuda = driver.api()
        if memory.vmm is not None:
            memory.vmm.release()
            memory.mailbox = 0
        if memory.peer_table:
            check(cuda.cuMemFree(memory.peer_table), "cuMemFree")
            memory.peer_table = 0
        if keep_control_words:
            return
        if memory.stage_state:
            check(cuda.cuMemFree(memory.stage_state), "cuMemFree")
            memory.stage_state = 0
        if memory.status_host:
            check(cuda.cuMemFreeHost(memory.status_host), "cuMemFreeHost")
            memory.status_host = 0

    def _release_contexts(self) -> None:
        for device in self._contexts:
            release_primary_context(device)
        self._contexts = []


_quarantine: list[GroupMemory] = []
"""Closed groups: their control words outlive them (see `GroupMemory.close`)."""
