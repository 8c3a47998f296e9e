"""The residual add + RMSNorm of a row: device pieces of the epilogue kernels (`ReduceNormKernel`,
`PublishReduceNormKernel`).

For a row (a token in oneshot, an owned row in reduce_scatter), with every float32
operation between these rounding points::

    y            = bf16( sum_src float32(partial_src) )            (src = 0..tp-1)
    residual_out = bf16( float32(y) + float32(residual) )
    out          = bf16( float32(residual_out) * rsqrt(mean(float32(residual_out)^2) + eps)
                         * float32(norm_weight) )

Each fragment stays in the registers of the thread that waited for it, from the mailbox
poll to the two stores; the mean needs only a row sum over the CTA, or the cluster that
holds the row (`RowSums`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.fp8_out import Fp8Out
from jax_moe_publish.kernels.lamport import NAN_BF16X2, WORDS, Lamport

WARP = 32
FLOAT_BYTES = 4
SMEM_ALIGNMENT = 16


def cluster_ctas(config: KernelConfig) -> int:
    """CTAs of the cluster that holds a row: ``ctas_per_row`` when fused, else 1."""
    return config.ctas_per_row if config.fuse_reduce else 1


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


class RowSums:
    """The sum over a row's CTA (cluster) of one float per thread, the same bits in every
    thread: each warp's butterfly sum, then the warps' sums added in warp order, then,
    with a cluster, the CTAs' sums added in cluster order.

    Each CTA delivers its sum into every CTA's shared memory with ``st.async``,
    which counts the bytes on the receiver's mbarrier: the receivers wait on their
    own mbarrier, with no cluster barrier (whose release would first make this
    thread's earlier global stores visible, an L2 round trip, every row).
    Everything is double-buffered by the parity of the row's index in the CTA's
    sequence: a CTA delivers its sum for row ``j + 1`` only after all of its
    threads have read row ``j``'s sums (the CTA barrier of row ``j + 1`` orders
    that), and no CTA gets past row ``j + 1`` without that delivery, so row
    ``j + 2``'s writes never land on sums still being read.
    """

    BARRIER_BYTES = 8

    def __init__(self, config: KernelConfig) -> None:
        self.warps = config.reduce_threads // WARP
        self.cluster = cluster_ctas(config)

    @staticmethod
    def shared_bytes(config: KernelConfig) -> int:
        """Two floats per warp; with a cluster, two per CTA of it and two mbarriers."""
        total = _aligned(2 * config.reduce_threads // WARP * FLOAT_BYTES)
        if cluster_ctas(config) == 1:
            return total
        return total + _aligned(2 * cluster_ctas(config) * FLOAT_BYTES) + _aligned(2 * RowSums.BARRIER_BYTES)

    def allocate(self):
        """(warp sums, CTA sums, mbarriers), the last two None without a cluster."""
        smem = cutlass.memory.SmemAllocator()
        sWarpSums = smem.allocate_tensor(Float32, cute.make_layout((2, self.warps)), byte_alignment=SMEM_ALIGNMENT)
        if self.cluster == 1:
            return sWarpSums, None, None
        sCtaSums = smem.allocate_tensor(Float32, cute.make_layout((2, self.cluster)), byte_alignment=SMEM_ALIGNMENT)
        barriers = smem.allocate_array(Int64, 2, byte_alignment=SMEM_ALIGNMENT)
        return sWarpSums, sCtaSums, barriers

    @cute.jit
    def initialize(self, storage, tidx) -> None:
        """With a cluster, initialize the mbarriers; the other CTAs may deliver into them only
        after a cluster barrier that follows."""
        if cutlass.const_expr(self.cluster > 1):
            barriers = storage[2]
            if tidx == 0:
                for parity in cutlass.range_constexpr(2):
                    # One arrival per row: thread 0's, which also expects the cluster's bytes.
                    cute.arch.mbarrier_init(barriers + parity, 1)
                cute.arch.mbarrier_init_fence()

    @cute.jit
    def sum(self, storage, value: Float32, tidx, row_index) -> Float32:
        """Sum of ``value`` over the CTA (the cluster), for this CTA's ``row_index``-th row; every
        thread of the cluster must call it, for the same rows in the same order."""
        sWarpSums, sCtaSums, barriers = storage
        parity = row_index % 2
        warp_sum = ptx.warp_sum_f32(value)
        if tidx % WARP == 0:
            sWarpSums[parity, tidx // WARP] = warp_sum
        cute.arch.barrier()
        total = Float32(0.0)
        for warp in cutlass.range_constexpr(self.warps):
            total = total + sWarpSums[parity, warp]
        if cutlass.const_expr(self.cluster > 1):
            barrier = barriers + parity
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(barrier, self.cluster * FLOAT_BYTES)
            if tidx < self.cluster:
                # Thread i delivers this CTA's sum to CTA i of the cluster.
                own = cute.arch.block_idx_in_cluster()
                slot = sCtaSums.iterator + cute.crd2idx((parity, own), sCtaSums.layout)
                ptx.store_async_cluster_f32(cute.arch.map_dsmem_ptr(slot, tidx).toint(), total,
                                            cute.arch.map_dsmem_ptr(barrier, tidx).toint())
            # Barrier `parity` serves rows parity, parity + 2, ...: this is its
            # (row_index // 2)-th phase.
            cute.arch.mbarrier_wait(barrier, (row_index // 2) % 2)
            total = Float32(0.0)
            for cta in cutlass.range_constexpr(self.cluster):
                total = total + sCtaSums[parity, cta]
        return total


class RowNorm:
    """A thread's fragments of a row: the wait (`Lamport`), the residual add and RMSNorm, the
    two stores. Fused, each thread holds the one fragment of ``elements_per_thread`` values
    that it published (8 or 16 bytes); unfused, ``norm_fragments_per_thread`` 16-byte ones."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        words = config.elements_per_thread // 2 if config.fuse_reduce else WORDS
        self.lamport = Lamport(config, fragment_words=words)
        self.fragment_words = words
        self.fragment_bytes = words * 4
        self.row_fragments = config.fragments if config.fuse_reduce else config.reduce_fragments
        self.fragments_per_thread = 1 if config.fuse_reduce else config.norm_fragments_per_thread
        self.row_sums = RowSums(config)
        self.fp8 = None if config.fp8_out == "none" else Fp8Out(config, words)

    def fragment_registers(self):
        """Registers for this thread's fragments of a row, as bf16x2 words."""
        return cute.make_rmem_tensor(cute.make_layout((self.fragments_per_thread, self.fragment_words)), Uint32)

    def load_norm_weight(self, norm_weight, first_fragment):
        """This thread's fragments of ``norm_weight``, as bf16x2 words."""
        rWeight = self.fragment_registers()
        for j in range(self.fragments_per_thread):
            offset, present = self.fragment(first_fragment, j)
            weight = ptx.load_words(norm_weight + offset, self.fragment_words, predicate=present)
            for w in range(self.fragment_words):
                rWeight[j, w] = weight[w]
        return rWeight

    def load_residual(self, residual, row, live, first_fragment):
        """This thread's fragments of residual row ``row`` (zeros where ``live`` is 0)."""
        rResidual = self.fragment_registers()
        for j in range(self.fragments_per_thread):
            offset, present = self.fragment(first_fragment, j)
            kept = ptx.load_words(residual + Int64(row) * self.lamport.row_bytes + offset, self.fragment_words,
                                  predicate=present & live)
            for w in range(self.fragment_words):
                rResidual[j, w] = kept[w]
        return rResidual

    @cute.jit
    def norm_row(self, row, token, live, stage, halt, rWeight, rResidual, tidx, first_fragment, sums,
                 row_index, mailbox, stage_state, status, out, timeout_ns, capacity_m, residual_out, eps,
                 own, fan_out=None, fp8_scales=None) -> None:
        """Wait for, sum, add the residual to and normalize mailbox row ``row`` (the one of
        ``token``; ``live`` is Int32 0 for a row past m) over this thread's fragments from
        ``first_fragment`` on. Every thread of the CTA (of the cluster) must call it, for the
        same rows; ``sums`` is `RowSums.allocate`'s, ``row_index`` the row's index in this
        CTA's sequence (`RowSums.sum`). ``own``: the fused kernel's own partial
        (`Lamport.wait_contributions`), else None.

        The outputs go to row ``row`` (reduce_scatter) or ``token``. Twoshot's owner also
        stores both into every peer's gather areas, ``fan_out`` = (peer_table, rank), with
        -0.0 turned into +0.0 in its own rows and the copies alike (-0.0 is the mailbox's
        empty marker). With an FP8 out, ``fp8_scales`` = (out_scales, out_scale), and the
        copies stay bf16 (the gather quantizes them as the owner does)."""
        cfg = self.config
        row_offset = Int64(row) * self.lamport.row_bytes
        if cutlass.const_expr(cfg.fans_out):
            row_offset = Int64(token) * self.lamport.row_bytes
        # residual_out, as bf16 words, and the float32 sum of its squares over this thread's lanes.
        rResidualOut = self.fragment_registers()
        squares = Float32(0.0)
        if live != 0:
            for j in cutlass.range_constexpr(self.fragments_per_thread):
                offset, present = self.fragment(first_fragment, j)
                if present != 0 and halt != protocol.HALT_RUNNING:
                    # Never touch a halted mailbox: report (closed) and trap, or NaN out.
                    self.lamport.halted(residual_out + row_offset + offset, halt, stage, token, stage_state, status)
                    for w in cutlass.range_constexpr(self.fragment_words):
                        rResidualOut[j, w] = Uint32(NAN_BF16X2)
                if present != 0 and halt == protocol.HALT_RUNNING:
                    slots, sources, skipped = self.lamport.wait_contributions(
                        mailbox, stage, row, offset, capacity_m, token, stage_state, status, timeout_ns, own
                    )
                    total = self.lamport.sum_sources(sources)
                    self.lamport.rearm(slots, skipped)
                    for w in cutlass.range_constexpr(self.fragment_words):
                        y_low, y_high = ptx.bf16x2_to_f32(total[w])
                        r_low, r_high = ptx.bf16x2_to_f32(rResidual[j, w])
                        word = ptx.f32x2_to_bf16x2(y_low + r_low, y_high + r_high)
                        rResidualOut[j, w] = word
                        low, high = ptx.bf16x2_to_f32(word)
                        squares = squares + low * low + high * high

        # Every thread takes part in the row sum (it has a barrier); rows past m sum zeros.
        mean = self.row_sums.sum(sums, squares, tidx, row_index) / Float32(cfg.hidden)
        inverse_rms = ptx.rsqrt_f32(mean + eps)
        if cutlass.const_expr(self.fp8 is not None):
            self._store_fp8(row, token, live, halt, rWeight, rResidualOut, inverse_rms, first_fragment, out,
                            residual_out, fan_out, fp8_scales, stage, capacity_m)
        else:
            for j in cutlass.range_constexpr(self.fragments_per_thread):
                offset, present = self.fragment(first_fragment, j)
                if present != 0:
                    if live != 0:
                        normed, sums_out = self._outputs(rResidualOut, rWeight, inverse_rms, j)
                        ptx.store_words(residual_out + row_offset + offset, sums_out)
                        ptx.store_words(out + row_offset + offset, normed)
                        if cutlass.const_expr(cfg.fans_out):
                            # A halted mailbox may be freed: its rows (NaN) stay here.
                            if halt == protocol.HALT_RUNNING:
                                self._fan_out(fan_out, stage, token, capacity_m, offset, normed, sums_out)
                    else:
                        if cutlass.const_expr(cfg.out_owned):
                            # Rows of no token: both outputs are +0.0, like the plain reduce's.
                            ptx.store_words(residual_out + row_offset + offset, [Uint32(0)] * self.fragment_words)
                            ptx.store_words(out + row_offset + offset, [Uint32(0)] * self.fragment_words)

    def _outputs(self, rResidualOut, rWeight, inverse_rms, j: int) -> tuple[list, list]:
        """(out, residual_out) of fragment ``j`` as bf16x2 words; where the owner fans out,
        with -0.0 turned into +0.0 (the mailbox's empty marker)."""
        normed = []
        for w in range(self.fragment_words):
            x_low, x_high = ptx.bf16x2_to_f32(rResidualOut[j, w])
            g_low, g_high = ptx.bf16x2_to_f32(rWeight[j, w])
            normed.append(ptx.f32x2_to_bf16x2(x_low * inverse_rms * g_low, x_high * inverse_rms * g_high))
        sums_out = [rResidualOut[j, w] for w in range(self.fragment_words)]
        if self.config.fans_out:
            normed = [ptx.positive_zero_bf16x2(word) for word in normed]
            sums_out = [ptx.positive_zero_bf16x2(word) for word in sums_out]
        return normed, sums_out

    def _fan_out(self, fan_out, stage, token, capacity_m, offset, normed, sums_out) -> None:
        """Twoshot's owner: both outputs of a fragment into every peer's gather areas 0 and 1."""
        peer_table, rank = fan_out
        gathered = self.lamport.gather_offset(stage, token, capacity_m) + offset
        gathered_residual = self.lamport.gather_offset(stage, token, capacity_m, area=1) + offset
        for step in range(self.config.tp - 1):
            peer = ptx.load_u64(peer_table + Int64((rank + (step + 1)) % self.config.tp) * 8)
            ptx.store_words(peer + gathered, normed)
            ptx.store_words(peer + gathered_residual, sums_out)

    @cute.jit
    def _store_fp8(self, row, token, live, halt, rWeight, rResidualOut, inverse_rms, first_fragment, out,
                   residual_out, fan_out, fp8_scales, stage, capacity_m) -> None:
        """`norm_row`'s stores with an FP8 out: every lane quantizes (the group's scale is a
        warp shuffle), with zeros where it keeps nothing; rows past m store zeros where the
        result has them (reduce_scatter's owned rows). The fanned-out copies stay bf16."""
        cfg = self.config
        out_row = token if cutlass.const_expr(cfg.fans_out) else row
        row_offset = Int64(out_row) * self.lamport.row_bytes
        for j in cutlass.range_constexpr(self.fragments_per_thread):
            offset, present = self.fragment(first_fragment, j)
            keep = present & live
            stored = present & (live | Int32(1 if cfg.out_owned else 0))
            normed, sums_out = self._outputs(rResidualOut, rWeight, inverse_rms, j)
            normed = Fp8Out.words_or_zeros(normed, keep)
            sums_out = Fp8Out.words_or_zeros(sums_out, keep)
            if stored != 0:
                ptx.store_words(residual_out + row_offset + offset, sums_out)
            self.fp8.store(normed, stored, out, fp8_scales[0], fp8_scales[1], out_row, offset // 2)
            if cutlass.const_expr(cfg.fans_out):
                if keep != 0 and halt == protocol.HALT_RUNNING:
                    self._fan_out(fan_out, stage, token, capacity_m, offset, normed, sums_out)

    def fragment(self, first_fragment, j: int):
        """(byte offset in the row, Int32 1 if it lies in the row) of this thread's
        ``j``-th fragment; consecutive threads take consecutive fragments."""
        fragment = first_fragment + j * self.config.reduce_threads
        return Int64(fragment) * self.fragment_bytes, Int32(fragment < self.row_fragments)
