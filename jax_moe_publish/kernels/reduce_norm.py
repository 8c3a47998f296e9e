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

``publish_reduce_norm`` (``fuse_reduce``, oneshot, one fragment of
``elements_per_thread`` values per thread: 16 bytes, or 8 for twice the
threads in flight) is the whole call in one persistent kernel. A row's ``ctas_per_token`` CTAs
form a thread block cluster (so that the row's expert loads spread over as
many SMs as the plain publish's); cluster ``c`` first publishes each thread's
fragment of rows ``c``, ``c + clusters``, ..., as `FusedPublishReduceKernel`
does, then goes on as above for the same rows, the CTAs' sums of squares
added in cluster order through distributed shared memory (`RowSums`). It reads the
residual only after ``griddepcontrol.wait``, since it may be the previous
call's ``residual_out``.

The wait, the stage protocol, the timeout and the halt word are the plain
reduce's (`LamportReduceKernel`), so every guarantee of it holds here: a bounded wait,
exactly the consumed slots re-armed, the stage advanced by the last CTA (which,
fused, arrives once it has published, as `FusedPublishReduceKernel` does), and
the same bits on every rank (the same config fixes every summation order; a
different launch shape may round the mean of squares differently).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.fused import OwnPartials
from jax_moe_publish.kernels.publish import FinalizePublishKernel
from jax_moe_publish.kernels.reduce import NAN_BF16X2, WORDS, LamportReduceKernel

WARP = 32
FLOAT_BYTES = 4
SMEM_ALIGNMENT = 16


def cluster_ctas(config: KernelConfig) -> int:
    """CTAs of the cluster that holds a row: ``ctas_per_token`` when fused, else 1."""
    return config.ctas_per_token if config.fuse_reduce else 1


def shared_bytes(config: KernelConfig) -> int:
    """Dynamic shared memory (the launcher must pass it): `RowSums`' and the fused kernel's
    `OwnPartials`."""
    return RowSums.shared_bytes(config) + OwnPartials.shared_bytes(config)


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


class LamportReduceNormKernel(LamportReduceKernel):
    """Device code of the fused reduce; every compile-time choice comes from ``config``."""

    def __init__(self, config: KernelConfig) -> None:
        # Fused, each thread publishes and then normalizes one fragment of the row: 8 or 16
        # bytes (``elements_per_thread``); unfused, 16-byte fragments.
        words = config.elements_per_thread // 2 if config.fuse_reduce else WORDS
        super().__init__(config, fragment_words=words)
        self.fragment_bytes = words * 4
        self.row_fragments = config.fragments if config.fuse_reduce else config.reduce_fragments
        self.publisher = FinalizePublishKernel(config)
        self.own = OwnPartials(self.publisher)
        self.fragments_per_thread = 1 if config.fuse_reduce else config.norm_fragments_per_thread
        self.row_sums = RowSums(config)
        self.cluster = cluster_ctas(config)

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
        block, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(finalize_inputs is not None):
            # Persistent, like `FusedPublishReduceKernel`, by cluster (``self.cluster`` CTAs, one
            # row): the cluster c of `clusters` publishes its fragments of rows c, c + clusters, ...
            # (the launcher caps the grid at the resident clusters), then reduces and
            # normalizes the same rows.
            routed, weights, indices, shared, num_rows = finalize_inputs
            sOwn = self.own.allocate()
            sums = self.row_sums.allocate()
            self.row_sums.initialize(sums, tidx)
            grid, _, _ = cute.arch.grid_dim()
            cluster_rank = block % self.cluster
            first_row = block // self.cluster
            clusters = grid // self.cluster
            if cutlass.const_expr(self.cluster > 1):
                # Every CTA of the cluster has started, and initialized its mbarriers, before any
                # writes into another's shared memory (the wait comes after the publishes).
                cute.arch.cluster_arrive_relaxed()
            _, offset, present = self.publisher.position(first_row * self.cluster + cluster_rank)
            first_fragment = cluster_rank * cfg.threads + tidx
            shared_words = self.publisher.begin_call(shared, first_row, offset, present)
            stage, halt = self.publisher.read_stage(stage_state)
            # After begin_call's griddepcontrol.wait: the residual may be the previous
            # call's residual_out, written by the kernel just before.
            rWeight = self._load_norm_weight(norm_weight, first_fragment)
            if present != 0:
                # The inputs are XLA's buffers, valid whatever the halt word: only the stores
                # into the mailbox wait for its value, not the first row's loads.
                packed = self.publisher.finalize(routed, weights, indices, num_rows, first_row, offset,
                                                 shared_words)
                if halt == protocol.HALT_RUNNING:
                    self.own.publish(sOwn, Int32(0), packed, first_row, offset, peer_table, capacity_m, rank,
                                     stage, first=True)
            # A separate test, not nested in the one above: nested, ptxas spills 16 bytes in
            # the hidden-9216 fp32-weight kernels.
            if present != 0 and halt == protocol.HALT_RUNNING:
                for row in cutlass.range(first_row + clusters, m, clusters):
                    row_shared = self.publisher.load_shared(shared, row, offset, present)
                    packed = self.publisher.finalize(routed, weights, indices, num_rows, row, offset,
                                                     row_shared)
                    self.own.publish(sOwn, (row - first_row) // clusters, packed, row, offset, peer_table,
                                     capacity_m, rank, stage, first=False)
            if cutlass.const_expr(self.cluster > 1):
                cute.arch.cluster_wait()
            arrived = self.arrive(stage_state, tidx)
            for row in cutlass.range(first_row, m, clusters):
                j = (row - first_row) // clusters
                rResidual = self._load_residual(residual, row, Int32(1), first_fragment)
                self._norm_row(row, row, Int32(1), stage, halt, rWeight, rResidual, tidx, first_fragment,
                               sums, j, mailbox, stage_state, status, out, timeout_ns, capacity_m, residual_out,
                               eps, self.own.held(sOwn, j, rank))
            self.finish_call(stage, stage_state, advance=True, waited=True, arrived=arrived)
        else:
            if cutlass.const_expr(cfg.algorithm == "oneshot"):
                token = block
            else:
                token = block * cfg.tp + rank
            # The residual and the weight are read before the mailbox wait, although this
            # kernel never waits for its predecessor: it starts only once every publish CTA
            # has passed its griddepcontrol.wait (the publish releases it after that wait),
            # so everything the stream ran before the publish, where these inputs come from,
            # has completed.
            live = Int32(token < m)
            rWeight = self._load_norm_weight(norm_weight, tidx)
            rResidual = self._load_residual(residual, block, live, tidx)
            stage, halt = self._start_call(stage_state)
            self._norm_row(block, token, live, stage, halt, rWeight, rResidual, tidx, tidx,
                           self.row_sums.allocate(), Int32(0), mailbox, stage_state, status, out, timeout_ns,
                           capacity_m, residual_out, eps, None)
            self.finish_call(stage, stage_state, advance=True, waited=False)

    def _fragment_registers(self):
        """Registers for this thread's fragments of a row, as bf16x2 words."""
        return cute.make_rmem_tensor(cute.make_layout((self.fragments_per_thread, self.fragment_words)), Uint32)

    def _load_norm_weight(self, norm_weight, first_fragment):
        """This thread's fragments of ``norm_weight``, as bf16x2 words."""
        rWeight = self._fragment_registers()
        for j in range(self.fragments_per_thread):
            offset, present = self._fragment(first_fragment, j)
            weight = ptx.load_words(norm_weight + offset, self.fragment_words, predicate=present)
            for w in range(self.fragment_words):
                rWeight[j, w] = weight[w]
        return rWeight

    def _load_residual(self, residual, row, live, first_fragment):
        """This thread's fragments of residual row ``row`` (zeros where ``live`` is 0)."""
        rResidual = self._fragment_registers()
        for j in range(self.fragments_per_thread):
            offset, present = self._fragment(first_fragment, j)
            kept = ptx.load_words(residual + Int64(row) * self.row_bytes + offset, self.fragment_words,
                                  predicate=present & live)
            for w in range(self.fragment_words):
                rResidual[j, w] = kept[w]
        return rResidual

    @cute.jit
    def _norm_row(self, row, token, live, stage, halt, rWeight, rResidual, tidx, first_fragment, sums,
                  row_index, mailbox, stage_state, status, out, timeout_ns, capacity_m, residual_out, eps,
                  own) -> None:
        """Wait for, sum, add the residual to and normalize output row ``row`` (the one of
        ``token``; ``live`` is Int32 0 for a row past m) over this thread's fragments from
        ``first_fragment`` on. Every thread of the CTA (of the cluster) must call it, for the
        same rows; ``sums`` is `RowSums.allocate`'s, ``row_index`` the row's index in this
        CTA's sequence (`RowSums.sum`). ``own``: the fused kernel's own partial
        (`LamportReduceKernel.wait_contributions`), else None."""
        cfg = self.config
        row_offset = Int64(row) * self.row_bytes
        # residual_out, as bf16 words, and the float32 sum of its squares over this thread's lanes.
        rResidualOut = self._fragment_registers()
        squares = Float32(0.0)
        if live != 0:
            for j in cutlass.range_constexpr(self.fragments_per_thread):
                offset, present = self._fragment(first_fragment, j)
                if present != 0 and halt != protocol.HALT_RUNNING:
                    # Never touch a halted mailbox: report (closed) and trap, or NaN out.
                    self.halted(residual_out + row_offset + offset, halt, stage, token, stage_state, status)
                    for w in cutlass.range_constexpr(self.fragment_words):
                        rResidualOut[j, w] = Uint32(NAN_BF16X2)
                if present != 0 and halt == protocol.HALT_RUNNING:
                    slots, sources, skipped = self.wait_contributions(
                        mailbox, stage, row, offset, capacity_m, token, stage_state, status, timeout_ns, own
                    )
                    total = self.sum_sources(sources)
                    self.rearm(slots, skipped)
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
        for j in cutlass.range_constexpr(self.fragments_per_thread):
            offset, present = self._fragment(first_fragment, j)
            if present != 0:
                if live != 0:
                    normed = []
                    for w in cutlass.range_constexpr(self.fragment_words):
                        x_low, x_high = ptx.bf16x2_to_f32(rResidualOut[j, w])
                        g_low, g_high = ptx.bf16x2_to_f32(rWeight[j, w])
                        normed.append(
                            ptx.f32x2_to_bf16x2(x_low * inverse_rms * g_low, x_high * inverse_rms * g_high)
                        )
                    ptx.store_words(residual_out + row_offset + offset,
                                    [rResidualOut[j, w] for w in range(self.fragment_words)])
                    ptx.store_words(out + row_offset + offset, normed)
                else:
                    if cutlass.const_expr(cfg.algorithm == "reduce_scatter"):
                        # Rows of no token: both outputs are +0.0, like the plain reduce's.
                        ptx.store_words(residual_out + row_offset + offset, [Uint32(0)] * self.fragment_words)
                        ptx.store_words(out + row_offset + offset, [Uint32(0)] * self.fragment_words)

    def _fragment(self, first_fragment, j: int):
        """(byte offset in the row, Int32 1 if it lies in the row) of this thread's
        ``j``-th fragment; consecutive threads take consecutive fragments."""
        fragment = first_fragment + j * self.config.reduce_threads
        return Int64(fragment) * self.fragment_bytes, Int32(fragment < self.row_fragments)
