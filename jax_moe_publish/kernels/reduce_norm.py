"""Lamport reduce with the fused epilogue: residual add, then RMSNorm, per row.

For a row (a token in oneshot, an owned row in reduce_scatter), with every
float32 operation between these rounding points::

    y            = bf16( sum_src float32(partial_src) )            (src = 0..tp-1)
    residual_out = bf16( float32(y) + float32(residual) )
    out          = bf16( float32(residual_out) * rsqrt(mean(float32(residual_out)^2) + eps)
                         * float32(norm_weight) )

Launch shape: one CTA per row, each thread holding
``KernelConfig.norm_fragments_per_thread`` 16-byte fragments (one for hidden
<= 8192: 896 threads for 7168). The mean then needs only a block reduction
(warp shuffles, one float per warp through shared memory, one barrier), and
each fragment stays in the registers of the thread that waited for it, from
the mailbox poll to the two stores.

``publish_reduce_norm`` (``fuse_reduce``, oneshot, one fragment per thread)
is the whole call in one kernel: each thread of the row's CTA first publishes
its fragment of the row, as `FusedPublishReduceKernel` does, then goes on as
above; it reads the residual only after ``griddepcontrol.wait``, since it may
be the previous call's ``residual_out``.

The wait, the stage protocol, the timeout and the halt word are the plain
reduce's (`LamportReduceKernel`), so every guarantee of it holds here: a bounded wait,
exactly the consumed slots re-armed, the stage advanced by the last CTA, and
the same bits on every rank (the same config fixes every summation order).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.publish import FinalizePublishKernel
from jax_moe_publish.kernels.reduce import EMPTY, FRAGMENT_BYTES, NAN_BF16X2, WORDS, LamportReduceKernel

WARP = 32
FLOAT_BYTES = 4


def shared_bytes(config: KernelConfig) -> int:
    """Dynamic shared memory of reduce_norm: one float per warp (the launcher must pass it)."""
    return config.reduce_threads // WARP * FLOAT_BYTES


class LamportReduceNormKernel(LamportReduceKernel):
    """Device code of the fused reduce; every compile-time choice comes from ``config``."""

    def __init__(self, config: KernelConfig) -> None:
        super().__init__(config)
        # The fused kernel's publish: its CTA is the row's, one 16-byte fragment per thread.
        self.publisher = FinalizePublishKernel(config)
        self.fragments_per_thread = config.norm_fragments_per_thread
        self.warps = config.reduce_threads // WARP

    @cute.kernel
    def reduce_norm(
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
    ) -> None:
        self._call(None, mailbox, peer_table, stage_state, status, out, timeout_ns, m, capacity_m, rank,
                   residual, norm_weight, residual_out, eps)

    @cute.kernel
    def publish_reduce_norm(
        self,
        routed: Int64,  # (num_rows, hidden) bf16
        weights: Int64,  # (m, top_k) bf16 or f32
        indices: Int64,  # (m, top_k) int32
        shared: Int64,  # (m, hidden) bf16, read only with include_shared_expert
        mailbox: Int64,
        peer_table: Int64,
        stage_state: Int64,
        status: Int64,
        out: Int64,  # (m, hidden) bf16
        timeout_ns: Int64,
        num_rows: Int32,
        m: Int32,
        capacity_m: Int32,
        rank: Int32,
        residual: Int64,
        norm_weight: Int64,
        residual_out: Int64,
        eps: Float32,
    ) -> None:
        """The whole call in one kernel (``fuse_reduce``, oneshot): each thread first
        publishes the fragment it will wait for (`FusedPublishReduceKernel`'s scheme)."""
        self._call((routed, weights, indices, shared, num_rows), mailbox, peer_table, stage_state, status,
                   out, timeout_ns, m, capacity_m, rank, residual, norm_weight, residual_out, eps)

    @cute.jit
    def _call(self, finalize_inputs, mailbox, peer_table, stage_state, status, out, timeout_ns, m,
              capacity_m, rank, residual, norm_weight, residual_out, eps) -> None:
        """Either kernel's body; ``finalize_inputs`` (routed, weights, indices, shared, num_rows)
        is None for reduce_norm."""
        cfg = self.config
        fused = finalize_inputs is not None
        row, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(cfg.mode == "oneshot"):
            token = row
        else:
            token = row * cfg.tp + rank
        live = token < m
        row_offset = Int64(row) * self.row_bytes

        if cutlass.const_expr(fused):
            # The residual may be the previous call's residual_out, written by the kernel
            # just before: read it only after griddepcontrol.wait (in begin_call).
            routed, weights, indices, shared, num_rows = finalize_inputs
            publish_offset, publish_present = self._fragment(tidx, 0)
            shared_words = self.publisher.begin_call(shared, token, publish_offset, publish_present)
            stage, halt = self.publisher.read_stage(stage_state)

        # The residual and the weight are read before the mailbox wait. In reduce_norm that
        # is safe although it never waits for its predecessor before reading them: it can
        # start only once every publish CTA has passed its griddepcontrol.wait (the publish
        # releases it after that wait), so everything the stream ran before the publish,
        # where these inputs come from, has completed.
        rResidual = cute.make_rmem_tensor(cute.make_layout((self.fragments_per_thread, WORDS)), Uint32)
        rWeight = cute.make_rmem_tensor(cute.make_layout((self.fragments_per_thread, WORDS)), Uint32)
        for j in cutlass.range_constexpr(self.fragments_per_thread):
            offset, present = self._fragment(tidx, j)
            weight = ptx.load_words(norm_weight + offset, WORDS, predicate=present)
            kept = ptx.load_words(residual + row_offset + offset, WORDS, predicate=present & Int32(live))
            for w in cutlass.range_constexpr(WORDS):
                rWeight[j, w] = weight[w]
                rResidual[j, w] = kept[w]

        if cutlass.const_expr(fused):
            if publish_present != 0 and halt == protocol.HALT_RUNNING:
                packed = self.publisher.finalize(routed, weights, indices, num_rows, token, publish_offset,
                                                 shared_words)
                self.publisher.store(packed, token, publish_offset, peer_table, capacity_m, rank, stage)
        else:
            stage, halt = self._start_call(stage_state)
        # residual_out, as bf16 words, and the float32 sum of its squares over this thread's lanes.
        rResidualOut = cute.make_rmem_tensor(cute.make_layout((self.fragments_per_thread, WORDS)), Uint32)
        squares = Float32(0.0)
        if live:
            for j in cutlass.range_constexpr(self.fragments_per_thread):
                offset, present = self._fragment(tidx, j)
                if present != 0 and halt != protocol.HALT_RUNNING:
                    # Never touch a halted mailbox: report (closed) and trap, or NaN out.
                    self.halted(residual_out + row_offset + offset, halt, stage, token, stage_state, status)
                    for w in cutlass.range_constexpr(WORDS):
                        rResidualOut[j, w] = Uint32(NAN_BF16X2)
                if present != 0 and halt == protocol.HALT_RUNNING:
                    slots, sources = self.wait_contributions(
                        mailbox, stage, row, offset, capacity_m, token, stage_state, status, timeout_ns
                    )
                    total = self.sum_sources(sources)
                    for address in slots:
                        ptx.store_words(address, EMPTY)
                    for w in cutlass.range_constexpr(WORDS):
                        y_low, y_high = ptx.bf16x2_to_f32(total[w])
                        r_low, r_high = ptx.bf16x2_to_f32(rResidual[j, w])
                        word = ptx.f32x2_to_bf16x2(y_low + r_low, y_high + r_high)
                        rResidualOut[j, w] = word
                        low, high = ptx.bf16x2_to_f32(word)
                        squares = squares + low * low + high * high

        # Every thread takes part in the row sum (it has a barrier); rows past m sum zeros.
        mean = self._row_sum(squares, tidx) / Float32(cfg.hidden)
        inverse_rms = ptx.rsqrt_f32(mean + eps)
        for j in cutlass.range_constexpr(self.fragments_per_thread):
            offset, present = self._fragment(tidx, j)
            if present != 0:
                if live:
                    normed = []
                    for w in cutlass.range_constexpr(WORDS):
                        x_low, x_high = ptx.bf16x2_to_f32(rResidualOut[j, w])
                        g_low, g_high = ptx.bf16x2_to_f32(rWeight[j, w])
                        normed.append(
                            ptx.f32x2_to_bf16x2(x_low * inverse_rms * g_low, x_high * inverse_rms * g_high)
                        )
                    ptx.store_words(residual_out + row_offset + offset,
                                    [rResidualOut[j, w] for w in range(WORDS)])
                    ptx.store_words(out + row_offset + offset, normed)
                else:
                    if cutlass.const_expr(cfg.mode == "reduce_scatter"):
                        # Rows of no token: both outputs are +0.0, like the plain reduce's.
                        ptx.store_words(residual_out + row_offset + offset, [Uint32(0)] * WORDS)
                        ptx.store_words(out + row_offset + offset, [Uint32(0)] * WORDS)
        self.finish_call(stage, stage_state, advance=True, waited=fused)

    def _fragment(self, tidx, j: int):
        """(byte offset in the row, Int32 1 if it lies in the row) of this thread's
        ``j``-th fragment; consecutive threads take consecutive fragments."""
        fragment = tidx + j * self.config.reduce_threads
        return Int64(fragment) * FRAGMENT_BYTES, Int32(fragment < self.config.reduce_fragments)

    @cute.jit
    def _row_sum(self, value: Float32, tidx) -> Float32:
        """Sum of ``value`` over the CTA, the same bits in every thread: each warp's
        butterfly sum, then the warps' sums added in warp order."""
        smem = cutlass.memory.SmemAllocator()
        sWarpSums = smem.allocate_tensor(Float32, cute.make_layout(self.warps), byte_alignment=16)
        warp_sum = ptx.warp_sum_f32(value)
        if tidx % WARP == 0:
            sWarpSums[tidx // WARP] = warp_sum
        cute.arch.barrier()
        total = Float32(0.0)
        for warp in cutlass.range_constexpr(self.warps):
            total = total + sWarpSums[warp]
        return total
