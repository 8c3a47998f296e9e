"""`BlockScaled`: an FP8 array with one float32 scale per block, as DeepSeek-V3's checkpoints
store their weights (e4m3, a scale per 128 x 128 block, ``weight_scale_inv``) and as serving
engines quantize activations (a scale per token and 128 channels: the epilogue's FP8 out).

The experts op (`moe_experts`) takes one wherever it takes a bf16 weight array or ``x``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_moe_publish._abi import FP8_MAX


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockScaled:
    """``values * scales``, blockwise: element ``[..., i, j]`` is
    ``float32(values[..., i, j]) * scales[..., i // block_rows, j // block_cols]``.

    ``values`` is float8_e4m3fn ``[..., rows, cols]``, ``scales`` float32 ``[..., rows /
    block_rows, cols / block_cols]`` (the block divides the array exactly). Weights in the
    experts op's layout ``[experts, in, out]`` (MaxText's) take their checkpoint's scales
    transposed like the weights: ``[experts, in / 128, out / 128]``. A pytree: it passes
    through ``jit``, ``vmap`` and ``shard_map`` as its two arrays (a ``PartitionSpec`` over
    ``[..., rows, cols]`` shards the scales' blocks alike where the shards hold whole blocks).
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple:
        return tuple(self.values.shape)

    @property
    def block(self) -> tuple[int, int]:
        """``(block_rows, block_cols)``: the elements that share one scale."""
        return (self.values.shape[-2] // self.scales.shape[-2], self.values.shape[-1] // self.scales.shape[-1])

    def dequantize(self) -> jax.Array:
        """The float32 array (each product of an e4m3 value and its scale rounded to float32)."""
        blocks = _blocks(self.values.astype(jnp.float32), self.block)
        return (blocks * self.scales[..., :, None, :, None]).reshape(self.shape)

    @classmethod
    def quantize(cls, x: jax.Array, block: tuple[int, int] = (128, 128)) -> "BlockScaled":
        """``x`` in e4m3 with a scale per ``block`` of its last two dimensions, as DeepSeek-V3's
        weights were quantized: ``scale = amax(|block|) / 448`` (float32), ``values =
        e4m3(x / scale)`` rounded to nearest even (0 where the block is all zero)."""
        x = jnp.asarray(x, jnp.float32)
        rows, cols = block
        if x.ndim < 2 or x.shape[-2] % rows or x.shape[-1] % cols:
            raise ValueError(f"x.shape={tuple(x.shape)}: expected at least 2 dimensions, the last two multiples "
                             f"of block={tuple(block)}")
        blocks = _blocks(x, block)
        scales = jnp.max(jnp.abs(blocks), axis=(-3, -1)) / jnp.float32(FP8_MAX)
        divisor = jnp.where(scales == 0, jnp.float32(1), scales)[..., :, None, :, None]
        values = (blocks / divisor).reshape(x.shape).astype(jnp.float8_e4m3fn)
        return cls(values, scales)


def _blocks(x: jax.Array, block: tuple[int, int]) -> jax.Array:
    """``x [..., R * rows, C * cols]`` as ``[..., R, rows, C, cols]``: one block per ``(R, C)``."""
    rows, cols = block
    return x.reshape(*x.shape[:-2], x.shape[-2] // rows, rows, x.shape[-1] // cols, cols)
