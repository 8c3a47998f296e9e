"""The publish kernel of a group (role ``publish``): each token's partial into the peers' mailboxes.

Nothing is stored while the mailbox is halted (``protocol.HALT``): a closed one may be freed.
The reduce (or gather) kernel that follows ends the call.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels.finalizer import Finalizer


class PublishKernel:
    """``ctas_per_row`` CTAs per token, one fragment per thread (`Finalizer`)."""

    def __init__(self, config: KernelConfig) -> None:
        self.finalizer = Finalizer(config)

    # The method name is the role: CuTe DSL names the entry kernel_cutlass_publish_..., and
    # the compile step finds the kernel by it. The parameters are `_abi.ROLES["publish"]`'s.
    @cute.kernel
    def publish(
        self,
        routed: Int64,  # (num_rows, hidden) bf16
        weights: Int64,  # (m, top_k) bf16 or f32
        indices: Int64,  # (m, top_k) int32
        shared: Int64,  # (m, hidden) bf16, read only with include_shared_expert
        stage_state: Int64,  # (STAGE_STATE_WORDS,) int32
        peer_table: Int64,  # (tp,) u64: every rank's mailbox base, by rank
        num_rows: Int32,
        m: Int32,
        capacity_m: Int32,
        rank: Int32,
    ) -> None:
        block, _, _ = cute.arch.block_idx()
        token, row_offset, in_range = self.finalizer.position(block)
        shared_words = self.finalizer.begin_call(shared, token, row_offset, in_range)
        stage, halt = self.finalizer.read_stage(stage_state)
        if in_range != 0 and token < m:
            packed = self.finalizer.finalize(routed, weights, indices, num_rows, token, row_offset, shared_words)
            if halt == protocol.HALT_RUNNING:
                self.finalizer.publish(packed, token, row_offset, peer_table, capacity_m, rank, stage)
