"""The finalize of one token fragment, and where it is stored (`Finalizer`): a device piece of
every kernel that finalizes (`FinalizeKernel`, `PublishKernel` and the fused kernels).

Per token ``t`` and fragment of ``E`` (4 or 8) bf16 values::

    y[t] = bf16( sum_k  (w[t, k] * scale) * routed[idx[t, k]]  +  shared[t] )

accumulated in float32 in the order k = 0..top_k-1. An index outside
``[0, num_rows)`` (-1 included) contributes nothing and its row is never read.
``y`` then goes to row ``t`` of the output (tp = 1), or for a group to slot
``[stage][rank][t]`` of every peer's mailbox through the peer table (``tp - 1``
stores where a fused kernel keeps its own partial), or, for the owner algorithms,
to the owner ``t % tp`` only, slot ``[stage][rank][t // tp]``. Published values
never hold bf16 -0.0 (the empty sentinel): it becomes +0.0.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx

BF16_BYTES = 2


class Finalizer:
    """Finalize and store of a token fragment; every compile-time choice comes from ``config``."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.elements = config.elements_per_thread
        self.words = self.elements // 2
        self.prefetch_groups = -(-config.top_k // config.prefetch_group)

    def position(self, tile):
        """(token, byte offset of the fragment in the row, Int32 1 if the fragment lies in the row)
        of this thread in ``tile``: the publish CTA index (``ctas_per_row`` per token)."""
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        token = tile // cfg.ctas_per_row
        fragment = (tile % cfg.ctas_per_row) * cfg.threads + tidx
        return token, Int64(fragment) * (self.elements * BF16_BYTES), Int32(fragment < cfg.fragments)

    def begin_call(self, shared, token, row_offset, in_range) -> list:
        """Wait for the predecessor grid, let the next one launch, and return the shared
        expert fragment (empty without it)."""
        cfg = self.config
        shared_words = []
        if cutlass.const_expr(cfg.load_shared_expert_before_pdl):
            shared_words = self.load_shared(shared, token, row_offset, in_range)
        if cutlass.const_expr(cfg.enable_pdl):
            # Every input may come from the kernel just before (the router, the
            # experts), so nothing else is read before this wait.
            cute.arch.griddepcontrol_wait()
            # The reduce reads only the mailbox and the stage word, so it may start
            # polling now, while this grid is still publishing. A successor of the fused
            # kernel reads nothing before its own griddepcontrol.wait.
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(not cfg.load_shared_expert_before_pdl):
            shared_words = self.load_shared(shared, token, row_offset, in_range)
        return shared_words

    def load_shared(self, shared, token, row_offset, in_range) -> list:
        """The shared expert fragment of ``token`` (empty without the shared expert)."""
        if cutlass.const_expr(not self.config.include_shared_expert):
            return []
        shared_row = shared + Int64(token) * (self.config.hidden * BF16_BYTES) + row_offset
        return ptx.load_words(shared_row, self.words, predicate=in_range)

    def read_stage(self, stage_state) -> tuple:
        """The call's stage and the HALT word: a halted mailbox may be freed (closed), so
        nothing may be stored into it."""
        stage = ptx.load_volatile_s32(stage_state + protocol.NEXT_STAGE * 4)
        halt = ptx.load_volatile_s32(stage_state + protocol.HALT * 4)
        return stage, halt

    def finalize(self, routed, weights, indices, num_rows, token, row_offset, shared_words) -> list:
        """The bf16x2 words of one fragment of ``y[token]``."""
        cfg = self.config
        # Every thread reads the token's indices and weights itself (the warp's
        # loads of one address are one transaction): no shared memory, no barrier.
        rows, scaled_weights = [], []
        for k in range(cfg.top_k):
            element = Int64(token) * cfg.top_k + Int64(k)
            row = ptx.load_s32(indices + element * 4)
            if cutlass.const_expr(cfg.fp32_weights):
                weight = ptx.load_f32(weights + element * 4)
            else:
                weight = ptx.load_bf16_as_f32(weights + element * BF16_BYTES)
            if cutlass.const_expr(cfg.routed_scaling_factor != 1.0):
                weight = weight * Float32(cfg.routed_scaling_factor)
            valid = (row >= 0) & (row < num_rows)
            rows.append((row, Int32(valid)))
            # A skipped expert's weight is 0 so that a NaN weight stays skipped.
            scaled_weights.append(Float32(cutlass.select_(valid, weight, Float32(0.0))))
        accumulator = [Float32(0.0)] * self.elements
        for group in range(self.prefetch_groups):
            members = [
                k
                for k in range(group * cfg.prefetch_group, (group + 1) * cfg.prefetch_group)
                if k < cfg.top_k
            ]
            # Issue every load of the group before the first use.
            loaded = []
            for k in members:
                row, valid = rows[k]
                source = routed + Int64(row) * (cfg.hidden * BF16_BYTES) + row_offset
                loaded.append(ptx.load_words(source, self.words, predicate=valid))
            for k, words in zip(members, loaded):
                accumulator = self._accumulate(accumulator, words, scaled_weights[k])
        if cutlass.const_expr(cfg.include_shared_expert):
            accumulator = self._accumulate(accumulator, shared_words, None)
        return [
            ptx.f32x2_to_bf16x2(accumulator[2 * i], accumulator[2 * i + 1])
            for i in range(self.words)
        ]

    def _accumulate(self, accumulator: list, words: list, weight) -> list:
        """accumulator + weight * bf16(words), or + bf16(words) when weight is None."""
        result = []
        for i, word in enumerate(words):
            low, high = ptx.bf16x2_to_f32(word)
            if cutlass.const_expr(weight is None):
                result += [accumulator[2 * i] + low, accumulator[2 * i + 1] + high]
            else:
                result += [accumulator[2 * i] + weight * low, accumulator[2 * i + 1] + weight * high]
        return result

    def store_row(self, packed: list, token, row_offset, out) -> None:
        """Store fragment ``packed`` of ``y[token]`` into output row ``token`` (tp = 1)."""
        ptx.store_words(out + Int64(token) * (self.config.hidden * BF16_BYTES) + row_offset, packed)

    def publish(self, packed: list, token, row_offset, peer_table, capacity_m, rank, stage, store_own=True) -> list:
        """Store fragment ``packed`` of ``y[token]`` into the mailboxes and return the words
        published. A fused kernel that keeps its own partial passes ``store_own`` False, or an
        Int32 that is zero where it keeps it: oneshot then skips the store into this rank's own
        mailbox."""
        cfg = self.config
        packed = [ptx.positive_zero_bf16x2(word) for word in packed]
        if cutlass.const_expr(not cfg.owned_rows):
            slot = Int64(token)
        else:
            slot = Int64(token // cfg.tp)
        slot_bytes = (
            ((Int64(stage) * cfg.tp + Int64(rank)) * Int64(capacity_m) + slot)
            * (cfg.hidden * BF16_BYTES)
            + row_offset
        )
        if cutlass.const_expr(not cfg.owned_rows):
            # Start at the next rank so that the ranks' first stores go to different peers;
            # the last store is this rank's own.
            for step in range(cfg.tp - 1):
                peer = (rank + (step + 1)) % cfg.tp
                ptx.store_words(ptx.load_u64(peer_table + Int64(peer) * 8) + slot_bytes, packed)
            if cutlass.const_expr(store_own is not False):
                own_slot = ptx.load_u64(peer_table + Int64(rank) * 8) + slot_bytes
                ptx.store_words(own_slot, packed, predicate=None if store_own is True else store_own)
        else:
            owner = token % cfg.tp
            ptx.store_words(ptx.load_u64(peer_table + Int64(owner) * 8) + slot_bytes, packed)
        return packed
