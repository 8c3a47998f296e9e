"""Two-shot in one persistent kernel (role ``publish_reduce_gather``: ``fuse_reduce``, twoshot).

A CTA goes through three phases over its tiles (publish CTA positions, ``ctas_per_row``
per row), ``b``, ``b + grid``, ...:

1. publish: each thread finalizes its fragment of a token (`Finalizer`) and stores it into
   the owner's mailbox, slot ``[stage][rank][t // tp]`` (the owner of token ``t`` is rank
   ``t % tp``);
2. reduce: for each row ``i`` this rank owns (token ``i * tp + rank``) it waits for every
   rank's fragment, sums in rank order (`Lamport`), writes its output row, stores the sum
   into gather slot ``[stage][t]`` of every peer and re-arms the slots it consumed;
3. gather: for each token another rank owns it waits for the owner's sum in its own gather
   slot, writes the output row and re-arms the slot.

No phase waits on a later one, and every CTA of every rank is resident at once (the
launcher caps the persistent grid), so every wait ends. The sum has -0.0 turned into +0.0,
so that the owner's row and the gathered copies carry the same bits; they are the unfused
twoshot kernels' bits. Stage protocol, timeout and halt word are those of every kernel: a
CTA counts itself in the stage's arrivals once it has published.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.finalizer import BF16_BYTES, Finalizer
from jax_moe_publish.kernels.lamport import Lamport


class PublishReduceGatherKernel:
    """``threads`` per CTA, ``ctas_per_row`` CTA positions (tiles) per row."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.finalizer = Finalizer(config)
        # Each thread polls exactly the fragment width it published: 8 or 16 bytes.
        self.lamport = Lamport(config, fragment_words=config.elements_per_thread // 2)

    # The method name is the role: CuTe DSL names the entry kernel_cutlass_publish_reduce_gather_...,
    # and the compile step finds the kernel by it. The parameters are
    # `_abi.ROLES["publish_reduce_gather"]`'s.
    @cute.kernel
    def publish_reduce_gather(
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
        cfg = self.config
        block, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tidx, _, _ = cute.arch.thread_idx()
        tiles = m * cfg.ctas_per_row
        owned_tiles = (m + cfg.tp - 1) // cfg.tp * cfg.ctas_per_row
        token, fragment_offset, in_range = self.finalizer.position(block)
        shared_words = self.finalizer.begin_call(shared, token, fragment_offset, in_range)
        stage, halt = self.finalizer.read_stage(stage_state)
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
                self.finalizer.publish(packed, token, fragment_offset, peer_table, capacity_m, rank, stage)
            for tile in cutlass.range(block + grid, tiles, grid):
                next_token, next_offset, next_in_range = self.finalizer.position(tile)
                if next_in_range != 0:
                    next_shared = self.finalizer.load_shared(shared, next_token, next_offset, next_in_range)
                    packed = self.finalizer.finalize(routed, weights, indices, num_rows, next_token, next_offset,
                                                     next_shared)
                    self.finalizer.publish(packed, next_token, next_offset, peer_table, capacity_m, rank, stage)
            arrived = self.lamport.arrive(stage_state, tidx)
            for tile in cutlass.range(block, owned_tiles, grid):
                # position() of an owned tile gives the owned row in place of the token.
                owned_row, owned_offset, owned_in_range = self.finalizer.position(tile)
                owned_token = owned_row * cfg.tp + rank
                if owned_in_range != 0 and owned_token < m:
                    slots, sources, skipped = self.lamport.wait_contributions(
                        mailbox, stage, owned_row, owned_offset, capacity_m, owned_token, stage_state, status,
                        timeout_ns
                    )
                    total = [ptx.positive_zero_bf16x2(word) for word in self.lamport.sum_sources(sources)]
                    ptx.store_words(self._destination(out, owned_token, owned_offset), total)
                    gather_slot = self.lamport.gather_offset(stage, owned_token, capacity_m) + owned_offset
                    for step in cutlass.range_constexpr(cfg.tp - 1):
                        peer = (rank + (step + 1)) % cfg.tp
                        ptx.store_words(ptx.load_u64(peer_table + Int64(peer) * 8) + gather_slot, total)
                    self.lamport.rearm(slots, skipped)
            for tile in cutlass.range(block, tiles, grid):
                gather_token, gather_offset, gather_in_range = self.finalizer.position(tile)
                owner = gather_token % cfg.tp
                if gather_in_range != 0 and owner != rank:
                    slot = mailbox + self.lamport.gather_offset(stage, gather_token, capacity_m) + gather_offset
                    sources = self.lamport.wait([slot], [owner], stage, gather_token, stage_state, status,
                                                timeout_ns)
                    ptx.store_words(self._destination(out, gather_token, gather_offset), sources[0])
                    ptx.store_words(slot, [Uint32(protocol.EMPTY_U32)] * self.lamport.fragment_words)
        self.lamport.finish_call(stage, stage_state, advance=True, waited=True, arrived=arrived)

    def _destination(self, out, token, fragment_offset) -> Int64:
        """Address of a fragment of output row ``token``."""
        return out + Int64(token) * (self.config.hidden * BF16_BYTES) + fragment_offset
