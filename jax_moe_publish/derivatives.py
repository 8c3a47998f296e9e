"""The derivative of `moe_finalize_publish`: the float32 math's, straight through the bf16 roundings.

A rounding to bf16 has derivative zero almost everywhere, which no training step can use, so
the rule takes every rounding of the op (partial, sum, residual add, output) as the identity
and differentiates the float32 math at the values the forward computed. With tangents ``d``::

    dp_r[t]       = sum_k scale * (dw[t,k] * routed[idx[t,k]] + w[t,k] * drouted[idx[t,k]]) + dshared[t]
    dy            = sum_r dp_r                                (in the result's layout)
    dx            = dy + dresidual,                           x = float32(residual_out) of the forward
    dout          = rmsnorm'(x, norm_weight) . (dx, dnorm_weight)
    dresidual_out = dx

with the sum over valid indices only, ``rmsnorm(x, w) = x * rsqrt(mean(x^2) + eps) * w``, and
zero in rows of no token (a reduce_scatter mailbox). Reverse mode is its transpose:
the cotangent of ``y`` reaches every rank's partial, the gradient of ``routed_output`` is the
scatter-add of ``scale * w[t,k] * g[t]`` into row ``idx[t,k]`` (exactly zero in rows that no
valid index names), that of ``expert_weights`` is ``scale * <g[t], routed[idx[t,k]]>`` (zero
for a skipped index) and that of ``shared_output`` is ``g``. Everything runs in jnp and float32;
only the results take the dtypes of the arrays they belong to.

Why a `jax.custom_jvp` whose tangent is linear, and not a `jax.custom_vjp`:

* ``jax.jvp`` works too; a custom_vjp function refuses forward mode.
* JAX transposes the tangent, the group sum's ``psum`` included, by its own rules, which are
  the ones shard_map applies to the cotangents it hands each shard, with ``check_vma`` on (the
  all-reduce's transpose casts the cotangent, the same on every rank, to varying: no
  communication) and off (its transpose is a ``psum`` of cotangents that shard_map divided by
  tp). A hand-written backward would have to restate both.
* It wraps the custom_vmap fold from outside (`op._folding_vmap_batches`): under ``jax.vmap``
  JAX batches the primal, the fold's one call of the kernels, apart from the tangent, which it
  batches as jnp. Inside the fold a derivative would have to pass through a custom_vmap, which
  JAX cannot transpose.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_moe_publish import reference
from jax_moe_publish._abi import FP8_GROUP


def straight_through(publish, *, axis_name: str, result: str, scale: float, norm_eps: float, fp8_out: str):
    """``publish`` (of routed_output, expert_weights, permuted_indices, shared_output, residual,
    norm_weight and out_scale, inside shard_map over ``axis_name``) with the derivative of this
    module; the forward is ``publish``'s, on whatever path it takes. With an FP8 out
    (``fp8_out``, `KernelConfig.fp8_out`) the tangent of ``out`` is bf16 out's divided by its
    scale, rounded to e4m3, that of the scales 0 (they are a maximum's, held fixed)."""

    @jax.custom_jvp
    def differentiable(*arrays):
        return publish(*arrays)

    @differentiable.defjvp
    def jvp(primals, tangents):
        outs = publish(*primals)
        tangent = _tangent(primals[:6], tangents[:6], outs, axis_name=axis_name, result=result, scale=scale,
                           norm_eps=norm_eps)
        if fp8_out == "none":
            return outs, tangent
        return outs, _fp8_tangents(tangent, outs, primals[6], fp8_out)

    return differentiable


def _fp8_tangents(tangent, outs, out_scale, fp8_out: str) -> tuple:
    """The tangents of an FP8 out's results from bf16 out's and residual_out's."""
    d_out, d_residual_out = tangent
    if fp8_out == "static":
        divisor = out_scale
    else:
        divisor = jnp.repeat(outs[1], FP8_GROUP, axis=-1)
    zero = divisor == 0
    d_q = jnp.where(zero, 0.0, d_out.astype(jnp.float32) / jnp.where(zero, 1.0, divisor)).astype(outs[0].dtype)
    if fp8_out == "static":
        return d_q, d_residual_out
    return d_q, jnp.zeros_like(outs[1]), d_residual_out


def _tangent(primals, tangents, outs, *, axis_name, result, scale, norm_eps):
    """The tangent of the op's outputs, linear in ``tangents``, at ``primals`` and the forward's ``outs``."""
    routed_output, expert_weights, permuted_indices, shared_output, residual, norm_weight = primals
    d_routed, d_weights, _, d_shared, d_residual, d_norm_weight = tangents  # indices: float0

    def partial(routed_output, expert_weights, shared_output):
        return reference.moe_finalize_float32(routed_output, expert_weights, permuted_indices, shared_output,
                                              routed_scaling_factor=scale)

    # In float32 from the start (bf16 converts exactly), so that the transpose sums the rows'
    # cotangents in float32: from bf16 rows, JAX's rules would scatter-add them in bf16.
    as_float32 = functools.partial(jax.tree.map, lambda x: x.astype(jnp.float32))
    _, d_partial = jax.jvp(partial, as_float32((routed_output, expert_weights, shared_output)),
                           as_float32((d_routed, d_weights, d_shared)))
    d_y = reference.reduce_over_group(d_partial, axis_name, result)
    if residual is None:
        return d_y.astype(jnp.bfloat16)
    residual_out = outs[-1]
    d_x = d_y + d_residual.astype(jnp.float32)
    _, d_out = jax.jvp(functools.partial(reference.rms_normalize, eps=norm_eps),
                       (reference.as_float32(residual_out), norm_weight), (d_x, d_norm_weight))
    if result == "reduce_scatter":
        has_token = reference.rows_with_tokens(d_x.shape[0], expert_weights.shape[0], axis_name)
        d_out, d_x = (jnp.where(has_token, d, jnp.zeros_like(d)) for d in (d_out, d_x))
    return d_out.astype(jnp.bfloat16), d_x.astype(jnp.bfloat16)
