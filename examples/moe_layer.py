"""A tensor-parallel MoE layer whose finalize and all-reduce are one jax-moe-publish call (shared by the examples).

Each rank holds a 1/tp slice of every expert's intermediate dimension (and of
the shared expert), so its expert outputs are partial sums that the group must
add up. The layer routes tokens, runs the sliced experts on expert-sorted rows,
and calls `moe_finalize_publish`, which does the weighted top-k sum, adds the
shared expert and reduces over the group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp

HIDDEN = 512
EXPERTS = 16
TOP_K = 4
INTERMEDIATE = 256
ROUTED_SCALE = 2.5
# The router is replicated; the rest is sliced along the intermediate dim, one slice per rank.
PARAM_SPECS = {"router": P(), "w_in": P("tp"), "w_out": P("tp"), "shared_in": P("tp"), "shared_out": P("tp")}


def init_params(key, tp: int):
    """Router (replicated), experts and shared expert sliced along the intermediate dim."""
    k = jax.random.split(key, 5)
    scale = HIDDEN**-0.5
    return {
        "router": jax.random.normal(k[0], (HIDDEN, EXPERTS), jnp.float32) * scale,
        "w_in": jax.random.normal(k[1], (tp, EXPERTS, HIDDEN, INTERMEDIATE // tp), jnp.bfloat16) * scale,
        "w_out": jax.random.normal(k[2], (tp, EXPERTS, INTERMEDIATE // tp, HIDDEN), jnp.bfloat16) * scale,
        "shared_in": jax.random.normal(k[3], (tp, HIDDEN, INTERMEDIATE // tp), jnp.bfloat16) * scale,
        "shared_out": jax.random.normal(k[4], (tp, INTERMEDIATE // tp, HIDDEN), jnp.bfloat16) * scale,
    }


def expert_outputs(params, x):
    """One shard's inputs of the finalize, from x bf16 [m, hidden] (replicated): routed_output bf16
    [m * top_k, hidden], weights float32 [m, top_k], permuted_indices int32 [m, top_k], shared
    bf16 [m, hidden], each this rank's partial."""
    m = x.shape[0]
    logits = x.astype(jnp.float32) @ params["router"]
    top_logits, experts = jax.lax.top_k(logits, TOP_K)
    weights = jax.nn.softmax(top_logits, axis=-1)  # float32 [m, top_k]
    # Expert-sorted rows, as a grouped GEMM would produce them.
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    permuted_indices = jnp.argsort(order).astype(jnp.int32).reshape(m, TOP_K)
    rows = x[order // TOP_K]
    w_in, w_out = params["w_in"][0], params["w_out"][0]
    hidden_rows = jax.nn.silu(jnp.einsum("rh,rhi->ri", rows, w_in[flat_experts[order]]))
    routed_output = jnp.einsum("ri,rih->rh", hidden_rows, w_out[flat_experts[order]]).astype(jnp.bfloat16)
    shared = (jax.nn.silu(x @ params["shared_in"][0]) @ params["shared_out"][0]).astype(jnp.bfloat16)
    return routed_output, weights, permuted_indices, shared


def moe_layer(params, x, *, mailbox):
    """One shard of the layer: x bf16 [m, hidden] (replicated) -> bf16 [m, hidden] (the group's sum)."""
    return jmp.moe_finalize_publish(*expert_outputs(params, x), mailbox=mailbox,
                                    routed_scaling_factor=ROUTED_SCALE)


def check_programs(mesh, mailbox):
    """The layer as two jitted programs, for the float64 model: the experts, whose outputs are
    every rank's op inputs (``[tp, ...]``) and the model's, then the op alone on them (so that
    it reads exactly the inputs the model gets)."""
    experts = jax.shard_map(lambda p, x: [a[None] for a in expert_outputs(p, x)], mesh=mesh,
                            in_specs=(PARAM_SPECS, P()), out_specs=P("tp"))
    finalize = functools.partial(jmp.sharded_moe_finalize_publish, mailbox, routed_scaling_factor=ROUTED_SCALE)
    return jax.jit(experts), jax.jit(finalize)
