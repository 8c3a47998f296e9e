"""The whole epilogue call in one persistent kernel (role ``publish_reduce_norm``: ``fuse_reduce``,
oneshot, the residual add + RMSNorm).

A row's ``ctas_per_row`` CTAs form a thread block cluster, so that the row's expert
loads spread over as many SMs as the plain publish's. Cluster ``c`` first publishes each
thread's fragment of rows ``c``, ``c + clusters``, ... (as `PublishReduceKernel` does; the
launcher caps the grid at the resident clusters), then waits for, sums and normalizes
the same rows (`RowNorm`), the CTAs' sums of squares added in cluster order through
distributed shared memory (`RowSums`). It reads the residual only after
``griddepcontrol.wait``, since it may be the previous call's ``residual_out``. Every
guarantee of the plain reduce holds (`Lamport`): a bounded wait, exactly the consumed
slots re-armed, the stage advanced by the last CTA, and the same bits on every rank.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels.finalizer import Finalizer
from jax_moe_publish.kernels.own_partials import OwnPartials
from jax_moe_publish.kernels.row_norm import RowNorm, cluster_ctas


class PublishReduceNormKernel:
    """``threads`` (= ``reduce_threads``) per CTA, one fragment each; a cluster of
    ``ctas_per_row`` CTAs per row."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.finalizer = Finalizer(config)
        self.own = OwnPartials(self.finalizer)
        self.norm = RowNorm(config)
        self.cluster = cluster_ctas(config)

    # The method name is the role: CuTe DSL names the entry kernel_cutlass_publish_reduce_norm_...,
    # and the compile step finds the kernel by it. The parameters are
    # `_abi.ROLES["publish_reduce_norm"]`'s.
    @cute.kernel
    def publish_reduce_norm(self, routed: Int64, weights: Int64, indices: Int64, shared: Int64, mailbox: Int64,
                            peer_table: Int64, stage_state: Int64, status: Int64, out: Int64, timeout_ns: Int64,
                            num_rows: Int32, m: Int32, capacity_m: Int32, rank: Int32, residual: Int64,
                            norm_weight: Int64, residual_out: Int64, eps: Float32) -> None:
        self._publish_reduce_norm(routed, weights, indices, shared, mailbox, peer_table, stage_state, status, out,
                                  timeout_ns, num_rows, m, capacity_m, rank, residual, norm_weight, residual_out,
                                  eps, None)

    # With an FP8 out (`_abi.FP8_ROLES`): ``out`` e4m3, with its scales or the static scale.
    @cute.kernel
    def publish_reduce_norm_fp8(self, routed: Int64, weights: Int64, indices: Int64, shared: Int64, mailbox: Int64,
                                peer_table: Int64, stage_state: Int64, status: Int64, out: Int64, timeout_ns: Int64,
                                num_rows: Int32, m: Int32, capacity_m: Int32, rank: Int32, residual: Int64,
                                norm_weight: Int64, residual_out: Int64, eps: Float32, out_scales: Int64) -> None:
        self._publish_reduce_norm(routed, weights, indices, shared, mailbox, peer_table, stage_state, status, out,
                                  timeout_ns, num_rows, m, capacity_m, rank, residual, norm_weight, residual_out,
                                  eps, (out_scales, Int64(0)))

    @cute.kernel
    def publish_reduce_norm_fp8_static(self, routed: Int64, weights: Int64, indices: Int64, shared: Int64,
                                       mailbox: Int64, peer_table: Int64, stage_state: Int64, status: Int64,
                                       out: Int64, timeout_ns: Int64, num_rows: Int32, m: Int32, capacity_m: Int32,
                                       rank: Int32, residual: Int64, norm_weight: Int64, residual_out: Int64,
                                       eps: Float32, out_scale: Int64) -> None:
        self._publish_reduce_norm(routed, weights, indices, shared, mailbox, peer_table, stage_state, status, out,
                                  timeout_ns, num_rows, m, capacity_m, rank, residual, norm_weight, residual_out,
                                  eps, (Int64(0), out_scale))

    @cute.jit
    def _publish_reduce_norm(
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
        residual: Int64,  # (m, hidden) bf16
        norm_weight: Int64,  # (hidden,) bf16
        residual_out: Int64,  # (m, hidden) bf16
        eps: Float32,
        fp8_scales,  # (out_scales, out_scale) with an FP8 out, else None
    ) -> None:
        cfg = self.config
        block, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        sOwn = self.own.allocate()
        sums = self.norm.row_sums.allocate()
        self.norm.row_sums.initialize(sums, tidx)
        grid, _, _ = cute.arch.grid_dim()
        cluster_rank = block % self.cluster
        first_row = block // self.cluster
        clusters = grid // self.cluster
        if cutlass.const_expr(self.cluster > 1):
            # Every CTA of the cluster has started, and initialized its mbarriers, before any
            # writes into another's shared memory (the wait comes after the publishes).
            cute.arch.cluster_arrive_relaxed()
        _, offset, present = self.finalizer.position(first_row * self.cluster + cluster_rank)
        first_fragment = cluster_rank * cfg.threads + tidx
        shared_words = self.finalizer.begin_call(shared, first_row, offset, present)
        stage, halt = self.finalizer.read_stage(stage_state)
        # After begin_call's griddepcontrol.wait: the residual may be the previous
        # call's residual_out, written by the kernel just before.
        rWeight = self.norm.load_norm_weight(norm_weight, first_fragment)
        if present != 0:
            # The inputs are XLA's buffers, valid whatever the halt word: only the stores
            # into the mailbox wait for its value, not the first row's loads.
            packed = self.finalizer.finalize(routed, weights, indices, num_rows, first_row, offset, shared_words)
            if halt == protocol.HALT_RUNNING:
                self.own.publish(sOwn, Int32(0), packed, first_row, offset, peer_table, capacity_m, rank, stage,
                                 first=True)
        # A separate test, not nested in the one above: nested, ptxas spills 16 bytes in
        # the hidden-9216 fp32-weight kernels.
        if present != 0 and halt == protocol.HALT_RUNNING:
            for row in cutlass.range(first_row + clusters, m, clusters):
                row_shared = self.finalizer.load_shared(shared, row, offset, present)
                packed = self.finalizer.finalize(routed, weights, indices, num_rows, row, offset, row_shared)
                self.own.publish(sOwn, (row - first_row) // clusters, packed, row, offset, peer_table, capacity_m,
                                 rank, stage, first=False)
        if cutlass.const_expr(self.cluster > 1):
            cute.arch.cluster_wait()
        arrived = self.norm.lamport.arrive(stage_state, tidx)
        for row in cutlass.range(first_row, m, clusters):
            j = (row - first_row) // clusters
            rResidual = self.norm.load_residual(residual, row, Int32(1), first_fragment)
            self.norm.norm_row(row, row, Int32(1), stage, halt, rWeight, rResidual, tidx, first_fragment, sums, j,
                               mailbox, stage_state, status, out, timeout_ns, capacity_m, residual_out, eps,
                               self.own.held(sOwn, j, rank), None, fp8_scales)
        self.norm.lamport.finish_call(stage, stage_state, advance=True, waited=True, arrived=arrived)
