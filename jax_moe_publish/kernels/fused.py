"""Publish and reduce in one kernel (``KernelConfig.fuse_reduce``, oneshot).

Each thread finalizes one fragment of a token (``elements_per_thread`` bf16
values: 8 or 16 bytes, a whole number of mailbox lanes), stores it into every
peer's mailbox (its own included), then waits in its own mailbox for that same
fragment from every rank, sums in rank order, writes the output and re-arms
the slots it consumed: the publish and reduce kernels' steps, in one thread.
A call is then one launch instead of two, which is what small ``m`` pays for.

The grid is persistent: the launcher caps it at the CTAs the GPU holds at
once (``load_kernel_set`` computes that from the occupancy), and CTA ``b``
takes the tiles (publish CTA positions, ``ctas_per_token`` per token) ``b``,
``b + grid``, ... . It publishes all of its tiles before it waits for any, so
every rank publishes every tile whatever the peers' grids, and a CTA's wait
overlaps the other CTAs' publishes: the reduce starts without a second
launch at every ``m``.

Rounding, summation order, stage protocol, timeout and halt word are those of
`FinalizePublishKernel` and `LamportReduceKernel`, so a fused call returns the
same bits as an unfused one of the same config otherwise.
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


class FusedPublishReduceKernel:
    """Device code of a fused call; every compile-time choice comes from ``config``."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.publisher = FinalizePublishKernel(config)
        # Each thread polls exactly the fragment it published: 8 or 16 bytes.
        self.reducer = LamportReduceKernel(config, fragment_words=config.elements_per_thread // 2)

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
        token, fragment_offset, in_range = self.publisher.position(block)
        shared_words = self.publisher.begin_call(shared, token, fragment_offset, in_range)
        stage, halt = self.publisher.read_stage(stage_state)
        if halt != protocol.HALT_RUNNING:
            for tile in cutlass.range(block, tiles, grid):
                halted_token, halted_offset, halted_in_range = self.publisher.position(tile)
                if halted_in_range != 0:
                    self.reducer.halted(self._destination(out, halted_token, halted_offset), halt, stage,
                                        halted_token, stage_state, status)
        else:
            if in_range != 0 and block < tiles:
                packed = self.publisher.finalize(routed, weights, indices, num_rows, token, fragment_offset,
                                                 shared_words)
                self.publisher.store(packed, token, fragment_offset, peer_table, capacity_m, rank, stage)
            for tile in cutlass.range(block + grid, tiles, grid):
                next_token, next_offset, next_in_range = self.publisher.position(tile)
                if next_in_range != 0:
                    next_shared = self.publisher.load_shared(shared, next_token, next_offset, next_in_range)
                    packed = self.publisher.finalize(routed, weights, indices, num_rows, next_token,
                                                     next_offset, next_shared)
                    self.publisher.store(packed, next_token, next_offset, peer_table, capacity_m, rank, stage)
            for tile in cutlass.range(block, tiles, grid):
                wait_token, wait_offset, wait_in_range = self.publisher.position(tile)
                if wait_in_range != 0:
                    slots, sources = self.reducer.wait_contributions(
                        mailbox, stage, wait_token, wait_offset, capacity_m, wait_token, stage_state, status,
                        timeout_ns
                    )
                    ptx.store_words(self._destination(out, wait_token, wait_offset),
                                    self.reducer.sum_sources(sources))
                    for address in slots:
                        ptx.store_words(address, [Uint32(protocol.EMPTY_U32)] * self.reducer.fragment_words)
        self.reducer.finish_call(stage, stage_state, advance=True, waited=True)

    def _destination(self, out, token, fragment_offset) -> Int64:
        """Address of a fragment of output row ``token``."""
        return out + Int64(token) * (self.config.hidden * BF16_BYTES) + fragment_offset
