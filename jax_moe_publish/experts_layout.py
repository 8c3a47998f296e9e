"""`PreparedExperts`: the experts' weights in the kernels' tiled order, made once by
`prepare_experts`, as serving engines prepare their weights at load time.

In their ``[experts, k, columns]`` rows a work item's weights are ``k`` strided pieces of 64 or
128 bytes, and a warp's load covers 16 of them. In the tiled order (`GemmShape.tiled_offset`)
each item is one contiguous block and every load of a warp is 512 or 1024 consecutive bytes.
The arrays keep their shapes (the same bytes, reordered within each expert), so they pass
through ``jit``, ``shard_map`` and the kernels' operand checks as the plain arrays do.
`prepare_experts` (`jax_moe_publish.experts`) checks and tiles; this module holds the order.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_moe_publish.block_scaled import BlockScaled
from jax_moe_publish.experts_config import MMA_K, ExpertsConfig


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The launch shapes a tiled order is made for: each kernel's warps side by side and their
    columns (`ExpertsConfig`'s ``*_warps_n`` and ``*_warp_cols``); the other choices of a
    config do not change the order."""

    gate_up_warps_n: int
    gate_up_warp_cols: int
    down_warps_n: int
    down_warp_cols: int

    @classmethod
    def of(cls, config: ExpertsConfig) -> "Tiling":
        return cls(config.gate_up_warps_n, config.gate_up_warp_cols, config.down_warps_n, config.down_warp_cols)

    def config_for(self, config: ExpertsConfig) -> ExpertsConfig:
        """``config`` reading weights in this order."""
        return config.replace(tiled_weights=True, **dataclasses.asdict(self))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreparedExperts:
    """The experts' weights in the tiled order of `tiling` (`prepare_experts`): ``gate_up``
    ``[experts, hidden, 2 * intermediate]`` (gate and up, as the fused array), ``down``
    ``[experts, intermediate, hidden]``, both bf16 or both `BlockScaled` e4m3 (the values
    tiled, the scales as they were). With `shared` the arrays hold one more expert after the
    routed ones: the shared expert, which every token uses. A pytree of the arrays (`tiling`
    and `shared` are static): it passes through ``jit`` and ``shard_map``. A rank prepares its
    own slices (`prepare_experts` inside ``shard_map``): the arrays' specs over I (gate_up's last
    axis, down's middle one), as a `PreparedExperts` of two specs with the rank's `tiling` and
    `shared`, then keep each rank's tiled block whole."""

    gate_up: jax.Array
    down: jax.Array
    tiling: Tiling = dataclasses.field(metadata=dict(static=True))
    shared: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def untiled(self) -> tuple:
        """``(gate_up, down)`` in their rows again: the fused gate_up, and down (with `shared`,
        the shared expert last)."""
        gate_up = _untile(self.gate_up, self.tiling.gate_up_warps_n, self.tiling.gate_up_warp_cols, gated=True)
        down = _untile(self.down, self.tiling.down_warps_n, self.tiling.down_warp_cols, gated=False)
        return gate_up, down


def tile(gate_up, down, tiling: Tiling, *, shared: bool = False) -> PreparedExperts:
    """The fused ``gate_up`` and ``down`` (checked arrays, JAX's or NumPy's: bf16, or
    `BlockScaled` whose values are tiled) in the tiled order of ``tiling``; ``shared``: their
    last expert is the shared one."""
    return PreparedExperts(_tile(gate_up, tiling.gate_up_warps_n, tiling.gate_up_warp_cols, gated=True),
                           _tile(down, tiling.down_warps_n, tiling.down_warp_cols, gated=False), tiling, shared)


def _split_axes(shape: tuple, warps_n: int, warp_cols: int, gated: bool) -> tuple[tuple, tuple]:
    """``[experts, k, columns]`` split into the axes of `GemmShape.tiled_offset`, and the
    transposition that puts them in the tiled order.

    Rows: ``k = 16 s + 8 h + 2 q + b``, so that lane ``4 g + q``'s row ``2 h + b`` is
    `LANE_ROWS`'s. Columns, each lane's ``warp_cols / 8`` (``c``) of its group ``g``: ``j``
    (the item), ``w_n``, ``g``, ``c``; gated, ``half`` (gate or up) first and ``g = 4 half +
    g4``. Tiled: ``[experts, j, s, w_n, h, b, g, q, c]``."""
    experts, k, columns = shape
    if k % MMA_K:
        raise ValueError(f"weights of shape {shape}: expected K (the middle dimension) a multiple of {MMA_K}")
    lane_cols = warp_cols // 8
    rows = (k // MMA_K, 2, 4, 2)  # s, h, q, b
    if gated:
        half_columns = columns // 2
        item = warps_n * warp_cols // 2
        if columns % 2 or half_columns % item:
            raise ValueError(f"gate_up of shape {shape}: expected 2 * intermediate columns, intermediate a "
                             f"multiple of {item} (gate_up_warps_n={warps_n} x gate_up_warp_cols={warp_cols} / 2)")
        split = (experts, *rows, 2, half_columns // item, warps_n, 4, lane_cols)
        # axes: 0 e, 1 s, 2 h, 3 q, 4 b, 5 half, 6 j, 7 w_n, 8 g4, 9 c
        order = (0, 6, 1, 7, 2, 4, 5, 8, 3, 9)
    else:
        item = warps_n * warp_cols
        if columns % item:
            raise ValueError(f"down of shape {shape}: expected hidden a multiple of {item} "
                             f"(down_warps_n={warps_n} x down_warp_cols={warp_cols})")
        split = (experts, *rows, columns // item, warps_n, 8, lane_cols)
        # axes: 0 e, 1 s, 2 h, 3 q, 4 b, 5 j, 6 w_n, 7 g, 8 c
        order = (0, 5, 1, 6, 2, 4, 7, 3, 8)
    return split, order


def _tile(weights, warps_n: int, warp_cols: int, *, gated: bool):
    if isinstance(weights, BlockScaled):
        return BlockScaled(_tile(weights.values, warps_n, warp_cols, gated=gated), weights.scales)
    split, order = _split_axes(tuple(weights.shape), warps_n, warp_cols, gated)
    if not isinstance(weights, jax.Array):
        return weights.reshape(split).transpose(order).reshape(weights.shape)

    def tile_expert(expert):
        return expert.reshape(split[1:]).transpose([axis - 1 for axis in order[1:]]).reshape(expert.shape)

    # One expert at a time: XLA's autotuner runs a whole layer's transpose into scratch as large as
    # the result, which a DeepSeek-V3 tp = 1 layer (15 GB of gate_up) cannot spare beside it.
    return jax.lax.map(tile_expert, weights)


def _untile(tiled, warps_n: int, warp_cols: int, *, gated: bool):
    if isinstance(tiled, BlockScaled):
        return BlockScaled(_untile(tiled.values, warps_n, warp_cols, gated=gated), tiled.scales)
    split, order = _split_axes(tuple(tiled.shape), warps_n, warp_cols, gated)
    tiled_split = tuple(split[axis] for axis in order)
    return tiled.reshape(tiled_split).transpose(tuple(int(a) for a in np.argsort(order))).reshape(tiled.shape)
