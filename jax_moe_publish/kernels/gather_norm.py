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
    def gather_norm(self, mailbox: Int64, peer_table: Int64, stage_state: Int64, status: Int64, out: Int64,
                    timeout_ns: Int64, m: Int32, capacity_m: Int32, rank: Int32, residual: Int64,
                    norm_weight: Int64, residual_out: Int64, eps: Float32) -> None:
        self._gather_norm(mailbox, stage_state, status, out, timeout_ns, m, capacity_m, rank, residual_out, None)

    # With an FP8 out (`_abi.FP8_ROLES`): the owner's bf16 out, quantized here as the owner
    # quantizes its own rows, so every rank's bits agree.
    @cute.kernel
    def gather_norm_fp8(self, mailbox: Int64, peer_table: Int64, stage_state: Int64, status: Int64, out: Int64,
                        timeout_ns: Int64, m: Int32, capacity_m: Int32, rank: Int32, residual: Int64,
                        norm_weight: Int64, residual_out: Int64, eps: Float32, out_scales: Int64) -> None:
        self._gather_norm(mailbox, stage_state, status, out, timeout_ns, m, capacity_m, rank, residual_out,
                          (out_scales, Int64(0)))

    @cute.kernel
    def gather_norm_fp8_static(self, mailbox: Int64, peer_table: Int64, stage_state: Int64, status: Int64,
                               out: Int64, timeout_ns: Int64, m: Int32, capacity_m: Int32, rank: Int32,
                               residual: Int64, norm_weight: Int64, residual_out: Int64, eps: Float32,
                               out_scale: Int64) -> None:
        self._gather_norm(mailbox, stage_state, status, out, timeout_ns, m, capacity_m, rank, residual_out,
                          (Int64(0), out_scale))

    @cute.jit
    def _gather_norm(
        self,
        mailbox: Int64,
        stage_state: Int64,
        status: Int64,
        out: Int64,  # (m, hidden) bf16, or e4m3 with an FP8 out
        timeout_ns: Int64,
        m: Int32,
        capacity_m: Int32,
        rank: Int32,
        residual_out: Int64,  # (m, hidden) bf16
        fp8_scales,  # (out_scales, out_scale) with an FP8 out, else None
    ) -> None:
        cfg = self.config
        token, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        stage, halt = self.norm.lamport.start_call(stage_state)
        owner = token % cfg.tp
        row_offset = Int64(token) * self.norm.lamport.row_bytes
        # With an FP8 out, the gathered bf16 out of each fragment (NaN on a halted mailbox,
        # zeros past the row), quantized below by every lane.
        rOut = self.norm.fragment_registers()
        if owner != rank and token < m:
            for j in cutlass.range_constexpr(self.norm.fragments_per_thread):
                offset, present = self.norm.fragment(tidx, j)
                if cutlass.const_expr(self.norm.fp8 is not None):
                    for w in cutlass.range_constexpr(len(EMPTY)):
                        rOut[j, w] = Uint32(0)
                if present != 0 and halt != protocol.HALT_RUNNING:
                    # Never touch a halted mailbox: report (closed) and trap, or NaN out.
                    if cutlass.const_expr(self.norm.fp8 is None):
                        self.norm.lamport.halted(out + row_offset + offset, halt, stage, token, stage_state, status)
                        ptx.store_words(residual_out + row_offset + offset, [Uint32(NAN_BF16X2)] * len(EMPTY))
                    else:
                        self.norm.lamport.halted(residual_out + row_offset + offset, halt, stage, token,
                                                 stage_state, status)
                        for w in cutlass.range_constexpr(len(EMPTY)):
                            rOut[j, w] = Uint32(NAN_BF16X2)
                if present != 0 and halt == protocol.HALT_RUNNING:
                    slots = [mailbox + self.norm.lamport.gather_offset(stage, token, capacity_m, area=area) + offset
                             for area in range(protocol.GATHER_AREAS)]
                    sources = self.norm.lamport.wait(slots, [owner, owner], stage, token, stage_state, status,
                                                     timeout_ns)
                    if cutlass.const_expr(self.norm.fp8 is None):
                        ptx.store_words(out + row_offset + offset, sources[0])
                    else:
                        for w in cutlass.range_constexpr(len(EMPTY)):
                            rOut[j, w] = sources[0][w]
                    ptx.store_words(residual_out + row_offset + offset, sources[1])
                    for slot in slots:
                        ptx.store_words(slot, EMPTY)
            if cutlass.const_expr(self.norm.fp8 is not None):
                for j in cutlass.range_constexpr(self.norm.fragments_per_thread):
                    offset, present = self.norm.fragment(tidx, j)
                    self.norm.fp8.store([rOut[j, w] for w in range(len(EMPTY))], present, out, fp8_scales[0],
                                        fp8_scales[1], token, offset // 2)
        self.norm.lamport.finish_call(stage, stage_state, advance=True, waited=False)
