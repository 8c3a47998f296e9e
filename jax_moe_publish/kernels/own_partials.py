"""This rank's own partials in shared memory (`KernelConfig.keep_own_partial`): a device piece of
the fused kernels, which need no mailbox slot for them."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels.finalizer import BF16_BYTES, Finalizer

OWN_PARTIAL_ALIGNMENT = 16


class OwnPartials:
    """This rank's own partials in shared memory (`KernelConfig.keep_own_partial`): a fused
    kernel's alternative to its own mailbox slot for the first ``own_partial_tiles`` tiles
    (rows, with the epilogue) of each CTA.

    The buffer holds tile ``j``'s words of thread ``t`` at ``[j, t, w]``, threads
    innermost so that the accesses are free of bank conflicts. Each thread reads
    back only what it wrote: no barrier.
    """

    def __init__(self, finalizer: Finalizer) -> None:
        self.finalizer = finalizer
        config = finalizer.config
        self.tiles = config.own_partial_tiles
        self.threads = config.threads
        self.words = config.elements_per_thread // 2

    @staticmethod
    def shared_bytes(config: KernelConfig) -> int:
        """Shared memory of the buffer (0 without it), a multiple of ``OWN_PARTIAL_ALIGNMENT``."""
        return config.own_partial_tiles * config.threads * config.elements_per_thread * BF16_BYTES

    def allocate(self):
        """The buffer, or None when the config keeps no own partial."""
        if self.tiles == 0:
            return None
        layout = cute.make_layout((self.tiles, self.threads, self.words),
                                  stride=(self.threads * self.words, 1, self.threads))
        return cutlass.memory.SmemAllocator().allocate_tensor(Uint32, layout,
                                                              byte_alignment=OWN_PARTIAL_ALIGNMENT)

    @cute.jit
    def publish(self, sOwn, j, packed, token, fragment_offset, peer_table, capacity_m, rank, stage,
                first: cutlass.Constexpr[bool]) -> None:
        """Publish ``packed``, this thread's fragment of its ``j``-th tile (``first``: ``j`` is 0),
        into the peers' mailboxes, and into ``sOwn`` instead of the own slot while ``j`` fits."""
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(sOwn is None):
            self.finalizer.publish(packed, token, fragment_offset, peer_table, capacity_m, rank, stage)
        elif cutlass.const_expr(first):
            published = self.finalizer.publish(packed, token, fragment_offset, peer_table, capacity_m, rank,
                                               stage, store_own=False)
            for w in cutlass.range_constexpr(self.words):
                sOwn[0, tidx, w] = published[w]
        else:
            kept = Int32(j < self.tiles)
            published = self.finalizer.publish(packed, token, fragment_offset, peer_table, capacity_m, rank,
                                               stage, store_own=Int32(kept == 0))
            if kept != 0:
                for w in cutlass.range_constexpr(self.words):
                    sOwn[j, tidx, w] = published[w]

    def held(self, sOwn, j, rank):
        """`Lamport.wait_contributions`'s ``own`` for this thread's ``j``-th tile."""
        if sOwn is None:
            return None
        tidx, _, _ = cute.arch.thread_idx()
        kept = Int32(j < self.tiles)
        # Past the buffer, tile 0's words stand in: they are not used there.
        index = cutlass.select_(kept != 0, j, Int32(0))
        return rank, kept, lambda: [sOwn[index, tidx, w] for w in range(self.words)]
