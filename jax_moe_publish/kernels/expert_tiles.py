"""One warp's share of an expert's GEMM on the tensor cores: a device piece of the experts'
kernels (`ExpertGateUpKernel`, `ExpertDownKernel`).

A warp computes ``D[c, t] = sum_k W[k, c] * X[t, k]`` for its ``warp_cols`` weight columns ``c``
and up to ``8 * token_tiles`` tokens ``t``, over its share of K (the 16-row steps ``w_k``,
``w_k + warps_k``, ...), with ``mma.sync.m16n8k16``: the weights are the mma's A (columns as
its rows: "swap AB", since decode has far more columns than tokens), the tokens' rows its B.

Lane ``l`` (group ``g = l // 4``, ``q = l % 4``) loads ``warp_cols / 8`` contiguous columns of
rows ``k0 + 2q``, ``+1``, ``+8`` and ``+9`` of each step: its group's columns are the A rows
``g`` (even columns) and ``g + 8`` (odd) of consecutive mma tiles, and ``prmt`` pairs the two
rows of each A register. The same lane loads its token's B words, ``X[t, k0 + 2q .. +1]`` and
``[k0 + 2q + 8 .. +9]``, for the token of column ``g`` of each 8-token tile. Each weight is
read once per pass. In the weights' ``[k, columns]`` rows a group's 8 or 16 bytes of a row
are one sector's half or whole, and a warp reads 64 or 128 contiguous bytes of each of its 16
rows; in the tiled order (`GemmShape.tiled_offset`) each of a warp's four loads of a step is
512 or 1024 consecutive bytes, and a work item's bytes are one contiguous block.

e4m3 weights (`GemmShape.fp8`) are loaded at half the bytes, widened to bf16 in registers (exact)
and their step's sums added times the float32 scale of their 128 x 128 block; e4m3 tokens
(`GemmShape.fp8_tokens`) are widened alike, and each sum is also times its token's scale of that
block.

Accumulators ``[mma tile, token tile, 4]`` hold the mma's D fragment: ``c0 = D[g][2q]``,
``c1 = D[g][2q + 1]``, ``c2 = D[g + 8][2q]``, ``c3 = D[g + 8][2q + 1]``, i.e. columns
``2i`` (c0, c1) and ``2i + 1`` (c2, c3) of this lane's group, tokens ``2q`` and ``2q + 1``.
Warps that split K add their sums in shared memory, in warp order (`reduce`), so every
result has one summation order whatever m and the tokens beside it.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32, Int64, Uint32

from jax_moe_publish.experts_config import FP8_BLOCK, LANE_ROWS, MMA_K, MMA_TOKENS, SMEM_ALIGNMENT, GemmShape
from jax_moe_publish.kernels import ptx

BF16_BYTES = 2
SCALE_BYTES = 4
"""A float32 block scale of e4m3 weights."""

def _allocate_row_major(shape):
    """Float32 shared memory of ``shape``, row-major (CuTe's default is column-major): with the
    lane innermost, 32 lanes on 32 consecutive words, 32 banks."""
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    layout = cute.make_layout(shape, stride=strides)
    return cutlass.memory.SmemAllocator().allocate_tensor(Float32, layout, byte_alignment=SMEM_ALIGNMENT)


class WeightWalk(NamedTuple):
    """Where a lane's weight loads are: its row ``r`` (`LANE_ROWS`) of the K step from row ``k0``
    at ``start + k0 * k_row_bytes + row_offsets[r]``, and of column block ``b`` at
    ``block_offsets[b]`` more (the three are compile-time constants). With e4m3 weights, the
    float32 scale of its columns' block in the K block of row ``k0`` at ``scales + (k0 /
    FP8_BLOCK) * scale_row_bytes`` (else ``scales`` is None)."""

    start: Int64
    k_row_bytes: int
    row_offsets: tuple
    scales: Int64 | None = None
    scale_row_bytes: int = 0
    block_offsets: tuple = (0,)


class Tokens(NamedTuple):
    """A pass's tokens for a lane (`ExpertTiles.tokens`): per token tile, the address of row 0
    of the token in column ``g`` (``rows``) and whether that column holds one (Int32 ``live``);
    with e4m3 tokens, per tile the addresses of the scales of the tokens in columns ``2q`` and
    ``2q + 1`` (``scale_rows``: the first K block's), else None."""

    rows: list
    live: list
    scale_rows: list | None = None


class StageOffsets(NamedTuple):
    """A lane's byte offsets in a ring stage (`ExpertTiles._stage_offsets`): its weight rows
    (``weight_row_bytes`` apart); its B words of token tile 0 (bf16 tokens); with e4m3 tokens
    where it copies its 4 bytes of tile 0, where its 2 + 2 bytes are, and its two token scales;
    its weight block's scale."""

    weights: object
    weight_row_bytes: int
    tokens: object
    fp8_token_copy: object
    fp8_tokens: object
    token_scales: object
    scale: object


class BulkRing(NamedTuple):
    """`bulk_loads`'s ring (`ExpertTiles.allocate_bulk_ring`): the 32-bit shared address of its
    stages, and pointers to its full and empty mbarriers, one of each per stage."""

    stages: object
    full: object
    empty: object


class ExpertTiles:
    """A warp's accumulation over its share of K, and the CTA's sum over the warps splitting K."""

    def __init__(self, shape: GemmShape) -> None:
        self.shape = shape

    def allocate_reduction(self):
        """Shared memory for the partial sums of the warps that split K, None without a split:
        ``[warps_k, warps_n, mma tile, token tile, 4, lane]``, lane innermost (no bank conflicts)."""
        s = self.shape
        if s.warps_k == 1:
            return None
        return _allocate_row_major((s.warps_k, s.warps_n, s.mma_tiles, s.token_tiles, 4, 32))

    def allocate_partials(self):
        """Shared memory for the sums the cluster's CTAs read (`add_cluster_partials`), None
        without a split: ``[warps_n, mma tile, token tile, 4, lane]``, lane innermost."""
        s = self.shape
        if s.split_k == 1:
            return None
        return _allocate_row_major((s.warps_n, s.mma_tiles, s.token_tiles, 4, 32))

    def allocate_ring(self):
        """Shared memory for the warps' rings of K steps (`async_loads`), None without: per warp
        ``unroll`` stages of `GemmShape.stage_words` words."""
        s = self.shape
        if not s.async_loads:
            return None
        layout = cute.make_layout(s.threads // 32 * s.unroll * s.stage_words)
        return cutlass.memory.SmemAllocator().allocate_tensor(Uint32, layout, byte_alignment=SMEM_ALIGNMENT)

    def allocate_bulk_ring(self) -> BulkRing | None:
        """Shared memory for `bulk_loads`'s ring of ``unroll`` stages (`GemmShape.bulk_stage_bytes`)
        and its mbarriers, None without."""
        s = self.shape
        if not s.bulk_loads:
            return None
        smem = cutlass.memory.SmemAllocator()
        stages = smem.allocate_tensor(Uint32, cute.make_layout(s.unroll * s.bulk_stage_bytes // 4),
                                      byte_alignment=SMEM_ALIGNMENT)
        barriers = smem.allocate_tensor(Int64, cute.make_layout(2 * s.unroll), byte_alignment=SMEM_ALIGNMENT)
        return BulkRing(stages.iterator.toint(), barriers.iterator, barriers.iterator + s.unroll)

    @cute.jit
    def init_bulk_ring(self, ring: BulkRing, tidx) -> None:
        """Thread 0 sets the ring's mbarriers up: a stage is full once the copying warp has arrived
        and its bytes have landed, empty once every compute thread has read it. The CTA's next
        barrier makes them visible."""
        s = self.shape
        if tidx == 0:
            for stage in cutlass.range_constexpr(s.unroll):
                cute.arch.mbarrier_init(ring.full + stage, 1)
                cute.arch.mbarrier_init(ring.empty + stage, s.compute_threads)
            cute.arch.mbarrier_init_fence()

    def item_weights(self, expert_weights: Int64, item_in_expert) -> Int64:
        """`bulk_loads`: the address of an item's block in an expert's tiled weights."""
        return expert_weights + Int64(item_in_expert) * self.shape.tile_item_bytes

    @cute.jit
    def copy_rounds(self, ring: BulkRing, item_weights: Int64, sPairs, start, count, first, lane, rows: Int64,
                    row_bytes: int, pairs_per_row: int, rounds_done) -> None:
        """The copying warp's share of a pass (`bulk_loads`): round ``r`` goes to stage
        ``(rounds_done + r) % unroll`` once the compute warps have emptied it: the round's block
        of ``item_weights``, and token ``j``'s slice of K (the pass's ``j``-th pair's row
        ``pair // pairs_per_row`` of ``rows``, stride ``row_bytes``) by lane ``j``. A slot past
        the pass's tokens is left as it is: its column's sums are never stored."""
        s = self.shape
        live = cutlass.min(count - first, Int32(s.tokens_per_pass))
        slot = first + cutlass.select_(lane < live, lane, Int32(0))
        token_row = rows + Int64(sPairs[start + slot] // pairs_per_row) * row_bytes
        transaction = s.round_bytes + live * s.round_token_bytes
        for r in cutlass.range(0, s.k_steps_per_warp, 1, unroll=1):
            n = rounds_done + r
            stage = n % s.unroll
            if n >= s.unroll:
                # The stage's previous round has been read (its phase's parity).
                cute.arch.mbarrier_wait(ring.empty + stage, ((n // s.unroll) % 2) ^ 1)
            full = ring.full + stage
            destination = ring.stages + stage * s.bulk_stage_bytes
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(full, transaction)
            cute.arch.sync_warp()
            if lane == 0:
                ptx.copy_bulk(destination, item_weights + Int64(r) * s.round_bytes, s.round_bytes, full.toint())
            if lane < live:
                ptx.copy_bulk(destination + s.stage_token_offset(lane, 0, 0),
                              token_row + Int64(r) * s.round_token_bytes, s.round_token_bytes, full.toint())

    @cute.jit
    def accumulate_staged(self, rAcc, walk: WeightWalk, tokens: Tokens | None, ring: BulkRing, rounds_done, w_k,
                          w_n, lane) -> None:
        """`accumulate` from `bulk_loads`'s ring, the pass's rounds from ``rounds_done`` on: this
        warp's step of each round is its K step, read where `GemmShape.tiled_offset` puts it
        within the round's block; its B words from the tokens' slices (a lane group's token
        ``j * 8 + g``). ``walk``: its e4m3 scales only; ``tokens`` (e4m3 tokens, else None):
        their scales only."""
        s = self.shape
        self._zero(rAcc)
        group, q = lane // 4, lane % 4
        weights_at = s.stage_weight_offset(w_k, w_n, 0, lane)
        tokens_at = s.stage_token_offset(group, w_k, q)
        for r in cutlass.range(0, s.k_steps_per_warp, 1, unroll=1):
            n = rounds_done + r
            stage = n % s.unroll
            # The scales are global loads (L1's after the first), issued before the wait.
            k_block = Int64((r * s.warps_k + w_k) * MMA_K // FP8_BLOCK)
            scale, token_scales = None, None
            if cutlass.const_expr(s.fp8):
                scale = ptx.load_f32(walk.scales + k_block * walk.scale_row_bytes)
            if cutlass.const_expr(s.fp8_tokens):
                token_scales = [[ptx.load_f32(tokens.scale_rows[j][u] + k_block * SCALE_BYTES) for u in range(2)]
                                for j in range(s.token_tiles)]
            cute.arch.mbarrier_wait(ring.full + stage, (n // s.unroll) % 2)
            at = ring.stages + stage * s.bulk_stage_bytes
            a_loaded = [self._load_weight_row(at + weights_at + s.stage_weight_offset(0, 0, row, 0), shared=True)
                        for row in range(4)]
            b_words = []
            for j in cutlass.range_constexpr(s.token_tiles):
                b = at + tokens_at + j * MMA_TOKENS * s.token_slot_bytes
                if cutlass.const_expr(s.fp8_tokens):
                    b_words.append([ptx.load_shared_e4m3x2_as_bf16x2(b + 8 * offset, shift=s.shift_widening)
                                    for offset in (0, 1)])
                else:
                    b_words.append([ptx.load_shared_u32(b + 8 * offset * BF16_BYTES) for offset in (0, 1)])
            cute.arch.mbarrier_arrive(ring.empty + stage)
            self._mma_step(rAcc, [self._widened(words) for words in a_loaded], b_words, scale, token_scales)

    @cute.jit
    def _zero(self, rAcc) -> None:
        s = self.shape
        for i in cutlass.range_constexpr(s.mma_tiles):
            for j in cutlass.range_constexpr(s.token_tiles):
                for c in cutlass.range_constexpr(4):
                    rAcc[i, j, c] = Float32(0.0)

    def make_accumulators(self):
        s = self.shape
        return cute.make_rmem_tensor(cute.make_layout((s.mma_tiles, s.token_tiles, 4)), Float32)

    def tokens(self, sPairs, start, count, first, lane, rows: Int64, row_bytes: int, pairs_per_row: int,
               scales: Int64 | None = None, scale_row_bytes: int = 0) -> Tokens:
        """`accumulate`'s `Tokens` for the pass from slot ``first`` of the expert's pairs
        ``sPairs[start:start + count]``: the token in column ``g`` (this lane's group) of each
        token tile reads row ``pair // pairs_per_row`` of ``rows`` (stride ``row_bytes``); a
        column past ``count`` is not live (its address is slot 0's, never read). e4m3 tokens:
        ``scales`` is the address of token 0's scale of the first K block of ``rows``, a
        token's ``scale_row_bytes`` apart; this lane's sums are of columns ``2q`` and ``2q + 1``."""
        def token_of(slot):
            live = Int32(slot < count)
            return live, sPairs[start + cutlass.select_(live != 0, slot, Int32(0))] // pairs_per_row

        group, q = lane // 4, lane % 4
        token_rows, token_live, scale_rows = [], [], []
        for j in range(self.shape.token_tiles):
            live, token = token_of(first + j * MMA_TOKENS + group)
            token_rows.append(rows + Int64(token) * row_bytes)
            token_live.append(live)
            if self.shape.fp8_tokens:
                scale_rows.append([scales + Int64(token_of(first + j * MMA_TOKENS + 2 * q + u)[1]) * scale_row_bytes
                                   for u in range(2)])
        return Tokens(token_rows, token_live, scale_rows if self.shape.fp8_tokens else None)

    def weight_walk(self, expert_weights: Int64, row_bytes: int, item_in_expert, lane_column, k_begin: Int64, w_n,
                    lane, q, expert_scales: Int64 | None = None, scale_row_bytes: int = 0) -> WeightWalk:
        """This lane's `WeightWalk` through an item's K steps from row ``k_begin``, with
        ``expert_weights`` the address of the expert's weights (the lane's matrix: gate or up,
        in the split layout). In the weights' rows (stride ``row_bytes``) the lane's columns
        start at ``item_in_expert * item_columns + lane_column``, each column block's
        `GemmShape.block_columns` after the one before; in the tiled order
        (`GemmShape.tiled_offset`) each of the item's column blocks is one block. e4m3 weights:
        ``expert_scales`` is the address of the lane's matrix's scales of the expert (``[k /
        FP8_BLOCK, columns / FP8_BLOCK]``, rows ``scale_row_bytes`` apart), whatever the order of
        the weights."""
        s = self.shape
        column = item_in_expert * s.item_columns + lane_column
        scales = None
        if cutlass.const_expr(s.fp8):
            # A lane's columns lie in one block (warp_cols / 8 of an aligned group), and k_begin
            # starts a block (`ExpertsConfig` checks the K split).
            scales = (expert_scales + (k_begin // FP8_BLOCK) * scale_row_bytes
                      + Int64(column // FP8_BLOCK) * SCALE_BYTES)
        if cutlass.const_expr(s.tiled):
            k_row_bytes = s.tile_step_bytes // MMA_K
            start = (expert_weights + Int64(item_in_expert * s.column_blocks) * s.tile_item_bytes
                     + k_begin * k_row_bytes + Int64(w_n * 4 * s.tile_row_bytes + lane * s.tile_lane_bytes))
            return WeightWalk(start, k_row_bytes, tuple(r * s.tile_row_bytes for r in range(4)), scales,
                              scale_row_bytes, tuple(b * s.tile_item_bytes for b in range(s.column_blocks)))
        start = expert_weights + k_begin * row_bytes + Int64(column) * s.weight_bytes + Int64(2 * q) * row_bytes
        return WeightWalk(start, row_bytes, tuple(r * row_bytes for r in LANE_ROWS), scales, scale_row_bytes,
                          tuple(b * s.block_columns * s.weight_bytes for b in range(s.column_blocks)))

    @cute.jit
    def accumulate(self, rAcc, walk: WeightWalk, tokens: Tokens, w_k, lane,
                   cached_tokens: cutlass.Constexpr[bool], sRing, warp) -> None:
        """``rAcc`` = this warp's sums over its share of K, the weights where ``walk`` says and
        the tokens where ``tokens`` says (`tokens`; B words 0 where a column holds no token).
        ``cached_tokens``: the token rows were written earlier in the call (load them through L2).
        ``sRing`` (`allocate_ring`) and ``warp``: the loads of `async_loads`."""
        s = self.shape
        self._zero(rAcc)
        # This lane's B bytes of a token's K step start at column 2q.
        token_offset = Int64(2 * (lane % 4)) * s.token_bytes
        if cutlass.const_expr(s.async_loads):
            self._accumulate_from_ring(rAcc, walk, tokens, token_offset, w_k, sRing, warp, lane)
        else:
            self._accumulate_from_registers(rAcc, walk, tokens, token_offset, w_k, cached_tokens)

    @cute.jit
    def _mma_step(self, rAcc, a_words, b_words, scale=None, token_scales=None) -> None:
        """One K step's mmas: ``a_words`` the lane's words of rows ``2q, +1, +8, +9`` (`LANE_ROWS`),
        ``b_words[j]`` its two B words of token tile ``j``. With ``scale`` (e4m3 weights) the
        step's sums are made apart and added times ``scale``, its weight block's, and with
        ``token_scales[j]`` (e4m3 tokens) times those of the tile's tokens ``2q`` and ``2q + 1``."""
        s = self.shape
        w0, w1, w8, w9 = a_words
        for i in cutlass.range_constexpr(s.mma_tiles):
            a = [ptx.pair_halves(w0[i], w1[i], False), ptx.pair_halves(w0[i], w1[i], True),
                 ptx.pair_halves(w8[i], w9[i], False), ptx.pair_halves(w8[i], w9[i], True)]
            for j in cutlass.range_constexpr(s.token_tiles):
                if cutlass.const_expr(scale is None):
                    d = ptx.mma_bf16_16x8x16(a, b_words[j], [rAcc[i, j, c] for c in range(4)])
                    for c in cutlass.range_constexpr(4):
                        rAcc[i, j, c] = d[c]
                elif cutlass.const_expr(token_scales is None):
                    d = ptx.mma_bf16_16x8x16(a, b_words[j], [Float32(0.0)] * 4)
                    for c in cutlass.range_constexpr(4):
                        rAcc[i, j, c] = rAcc[i, j, c] + d[c] * scale
                else:
                    # c0, c2: token 2q; c1, c3: token 2q + 1.
                    d = ptx.mma_bf16_16x8x16(a, b_words[j], [Float32(0.0)] * 4)
                    for c in cutlass.range_constexpr(4):
                        rAcc[i, j, c] = rAcc[i, j, c] + d[c] * (scale * token_scales[j][c % 2])

    @cute.jit
    def _accumulate_from_ring(self, rAcc, walk: WeightWalk, tokens: Tokens, token_offset, w_k, sRing, warp,
                              lane) -> None:
        """`accumulate` through the warp's ring: the copies of steps ``0 .. unroll - 1`` first,
        then each step's mmas from its stage, whose copies for the step ``unroll`` later are
        issued once those mmas have read it. A lane reads only what it copied, but with e4m3
        tokens its group's four lanes copy their token's bytes together: the warp syncs after
        each step's copies land and before it refills that stage."""
        s = self.shape
        stage_bytes = s.stage_words * 4
        ring = sRing.iterator.toint() + warp * (s.unroll * stage_bytes)
        at = self._stage_offsets(lane)
        for step in cutlass.range_constexpr(s.unroll):
            if cutlass.const_expr(step < s.k_steps_per_warp):
                self._copy_step(ring + step * stage_bytes, at, Int32(step), walk, tokens, token_offset, w_k, lane)
            ptx.commit_async_group()
        for step in cutlass.range(0, s.k_steps_per_warp, 1, unroll=1):
            # Every group but the newest unroll - 1 is complete: this step's is.
            ptx.wait_async_groups(s.unroll - 1)
            if cutlass.const_expr(s.fp8_tokens):
                cute.arch.sync_warp()
            stage = ring + (step % s.unroll) * stage_bytes
            a_words = [self._widened(self._load_weight_row(stage + at.weights + r * at.weight_row_bytes, shared=True))
                       for r in range(4)]
            b_words, token_scales = [], None
            if cutlass.const_expr(s.fp8_tokens):
                token_scales = []
                for j in cutlass.range_constexpr(s.token_tiles):
                    b = stage + at.fp8_tokens + j * (MMA_TOKENS * MMA_K)
                    b_words.append([ptx.load_shared_e4m3x2_as_bf16x2(b + offset, shift=s.shift_widening)
                                    for offset in (0, 8)])
                    scales = stage + at.token_scales + j * 256
                    token_scales.append([ptx.load_shared_f32(scales), ptx.load_shared_f32(scales + 4)])
            else:
                for j in cutlass.range_constexpr(s.token_tiles):
                    b_words.append([ptx.load_shared_u32(stage + at.tokens + j * 256),
                                    ptx.load_shared_u32(stage + at.tokens + j * 256 + 4)])
            scale = None
            if cutlass.const_expr(s.fp8):
                scale = ptx.load_shared_f32(stage + at.scale)
            self._mma_step(rAcc, a_words, b_words, scale, token_scales)
            if step + s.unroll < s.k_steps_per_warp:
                if cutlass.const_expr(s.fp8_tokens):
                    cute.arch.sync_warp()
                self._copy_step(stage, at, step + s.unroll, walk, tokens, token_offset, w_k, lane)
            ptx.commit_async_group()
        ptx.wait_async_groups(0)

    def _stage_offsets(self, lane) -> StageOffsets:
        """This lane's places in a ring stage (`GemmShape.stage_words`): its four weight rows,
        then the tokens (bf16: two words per lane and tile; e4m3: each tile's 8 tokens' 16-byte
        K steps, then two token scales per lane and tile), then its weight block's scale."""
        s = self.shape
        weight_row_bytes = 32 * s.tile_lane_bytes
        tokens = 4 * weight_row_bytes
        token_scales = tokens + (MMA_TOKENS * MMA_K if s.fp8_tokens else 256) * s.token_tiles
        scale = token_scales + (256 * s.token_tiles if s.fp8_tokens else 0)
        return StageOffsets(lane * s.tile_lane_bytes, weight_row_bytes, tokens + lane * 8,
                            tokens + lane * 4, tokens + (lane // 4) * MMA_K + 2 * (lane % 4),
                            token_scales + lane * 8, scale + lane * SCALE_BYTES)

    @cute.jit
    def _copy_step(self, stage, at: StageOffsets, step, walk: WeightWalk, tokens: Tokens, token_offset, w_k,
                   lane) -> None:
        """This lane's copies of K step ``step`` into ``stage`` (at ``at``): its rows
        `LANE_ROWS`; its B words (e4m3 tokens: bytes ``4q .. 4q + 3`` of its group's token's
        step, and the scales of tokens ``2q`` and ``2q + 1``); its e4m3 block's scale."""
        s = self.shape
        k0 = Int64((step * s.warps_k + w_k) * MMA_K)
        rows = walk.start + k0 * walk.k_row_bytes
        for r in cutlass.range_constexpr(4):
            ptx.copy_async(stage + at.weights + r * at.weight_row_bytes, rows + walk.row_offsets[r],
                           s.tile_lane_bytes)
        for j in cutlass.range_constexpr(s.token_tiles):
            if cutlass.const_expr(s.fp8_tokens):
                ptx.copy_async(stage + at.fp8_token_copy + j * (MMA_TOKENS * MMA_K),
                               tokens.rows[j] + k0 + Int64(4 * (lane % 4)), 4, predicate=tokens.live[j])
                for u in cutlass.range_constexpr(2):
                    ptx.copy_async(stage + at.token_scales + j * 256 + u * 4,
                                   tokens.scale_rows[j][u] + (k0 // FP8_BLOCK) * SCALE_BYTES, SCALE_BYTES)
            else:
                b = tokens.rows[j] + k0 * BF16_BYTES + token_offset
                ptx.copy_async(stage + at.tokens + j * 256, b, 4, predicate=tokens.live[j])
                ptx.copy_async(stage + at.tokens + j * 256 + 4, b + 8 * BF16_BYTES, 4, predicate=tokens.live[j])
        if cutlass.const_expr(s.fp8):
            ptx.copy_async(stage + at.scale, walk.scales + (k0 // FP8_BLOCK) * walk.scale_row_bytes, SCALE_BYTES)

    @cute.jit
    def _accumulate_from_registers(self, rAcc, walk: WeightWalk, tokens: Tokens, token_offset, w_k,
                                   cached_tokens: cutlass.Constexpr[bool]) -> None:
        """`accumulate` with register loads, ``unroll`` steps' loads issued before their mmas."""
        s = self.shape
        # Unrolled by `unroll` below, not further: the loads in flight are those of `unroll` steps.
        for step in cutlass.range(0, s.k_steps_per_warp, s.unroll, unroll=1):
            # Every load of the unrolled steps first, so that they are in flight together.
            loaded = []
            for u in cutlass.range_constexpr(s.unroll):
                k0 = Int64(((step + u) * s.warps_k + w_k) * MMA_K)
                rows = walk.start + k0 * walk.k_row_bytes
                # As loaded (e4m3: half the registers), widened at their mmas; a row's words of
                # every column block in turn (`GemmShape.tile_column`).
                a_loaded = [[word for block in walk.block_offsets
                             for word in self._load_weight_row(rows + offset + block)] for offset in walk.row_offsets]
                b_words, token_scales = [], None
                if cutlass.const_expr(s.fp8_tokens):
                    token_scales = []
                    for j in cutlass.range_constexpr(s.token_tiles):
                        at = tokens.rows[j] + k0 + token_offset
                        b_words.append([ptx.load_e4m3x2_as_bf16x2(at + offset, predicate=tokens.live[j],
                                                                  shift=s.shift_widening) for offset in (0, 8)])
                        token_scales.append([ptx.load_f32(tokens.scale_rows[j][v] + (k0 // FP8_BLOCK) * SCALE_BYTES)
                                             for v in range(2)])
                else:
                    for j in cutlass.range_constexpr(s.token_tiles):
                        at = tokens.rows[j] + k0 * BF16_BYTES + token_offset
                        b_words.append([ptx.load_u32(at, predicate=tokens.live[j], cached=cached_tokens),
                                        ptx.load_u32(at + 8 * BF16_BYTES, predicate=tokens.live[j],
                                                     cached=cached_tokens)])
                scale = None
                if cutlass.const_expr(s.fp8):
                    scale = ptx.load_f32(walk.scales + (k0 // FP8_BLOCK) * walk.scale_row_bytes)
                loaded.append((a_loaded, b_words, scale, token_scales))
            for a_loaded, b_words, scale, token_scales in loaded:
                self._mma_step(rAcc, [self._widened(words) for words in a_loaded], b_words, scale, token_scales)

    def _load_weight_row(self, address, shared: bool = False) -> list:
        """This lane's words of one weight row as stored (`lane_weight_words`), at a global
        ``address`` or in its ring stage (``shared``)."""
        s = self.shape
        if s.lane_weight_words == 1:
            return [ptx.load_shared_u32(address) if shared else ptx.load_u32(address)]
        load = ptx.load_shared_words if shared else ptx.load_words
        return load(address, s.lane_weight_words)

    def _widened(self, words: list) -> list:
        """A lane's loaded words of one weight row as bf16 words (`lane_words`): as they are, or
        e4m3 widened (`ptx.e4m3x4_to_bf16x4`)."""
        if not self.shape.fp8:
            return words
        return [word for packed in words for word in ptx.e4m3x4_to_bf16x4(packed, shift=self.shape.shift_widening)]

    @cute.jit
    def reduce(self, rAcc, sReduction, w_k, w_n, lane) -> None:
        """Add the sums of the warps that split K into warp ``w_k = 0``'s ``rAcc``, in warp order.
        Every compute thread of the CTA must call it (it has barriers)."""
        s = self.shape
        if cutlass.const_expr(s.warps_k > 1):
            if w_k > 0:
                for i in cutlass.range_constexpr(s.mma_tiles):
                    for j in cutlass.range_constexpr(s.token_tiles):
                        for c in cutlass.range_constexpr(4):
                            sReduction[w_k, w_n, i, j, c, lane] = rAcc[i, j, c]
            self._sync_compute_warps()
            if w_k == 0:
                for other in cutlass.range_constexpr(1, s.warps_k):
                    for i in cutlass.range_constexpr(s.mma_tiles):
                        for j in cutlass.range_constexpr(s.token_tiles):
                            for c in cutlass.range_constexpr(4):
                                rAcc[i, j, c] = rAcc[i, j, c] + sReduction[other, w_n, i, j, c, lane]
            # The next pass writes the buffer again.
            self._sync_compute_warps()

    def _sync_compute_warps(self) -> None:
        """A barrier of the warps that run the mmas: all the CTA's, but `bulk_loads`'s copying warp."""
        if cutlass.const_expr(self.shape.bulk_loads):
            cute.arch.barrier(barrier_id=1, number_of_threads=self.shape.compute_threads)
        else:
            cute.arch.barrier()

    @cute.jit
    def add_cluster_partials(self, rAcc, sPartials, w_k, w_n, lane, cluster_rank) -> bool:
        """Across the CTAs of a cluster that split K: each CTA's warp ``w_k = 0`` puts its sums in
        shared memory, and warp ``w_n`` of CTA ``w_n % split_k`` replaces its ``rAcc`` with the
        CTAs' sums added in cluster order; True for the warps that then hold a result. Every
        thread of every CTA of the cluster must call it (it has cluster barriers)."""
        s = self.shape
        finisher = (w_k == 0) & (w_n % s.split_k == cluster_rank)
        if w_k == 0:
            for i in cutlass.range_constexpr(s.mma_tiles):
                for j in cutlass.range_constexpr(s.token_tiles):
                    for c in cutlass.range_constexpr(4):
                        sPartials[w_n, i, j, c, lane] = rAcc[i, j, c]
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if finisher:
            for i in cutlass.range_constexpr(s.mma_tiles):
                for j in cutlass.range_constexpr(s.token_tiles):
                    for c in cutlass.range_constexpr(4):
                        rAcc[i, j, c] = Float32(0.0)
            lane_partials = (sPartials.iterator + cute.crd2idx((w_n, 0, 0, 0, lane), sPartials.layout)).toint()
            for cta in cutlass.range_constexpr(s.split_k):
                remote = ptx.cluster_address(lane_partials, cta)
                for i in cutlass.range_constexpr(s.mma_tiles):
                    for j in cutlass.range_constexpr(s.token_tiles):
                        for c in cutlass.range_constexpr(4):
                            offset = cute.crd2idx((0, i, j, c, 0), sPartials.layout) * 4
                            rAcc[i, j, c] = rAcc[i, j, c] + ptx.load_cluster_f32(remote + offset)
        # The next pass writes the partials again: every CTA has read them.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        return finisher
