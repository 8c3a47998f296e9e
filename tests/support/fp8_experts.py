"""Experts-op inputs with `BlockScaled` FP8 operands, and the float64 model's inputs for them
(the values the FP8 operands stand for): shared by the CPU and GPU tests."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import numerics
import jax_moe_publish as jmp
from jax_moe_publish import reference

# Every e4m3 code's value (the two NaN codes NaN).
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def dequantized(a) -> np.ndarray:
    """The float64 array a `BlockScaled` stands for: each e4m3 value times its block's scale
    (exact in float64), apart from `BlockScaled.dequantize`: the values through a table of the
    256 codes, each block times its scale."""
    values = _E4M3_VALUES[np.asarray(a.values).view(np.uint8)]
    scales = np.asarray(a.scales).astype(np.float64)
    row_blocks, col_blocks = scales.shape[-2:]
    blocks = values.reshape(*values.shape[:-2], row_blocks, values.shape[-2] // row_blocks, col_blocks,
                            values.shape[-1] // col_blocks)
    return (blocks * scales[..., :, None, :, None]).reshape(values.shape)


def random_case(rng, *, m, hidden, intermediate, experts_count, top_k, fused, block=(128, 128), fp8_x=False,
                **routing):
    """Fresh inputs with the weights quantized per ``block`` (and with ``fp8_x`` the tokens per
    128 channels by `reference.quantize_fp8`): the op's arguments and the model's inputs, whose
    arrays are the float64 values the FP8 operands stand for. ``routing``: `numerics.random_experts`'
    ``skipped_fraction`` and ``hot_experts``."""
    inputs = numerics.random_experts(rng, m=m, hidden=hidden, intermediate=intermediate, experts=experts_count,
                                     top_k=top_k, **routing)
    down = jmp.BlockScaled.quantize(inputs.down, block)
    if fused:
        gate_up = jmp.BlockScaled.quantize(inputs.gate_up, block)
        gate, up = np.split(dequantized(gate_up), 2, axis=-1)
    else:
        gate_up = tuple(jmp.BlockScaled.quantize(w, block) for w in (inputs.gate, inputs.up))
        gate, up = (dequantized(w) for w in gate_up)
    x = inputs.x
    model_x = x
    if fp8_x:
        x = jmp.BlockScaled(*reference.quantize_fp8(jnp.asarray(inputs.x)))
        model_x = dequantized(x)
    model = dataclasses.replace(inputs, x=model_x, gate=gate, up=up, down=dequantized(down))
    return (x, inputs.expert_ids, gate_up, down), model
