"""The FP8 ``out`` of the epilogue kernels: a row's bf16 ``out`` quantized where it is made.

`reference.quantize_fp8` is the contract, with every operation in float32: per row and group
of ``FP8_GROUP`` columns, ``scale = max|x| * float32(1 / 448)`` (``max.NaN``, so a NaN makes
the scale NaN), ``q = e4m3(x * (1 / scale))`` with the IEEE reciprocal and a saturating
rounding, and ``q = 0`` in a group whose scale is 0; or the same with a static scale.

A thread holds fragments of ``2 * words`` consecutive values, and consecutive threads hold
consecutive fragments, so a group is the fragments of ``FP8_GROUP / (2 * words)`` (16 or 32)
aligned lanes of one warp: its maximum is a butterfly over those lanes, the same bits in each.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_moe_publish._abi import FP8_GROUP, FP8_MAX
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx

SCALE_BYTES = 4


class Fp8Out:
    """Quantize and store one fragment of a row (``words`` bf16x2 words) of the FP8 ``out``."""

    def __init__(self, config: KernelConfig, words: int) -> None:
        self.dynamic = config.fp8_out == "group"
        self.words = words
        self.hidden = config.hidden
        self.group_lanes = FP8_GROUP // (2 * words)

    @cute.jit
    def store(self, words, keep, out, out_scales, out_scale, row, element) -> None:
        """Quantize ``words`` (the fragment's bf16 ``out`` values; zeros in a lane that keeps
        nothing) and, where ``keep`` (Int32) is nonzero, store them at column ``element`` of
        row ``row`` of ``out`` (e4m3 [rows, hidden]), and the group's scale into
        ``out_scales`` (float32 [rows, hidden / FP8_GROUP]) from the group's first lane.
        Every lane of the warp must call it (the dynamic scale is a warp shuffle)."""
        values = []
        for w in cutlass.range_constexpr(self.words):
            low, high = ptx.bf16x2_to_f32(words[w])
            values.append(low)
            values.append(high)
        if cutlass.const_expr(self.dynamic):
            scale = self._group_max(values) * Float32(1.0 / FP8_MAX)
        else:
            scale = ptx.load_f32(out_scale)
        inverse = ptx.div_rn_f32(Float32(1.0), scale)
        packed = []
        for i in cutlass.range_constexpr(len(values) // 4):
            q = [values[4 * i + k] * inverse for k in range(4)]
            packed.append(ptx.f32x4_to_e4m3x4(q[0], q[1], q[2], q[3]))
        if cutlass.const_expr(self.dynamic):
            # A zero group: zeros, not 0 / 0.
            packed = [cutlass.select_(scale == Float32(0.0), Uint32(0), word) for word in packed]
        if keep != 0:
            address = out + Int64(row) * self.hidden + element
            if cutlass.const_expr(len(packed) == 1):
                ptx.store_u32(address, packed[0])
            else:
                ptx.store_words(address, packed)
            if cutlass.const_expr(self.dynamic):
                if element % FP8_GROUP == 0:
                    group = Int64(row) * (self.hidden // FP8_GROUP) + element // FP8_GROUP
                    ptx.store_f32(out_scales + group * SCALE_BYTES, scale)

    def _group_max(self, values) -> Float32:
        """``max|v|`` over the group's lanes (NaN if any is), the same bits in each."""
        maximum = Float32(0.0)
        for value in values:
            maximum = ptx.max_abs_nan_f32(maximum, value)
        lane_mask = self.group_lanes // 2
        while lane_mask >= 1:
            maximum = ptx.max_nan_f32(maximum, ptx.shuffle_xor_f32(maximum, lane_mask))
            lane_mask //= 2
        return maximum

    @staticmethod
    def words_or_zeros(words, keep: Int32) -> list:
        """``words`` where ``keep`` is nonzero, else zeros (a lane whose values must not count)."""
        return [cutlass.select_(keep != 0, Uint32(w), Uint32(0)) for w in words]
