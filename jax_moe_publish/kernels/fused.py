"""Publish and reduce in one kernel (``KernelConfig.fuse_reduce``, oneshot).

Each thread finalizes one fragment of a token (``elements_per_thread`` bf16
values: 8 or 16 bytes, a whole number of mailbox lanes), stores it into every
peer's mailbox, then waits in its own mailbox for that same fragment from every
rank, sums in rank order, writes the output and re-arms the slots it consumed:
the publish and reduce kernels' steps, in one thread. A call is then one launch
instead of two, which is what small ``m`` pays for. This rank's own fragment
needs no mailbox slot: it stays in shared memory (`OwnPartials`), which saves
the HBM write, poll and re-arm of a slot (up to the buffer's tiles per CTA).

The grid is persistent: the launcher caps it at the CTAs the GPU holds at
once (``load_kernel_set`` computes that from the occupancy), and CTA ``b``
takes the tiles (publish CTA positions, ``ctas_per_token`` per token) ``b``,
``b + grid``, ... . It publishes all of its tiles before it waits for any, so
every rank publishes every tile whatever the peers' grids, and a CTA's wait
overlaps the other CTAs' publishes: the reduce starts without a second
launch at every ``m``.

Rounding, summation order, stage protocol, timeout and halt word are those of
`FinalizePublishKernel` and `LamportReduceKernel`, so a fused call returns the
same bits as an unfused one of the same config otherwise. Only the arrival that
lets the last CTA advance the stage comes earlier: once the CTA has published
(`LamportReduceKernel.arrive`), so that its round trip overlaps the waits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.publish import BF16_BYTES, FinalizePublishKernel
from jax_moe_publish.kernels.reduce import LamportReduceKernel

OWN_PARTIAL_ALIGNMENT = 16


class FusedPublishReduceKernel:
    """Device code of a fused call; every compile-time choice comes from ``config``."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.publisher = FinalizePublishKernel(config)
        # Each thread polls exactly the fragment it published: 8 or 16 bytes.
        self.reducer = LamportReduceKernel(config, fragment_words=config.elements_per_thread // 2)
        self.own = OwnPartials(self.publisher)

    @cute.kernel
    def publish_reduce(
        self,
        routed: Int64,  # (num_rows, hidden) bf16
        weights: Int64,  # (m, top_k) bf16 or f32
        indices: Int64,  # (m, top_k) int32
        shared: Int64,  # (m, hidden) bf16, read only with include_shared_expert
        mailbox: Int64,  # this device's mailbox, bf16
        peer_table: Int64,  # (tp,) u64: every rank's mailbox base, by rank
        stage_state: Int64,  # (STAGE_STATE_WORDS,) int32
        status: Int64,  # (STATUS_WORDS,) int32, host-visible diagnostics
        out: Int64,  # (m, hidden) bf16
        timeout_ns: Int64,
        num_rows: Int32,
        m: Int32,
        capacity_m: Int32,
        rank: Int32,
    ) -> None:
        block, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tiles = m * self.config.ctas_per_token
        sOwn = self.own.allocate()
        token, fragment_offset, in_range = self.publisher.position(block)
        shared_words = self.publisher.begin_call(shared, token, fragment_offset, in_range)
        stage, halt = self.publisher.read_stage(stage_state)
        tidx, _, _ = cute.arch.thread_idx()
        arrived = Int32(0)
        if halt != protocol.HALT_RUNNING:
            arrived = self.reducer.arrive(stage_state, tidx)
            for tile in cutlass.range(block, tiles, grid):
                halted_token, halted_offset, halted_in_range = self.publisher.position(tile)
                if halted_in_range != 0:
                    self.reducer.halted(self._destination(out, halted_token, halted_offset), halt, stage,
                                        halted_token, stage_state, status)
        else:
            if in_range != 0 and block < tiles:
                packed = self.publisher.finalize(routed, weights, indices, num_rows, token, fragment_offset,
                                                 shared_words)
                self.own.publish(sOwn, Int32(0), packed, token, fragment_offset, peer_table, capacity_m, rank,
                                 stage, first=True)
            for tile in cutlass.range(block + grid, tiles, grid):
                next_token, next_offset, next_in_range = self.publisher.position(tile)
                if next_in_range != 0:
                    next_shared = self.publisher.load_shared(shared, next_token, next_offset, next_in_range)
                    packed = self.publisher.finalize(routed, weights, indices, num_rows, next_token,
                                                     next_offset, next_shared)
                    self.own.publish(sOwn, (tile - block) // grid, packed, next_token, next_offset, peer_table,
                                     capacity_m, rank, stage, first=False)
            arrived = self.reducer.arrive(stage_state, tidx)
            for tile in cutlass.range(block, tiles, grid):
                wait_token, wait_offset, wait_in_range = self.publisher.position(tile)
                if wait_in_range != 0:
                    slots, sources, skipped = self.reducer.wait_contributions(
                        mailbox, stage, wait_token, wait_offset, capacity_m, wait_token, stage_state, status,
                        timeout_ns, own=self.own.held(sOwn, (tile - block) // grid, rank)
                    )
                    ptx.store_words(self._destination(out, wait_token, wait_offset),
                                    self.reducer.sum_sources(sources))
                    self.reducer.rearm(slots, skipped)
        self.reducer.finish_call(stage, stage_state, advance=True, waited=True, arrived=arrived)

    def _destination(self, out, token, fragment_offset) -> Int64:
        """Address of a fragment of output row ``token``."""
        return out + Int64(token) * (self.config.hidden * BF16_BYTES) + fragment_offset


class OwnPartials:
    """This rank's own partials in shared memory (`KernelConfig.keep_own_partial`): a fused
    kernel's alternative to its own mailbox slot for the first ``own_partial_tiles`` tiles
    (rows, with the epilogue) of each CTA.

    The buffer holds tile ``j``'s words of thread ``t`` at ``[j, t, w]``, threads
    innermost so that the accesses are free of bank conflicts. Each thread reads
    back only what it wrote: no barrier.
    """

    def __init__(self, publisher: FinalizePublishKernel) -> None:
        self.publisher = publisher
        config = publisher.config
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
            self.publisher.store(packed, token, fragment_offset, peer_table, capacity_m, rank, stage)
        elif cutlass.const_expr(first):
            published = self.publisher.store(packed, token, fragment_offset, peer_table, capacity_m, rank, stage,
                                             store_own=False)
            for w in cutlass.range_constexpr(self.words):
                sOwn[0, tidx, w] = published[w]
        else:
            kept = Int32(j < self.tiles)
            published = self.publisher.store(packed, token, fragment_offset, peer_table, capacity_m, rank, stage,
                                             store_own=Int32(kept == 0))
            if kept != 0:
                for w in cutlass.range_constexpr(self.words):
                    sOwn[j, tidx, w] = published[w]

    def held(self, sOwn, j, rank):
        """`LamportReduceKernel.wait_contributions`'s ``own`` for this thread's ``j``-th tile."""
        if sOwn is None:
            return None
        tidx, _, _ = cute.arch.thread_idx()
        kept = Int32(j < self.tiles)
        # Past the buffer, tile 0's words stand in: they are not used there.
        index = cutlass.select_(kept != 0, j, Int32(0))
        return rank, kept, lambda: [sOwn[index, tidx, w] for w in range(self.words)]
