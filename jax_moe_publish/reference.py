"""Pure-JAX semantics of the ops, with the kernels' rounding points.

These functions define what the kernels compute and run anywhere JAX runs;
`moe_finalize_publish` and `moe_experts` with ``impl="reference"`` (or ``"auto"`` off CUDA)
use them.

One rank's partial, for token ``t`` (float32 accumulation in the order k = 0..top_k-1)::

    partial[t] = bf16( sum_k (w[t, k] * scale) * routed[idx[t, k]] + shared[t] )

with terms whose index is outside ``[0, num_rows)`` left out. Across a group the
partials are published with bf16 -0.0 turned into +0.0, summed in float32 and
rounded once to bf16.

The optional epilogue (`add_rmsnorm`) rounds to bf16 where the fused kernel
does: once after the residual add, once at the end.

JAX differentiates these functions by its own rules, which round the cotangents
where the forward rounds. The op's derivative (`jax_moe_publish.derivatives`)
differentiates their float32 parts (`moe_finalize_float32`, `rms_normalize`)
instead, straight through the roundings.

Each function checks its arguments with the op's checks (`jax_moe_publish.checks`), less the
kernels' own bounds (capacity_m, top-k, row counts), while it is traced: unchecked, a bad
shape would broadcast, a bad eps give NaN and a group function outside its named axis fail
with JAX's bare NameError.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe_publish import checks, protocol
from jax_moe_publish._abi import FP8_MAX
from jax_moe_publish.block_scaled import BlockScaled


def as_float32(x: jax.Array) -> jax.Array:
    """``x`` in float32; a bf16 ``x`` explicitly at bf16 precision. XLA may keep a bf16 value
    that the same program computed in float32 (``xla_allow_excess_precision``), while the
    kernels read the stored bf16: the rounding makes both read the same numbers."""
    if x.dtype != jnp.bfloat16:
        return x.astype(jnp.float32)
    return lax.reduce_precision(x.astype(jnp.float32), exponent_bits=8, mantissa_bits=7)


def gemm_operands(a, b) -> tuple[jax.Array, jax.Array, lax.Precision | None]:
    """Two operands of the experts' GEMMs as they are read, and the GEMM's precision: a
    `BlockScaled` dequantized to float32 (`BlockScaled.dequantize`), both in float32 where
    their dtypes then differ (a bf16 value is exact in float32), bf16 and bf16 as they are.
    Float32 operands take ``HIGHEST``: float32 products, not TF32's, whatever the platform's
    default."""
    a, b = (v.dequantize() if isinstance(v, BlockScaled) else v for v in (a, b))
    if a.dtype == b.dtype == jnp.bfloat16:
        return a, b, None
    return as_float32(a), as_float32(b), lax.Precision.HIGHEST


def moe_finalize(
    routed_output: jax.Array,
    expert_weights: jax.Array,
    permuted_indices: jax.Array,
    shared_output: jax.Array | None = None,
    *,
    routed_scaling_factor: float = 1.0,
) -> jax.Array:
    """One rank's MoE finalize.

    Parameters
    ----------
    routed_output : bf16 [num_rows, hidden]
        Rows of the routed experts' outputs.
    expert_weights : bf16 or float32 [m, top_k]
        Router weights.
    permuted_indices : int32 [m, top_k]
        Row of ``routed_output`` for each (token, expert); an index outside
        ``[0, num_rows)`` (such as -1) contributes nothing.
    shared_output : bf16 [m, hidden] or None
        Shared expert output, added once per token.
    routed_scaling_factor : float
        Multiplies every router weight (in float32, before the product).

    Returns
    -------
    bf16 [m, hidden]
        ``bf16(sum_k (w[t,k] * scale) * routed[idx[t,k]] + shared[t])``, float32
        accumulation in expert order.
    """
    checks.check_static_scalars(routed_scaling_factor=routed_scaling_factor)
    _check_finalize(routed_output, expert_weights, permuted_indices, shared_output, routed_scaling_factor)
    return _finalize_float32(routed_output, expert_weights, permuted_indices, shared_output,
                             routed_scaling_factor).astype(jnp.bfloat16)


def _check_finalize(routed_output, expert_weights, permuted_indices, shared_output, routed_scaling_factor,
                    row_dtypes=(jnp.bfloat16,)) -> None:
    """The op's checks of a finalize's arguments (`checks`), with no mailbox to fix hidden:
    the shared rows are as wide as the routed ones."""
    checks.check_finalize_arrays(routed_output, expert_weights, permuted_indices, row_dtypes=row_dtypes)
    checks.check_shared_output(shared_output, expert_weights, routed_output.shape[1],
                               hidden_of="routed_output's hidden", row_dtypes=row_dtypes)
    checks.check_scale(routed_scaling_factor)


def moe_finalize_float32(
    routed_output: jax.Array,
    expert_weights: jax.Array,
    permuted_indices: jax.Array,
    shared_output: jax.Array | None = None,
    *,
    routed_scaling_factor: float = 1.0,
) -> jax.Array:
    """`moe_finalize` before its bf16 rounding: the float32 sum, which the op's derivative
    differentiates (`jax_moe_publish.derivatives`) at float32 copies of the bf16 rows, so it
    takes float32 rows too."""
    checks.check_static_scalars(routed_scaling_factor=routed_scaling_factor)
    _check_finalize(routed_output, expert_weights, permuted_indices, shared_output, routed_scaling_factor,
                    row_dtypes=(jnp.bfloat16, jnp.float32))
    return _finalize_float32(routed_output, expert_weights, permuted_indices, shared_output, routed_scaling_factor)


def _finalize_float32(routed_output, expert_weights, permuted_indices, shared_output, routed_scaling_factor):
    num_rows = routed_output.shape[0]
    m, top_k = permuted_indices.shape
    valid = (permuted_indices >= 0) & (permuted_indices < num_rows)
    safe_indices = jnp.where(valid, permuted_indices, 0)
    weights = as_float32(expert_weights)
    if routed_scaling_factor != 1.0:
        weights = weights * jnp.float32(routed_scaling_factor)
    weights = jnp.where(valid, weights, jnp.float32(0.0))
    if num_rows == 0:
        # Nothing is valid; one zero row keeps the (masked) gather well-formed.
        routed_output = jnp.zeros((1, routed_output.shape[1]), routed_output.dtype)
    accumulator = jnp.zeros((m, routed_output.shape[1]), jnp.float32)
    for k in range(top_k):
        rows = jnp.where(valid[:, k, None], as_float32(routed_output[safe_indices[:, k]]), 0.0)
        accumulator = accumulator + weights[:, k, None] * rows
    if shared_output is not None:
        accumulator = accumulator + as_float32(shared_output)
    return accumulator


@jax.custom_jvp
def positive_zero(x: jax.Array) -> jax.Array:
    """bf16 ``x`` with -0.0 replaced by +0.0: what the publish stores.

    The bits are rewritten (a bitcast), since only the sign bit of a zero changes; as a
    function of values it is the identity (-0.0 == +0.0), so its derivative is 1, which the
    bitcast through uint16 would not carry."""
    checks.check_array("x", x, None, [jnp.bfloat16])
    bits = lax.bitcast_convert_type(x, jnp.uint16)
    bits = jnp.where(bits == protocol.EMPTY_BF16, jnp.uint16(0), bits)
    return lax.bitcast_convert_type(bits, jnp.bfloat16)


@positive_zero.defjvp
def _positive_zero_jvp(primals, tangents):
    (x,), (tangent,) = primals, tangents
    return positive_zero(x), tangent


def owned_rows(x: jax.Array, tp: int, rank) -> jax.Array:
    """Rows ``t`` of ``x`` [m, n] with ``t % tp == rank``, in order, zero-padded to ``ceil(m / tp)``."""
    if not hasattr(x, "ndim") or x.ndim != 2:
        raise ValueError(f"x.shape={getattr(x, 'shape', None)}: expected [m, n], 2 dimensions")
    if checks.checked_int("tp", tp) < 1:
        raise ValueError(f"tp={tp!r}: expected an int >= 1")
    m = x.shape[0]
    rows = protocol.owned_rows(m, tp)
    padded = jnp.pad(x, ((0, rows * tp - m), (0, 0)))
    return lax.dynamic_index_in_dim(padded.reshape(rows, tp, -1), rank, axis=1, keepdims=False)


def rows_with_tokens(rows: int, m: int, axis_name: str) -> jax.Array:
    """bool [rows, 1]: which of a reduce_scatter rank's ``rows`` result rows hold one of the
    ``m`` tokens (row i: token ``i * tp + rank``)."""
    tp, rank = _group_size(axis_name, "rows_with_tokens"), lax.axis_index(axis_name)
    return (jnp.arange(rows) * tp + rank < m)[:, None]


def reduce_over_group(x: jax.Array, axis_name: str, result: str) -> jax.Array:
    """The sum of ``x`` [m, ...] over the group, in the layout of ``result``: all of it
    (``allreduce``), or this rank's owned rows (``reduce_scatter``, `owned_rows`)."""
    checks.check_result(result)
    tp = _group_size(axis_name, "reduce_over_group")
    total = lax.psum(x, axis_name)
    if result == "allreduce":
        return total
    return owned_rows(total, tp, lax.axis_index(axis_name))


def _group_size(axis_name, who: str) -> int:
    """The size of the group along ``axis_name``, which the caller's shard_map binds."""
    return checks.check_axis_bound(axis_name, f"reference.{who}", "jax.shard_map over that axis")


def add_rmsnorm(
    y: jax.Array, residual: jax.Array, norm_weight: jax.Array, *, eps: float
) -> tuple[jax.Array, jax.Array]:
    """Residual add, then RMSNorm over the last axis, with the fused kernel's rounding points.

    ::

        residual_out = bf16( float32(y) + float32(residual) )
        out          = bf16( x * rsqrt(mean(x^2) + eps) * float32(norm_weight) ),  x = float32(residual_out)

    The mean and everything after it are float32. ``y`` and ``residual`` are bf16
    [rows, hidden], ``norm_weight`` bf16 [hidden]. Returns ``(out, residual_out)``.
    """
    checks.check_static_scalars(eps=eps)
    checks.check_array("y", y, 2, [jnp.bfloat16])
    checks.check_epilogue_arrays(residual, norm_weight, shape=y.shape, why="the shape of y")
    checks.check_norm_eps(eps, "eps")
    return _add_rmsnorm(y, residual, norm_weight, eps)


def _add_rmsnorm(y, residual, norm_weight, eps):
    # Explicit roundings to bf16 (`as_float32`): of the inputs, and of the sum, whose rounding
    # point XLA would otherwise be free to move.
    x = as_float32((as_float32(y) + as_float32(residual)).astype(jnp.bfloat16))
    residual_out = x.astype(jnp.bfloat16)
    out = _rms_normalize(x, norm_weight, eps).astype(jnp.bfloat16)
    return out, residual_out


def quantize_fp8(x: jax.Array, scale: jax.Array | None = None):
    """``x`` (bf16 ``[rows, hidden]``, the epilogue's ``out``) in float8_e4m3fn, as DeepSeek-V3's
    activation quantizer computes it, with every operation in float32::

        dynamic (scale None), per row and group of 128 columns:
            s = max(|x|) * float32(1 / 448)            (the group's scale, returned)
            q = e4m3( clip(x * (1 / s), -448, 448) ),  q = 0 where s == 0
        static (a float32 scalar scale):
            q = e4m3( clip(x * (1 / scale), -448, 448) )

    ``1 / s`` is the IEEE float32 reciprocal, once per group, and multiplies each value (as
    serving engines' quantizers do, and the kernels: one division per group, and the same bits
    whether or not XLA turns a division by a broadcast into that product). e4m3 rounds to
    nearest even. An all-zero group has scale 0 and zeros. A group holding a NaN has scale NaN
    and only NaNs; one holding an infinity (and no NaN) has scale inf, NaN where x is infinite
    and 0 elsewhere. Returns ``(q, scales)`` with scales float32 ``[rows, hidden / 128]``, or
    ``q`` with a static scale."""
    checks.check_array("x", x, 2, [jnp.bfloat16])
    x = as_float32(x)
    if scale is not None:
        scale = checks.check_fp8_scale(scale)
        return _to_fp8(x * (jnp.float32(1) / scale))
    checks.check_fp8_groups(x.shape[1])
    groups = x.reshape(x.shape[0], -1, checks.FP8_GROUP)
    scales = jnp.max(jnp.abs(groups), axis=-1) * jnp.float32(1 / FP8_MAX)
    # The divisor of a zero group is 1, not 0: no 1 / 0 for a derivative to meet.
    zero = scales[..., None] == 0
    inverse = jnp.float32(1) / jnp.where(zero, jnp.float32(1), scales[..., None])
    q = jnp.where(zero, jnp.float32(0), groups * inverse)
    return _to_fp8(q.reshape(x.shape)), scales


def _to_fp8(x):
    # jnp.clip keeps NaN; the clip makes the rounding saturate, as the kernels' cvt does.
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


def rms_normalize(x: jax.Array, norm_weight: jax.Array, *, eps: float) -> jax.Array:
    """float32 ``x * rsqrt(mean(x^2) + eps) * float32(norm_weight)`` over the last axis, unrounded:
    `add_rmsnorm`'s ``out`` before its bf16 rounding. ``x`` is float32 [..., hidden],
    ``norm_weight`` bf16 [hidden]."""
    checks.check_static_scalars(eps=eps)
    checks.check_array("x", x, None, [jnp.float32])
    if x.ndim < 1:
        raise ValueError(f"x.shape={tuple(x.shape)}: expected [..., hidden], at least 1 dimension")
    checks.check_array("norm_weight", norm_weight, 1, [jnp.bfloat16], shape=(x.shape[-1],))
    checks.check_norm_eps(eps, "eps")
    return _rms_normalize(x, norm_weight, eps)


def _rms_normalize(x, norm_weight, eps):
    inverse_rms = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + jnp.float32(eps))
    return x * inverse_rms * as_float32(norm_weight)


def moe_finalize_publish(
    routed_output: jax.Array,
    expert_weights: jax.Array,
    permuted_indices: jax.Array,
    shared_output: jax.Array | None = None,
    *,
    axis_name: str,
    routed_scaling_factor: float = 1.0,
    result: str = "allreduce",
    residual: jax.Array | None = None,
    norm_weight: jax.Array | None = None,
    norm_eps: float = 1e-6,
):
    """The op's semantics on one shard, inside ``shard_map`` over ``axis_name``.

    Returns ``y = bf16(sum over ranks of float32(positive_zero(partial)))``:
    bf16 [m, hidden] for ``result="allreduce"``, or for ``result="reduce_scatter"``
    the rows of tokens ``t`` with ``t % tp == rank`` as bf16 [ceil(m/tp),
    hidden], unused rows zero.

    With ``residual`` (the shape of ``y``) and ``norm_weight`` ([hidden]),
    returns ``add_rmsnorm(y, residual, norm_weight, eps=norm_eps)`` instead:
    ``(out, residual_out)``, both zero in rows of no token.

    The arguments are checked as the op checks them, ``axis_name`` bound and ``result`` one
    of `tuning.RESULTS` included.
    """
    checks.check_static_scalars(routed_scaling_factor=routed_scaling_factor, norm_eps=norm_eps)
    _check_finalize(routed_output, expert_weights, permuted_indices, shared_output, routed_scaling_factor)
    checks.check_result(result)
    tp = _group_size(axis_name, "moe_finalize_publish")
    rows, rule = checks.result_rows(expert_weights.shape[0], tp, result)
    default_eps = inspect.signature(moe_finalize_publish).parameters["norm_eps"].default
    checks.check_epilogue(residual, norm_weight, norm_eps, default_eps=default_eps, rows=rows, rule=rule,
                          hidden=routed_output.shape[1])
    partial = _finalize_float32(routed_output, expert_weights, permuted_indices, shared_output,
                                routed_scaling_factor).astype(jnp.bfloat16)
    y = reduce_over_group(positive_zero(partial).astype(jnp.float32), axis_name, result).astype(jnp.bfloat16)
    if residual is None:
        return y
    out, residual_out = _add_rmsnorm(y, residual, norm_weight, norm_eps)
    if result == "reduce_scatter":
        has_token = rows_with_tokens(y.shape[0], partial.shape[0], axis_name)
        out = jnp.where(has_token, out, jnp.zeros_like(out))
        residual_out = jnp.where(has_token, residual_out, jnp.zeros_like(residual_out))
    return out, residual_out


def moe_experts(x: jax.Array, expert_ids: jax.Array, gate_up, down: jax.Array) -> jax.Array:
    """The routed experts of one rank's shard, with the experts kernels' rounding points.

    For each pair ``p = t * top_k + k`` whose expert ``e = expert_ids[t, k]`` lies in
    ``[0, experts)``, with float32 sums::

        gate = bf16( x[t] @ W_gate[e] )        up = bf16( x[t] @ W_up[e] )
        h    = bf16( silu(gate) * up )         (float32)
        y[p] = bf16( h @ W_down[e] )

    and ``y[p] = 0`` for any other id. The pairs go through `jax.lax.ragged_dot` in expert
    order (a stable sort), as a JAX MoE layer runs them. A `BlockScaled` FP8 operand is
    dequantized to float32 (each e4m3 value times its block's scale) and its GEMM runs in
    float32 (`gemm_operands`); the rounding points are the same.

    Parameters
    ----------
    x : bf16 [m, hidden], or a `BlockScaled` of that shape
    expert_ids : int32 [m, top_k]
    gate_up : bf16 [experts, hidden, 2 * intermediate] (gate columns, then up), or a pair
        ``(gate, up)`` of bf16 [experts, hidden, intermediate]; or `BlockScaled` of those shapes
    down : bf16 [experts, intermediate, hidden], or a `BlockScaled` of that shape

    Returns
    -------
    bf16 [m * top_k, hidden], pair ``t * top_k + k`` in row ``t * top_k + k``.
    """
    return moe_experts_with_activations(x, expert_ids, gate_up, down)[0]


def shared_expert(x: jax.Array, gate_up, down: jax.Array) -> jax.Array:
    """The shared expert, which every token uses, with `moe_experts`'s rounding points::

        gate = bf16( x[t] @ W_gate )        up = bf16( x[t] @ W_up )
        y[t] = bf16( bf16(silu(gate) * up) @ W_down )

    ``x`` bf16 [m, hidden] (or a `BlockScaled`); ``gate_up`` bf16 [hidden, 2 * intermediate]
    (gate columns, then up) or a pair ``(gate, up)`` of [hidden, intermediate]; ``down`` bf16
    [intermediate, hidden]; any weight may be a `BlockScaled` of its shape (float32 GEMMs of
    the dequantized blocks, `gemm_operands`). Returns bf16 [m, hidden]: the ``shared`` operand
    of `moe_finalize`.
    """
    checks.check_operand("x", x, 2)
    checks.check_shared_expert((gate_up, down), hidden=x.shape[1], hidden_from=f"x.shape={tuple(x.shape)}")

    def project(a, w):
        a, w, precision = gemm_operands(a, w)
        return jnp.dot(a, w, precision=precision, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    if isinstance(gate_up, (tuple, list)):
        gate, up = project(x, gate_up[0]), project(x, gate_up[1])
    else:
        gate, up = jnp.split(project(x, gate_up), 2, axis=-1)
    return project(swiglu(gate, up), down)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``bf16(silu(gate) * up)`` of the bf16 gate and up sums, in float32."""
    return (jax.nn.silu(as_float32(gate)) * as_float32(up)).astype(jnp.bfloat16)


def moe_experts_with_activations(x: jax.Array, expert_ids: jax.Array, gate_up, down: jax.Array, *,
                                 ragged_dot=lax.ragged_dot):
    """`moe_experts` and its activations ``h``: ``(y, h)``, h bf16 [m * top_k, intermediate] in
    pair order (the kernels' intermediate between their two GEMMs), zero for a skipped pair.
    ``ragged_dot``: the grouped GEMM the pairs run through, of `jax.lax.ragged_dot`'s signature
    (the op's tokamax route passes tokamax's, `experts_tokamax`); the rows past the groups,
    the skipped pairs', are zeroed here, whatever it leaves in them."""
    shape = checks.check_expert_arrays(x, expert_ids, gate_up, down)
    flat = expert_ids.reshape(-1)
    valid = (flat >= 0) & (flat < shape.experts)
    # Skipped pairs sort last, past every group; their rows are zeroed below.
    group = jnp.where(valid, flat, shape.experts)
    order = jnp.argsort(group, stable=True)
    sizes = jnp.zeros((shape.experts + 1,), jnp.int32).at[group].add(1)[: shape.experts]
    rows = jax.tree.map(lambda a: a[order // shape.top_k], x)

    def project(a, w):
        a, w, precision = gemm_operands(a, w)
        return ragged_dot(a, w, sizes, precision=precision,
                          preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    if shape.fused:
        gate, up = jnp.split(project(rows, gate_up), 2, axis=-1)
    else:
        gate, up = project(rows, gate_up[0]), project(rows, gate_up[1])
    skipped = ~valid[order][:, None]
    h = jnp.where(skipped, jnp.zeros((), jnp.bfloat16), swiglu(gate, up))
    y = jnp.where(skipped, jnp.zeros((), jnp.bfloat16), project(h, down))

    def unsort(sorted_rows):
        return jnp.zeros_like(sorted_rows).at[order].set(sorted_rows, unique_indices=True)

    return unsort(y), unsort(h)
