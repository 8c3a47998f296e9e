"""The reduce kernel with the epilogue (role ``reduce_norm``), after a `PublishKernel`.

In twoshot the owner's rows then go to every peer's gather areas, and a `GatherNormKernel`
ends the call.

One CTA per row, each thread holding ``KernelConfig.norm_fragments_per_thread`` 16-byte
fragments (one for hidden <= 8192: 896 threads for 7168): the mean then needs only a block
reduction (`RowSums`). The wait, the stage protocol, the timeout and the halt word are the
plain reduce's (`Lamport`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels.row_norm import RowNorm


class ReduceNormKernel:
    """One CTA of ``reduce_threads`` threads per row (a token, or an owned row)."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.norm = RowNorm(config)

    # The method name is the role: CuTe DSL names the entry kernel_cutlass_reduce_norm_..., and
    # the compile step finds the kernel by it. The parameters are `_abi.ROLES["reduce_norm"]`'s.
    @cute.kernel
    def reduce_norm(self, mailbox: Int64, peer_table: Int64, stage_state: Int64, status: Int64, out: Int64,
                    timeout_ns: Int64, m: Int32, capacity_m: Int32, rank: Int32, residual: Int64,
                    norm_weight: Int64, residual_out: Int64, eps: Float32) -> None:
        self._reduce_norm(mailbox, peer_table, stage_state, status, out, timeout_ns, m, capacity_m, rank, residual,
                          norm_weight, residual_out, eps, None)

    # With an FP8 out (`_abi.FP8_ROLES`): ``out`` e4m3, with its scales or the static scale.
    @cute.kernel
    def reduce_norm_fp8(self, mailbox: Int64, peer_table: Int64, stage_state: Int64, status: Int64, out: Int64,
                        timeout_ns: Int64, m: Int32, capacity_m: Int32, rank: Int32, residual: Int64,
                        norm_weight: Int64, residual_out: Int64, eps: Float32, out_scales: Int64) -> None:
        self._reduce_norm(mailbox, peer_table, stage_state, status, out, timeout_ns, m, capacity_m, rank, residual,
                          norm_weight, residual_out, eps, (out_scales, Int64(0)))

    @cute.kernel
    def reduce_norm_fp8_static(self, mailbox: Int64, peer_table: Int64, stage_state: Int64, status: Int64,
                               out: Int64, timeout_ns: Int64, m: Int32, capacity_m: Int32, rank: Int32,
                               residual: Int64, norm_weight: Int64, residual_out: Int64, eps: Float32,
                               out_scale: Int64) -> None:
        self._reduce_norm(mailbox, peer_table, stage_state, status, out, timeout_ns, m, capacity_m, rank, residual,
                          norm_weight, residual_out, eps, (Int64(0), out_scale))

    @cute.jit
    def _reduce_norm(
        self,
        mailbox: Int64,  # this device's mailbox, bf16
        peer_table: Int64,  # (tp,) u64: every rank's mailbox base, by rank
        stage_state: Int64,  # (STAGE_STATE_WORDS,) int32
        status: Int64,  # (STATUS_WORDS,) int32, host-visible diagnostics
        out: Int64,  # (rows, hidden) bf16: rows = m, or ceil(m/tp) for reduce_scatter
        timeout_ns: Int64,
        m: Int32,
        capacity_m: Int32,
        rank: Int32,
        residual: Int64,  # (rows, hidden) bf16
        norm_weight: Int64,  # (hidden,) bf16
        residual_out: Int64,  # (rows, hidden) bf16
        eps: Float32,
        fp8_scales,  # (out_scales, out_scale) with an FP8 out, else None
    ) -> None:
        cfg = self.config
        block, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(not cfg.owned_rows):
            token = block
        else:
            token = block * cfg.tp + rank
        # The residual has the result's layout: every token's row, or reduce_scatter's own rows.
        residual_row = block if cutlass.const_expr(cfg.out_owned) else token
        # The residual and the weight are read before the mailbox wait, although this
        # kernel never waits for its predecessor: it starts only once every publish CTA
        # has passed its griddepcontrol.wait (the publish releases it after that wait),
        # so everything the stream ran before the publish, where these inputs come from,
        # has completed.
        live = Int32(token < m)
        rWeight = self.norm.load_norm_weight(norm_weight, tidx)
        rResidual = self.norm.load_residual(residual, residual_row, live, tidx)
        stage, halt = self.norm.lamport.start_call(stage_state)
        self.norm.norm_row(block, token, live, stage, halt, rWeight, rResidual, tidx, tidx,
                           self.norm.row_sums.allocate(), Int32(0), mailbox, stage_state, status, out, timeout_ns,
                           capacity_m, residual_out, eps, None, (peer_table, rank), fp8_scales)
        # Where the owners fan out, the gather ends the call and advances the stage.
        self.norm.lamport.finish_call(stage, stage_state, advance=not cfg.fans_out, waited=False)
