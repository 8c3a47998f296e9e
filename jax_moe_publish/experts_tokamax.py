"""The experts op's ``impl="tokamax"`` route: the reference's pairs, in expert order, through
tokamax's grouped GEMM for Hopper (``tokamax.ragged_dot``, its Mosaic GPU implementation).

tokamax is optional (``pip install "jax-moe-publish[tokamax]"``; its 0.0.17 needs jax >=
0.11.1). Its kernel tiles each expert's pairs for tensor cores in blocks sized for prefill, and
``impl="auto"`` takes it only where a run measured it fastest (`experts_tuning`; the design's
"the experts op" says where). The rounding points are the reference's
(`reference.moe_experts`); only the order of the float32 sums is tokamax's.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jax_moe_publish import checks, reference

IMPLEMENTATION = "mosaic"
"""tokamax's implementation the route names: its Mosaic GPU kernel (sm_90 and later)."""
TILE = 64
"""What hidden and intermediate must be multiples of: the kernel's TMA tiles (at Qwen3-30B's
tp = 8 shard, intermediate 96, it raised that a dimension must be a multiple of its tiling 64)."""
ROW_TILE = 8
"""What the route pads a call's pairs to a multiple of, with skipped pairs: tokamax aligns each
expert's rows to 8 (its sm_90 kernel's ``align_tile``), and on one H100 calls of 28 pairs
failed where 4, 56 and 256 passed."""


@functools.cache
def import_error() -> str | None:
    """Why ``import tokamax`` fails in this Python (its exception as one line), or None."""
    try:
        import tokamax  # noqa: F401  (imported for its error only)
    except Exception as error:  # noqa: BLE001 - an install for another jax raises its own types
        return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    return None


def why_not(shape: checks.ExpertsShape) -> str | None:
    """Why the route cannot take a call of ``shape``, or None: tokamax does not import, an
    operand is a `BlockScaled` (the route runs bf16 GEMMs only), or hidden or intermediate is
    not a multiple of `TILE`."""
    error = import_error()
    if error is not None:
        return f"tokamax does not import ({error}); install it with pip install 'jax-moe-publish[tokamax]'"
    if shape.block_scaled:
        return "the tokamax route takes bf16 x and weights only; this call has BlockScaled operands"
    untiled = [f"{name}={size}" for name, size in (("hidden", shape.hidden), ("intermediate", shape.intermediate))
               if size % TILE]
    if untiled:
        return f"{', '.join(untiled)}: the tokamax route takes hidden and intermediate multiples of {TILE}"
    return None


def moe_experts(x, expert_ids, gate_up, down):
    """`reference.moe_experts`'s arguments and result, its two grouped GEMMs tokamax's, on the
    pairs padded to a multiple of `ROW_TILE` by tokens whose ids are all skipped (sorted past
    every group: no expert reads them; their rows are dropped)."""
    import tokamax

    m, top_k = expert_ids.shape
    padded_m = m
    while padded_m * top_k % ROW_TILE:
        padded_m += 1
    x = jnp.pad(x, ((0, padded_m - m), (0, 0)))
    expert_ids = jnp.pad(expert_ids, ((0, padded_m - m), (0, 0)), constant_values=-1)
    grouped = functools.partial(tokamax.ragged_dot, implementation=IMPLEMENTATION)
    rows = reference.moe_experts_with_activations(x, expert_ids, gate_up, down, ragged_dot=grouped)[0]
    return rows[: m * top_k]
