"""A VMM allocation (``cuMemCreate`` + ``cuMemMap``) mapped into this process's address space."""

from __future__ import annotations

import dataclasses

from jax_moe_publish.memory import driver
from jax_moe_publish.memory.driver import check


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
        cuda = driver.api()
        self.handle = handle
        reserved = check(cuda.cuMemAddressReserve(self.size, alignment, 0, 0), f"cuMemAddressReserve({self.what})")
        self.address = int(reserved)
        check(cuda.cuMemMap(self.address, self.size, 0, handle, 0), f"cuMemMap({self.what})")
        self.mapped = True
        access = []
        for ordinal in dict.fromkeys(ordinals):  # virtual ranks of the tests share a device
            desc = cuda.CUmemAccessDesc()
            desc.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = ordinal
            desc.flags = cuda.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            access.append(desc)
        check(cuda.cuMemSetAccess(self.address, self.size, access, len(access)), f"cuMemSetAccess({self.what})")

    def release(self) -> None:
        """Unmap, free the address range and drop this process's reference; safe to call twice."""
        cuda = driver.api()
        if self.mapped:
            check(cuda.cuMemUnmap(self.address, self.size), f"cuMemUnmap({self.what})")
            self.mapped = False
        if self.address:
            check(cuda.cuMemAddressFree(self.address, self.size), f"cuMemAddressFree({self.what})")
            self.address = 0
        if self.handle is not None:
            check(cuda.cuMemRelease(self.handle), f"cuMemRelease({self.what})")
            self.handle = None
