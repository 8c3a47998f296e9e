"""The gather kernel of twoshot with the epilogue (role ``gather_norm``).

The owner's `ReduceNormKernel` stored both outputs of its rows into gather areas 0 (``out``)
and 1 (``residual_out``) of every peer; for every token another rank owns, this kernel
waits for both (`Lamport`), writes them, re-arms the slots and ends the call. One CTA per
row, each thread holding ``norm_fragments_per_thread`` 16-byte fragments of it (`RowNorm`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.lamport import EMPTY, NAN_BF16X2
from jax_moe_publish.kernels.row_norm import RowNorm


class GatherNormKernel:
    """One CTA of ``reduce_threads`` threads per token."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.norm = RowNorm(config)

    # The method name is the role: CuTe DSL names the entry kernel_cutlass_gather_norm_..., and
    # the compile step finds the kernel by it. The parameters are `_abi.ROLES["gather_norm"]`'s
    # (residual, norm_weight and eps are not read).
    @cute.kernel
    def gather_norm(
        self,
        mailbox: Int64,
        peer_table: Int64,
        stage_state: Int64,
        status: Int64,
        out: Int64,  # (m, hidden) bf16
        timeout_ns: Int64,
        m: Int32,
        capacity_m: Int32,
        rank: Int32,
        residual: Int64,
        norm_weight: Int64,
        residual_out: Int64,  # (m, hidden) bf16
        eps: Float32,
    ) -> None:
        cfg = self.config
        token, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        stage, halt = self.norm.lamport.start_call(stage_state)
        owner = token % cfg.tp
        row_offset = Int64(token) * self.norm.lamport.row_bytes
        if owner != rank and token < m:
            for j in cutlass.range_constexpr(self.norm.fragments_per_thread):
                offset, present = self.norm.fragment(tidx, j)
                if present != 0 and halt != protocol.HALT_RUNNING:
                    self.norm.lamport.halted(out + row_offset + offset, halt, stage, token, stage_state, status)
                    ptx.store_words(residual_out + row_offset + offset, [Uint32(NAN_BF16X2)] * len(EMPTY))
                if present != 0 and halt == protocol.HALT_RUNNING:
                    slots = [mailbox + self.norm.lamport.gather_offset(stage, token, capacity_m, area=area) + offset
                             for area in range(protocol.GATHER_AREAS)]
                    sources = self.norm.lamport.wait(slots, [owner, owner], stage, token, stage_state, status,
                                                     timeout_ns)
                    ptx.store_words(out + row_offset + offset, sources[0])
                    ptx.store_words(residual_out + row_offset + offset, sources[1])
                    for slot in slots:
                        ptx.store_words(slot, EMPTY)
        self.norm.lamport.finish_call(stage, stage_state, advance=True, waited=False)
