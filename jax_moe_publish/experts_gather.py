"""The experts op's ``impl="gather"`` route: XLA reads only the active experts' weights.

At decode at most ``m * top_k`` experts are active. Their weights are gathered into ``slots =
min(m * top_k, experts)`` slots (the distinct experts in ascending order; unused slots repeat
the last expert), and every token runs through every slot in two batched GEMMs (``[slots] x
[m, hidden] @ [hidden, 2i]``, then ``[m, i] @ [i, hidden]``), each slot's weights read once;
each pair's row is then picked out. The tokens a slot does not serve cost FLOPs, not bytes:
``m`` FLOPs per weight byte is below an H100/H200's roofline ridge (about 200) at every
decode m. Where the gather would move more bytes than reading every expert once
(`gather_slots`), the GEMMs read the weights in place instead. Its intermediates grow as
``slots * m``: a route for decode, which ``impl="auto"`` takes only where a run measured it
fastest (`experts_tuning`). On one H200 it beat the kernels and every ``ragged_dot`` route at
Qwen3-30B-A3B's shards at m = 64 (benchmarks/README.md, the experts op).

The numerics are the reference's (`reference.moe_experts`): bf16 operands (a `BlockScaled`
FP8 one dequantized to float32 after the gather), float32 sums,
gate and up rounded to bf16, ``silu(gate) * up`` in float32 rounded to bf16, the down
projection's float32 sum rounded to bf16; a pair whose id lies outside ``[0, experts)`` gets
a zero row. Only the order of the float32 sums may differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe_publish import checks
from jax_moe_publish.reference import gemm_operands, swiglu

GATHER_TRAFFIC = 3
"""Bytes the gather moves per byte of an active expert's weights: its read and its write of the
copy, then the GEMM's read of the copy."""


def gather_slots(m: int, top_k: int, experts: int) -> tuple[int, bool]:
    """``(slots, gathered)``: ``min(m * top_k, experts)`` slots, whose weights are gathered while
    that moves fewer bytes than reading every expert once (``GATHER_TRAFFIC * slots < experts``)."""
    slots = min(m * top_k, experts)
    return slots, GATHER_TRAFFIC * slots < experts


def moe_experts(x: jax.Array, expert_ids: jax.Array, gate_up, down: jax.Array) -> jax.Array:
    """The routed experts of one rank's shard through the active experts' gathered weights:
    `reference.moe_experts`'s arguments, result (bf16 [m * top_k, hidden] in pair order, zero
    rows for skipped pairs) and rounding points, which its docstring states."""
    return moe_experts_with_activations(x, expert_ids, gate_up, down)[0]


def moe_experts_with_activations(x: jax.Array, expert_ids: jax.Array, gate_up, down: jax.Array):
    """`moe_experts` and its activations ``h``: ``(y, h)``, h bf16 [m * top_k, intermediate] in
    pair order, zero for a skipped pair (as `reference.moe_experts_with_activations`)."""
    shape = checks.check_expert_arrays(x, expert_ids, gate_up, down)
    flat = expert_ids.reshape(-1)
    valid = (flat >= 0) & (flat < shape.experts)
    slots, gathered = gather_slots(shape.m, shape.top_k, shape.experts)
    # A skipped pair reads the padding's expert, so that it adds no slot; its rows are zeroed below.
    slot = jnp.where(valid, flat, shape.experts - 1)
    projections = [gate_up] if shape.fused else list(gate_up)
    if gathered:
        active, slot = jnp.unique(slot, return_inverse=True, size=slots, fill_value=shape.experts - 1)
        # A BlockScaled expert's values and scales alike: its FP8 bytes are what move.
        projections, down = jax.tree.map(lambda w: w[active], (projections, down))
        slot = slot.reshape(-1)

    def gemm(spec, a, b):
        a, b, precision = gemm_operands(a, b)
        return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    projected = [gemm("mh,shj->smj", x, w) for w in projections]  # [slots, m, columns] each
    gate, up = jnp.split(projected[0], 2, axis=-1) if shape.fused else projected
    h = swiglu(gate, up)
    y = gemm("smi,sih->smh", h, down)
    token = jnp.arange(flat.shape[0]) // shape.top_k
    skipped = ~valid[:, None]

    def pick(per_slot):  # [slots, m, columns] -> each pair's row, zero for a skipped pair
        return jnp.where(skipped, jnp.zeros((), jnp.bfloat16), per_slot[slot, token])

    return pick(y), pick(h)
