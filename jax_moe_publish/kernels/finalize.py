"""The finalize kernel of tp = 1 (role ``finalize``): each token's finalize is its output row."""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64

from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels.finalizer import Finalizer


class FinalizeKernel:
    """``ctas_per_row`` CTAs per token, one fragment per thread (`Finalizer`)."""

    def __init__(self, config: KernelConfig) -> None:
        self.finalizer = Finalizer(config)

    # The method name is the role: CuTe DSL names the entry kernel_cutlass_finalize_..., and
    # the compile step finds the kernel by it. The parameters are `_abi.ROLES["finalize"]`'s.
    @cute.kernel
    def finalize(
        self,
        routed: Int64,  # (num_rows, hidden) bf16
        weights: Int64,  # (m, top_k) bf16 or f32
        indices: Int64,  # (m, top_k) int32
        shared: Int64,  # (m, hidden) bf16, read only with include_shared_expert
        stage_state: Int64,  # not read: tp = 1 has no mailbox
        out: Int64,  # (m, hidden) bf16
        num_rows: Int32,
        m: Int32,
        capacity_m: Int32,  # not read
        rank: Int32,  # not read
    ) -> None:
        block, _, _ = cute.arch.block_idx()
        token, row_offset, in_range = self.finalizer.position(block)
        shared_words = self.finalizer.begin_call(shared, token, row_offset, in_range)
        if in_range != 0 and token < m:
            packed = self.finalizer.finalize(routed, weights, indices, num_rows, token, row_offset, shared_words)
            self.finalizer.store_row(packed, token, row_offset, out)
