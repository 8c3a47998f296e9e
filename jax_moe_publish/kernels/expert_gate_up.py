"""The experts' gate and up projections with their SwiGLU (role ``expert_gate_up``).

For every token-expert pair ``p = t * top_k + k`` whose id ``e`` is a valid expert::

    gate = bf16( x[t] @ W_gate[e] )          up = bf16( x[t] @ W_up[e] )        (float32 sums)
    activations[p] = bf16( silu(gate) * up )                                   (float32)

with ``silu(g) = g / (1 + 2 ** (-g * log2(e)))``. The grid is persistent (the CTAs the GPU holds
at once); every CTA builds the routing tables (`ExpertRouting`), then takes the work items
``b, b + grid, ...``: item ``n * items_per_expert + j`` is column block ``j`` of the ``n``-th
pass, a pass being up to ``8 * token_tiles`` of one active group's pairs (`ExpertTiles`,
`ExpertRouting.work_item`).
Each warp reads ``warp_cols / 2`` columns of gate and the same of up, so lanes ``l`` and
``l + 16`` hold a column's gate and up sums. With ``gate_up_split_k`` > 1 the grid is of
clusters of that many CTAs: cluster ``c`` takes the items ``c, c + clusters, ...``, its CTA
``r`` the ``r``-th range of ``hidden / split_k`` consecutive rows of each, and the CTAs' sums
are added in cluster order before the SwiGLU (`ExpertTiles.add_cluster_partials`), so an item's
weight rows are read in whole spans of its columns by one CTA. With ``tiled_weights`` the gate
and up weights are one array in the tiled order (`GemmShape.tiled_offset`); with ``fp8_weights``
they are e4m3 with a float32 scale per 128 x 128 block (roles ``expert_gate_up_fp8`` and
``expert_gate_up_split_fp8``), and with ``fp8_tokens`` so are the tokens, with a float32 scale
per token and 128 channels (the roles ``..._fp8_tokens``). With ``gate_up_bulk_loads`` the CTA's
last warp copies each pass's rounds into a ring in shared memory (`ExpertTiles.copy_rounds`),
which the others read (`ExpertTiles.accumulate_staged`). With ``shared_expert`` the weights'
last expert is the shared one and each token's last pair its (`ExpertRouting`): pair ``p`` is
token ``p // (top_k + 1)``'s, and ``activations`` holds ``top_k + 1`` rows per token.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_moe_publish.experts_config import FP8_BLOCK, MMA_TOKENS, ExpertsConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.expert_routing import ExpertRouting
from jax_moe_publish.kernels.expert_tiles import BF16_BYTES, SCALE_BYTES, ExpertTiles

WARP = 32
UP_LANES = 16
"""Lane ``l + UP_LANES`` holds the up sums of the columns whose gate sums lane ``l`` holds."""
LOG2_E = math.log2(math.e)


def bf16_round_pair(low, high) -> tuple:
    """Two float32 rounded to bf16 (to nearest even) and widened back: the values a bf16 array holds."""
    return ptx.bf16x2_to_f32(ptx.f32x2_to_bf16x2(low, high))


def silu(gate) -> Float32:
    """``gate * sigmoid(gate)`` in float32."""
    return gate / (Float32(1.0) + ptx.exp2_f32(gate * Float32(-LOG2_E)))


class ExpertGateUpKernel:
    """``32 * warps_k * warps_n`` threads per CTA, the gate/up `GemmShape` of ``config``."""

    def __init__(self, config: ExpertsConfig) -> None:
        self.config = config
        self.shape = config.gemm("gate_up")
        self.routing = ExpertRouting(config, self.shape)
        self.tiles = ExpertTiles(self.shape)

    # The method names are the roles: CuTe DSL names the entries kernel_cutlass_expert_gate_up_...,
    # and the compile step finds each kernel by it. The parameters are `_abi.EXPERTS.roles`'s.
    @cute.kernel
    def expert_gate_up(
        self,
        x: Int64,  # (m, hidden) bf16
        expert_ids: Int64,  # (m, top_k) int32
        gate_up: Int64,  # (experts, hidden, 2 * intermediate) bf16, gate columns first
        activations: Int64,  # (m * top_k, intermediate) bf16, written
        m: Int32,
    ) -> None:
        self._fused(x, expert_ids, gate_up, activations, m)

    @cute.kernel
    def expert_gate_up_fp8(
        self,
        x: Int64,  # (m, hidden) bf16
        expert_ids: Int64,  # (m, top_k) int32
        gate_up: Int64,  # (experts, hidden, 2 * intermediate) e4m3, gate columns first
        gate_up_scales: Int64,  # (experts, hidden / 128, 2 * intermediate / 128) float32
        activations: Int64,  # (m * top_k, intermediate) bf16, written
        m: Int32,
    ) -> None:
        self._fused(x, expert_ids, gate_up, activations, m, gate_up_scales)

    @cute.kernel
    def expert_gate_up_split_fp8(
        self,
        x: Int64,  # (m, hidden) bf16
        expert_ids: Int64,  # (m, top_k) int32
        gate: Int64,  # (experts, hidden, intermediate) e4m3
        up: Int64,  # (experts, hidden, intermediate) e4m3
        gate_scales: Int64,  # (experts, hidden / 128, intermediate / 128) float32
        up_scales: Int64,  # (experts, hidden / 128, intermediate / 128) float32
        activations: Int64,  # (m * top_k, intermediate) bf16, written
        m: Int32,
    ) -> None:
        self._split(x, expert_ids, gate, up, activations, m, gate_scales, up_scales)

    @cute.kernel
    def expert_gate_up_fp8_tokens(
        self,
        x: Int64,  # (m, hidden) e4m3
        expert_ids: Int64,  # (m, top_k) int32
        gate_up: Int64,  # (experts, hidden, 2 * intermediate) e4m3, gate columns first
        gate_up_scales: Int64,  # (experts, hidden / 128, 2 * intermediate / 128) float32
        x_scales: Int64,  # (m, hidden / 128) float32
        activations: Int64,  # (m * top_k, intermediate) bf16, written
        m: Int32,
    ) -> None:
        self._fused(x, expert_ids, gate_up, activations, m, gate_up_scales, x_scales)

    @cute.kernel
    def expert_gate_up_split_fp8_tokens(
        self,
        x: Int64,  # (m, hidden) e4m3
        expert_ids: Int64,  # (m, top_k) int32
        gate: Int64,  # (experts, hidden, intermediate) e4m3
        up: Int64,  # (experts, hidden, intermediate) e4m3
        gate_scales: Int64,  # (experts, hidden / 128, intermediate / 128) float32
        up_scales: Int64,  # (experts, hidden / 128, intermediate / 128) float32
        x_scales: Int64,  # (m, hidden / 128) float32
        activations: Int64,  # (m * top_k, intermediate) bf16, written
        m: Int32,
    ) -> None:
        self._split(x, expert_ids, gate, up, activations, m, gate_scales, up_scales, x_scales)

    @cute.kernel
    def expert_gate_up_split(
        self,
        x: Int64,  # (m, hidden) bf16
        expert_ids: Int64,  # (m, top_k) int32
        gate: Int64,  # (experts, hidden, intermediate) bf16
        up: Int64,  # (experts, hidden, intermediate) bf16
        activations: Int64,  # (m * top_k, intermediate) bf16, written
        m: Int32,
    ) -> None:
        self._split(x, expert_ids, gate, up, activations, m)

    def _fused(self, x, expert_ids, gate_up, activations, m, gate_up_scales=None, x_scales=None) -> None:
        """`_gate_up` on the fused layout: each row (of weights, and of e4m3 scales) holds gate's
        columns, then up's."""
        cfg, s = self.config, self.shape
        up_scales = None if gate_up_scales is None else gate_up_scales + cfg.intermediate // FP8_BLOCK * SCALE_BYTES
        self._gate_up(x, expert_ids, gate_up, gate_up + cfg.intermediate * s.weight_bytes,
                      2 * cfg.intermediate * s.weight_bytes, activations, m, gate_up_scales, up_scales,
                      2 * (cfg.intermediate // FP8_BLOCK) * SCALE_BYTES, x_scales)

    def _split(self, x, expert_ids, gate, up, activations, m, gate_scales=None, up_scales=None,
               x_scales=None) -> None:
        """`_gate_up` on the split layout: gate and up (and their e4m3 scales) as two arrays."""
        cfg, s = self.config, self.shape
        self._gate_up(x, expert_ids, gate, up, cfg.intermediate * s.weight_bytes, activations, m, gate_scales,
                      up_scales, cfg.intermediate // FP8_BLOCK * SCALE_BYTES, x_scales)

    @cute.jit
    def _gate_up(self, x, expert_ids, gate, up, row_bytes: int, activations, m, gate_scales=None, up_scales=None,
                 scale_row_bytes: int = 0, x_scales=None) -> None:
        """The kernel, with ``gate`` and ``up`` the addresses of expert 0's row 0 and
        ``row_bytes`` their rows' stride (both layouts); e4m3 weights: ``gate_scales`` and
        ``up_scales`` those of expert 0's scales, rows ``scale_row_bytes`` apart; e4m3 tokens:
        ``x_scales`` the address of theirs."""
        cfg, s = self.config, self.shape
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tables = self.routing.allocate()
        sReduction = self.tiles.allocate_reduction()
        sPartials = self.tiles.allocate_partials()
        sRing = self.tiles.allocate_ring()
        ring = self.tiles.allocate_bulk_ring()
        rAcc = self.tiles.make_accumulators()
        if cutlass.const_expr(s.bulk_loads):
            self.tiles.init_bulk_ring(ring, tidx)
        # Cluster `block // split_k` of the grid's; this CTA's rows of each item start at k_begin.
        cluster_rank = block % s.split_k
        cluster, clusters = block // s.split_k, grid // s.split_k
        k_begin = Int64(cluster_rank * s.k_rows_per_cta)
        if cutlass.const_expr(cfg.enable_pdl):
            # x and the ids may come from the kernel just before.
            cute.arch.griddepcontrol_wait()
        self.routing.build(tables, expert_ids, m, tidx)
        sPairs = tables[-1]
        warp, lane = tidx // WARP, tidx % WARP
        w_k, w_n = warp % s.warps_k, warp // s.warps_k
        group, q = lane // 4, lane % 4
        # This lane's columns within an item: its group's, among gate's (groups 0-3) or up's.
        lane_column = w_n * (s.warp_cols // 2) + (group % 4) * (s.warp_cols // 8)
        # Tiled, gate and up are one array: the order puts each lane's columns where it reads.
        matrix = gate if cutlass.const_expr(s.tiled) else cutlass.select_(group >= 4, up, gate)
        expert_bytes = cfg.hidden * row_bytes
        scales, expert_scale_bytes = None, cfg.hidden // FP8_BLOCK * scale_row_bytes
        if cutlass.const_expr(s.fp8):
            scales = cutlass.select_(group >= 4, up_scales, gate_scales)
        # e4m3 tokens: a byte each, and their scales from this CTA's first K block on.
        token_bytes = s.token_bytes
        token_scales = None
        if cutlass.const_expr(s.fp8_tokens):
            token_scales = x_scales + (k_begin // FP8_BLOCK) * SCALE_BYTES
        items = self.routing.items(tables)
        rounds_done = Int32(0)
        for item in cutlass.range(cluster, items, clusters):
            if cutlass.const_expr(cfg.early_down):
                if item + clusters >= items:
                    # This CTA's last item: the down kernel may launch, and read ahead, meanwhile.
                    cute.arch.griddepcontrol_launch_dependents()
            expert, item_in_expert, start, count = self.routing.work_item(tables, item)
            column = item_in_expert * s.item_columns + lane_column
            expert_scales = None
            if cutlass.const_expr(s.fp8):
                expert_scales = scales + Int64(expert) * expert_scale_bytes
            walk = self.tiles.weight_walk(matrix + Int64(expert) * expert_bytes, row_bytes, item_in_expert,
                                          lane_column, k_begin, w_n, lane, q, expert_scales, scale_row_bytes)
            for first in cutlass.range(0, count, s.tokens_per_pass):
                if cutlass.const_expr(s.bulk_loads):
                    if warp == s.compute_threads // WARP:
                        self.tiles.copy_rounds(ring, self.tiles.item_weights(matrix + Int64(expert) * expert_bytes,
                                                                             item_in_expert),
                                               sPairs, start, count, first, lane, x, cfg.hidden * token_bytes,
                                               cfg.pairs_per_token, rounds_done)
                    else:
                        tokens = None
                        if cutlass.const_expr(s.fp8_tokens):
                            tokens = self.tiles.tokens(sPairs, start, count, first, lane, x, cfg.hidden * token_bytes,
                                                       cfg.pairs_per_token, token_scales,
                                                       cfg.hidden // FP8_BLOCK * SCALE_BYTES)
                        self.tiles.accumulate_staged(rAcc, walk, tokens, ring, rounds_done, w_k, w_n, lane)
                        self.tiles.reduce(rAcc, sReduction, w_k, w_n, lane)
                        if w_k == 0:
                            self._store(rAcc, activations, sPairs, start, count, first, column, group, q)
                    rounds_done = rounds_done + s.k_steps_per_warp
                else:
                    tokens = self.tiles.tokens(sPairs, start, count, first, lane, x + k_begin * token_bytes,
                                               cfg.hidden * token_bytes, cfg.pairs_per_token, token_scales,
                                               cfg.hidden // FP8_BLOCK * SCALE_BYTES)
                    self.tiles.accumulate(rAcc, walk, tokens, w_k, lane, False, sRing, warp)
                    self.tiles.reduce(rAcc, sReduction, w_k, w_n, lane)
                    if cutlass.const_expr(s.split_k > 1):
                        if self.tiles.add_cluster_partials(rAcc, sPartials, w_k, w_n, lane, cluster_rank):
                            self._store(rAcc, activations, sPairs, start, count, first, column, group, q)
                    elif w_k == 0:
                        self._store(rAcc, activations, sPairs, start, count, first, column, group, q)
        if cutlass.const_expr(cfg.enable_pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _store(self, rAcc, activations, sPairs, start, count, first, column, group, q) -> None:
        """SwiGLU of a pass's sums into the activation rows of its pairs. The whole warp calls it:
        the up lanes pass their sums to the gate lanes, which store."""
        cfg, s = self.config, self.shape
        for i in cutlass.range_constexpr(s.mma_tiles):
            for j in cutlass.range_constexpr(s.token_tiles):
                up = [ptx.shuffle_xor_f32(rAcc[i, j, c], UP_LANES) for c in range(4)]
                if group < 4:
                    # c0, c2: token 2q, columns 2i and 2i + 1; c1, c3: token 2q + 1.
                    for token in cutlass.range_constexpr(2):
                        slot = first + j * MMA_TOKENS + 2 * q + token
                        if slot < count:
                            gate_low, gate_high = bf16_round_pair(rAcc[i, j, token], rAcc[i, j, token + 2])
                            up_low, up_high = bf16_round_pair(up[token], up[token + 2])
                            word = ptx.f32x2_to_bf16x2(silu(gate_low) * up_low, silu(gate_high) * up_high)
                            row = activations + Int64(sPairs[start + slot]) * (cfg.intermediate * BF16_BYTES)
                            ptx.store_u32(row + Int64(column + s.tile_column(i)) * BF16_BYTES, word)
