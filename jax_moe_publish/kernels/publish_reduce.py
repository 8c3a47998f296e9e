"""Publish and reduce in one persistent kernel (role ``publish_reduce``: ``fuse_reduce``, oneshot).

Each thread finalizes one fragment of a token (`Finalizer`), stores it into every peer's
mailbox, then waits in its own mailbox for that same fragment from every rank, sums in
rank order, writes the output and re-arms the slots it consumed (`Lamport`). This rank's
own fragment stays in shared memory (`OwnPartials`) for a CTA's first tiles.

The grid is persistent: the launcher caps it at the CTAs the GPU holds at once, and CTA
``b`` takes the tiles (publish CTA positions, ``ctas_per_row`` per token) ``b``,
``b + grid``, ... . It publishes all of its tiles before it waits for any, so every rank
publishes every tile whatever the peers' grids. A CTA counts itself in the stage's
arrivals once it has published (`Lamport.arrive`), so that the atomic overlaps its waits.
Rounding, summation order, stage protocol, timeout and halt word are those of the unfused
kernels: a fused call returns the same bits.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.finalizer import BF16_BYTES, Finalizer
from jax_moe_publish.kernels.lamport import Lamport
from jax_moe_publish.kernels.own_partials import OwnPartials


class PublishReduceKernel:
    """``threads`` per CTA, ``ctas_per_row`` CTA positions (tiles) per token."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.finalizer = Finalizer(config)
        # Each thread polls exactly the fragment it published: 8 or 16 bytes.
        self.lamport = Lamport(config, fragment_words=config.elements_per_thread // 2)
        self.own = OwnPartials(self.finalizer)

    # The method name is the role: CuTe DSL names the entry kernel_cutlass_publish_reduce_...,
    # and the compile step finds the kernel by it. The parameters are
    # `_abi.ROLES["publish_reduce"]`'s.
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
        tiles = m * self.config.ctas_per_row
        sOwn = self.own.allocate()
        token, fragment_offset, in_range = self.finalizer.position(block)
        shared_words = self.finalizer.begin_call(shared, token, fragment_offset, in_range)
        stage, halt = self.finalizer.read_stage(stage_state)
        tidx, _, _ = cute.arch.thread_idx()
        arrived = Int32(0)
        if halt != protocol.HALT_RUNNING:
            arrived = self.lamport.arrive(stage_state, tidx)
            for tile in cutlass.range(block, tiles, grid):
                halted_token, halted_offset, halted_in_range = self.finalizer.position(tile)
                if halted_in_range != 0:
                    self.lamport.halted(self._destination(out, halted_token, halted_offset), halt, stage,
                                        halted_token, stage_state, status)
        else:
            if in_range != 0 and block < tiles:
                packed = self.finalizer.finalize(routed, weights, indices, num_rows, token, fragment_offset,
                                                 shared_words)
                self.own.publish(sOwn, Int32(0), packed, token, fragment_offset, peer_table, capacity_m, rank,
                                 stage, first=True)
            for tile in cutlass.range(block + grid, tiles, grid):
                next_token, next_offset, next_in_range = self.finalizer.position(tile)
                if next_in_range != 0:
                    next_shared = self.finalizer.load_shared(shared, next_token, next_offset, next_in_range)
                    packed = self.finalizer.finalize(routed, weights, indices, num_rows, next_token, next_offset,
                                                     next_shared)
                    self.own.publish(sOwn, (tile - block) // grid, packed, next_token, next_offset, peer_table,
                                     capacity_m, rank, stage, first=False)
            arrived = self.lamport.arrive(stage_state, tidx)
            for tile in cutlass.range(block, tiles, grid):
                wait_token, wait_offset, wait_in_range = self.finalizer.position(tile)
                if wait_in_range != 0:
                    slots, sources, skipped = self.lamport.wait_contributions(
                        mailbox, stage, wait_token, wait_offset, capacity_m, wait_token, stage_state, status,
                        timeout_ns, own=self.own.held(sOwn, (tile - block) // grid, rank)
                    )
                    ptx.store_words(self._destination(out, wait_token, wait_offset),
                                    self.lamport.sum_sources(sources))
                    self.lamport.rearm(slots, skipped)
        self.lamport.finish_call(stage, stage_state, advance=True, waited=True, arrived=arrived)

    def _destination(self, out, token, fragment_offset) -> Int64:
        """Address of a fragment of output row ``token``."""
        return out + Int64(token) * (self.config.hidden * BF16_BYTES) + fragment_offset
