"""The experts' down projection (role ``expert_down``): the routed rows.

For every token-expert pair ``p = t * top_k + k`` whose id ``e`` is a valid expert::

    out[p] = bf16( activations[p] @ W_down[e] )          (float32 sums)

and ``out[p] = 0`` for a pair whose id lies outside ``[0, experts)``. With ``shared_expert``
(roles ``..._shared``) each token's last pair (`ExpertRouting`) is its shared expert's, whose
row goes to ``shared[t]``. The grid is persistent;
every CTA builds the routing tables (`ExpertRouting`) once the gate/up kernel has finished
(the activations are its), then takes the work items ``b, b + grid, ...`` (item
``n * items_per_expert + j``: column block ``j`` of the ``n``-th pass of the active groups'
pairs, `ExpertRouting.work_item`), and the grid's warps
together zero the rows of the skipped pairs (after the items, or before them with the
shared expert). With ``down_bulk_loads`` the CTA's last warp
copies each pass's rounds into a ring in shared memory, which the others read (`ExpertTiles`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_moe_publish.experts_config import FP8_BLOCK, MMA_TOKENS, ExpertsConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.expert_routing import ExpertRouting
from jax_moe_publish.kernels.expert_tiles import BF16_BYTES, SCALE_BYTES, ExpertTiles

WARP = 32
VECTOR_BYTES = 16


class ExpertDownKernel:
    """``32 * warps_k * warps_n`` threads per CTA, the down `GemmShape` of ``config``."""

    def __init__(self, config: ExpertsConfig) -> None:
        self.config = config
        self.shape = config.gemm("down")
        self.routing = ExpertRouting(config, self.shape)
        self.tiles = ExpertTiles(self.shape)

    # The method name is the role (the compile step finds the kernel by it). The parameters are
    # `_abi.EXPERTS.roles`'s.
    @cute.kernel
    def expert_down(
        self,
        expert_ids: Int64,  # (m, top_k) int32
        down: Int64,  # (experts, intermediate, hidden) bf16, in rows or tiled (`GemmShape.tiled_offset`)
        activations: Int64,  # (m * top_k, intermediate) bf16, the gate/up kernel's
        out: Int64,  # (m * top_k, hidden) bf16
        m: Int32,
    ) -> None:
        self._down(expert_ids, down, None, activations, out, m)

    @cute.kernel
    def expert_down_shared(
        self,
        expert_ids: Int64,  # (m, top_k) int32
        down: Int64,  # (experts + 1, intermediate, hidden) bf16, the shared expert last
        activations: Int64,  # (m, top_k + 1, intermediate) bf16, the gate/up kernel's
        out: Int64,  # (m * top_k, hidden) bf16
        shared: Int64,  # (m, hidden) bf16
        m: Int32,
    ) -> None:
        self._down(expert_ids, down, None, activations, out, m, shared)

    @cute.kernel
    def expert_down_fp8_shared(
        self,
        expert_ids: Int64,  # (m, top_k) int32
        down: Int64,  # (experts + 1, intermediate, hidden) e4m3, the shared expert last
        down_scales: Int64,  # (experts + 1, intermediate / 128, hidden / 128) float32
        activations: Int64,  # (m, top_k + 1, intermediate) bf16, the gate/up kernel's
        out: Int64,  # (m * top_k, hidden) bf16
        shared: Int64,  # (m, hidden) bf16
        m: Int32,
    ) -> None:
        self._down(expert_ids, down, down_scales, activations, out, m, shared)

    @cute.kernel
    def expert_down_fp8(
        self,
        expert_ids: Int64,  # (m, top_k) int32
        down: Int64,  # (experts, intermediate, hidden) e4m3
        down_scales: Int64,  # (experts, intermediate / 128, hidden / 128) float32
        activations: Int64,  # (m * top_k, intermediate) bf16, the gate/up kernel's
        out: Int64,  # (m * top_k, hidden) bf16
        m: Int32,
    ) -> None:
        self._down(expert_ids, down, down_scales, activations, out, m)

    @cute.jit
    def _down(self, expert_ids, down, down_scales, activations, out, m, shared=None) -> None:
        """The kernel; ``down_scales``: e4m3 weights' scales, else None; ``shared``: the shared
        expert's rows, else None."""
        cfg, s = self.config, self.shape
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tables = self.routing.allocate()
        sReduction = self.tiles.allocate_reduction()
        sRing = self.tiles.allocate_ring()
        ring = self.tiles.allocate_bulk_ring()
        rAcc = self.tiles.make_accumulators()
        if cutlass.const_expr(s.bulk_loads):
            self.tiles.init_bulk_ring(ring, tidx)
        if cutlass.const_expr(cfg.enable_pdl and not cfg.early_down):
            cute.arch.griddepcontrol_wait()
        # early_down: the ids are the input of gate/up, whose predecessor had finished before
        # gate/up let this kernel launch; only the activations need the wait.
        self.routing.build(tables, expert_ids, m, tidx)
        sPairs = tables[-1]
        warp, lane = tidx // WARP, tidx % WARP
        w_k, w_n = warp % s.warps_k, warp // s.warps_k
        group, q = lane // 4, lane % 4
        lane_column = w_n * s.warp_cols + group * (s.warp_cols // 8)
        row_bytes = cfg.hidden * s.weight_bytes
        expert_bytes = cfg.intermediate * row_bytes
        scale_row_bytes = cfg.hidden // FP8_BLOCK * SCALE_BYTES
        expert_scale_bytes = cfg.intermediate // FP8_BLOCK * scale_row_bytes
        activation_row_bytes = cfg.intermediate * BF16_BYTES
        out_row_bytes = cfg.hidden * BF16_BYTES
        items = self.routing.items(tables)
        if cutlass.const_expr(cfg.early_down):
            # While gate/up runs its last items: this CTA's first item into L2, then the wait.
            if (tidx == 0) & (block < items):
                expert, item_in_expert, _, _ = self.routing.work_item(tables, block)
                first = down + Int64(expert) * expert_bytes
                ptx.prefetch_l2(first + Int64(item_in_expert) * s.tile_item_bytes, s.tile_item_bytes)
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(cfg.shared_expert):
            # Before the items: the ids' address and m need not stay in registers across them
            # (at 64 registers, the shared expert's down kernel of one test shape spilled).
            self._zero_skipped(out, expert_ids, m, warp, lane, block, grid)
        rounds_done = Int32(0)
        for item in cutlass.range(block, items, grid):
            expert, item_in_expert, start, count = self.routing.work_item(tables, item)
            column = item_in_expert * s.item_columns + lane_column
            expert_scales = None
            if cutlass.const_expr(s.fp8):
                expert_scales = down_scales + Int64(expert) * expert_scale_bytes
            walk = self.tiles.weight_walk(down + Int64(expert) * expert_bytes, row_bytes, item_in_expert,
                                          lane_column, Int64(0), w_n, lane, q, expert_scales, scale_row_bytes)
            for first in cutlass.range(0, count, s.tokens_per_pass):
                if cutlass.const_expr(s.bulk_loads):
                    if warp == s.compute_threads // WARP:
                        self.tiles.copy_rounds(ring, self.tiles.item_weights(down + Int64(expert) * expert_bytes,
                                                                             item_in_expert),
                                               sPairs, start, count, first, lane, activations, activation_row_bytes,
                                               1, rounds_done)
                    else:
                        self.tiles.accumulate_staged(rAcc, walk, None, ring, rounds_done, w_k, w_n, lane)
                        self._finish_pass(rAcc, sReduction, w_k, w_n, lane, sPairs, start, count, first, q, column,
                                          out, shared, out_row_bytes)
                    rounds_done = rounds_done + s.k_steps_per_warp
                else:
                    tokens = self.tiles.tokens(sPairs, start, count, first, lane, activations, activation_row_bytes,
                                               1)
                    self.tiles.accumulate(rAcc, walk, tokens, w_k, lane, True, sRing, warp)
                    self._finish_pass(rAcc, sReduction, w_k, w_n, lane, sPairs, start, count, first, q, column,
                                      out, shared, out_row_bytes)
        if cutlass.const_expr(not cfg.shared_expert):
            # After the items: a CTA whose items end early does it while others still compute.
            self._zero_skipped(out, expert_ids, m, warp, lane, block, grid)
        if cutlass.const_expr(cfg.enable_pdl):
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _finish_pass(self, rAcc, sReduction, w_k, w_n, lane, sPairs, start, count, first, q, column, out, shared,
                     out_row_bytes: int) -> None:
        """The K split's sums added, and the pass's rows stored from warp ``w_k = 0``'s."""
        s = self.shape
        self.tiles.reduce(rAcc, sReduction, w_k, w_n, lane)
        if w_k == 0:
            for i in cutlass.range_constexpr(s.mma_tiles):
                for j in cutlass.range_constexpr(s.token_tiles):
                    # c0, c2: token 2q, columns 2i and 2i + 1; c1, c3: token 2q + 1.
                    for token in cutlass.range_constexpr(2):
                        slot = first + j * MMA_TOKENS + 2 * q + token
                        if slot < count:
                            word = ptx.f32x2_to_bf16x2(rAcc[i, j, token], rAcc[i, j, token + 2])
                            row = self._row(sPairs[start + slot], out, shared, out_row_bytes)
                            ptx.store_u32(row + Int64(column + s.tile_column(i)) * BF16_BYTES, word)

    def _row(self, pair, out, shared, row_bytes: int):
        """The address of ``pair``'s row: ``out``'s row ``pair``; with the shared expert, the
        routed pair ``(t, k)``'s ``t * top_k + k`` and the shared one's ``shared[t]``."""
        if shared is None:
            return out + Int64(pair) * row_bytes
        cfg = self.config
        token = pair // cfg.pairs_per_token
        k = pair - token * cfg.pairs_per_token
        return cutlass.select_(k == cfg.top_k, shared + Int64(token) * row_bytes,
                               out + Int64(token * cfg.top_k + k) * row_bytes)

    @cute.jit
    def _zero_skipped(self, out, expert_ids, m, warp, lane, block, grid) -> None:
        """Zero the rows of the pairs with no valid expert: warp ``w`` of the grid takes pairs
        ``w, w + warps, ...``, and for a skipped one writes its whole row, 16 bytes per lane and
        step. Keyed by the pair: a skipped pair has no slot of ``sPairs``."""
        cfg = self.config
        row_bytes = cfg.hidden * BF16_BYTES
        warps = self.shape.threads // WARP
        for pair in cutlass.range(block * warps + warp, m * cfg.top_k, grid * warps):
            expert = ptx.load_s32(expert_ids + Int64(pair) * 4)
            if (expert < 0) | (expert >= cfg.experts):
                row = out + Int64(pair) * row_bytes
                for vector in cutlass.range(lane, row_bytes // VECTOR_BYTES, WARP):
                    ptx.store_words(row + Int64(vector) * VECTOR_BYTES, [Uint32(0)] * 4)
