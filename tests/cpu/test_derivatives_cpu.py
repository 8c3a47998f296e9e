"""Derivatives of the op on virtual CPU devices (the reference path), against a float64 model.

The model (`_model`) is the op's math in NumPy float64, written from README's formulas as a
function of every rank's inputs in token order. The expected derivatives are its central
differences (`_fd_gradient`, `_fd_tangents`): the op rounds to bf16 at every step, so
differences of the op itself would be noise. The op's derivative is straight-through, the
float32 math's at the forward's values, computed from bf16 inputs; `_gradient_bounds` and
`_tangent_bounds` bound, element by element, how far it may lie from the model's exact one:

* the epilogue's linearization point: the op differentiates RMSNorm at the forward's bf16
  ``residual_out``, which lies within the forward's bound Δ of the exact ``y + residual``
  (`numerics.expected_residual_out`): the first-order change of the derivative over Δ, doubled
  for the higher orders (Δ / |x| is a few 2^-8, so they are far smaller);
* float32 evaluation: (terms + 10) float32 unit roundoffs of the magnitude of the terms;
* the result's rounding to the dtype of its input: 2^-8 relative for bf16, 2^-24 for float32;
* the differences themselves: 1e-6 of the magnitude (step 2^-14: exact for the bilinear
  finalize up to float64 roundoff, off by about 1e-9 for RMSNorm).

Besides, each array's ‖g − g_fd‖ / ‖g_fd‖ must be at most `MAX_RELATIVE` = 2^-6: a bf16
result is within 2^-8 of its value, and the linearization point moves RMSNorm's derivative
by a few times that at most.

Every index set holds skipped indices (-1 and beyond the rows) and a row that no valid index
names: their gradients are bounded by zero, so they must come out exactly zero.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp
import jaxprs
import numerics
import stand_in_kernels as stand_in_kernels_module
from jax_moe_publish import reference

HIDDEN, TOP_K, NUM_ROWS, SCALE, EPS = 32, 3, 8, 2.5, 1e-6
EPS32 = float(np.float32(EPS))  # the op adds eps in float32
BF16_EPS, F32_EPS = numerics.BF16_EPS, numerics.F32_EPS
FD_STEP, FD_SLACK = 2.0**-14, 1e-6
MAX_RELATIVE = 2.0**-6
ARGUMENTS = ("routed_output", "expert_weights", "permuted_indices", "shared_output", "residual", "norm_weight")


# --- the float64 model ------------------------------------------------------------------------


def _finalize_terms(arrays, indices):
    """(scale * w[t,k] [G, tp, m, K] and rows routed[idx[t,k]] [G, tp, m, K, H], both zero
    where the index is skipped; the valid mask) in float64."""
    groups, tp = indices.shape[:2]
    routed = np.broadcast_to(arrays["routed_output"], (groups, tp, *arrays["routed_output"].shape[-2:]))
    valid = (indices >= 0) & (indices < routed.shape[-2])
    g, r = np.ogrid[:groups, :tp]
    rows = routed[g[:, :, None, None], r[:, :, None, None], np.where(valid, indices, 0)] * valid[..., None]
    return arrays["expert_weights"] * SCALE * valid, rows, valid


def _model(arrays, indices):
    """The op's outputs in token order, [G, m, H] each, in float64: ``(y,)``, or with the
    epilogue ``(out, residual_out)``. ``routed_output`` and ``norm_weight`` without a group
    axis serve every group."""
    weights, rows, _ = _finalize_terms(arrays, indices)
    partial = np.einsum("grtk,grtkh->grth", weights, rows)
    if "shared_output" in arrays:
        partial = partial + arrays["shared_output"]
    y = partial.sum(axis=1)
    if "residual" not in arrays:
        return (y,)
    x = y + arrays["residual"]
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS32) * arrays["norm_weight"], x


def _loss(arrays, indices, cotangents):
    return sum(np.sum(c * out) for c, out in zip(cotangents, _model(arrays, indices)))


def _fd_gradient(arrays, indices, cotangents) -> dict:
    """Central differences of ``sum <cotangent, output>`` in every element of every input."""
    arrays = {name: x.copy() for name, x in arrays.items()}
    gradient = {}
    for name, x in arrays.items():
        g = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            value = x[i]
            x[i] = value + FD_STEP
            up = _loss(arrays, indices, cotangents)
            x[i] = value - FD_STEP
            down = _loss(arrays, indices, cotangents)
            x[i] = value
            g[i] = (up - down) / (2 * FD_STEP)
        gradient[name] = g
    return gradient


def _fd_tangents(arrays, indices, tangents) -> tuple:
    """Central differences of every output along ``tangents``."""
    up = _model({n: x + FD_STEP * tangents[n] for n, x in arrays.items()}, indices)
    down = _model({n: x - FD_STEP * tangents[n] for n, x in arrays.items()}, indices)
    return tuple((u - d) / (2 * FD_STEP) for u, d in zip(up, down))


# --- the bounds -------------------------------------------------------------------------------


def _linearization_point(arrays, indices):
    """(exact ``x = y + residual`` [G, m, H], the forward's bound Δ of its bf16 ``residual_out``)."""
    weights_in = np.broadcast_to(arrays["expert_weights"], indices.shape)
    routed = np.broadcast_to(arrays["routed_output"], (*indices.shape[:2], *arrays["routed_output"].shape[-2:]))
    points = []
    for g in range(indices.shape[0]):
        problems = [numerics.RankInputs(routed[g, r], weights_in[g, r], indices[g, r],
                                     arrays["shared_output"][g, r] if "shared_output" in arrays else None)
                    for r in range(indices.shape[1])]
        points.append(numerics.expected_residual_out(*numerics.expected_sum(problems, SCALE), arrays["residual"][g]))
    return np.stack([x for x, _ in points]), np.stack([delta for _, delta in points])


def _rmsnorm_point(arrays, indices):
    """(|x|, Δ, 1/rms(x), the bound of 1/rms's change over Δ), for RMSNorm's derivative."""
    x, delta = _linearization_point(arrays, indices)
    inverse = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS32)
    inverse_moved = inverse**3 * np.mean(np.abs(x) * delta, axis=-1, keepdims=True)
    return np.abs(x), delta, inverse, inverse_moved


def _scatter_rows(values, indices, valid, arrays):
    """Transpose of the gather: sum of ``values`` [G, tp, m, K, H] into the rows they read,
    in the shape of ``routed_output``."""
    groups, tp = indices.shape[:2]
    out = np.zeros((groups, tp, *arrays["routed_output"].shape[-2:]))
    g, r, t, k = np.nonzero(valid)
    np.add.at(out, (g, r, indices[g, r, t, k]), values[g, r, t, k])
    return out.reshape(arrays["routed_output"].shape) if arrays["routed_output"].ndim == 4 else out.sum(axis=0)


def _gradient_bounds(arrays, indices, cotangents, *, cotangent_rounding=0.0, row_sum_unit=F32_EPS) -> dict:
    """Per input, (bound of |op's gradient − exact gradient| before the final rounding, magnitude
    of its terms). JAX's own rules on the reference round more: the cotangent of ``y`` once
    more (``cotangent_rounding``, relative) and the routed rows' terms in the precision of the
    bf16 gather that they sum into (``row_sum_unit``)."""
    weights, rows, valid = _finalize_terms(arrays, indices)
    groups, tp, m, top_k, hidden = rows.shape
    float32 = (hidden + 10) * F32_EPS
    bounds = {}
    if "residual" in arrays:
        c_out, c_residual = cotangents
        x_abs, delta, inverse, inverse_moved = _rmsnorm_point(arrays, indices)
        # RMSNorm's transpose: g_x = inv * (w c) - x * inv^3 * mean(w c x), inv = 1 / rms(x). Over
        # Δ, inv moves by at most inverse_moved; each factor of each term moves by its bound.
        cw = np.abs(c_out * arrays["norm_weight"])
        s = np.mean(cw * x_abs, axis=-1, keepdims=True)
        s_moved = np.mean(cw * delta, axis=-1, keepdims=True)
        magnitude_x = cw * inverse + x_abs * inverse**3 * s
        moved_x = cw * inverse_moved + (delta * s + 3 * x_abs * inverse_moved / inverse * s
                                        + x_abs * s_moved) * inverse**3
        magnitude_y = magnitude_x + np.abs(c_residual)
        error_y = 2 * moved_x + (float32 + tp * F32_EPS + cotangent_rounding) * magnitude_y
        bounds["residual"] = (error_y, magnitude_y)
        magnitude_w = np.sum(np.abs(c_out) * x_abs * inverse, axis=(0, 1))
        moved_w = np.sum(np.abs(c_out) * (delta * inverse + x_abs * inverse_moved), axis=(0, 1))
        bounds["norm_weight"] = (2 * moved_w + (float32 + groups * m * F32_EPS) * magnitude_w, magnitude_w)
    else:
        (c_y,) = cotangents
        magnitude_y = np.abs(c_y)
        error_y = (tp * F32_EPS + cotangent_rounding) * magnitude_y
    # The cotangent of y reaches every rank's partial.
    error_p, magnitude_p = error_y[:, None, :, None, :], (magnitude_y + error_y)[:, None, :, None, :]
    w = np.abs(weights)[..., None]
    terms = groups * m * top_k + 2
    routed_magnitude = _scatter_rows(w * magnitude_p, indices, valid, arrays)
    routed_error = _scatter_rows(w * error_p, indices, valid, arrays) + terms * row_sum_unit * routed_magnitude
    bounds["routed_output"] = (routed_error, routed_magnitude)
    weights_magnitude = SCALE * valid * np.sum(np.abs(rows) * magnitude_p, axis=-1)
    bounds["expert_weights"] = (SCALE * valid * np.sum(np.abs(rows) * error_p, axis=-1)
                                + (hidden + 2) * F32_EPS * weights_magnitude, weights_magnitude)
    if "shared_output" in arrays:
        shape = arrays["shared_output"].shape
        bounds["shared_output"] = (np.broadcast_to((error_y + F32_EPS * magnitude_y)[:, None], shape),
                                   np.broadcast_to(magnitude_y[:, None], shape))
    return bounds


def _tangent_bounds(arrays, indices, tangents) -> list:
    """Per output, (bound of |op's tangent − exact tangent| before its bf16 rounding, magnitude)."""
    weights, rows, _ = _finalize_terms(arrays, indices)
    d_weights, d_rows, _ = _finalize_terms(tangents, indices)
    tp, top_k, hidden = rows.shape[1], rows.shape[3], rows.shape[4]
    magnitude_p = np.sum(np.abs(d_weights)[..., None] * np.abs(rows) + np.abs(weights)[..., None] * np.abs(d_rows),
                         axis=3)
    if "shared_output" in tangents:
        magnitude_p = magnitude_p + np.abs(tangents["shared_output"])
    magnitude_y = magnitude_p.sum(axis=1)
    error_y = (2 * top_k + 2 + tp) * F32_EPS * magnitude_y
    if "residual" not in arrays:
        return [(error_y, magnitude_y)]
    x_abs, delta, inverse, inverse_moved = _rmsnorm_point(arrays, indices)
    weight, d_weight = np.abs(arrays["norm_weight"]), np.abs(tangents["norm_weight"])
    magnitude_x = magnitude_y + np.abs(tangents["residual"])
    error_x = error_y + F32_EPS * magnitude_x
    # RMSNorm's tangent: d_out = w * (inv * dx - x * inv^3 * mean(x dx)) + x * inv * dw, moved over Δ
    # as in `_gradient_bounds`; errors of dx pass through it.
    a = np.mean(x_abs * magnitude_x, axis=-1, keepdims=True)
    moved = (weight * magnitude_x * inverse_moved + d_weight * (delta * inverse + x_abs * inverse_moved)
             + weight * (delta * a + 3 * x_abs * inverse_moved / inverse * a
                         + x_abs * np.mean(delta * magnitude_x, axis=-1, keepdims=True)) * inverse**3)
    from_x = weight * inverse * error_x + weight * x_abs * inverse**3 * np.mean(x_abs * error_x, axis=-1, keepdims=True)
    magnitude_out = weight * magnitude_x * inverse + weight * x_abs * inverse**3 * a + x_abs * d_weight * inverse
    return [(2 * moved + from_x + (hidden + 10) * F32_EPS * magnitude_out, magnitude_out), (error_x, magnitude_x)]


def _assert_close(got, expected, bound, dtype, what):
    """``got`` (in ``dtype``) against the model's exact derivative, within ``bound`` = (error,
    magnitude) plus the rounding to ``dtype`` and the differences' own error."""
    error, magnitude = bound
    unit = F32_EPS if jnp.dtype(dtype) == jnp.float32 else BF16_EPS
    total = error + unit * (np.abs(expected) + error) + FD_SLACK * (magnitude + np.abs(expected)) + 1e-30
    numerics.assert_close(got, expected, total, what=what, max_relative=MAX_RELATIVE)


# --- inputs and the op as a function of canonical arrays ----------------------------------------


def _inputs(rng, *, groups, tp, m, shared=True, epilogue=False, fp32_weights=False, routed_batched=True):
    """Fresh canonical inputs (groups first; per rank [G, tp, ...]; the residual [G, m, H] in
    token order) as the op takes them, and the int32 indices [G, tp, m, top_k]. Every rank
    skips an index of -1 and one beyond the rows, and no valid index names the last row."""
    problems = [[numerics.random_problem(rng, m=m, hidden=HIDDEN, top_k=TOP_K, num_rows=NUM_ROWS,
                                         fp32_weights=fp32_weights, shared=shared, invalid_fraction=0.25)
                 for _ in range(tp)] for _ in range(groups)]

    def stack(field):
        return np.stack([np.stack([getattr(p, field) for p in group]) for group in problems])

    indices = stack("indices")
    indices[..., 0, 0], indices[..., 1, 0] = -1, NUM_ROWS
    indices = np.where(indices == NUM_ROWS - 1, -1, indices).astype(np.int32)
    arrays = {"routed_output": stack("routed") if routed_batched else stack("routed")[0],
              "expert_weights": stack("weights")}
    if shared:
        arrays["shared_output"] = stack("shared")
    if epilogue:
        arrays["residual"] = rng.standard_normal((groups, m, HIDDEN)).astype(numerics.BF16)
        arrays["norm_weight"] = rng.normal(1.0, 0.5, HIDDEN).astype(numerics.BF16)
    return {name: jnp.asarray(x) for name, x in arrays.items()}, indices


def _random_like(rng, shapes) -> tuple:
    """Fresh bf16 (float32 where the array is) values of each array's shape, never all zero."""
    return tuple(jnp.asarray(rng.standard_normal(x.shape).astype(np.float32 if x.dtype == jnp.float32
                                                                 else numerics.BF16)) for x in shapes)


def _owned_layout(x, tp):
    """[..., m, H] in token order -> [..., tp, ceil(m/tp), H]: rank r's row i holds token i * tp + r
    (README), zero past m."""
    m, rows = x.shape[-2], -(-x.shape[-2] // tp)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, rows * tp - m), (0, 0)])
    return jnp.swapaxes(x.reshape(*x.shape[:-2], rows, tp, x.shape[-1]), -3, -2)


def _token_order(x, m):
    """[..., tp, rows, H] -> [..., m, H], the inverse of `_owned_layout` on the rows of tokens."""
    x = jnp.swapaxes(x, -3, -2)
    return x.reshape(*x.shape[:-3], -1, x.shape[-1])[..., :m, :]


def _swap(x):
    return jnp.swapaxes(x, 0, 1)


def _same(x):
    return x


@dataclasses.dataclass(frozen=True)
class _Way:
    """How one kind of canonical array reaches a call of the op inside shard_map, and how a
    result of that kind comes back."""

    to_global: Callable  # canonical -> shard_map's global argument
    spec: P
    to_argument: Callable  # the shard's block -> the call's argument
    to_block: Callable = _same  # the call's result -> the shard's block
    to_canonical: Callable = _same  # shard_map's global result -> canonical


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A mesh, and the ways of per-rank arrays (canonical [G, tp, ...]) and of per-group ones
    ([G, ...]); with ``vmapped`` the G groups are one call's jax.vmap batch."""

    mesh_shape: tuple
    axes: tuple
    vmapped: bool
    ranked: _Way
    grouped: _Way


_LAYOUTS = {
    # One 1-D group, G = 1.
    "tp": _Layout((4,), ("tp",), False,
                  ranked=_Way(lambda x: x[0], P("tp"), lambda b: b[0], lambda o: o[None], lambda g: g[None]),
                  grouped=_Way(lambda x: x[0], P(), _same, _same, lambda g: g[None])),
    # One 1-D group, G = the batch elements of jax.vmap.
    "vmap": _Layout((2,), ("tp",), True,
                    ranked=_Way(_swap, P("tp"), lambda b: b[0], lambda o: o[None], _swap),
                    grouped=_Way(_same, P(), _same)),
    # G = 2 groups of a (dp, tp) mesh.
    "dp": _Layout((2, 2), ("dp", "tp"), False,
                  ranked=_Way(_same, P("dp", "tp"), lambda b: b[0, 0], lambda o: o[None, None]),
                  grouped=_Way(_same, P("dp"), lambda b: b[0], lambda o: o[None])),
}
EVERY_GROUP = _Way(_same, P(), _same)  # norm_weight
EVERY_ELEMENT = _Way(_same, P("tp"), lambda b: b[0])  # under jax.vmap, a routed_output [tp, R, H] of no batch axis


def _mesh(layout: _Layout):
    return jax.sharding.Mesh(np.array(jax.devices()[: math.prod(layout.mesh_shape)]).reshape(layout.mesh_shape),
                             layout.axes)


def _public_call(mailbox, impl="auto", remat=False):
    """One call of the public op, as the model's function of six arguments."""

    def call(routed, weights, indices, shared, residual, norm_weight):
        static = dict(mailbox=mailbox, routed_scaling_factor=SCALE, impl=impl)
        if residual is not None:
            static["norm_eps"] = EPS
        op = functools.partial(jmp.moe_finalize_publish, **static)  # jax.checkpoint traces what it is given
        if remat:
            op = jax.checkpoint(op)
        return op(routed, weights, indices, shared, residual=residual, norm_weight=norm_weight)

    return call


def _reference_call(mailbox):
    """`jmp.reference.moe_finalize_publish`, differentiated by JAX's own rules."""

    def call(routed, weights, indices, shared, residual, norm_weight):
        return jmp.reference.moe_finalize_publish(
            routed, weights, indices, shared, axis_name=mailbox.axis_name, routed_scaling_factor=SCALE,
            result=mailbox.result, residual=residual, norm_weight=norm_weight, norm_eps=EPS)

    return call


def _canonical(mailbox, layout: _Layout, call, *, check_vma=True):
    """``f(arrays, indices)``: ``call`` inside shard_map (and jax.vmap over the groups for the
    vmap layout) as a function of canonical arrays, returning its outputs in token order
    [G, m, H]. ``norm_weight`` [H] serves every group, and so does, under jax.vmap, a
    ``routed_output`` [tp, R, H]."""
    scatter, tp = mailbox.result == "reduce_scatter", mailbox.tp

    def f(arrays, indices):
        m = indices.shape[-2]
        inputs = dict(arrays, permuted_indices=jnp.asarray(indices))
        if scatter and "residual" in inputs:
            inputs["residual"] = _owned_layout(inputs["residual"], tp)  # per rank: [G, tp, rows, H]
        per_rank = {"routed_output", "expert_weights", "permuted_indices", "shared_output"}
        ways = {name: layout.ranked if name in per_rank or scatter else layout.grouped for name in inputs}
        shared_by_all = {"norm_weight"} & set(inputs)
        ways.update(dict.fromkeys(shared_by_all, EVERY_GROUP))
        if inputs["routed_output"].ndim == 3:
            shared_by_all.add("routed_output")
            ways["routed_output"] = EVERY_ELEMENT
        out_way = layout.ranked if scatter else layout.grouped

        def one(*args):
            return jax.tree.leaves(call(*args))

        def shard(blocks):
            args = [ways[name].to_argument(blocks[name]) if name in blocks else None for name in ARGUMENTS]
            if layout.vmapped:
                in_axes = [0 if name in blocks and name not in shared_by_all else None for name in ARGUMENTS]
                outs = jax.vmap(one, in_axes=in_axes)(*args)
            else:
                outs = one(*args)
            return [out_way.to_block(o) for o in outs]

        outs = jax.shard_map(shard, mesh=mailbox.mesh, in_specs=({name: ways[name].spec for name in inputs},),
                             out_specs=out_way.spec, check_vma=check_vma)(
            {name: ways[name].to_global(x) for name, x in inputs.items()})
        return tuple(_token_order(out_way.to_canonical(o), m) if scatter else out_way.to_canonical(o) for o in outs)

    return f


# --- the checks -------------------------------------------------------------------------------


def _float64(arrays) -> dict:
    return {name: np.asarray(x).astype(np.float64) for name, x in arrays.items()}


def _check_gradient(f, arrays, indices, cotangents, *, how="vjp", **rounding):
    """``f``'s gradient (jax.vjp, or jax.grad of ``sum <cotangent, output>`` in float32) against
    the model's; the gradients of skipped indices and unreferenced rows must be exactly zero."""
    if how == "vjp":
        (gradient,) = jax.jit(lambda a, c: jax.vjp(lambda a: f(a, indices), a)[1](c))(arrays, cotangents)
    else:
        def loss(a):
            outs = f(a, indices)
            return sum(jnp.sum(c.astype(jnp.float32) * o.astype(jnp.float32)) for c, o in zip(cotangents, outs))
        gradient = jax.jit(jax.grad(loss))(arrays)
    arrays64, cotangents64 = _float64(arrays), [np.asarray(c).astype(np.float64) for c in cotangents]
    expected = _fd_gradient(arrays64, indices, cotangents64)
    bounds = _gradient_bounds(arrays64, indices, cotangents64, **rounding)
    assert set(gradient) == set(arrays)
    for name in arrays:
        assert gradient[name].dtype == arrays[name].dtype, name
        assert np.any(np.asarray(gradient[name], np.float64) != 0), f"d/d{name} is all zero"
        _assert_close(gradient[name], expected[name], bounds[name], arrays[name].dtype, f"d/d{name}")
    _, _, valid = _finalize_terms(arrays64, indices)
    assert np.all(np.asarray(gradient["expert_weights"])[~valid] == 0), "a skipped index's weight has a gradient"
    assert np.all(np.asarray(gradient["routed_output"])[..., NUM_ROWS - 1, :] == 0), "an unreferenced row's gradient"
    return gradient


def _check_tangents(f, arrays, indices, tangents):
    """``f``'s jax.jvp along ``tangents`` against the model's directional derivative."""
    outs, got = jax.jit(lambda a, t: jax.jvp(lambda a: f(a, indices), (a,), (t,)))(arrays, tangents)
    arrays64, tangents64 = _float64(arrays), _float64(tangents)
    expected = _fd_tangents(arrays64, indices, tangents64)
    for i, (g, e, b) in enumerate(zip(got, expected, _tangent_bounds(arrays64, indices, tangents64))):
        assert g.dtype == jnp.bfloat16
        _assert_close(g, e, b, jnp.bfloat16, f"tangent of output {i}")
    return outs


RESULTS = ("allreduce", "reduce_scatter")


def test_positive_zero_keeps_the_bits_and_passes_the_derivative():
    """-0.0 becomes +0.0 and nothing else changes, bit for bit (NaN payloads too); as a function
    of values it is the identity, so its derivative is 1."""
    bits = np.array([0x8000, 0x0000, 0x3F80, 0xBF80, 0x0001, 0x8001, 0x7F80, 0xFF80, 0x7FC1, 0xFFC1], np.uint16)
    x = jnp.asarray(bits.view(numerics.BF16))
    expected = np.where(bits == 0x8000, 0, bits)
    assert np.array_equal(np.asarray(jax.jit(reference.positive_zero)(x)).view(np.uint16), expected)
    tangent = jnp.asarray(np.arange(1, len(bits) + 1, dtype=np.float32).astype(numerics.BF16))
    _, out_tangent = jax.jvp(reference.positive_zero, (x,), (tangent,))
    assert np.array_equal(np.asarray(out_tangent), np.asarray(tangent))
    finite = x[:6]
    gradient = jax.grad(lambda v: jnp.sum(reference.positive_zero(v).astype(jnp.float32) * jnp.arange(6.0)))(finite)
    assert np.array_equal(np.asarray(gradient, np.float32), np.arange(6.0, dtype=np.float32))


@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
@pytest.mark.parametrize("result", RESULTS)
def test_the_reference_function_differentiates(result, epilogue, rng):
    """jax.grad through `jmp.reference.moe_finalize_publish` by JAX's own rules, which round
    where the forward rounds: the cotangent of ``y`` to bf16 once (with the epilogue), and the
    routed rows' terms, summed in bf16 into the rows they were gathered from."""
    layout = _LAYOUTS["tp"]
    arrays, indices = _inputs(rng, groups=1, tp=4, m=7, epilogue=epilogue)
    with jmp.Mailbox(_mesh(layout), "tp", hidden=HIDDEN, capacity_m=8, result=result) as mailbox:
        f = _canonical(mailbox, layout, _reference_call(mailbox))
        cotangents = _random_like(rng, jax.eval_shape(f, arrays, indices))
        _check_gradient(f, arrays, indices, cotangents, how="grad", cotangent_rounding=BF16_EPS * epilogue,
                        row_sum_unit=BF16_EPS)


@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared expert", "no shared expert"])
@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
@pytest.mark.parametrize("result", RESULTS)
def test_gradient_matches_float64(result, epilogue, shared, impl, rng):
    """tp = 4, m = 7 (not a multiple of tp; with reduce_scatter rank 3 holds a row of no token),
    float32 weights where there is no shared expert."""
    layout = _LAYOUTS["tp"]
    arrays, indices = _inputs(rng, groups=1, tp=4, m=7, shared=shared, epilogue=epilogue, fp32_weights=not shared)
    with jmp.Mailbox(_mesh(layout), "tp", hidden=HIDDEN, capacity_m=8, result=result) as mailbox:
        f = _canonical(mailbox, layout, _public_call(mailbox, impl))
        cotangents = _random_like(rng, jax.eval_shape(f, arrays, indices))
        _check_gradient(f, arrays, indices, cotangents, how="grad" if impl == "auto" else "vjp")


@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
@pytest.mark.parametrize("result", RESULTS)
def test_jvp_matches_float64(result, epilogue, rng):
    layout = _LAYOUTS["tp"]
    arrays, indices = _inputs(rng, groups=1, tp=4, m=7, epilogue=epilogue)
    with jmp.Mailbox(_mesh(layout), "tp", hidden=HIDDEN, capacity_m=8, result=result) as mailbox:
        f = _canonical(mailbox, layout, _public_call(mailbox))
        outs = _check_tangents(f, arrays, indices, dict(zip(arrays, _random_like(rng, arrays.values()))))
        plain = jax.jit(f)(arrays, indices)
    # The primal of jax.jvp is the op's forward, bit for bit.
    for a, b in zip(outs, plain):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@pytest.mark.parametrize("routed_batched", [True, False], ids=["routed batched", "routed per rank"])
@pytest.mark.parametrize("result", RESULTS)
def test_derivatives_under_vmap(result, routed_batched, rng):
    """jax.vmap over 3 calls (the fold makes one; each element's m = 5 padded to 6 with
    reduce_scatter): each element's derivative, and for a routed_output or norm_weight that
    the batch shares, their sum."""
    layout = _LAYOUTS["vmap"]
    arrays, indices = _inputs(rng, groups=3, tp=2, m=5, epilogue=True, routed_batched=routed_batched)
    with jmp.Mailbox(_mesh(layout), "tp", hidden=HIDDEN, capacity_m=18, result=result) as mailbox:
        f = _canonical(mailbox, layout, _public_call(mailbox))
        cotangents = _random_like(rng, jax.eval_shape(f, arrays, indices))
        _check_gradient(f, arrays, indices, cotangents)
        _check_tangents(f, arrays, indices, dict(zip(arrays, _random_like(rng, arrays.values()))))


@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
@pytest.mark.parametrize("result", RESULTS)
def test_derivatives_on_a_two_dim_mesh(result, epilogue, rng):
    """Two (dp) groups of two ranks, each its own data; the one norm_weight's gradient is the
    sum over both groups."""
    layout = _LAYOUTS["dp"]
    arrays, indices = _inputs(rng, groups=2, tp=2, m=5, epilogue=epilogue)
    with jmp.Mailbox(_mesh(layout), "tp", hidden=HIDDEN, capacity_m=8, result=result) as mailbox:
        f = _canonical(mailbox, layout, _public_call(mailbox))
        cotangents = _random_like(rng, jax.eval_shape(f, arrays, indices))
        _check_gradient(f, arrays, indices, cotangents)
        _check_tangents(f, arrays, indices, dict(zip(arrays, _random_like(rng, arrays.values()))))


@pytest.mark.parametrize("result", RESULTS)
def test_gradient_under_checkpoint(result, rng):
    layout = _LAYOUTS["tp"]
    arrays, indices = _inputs(rng, groups=1, tp=4, m=7, epilogue=True)
    with jmp.Mailbox(_mesh(layout), "tp", hidden=HIDDEN, capacity_m=8, result=result) as mailbox:
        f = _canonical(mailbox, layout, _public_call(mailbox, remat=True))
        cotangents = _random_like(rng, jax.eval_shape(f, arrays, indices))
        _check_gradient(f, arrays, indices, cotangents)
        jaxpr = jax.make_jaxpr(lambda a, c: jax.vjp(lambda a: f(a, indices), a)[1](c))(arrays, cotangents).jaxpr
    assert {"remat2", "checkpoint"} & set(_count(jaxpr)), "the backward recomputes the forward"  # remat's names


@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
@pytest.mark.parametrize("result", RESULTS)
def test_gradient_without_the_varying_axes_check(result, epilogue, rng):
    """With ``check_vma=False`` shard_map hands each shard 1/tp of an all-reduce's cotangent and
    sums the cotangents of replicated inputs: the derivative must come out the same."""
    layout = _LAYOUTS["tp"]
    arrays, indices = _inputs(rng, groups=1, tp=4, m=7, epilogue=epilogue)
    with jmp.Mailbox(_mesh(layout), "tp", hidden=HIDDEN, capacity_m=8, result=result) as mailbox:
        f = _canonical(mailbox, layout, _public_call(mailbox), check_vma=False)
        cotangents = _random_like(rng, jax.eval_shape(f, arrays, indices))
        _check_gradient(f, arrays, indices, cotangents)


def test_rows_of_no_token_pass_no_derivative(rng):
    """reduce_scatter with the epilogue, tp = 4, m = 7: rank 3's second row holds no token. Its
    residual row (NaN here: it is never read) gets an exactly zero gradient, and cotangents
    given to its output rows (which are constant zero) reach no input."""
    tp, m = 4, 7
    arrays, indices = _inputs(rng, groups=1, tp=tp, m=m, epilogue=True)
    ranked = {name: x[0] for name, x in arrays.items() if name not in ("residual", "norm_weight")}
    tokenless = np.zeros((tp, 2, 1), bool)
    tokenless[3, 1] = True
    residual = jnp.where(tokenless, jnp.nan, _owned_layout(arrays["residual"][0], tp)).astype(jnp.bfloat16)
    floats = dict(ranked, residual=residual, norm_weight=arrays["norm_weight"])
    mesh = _mesh(_LAYOUTS["tp"])
    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8, result="reduce_scatter") as mailbox:
        def f(a):
            return jmp.sharded_moe_finalize_publish(
                mailbox, a["routed_output"], a["expert_weights"], jnp.asarray(indices[0]), a["shared_output"],
                routed_scaling_factor=SCALE, residual=a["residual"], norm_weight=a["norm_weight"], norm_eps=EPS)

        pullback = jax.jit(lambda a, c: jax.vjp(f, a)[1](c)[0])
        cotangents = _random_like(rng, jax.eval_shape(f, floats))
        quiet = tuple(jnp.where(tokenless, 0, c).astype(c.dtype) for c in cotangents)
        loud = tuple(jnp.where(tokenless, 1e4, c).astype(c.dtype) for c in cotangents)
        gradient, gradient_loud = pullback(floats, quiet), pullback(floats, loud)
    for name in floats:
        got = np.asarray(gradient[name], np.float64)
        assert np.all(np.isfinite(got)), f"d/d{name} holds NaN: a row of no token was read"
        assert np.array_equal(got, np.asarray(gradient_loud[name], np.float64)), f"d/d{name}: a row of no token leaks"
    assert np.all(np.asarray(gradient["residual"], np.float64)[np.broadcast_to(tokenless, residual.shape)] == 0)


def _scalar_call(mesh, mailbox, arrays, indices, **scalars):
    """The op with traced or static scalars, as one shard_map over the mailbox's mesh."""
    def shard(routed, weights, indices, shared, residual, norm_weight):
        return jmp.moe_finalize_publish(routed[0], weights[0], indices[0], shared[0], mailbox=mailbox, impl="auto",
                                        residual=residual, norm_weight=norm_weight, **scalars)

    return jax.shard_map(shard, mesh=mesh, in_specs=(P("tp"),) * 4 + (P(), P()), out_specs=P())(
        arrays["routed_output"][0], arrays["expert_weights"][0], jnp.asarray(indices[0]), arrays["shared_output"][0],
        arrays["residual"][0], arrays["norm_weight"])


def _loss_of(outs):
    return sum(jnp.sum(o.astype(jnp.float32)) for o in outs)


@pytest.mark.parametrize("transform", ["grad", "jvp", "vmap"])
def test_a_traced_scale_is_refused_with_its_name(transform, rng):
    """routed_scaling_factor is a static float: closing over a traced one (to differentiate or
    batch over it) raises a TypeError naming it, never a zero derivative."""
    arrays, indices = _inputs(rng, groups=1, tp=2, m=3, epilogue=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        def of_scale(scale):
            return _loss_of(_scalar_call(mesh, mailbox, arrays, indices, routed_scaling_factor=scale, norm_eps=EPS))

        apply = {"grad": lambda: jax.grad(of_scale)(2.5), "jvp": lambda: jax.jvp(of_scale, (2.5,), (1.0,)),
                 "vmap": lambda: jax.vmap(of_scale)(jnp.array([1.0, 2.5]))}[transform]
        with pytest.raises(TypeError) as raised:
            jax.jit(apply)() if transform != "vmap" else apply()
    message = str(raised.value)
    for words in ("routed_scaling_factor: expected a Python float, got a traced float32[]",
                  "no derivative with respect to it", "multiply expert_weights by it"):
        assert words in message


def test_a_traced_norm_eps_is_refused_with_its_name(rng):
    arrays, indices = _inputs(rng, groups=1, tp=2, m=3, epilogue=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        def of_eps(eps):
            return _loss_of(_scalar_call(mesh, mailbox, arrays, indices, routed_scaling_factor=SCALE, norm_eps=eps))

        with pytest.raises(TypeError, match=r"norm_eps: expected a Python float, got a traced float32\[\]") as raised:
            jax.jit(jax.grad(of_eps))(EPS)
    assert "no derivative with respect to it" in str(raised.value)


def test_integer_indices_have_no_derivative(rng):
    """jax.grad refuses the int32 indices as its argument; with allow_int their cotangent is
    float0, JAX's "no tangent space", and the other gradients are unchanged."""
    arrays, indices = _inputs(rng, groups=1, tp=2, m=3, epilogue=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        def loss(a, idx):
            return _loss_of(_scalar_call(mesh, mailbox, a, idx, routed_scaling_factor=SCALE, norm_eps=EPS))

        with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
            jax.jit(jax.grad(loss, argnums=1))(arrays, jnp.asarray(indices))
        d_arrays, d_indices = jax.jit(jax.grad(loss, argnums=(0, 1), allow_int=True))(arrays, jnp.asarray(indices))
        plain = jax.jit(jax.grad(loss))(arrays, jnp.asarray(indices))
    assert d_indices.dtype == jax.dtypes.float0 and d_indices.shape == indices.shape
    for name in arrays:
        assert np.array_equal(np.asarray(d_arrays[name], np.float64), np.asarray(plain[name], np.float64))


# --- the kernel path, its FFI call stood in for (traced, never run) -------------------------------


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """impl="kernel" on the CPU mailbox, its FFI call stood in for (`stand_in_kernels`): jaxprs only."""
    stand_in_kernels_module.install(monkeypatch)
    return monkeypatch


def _count(jaxpr) -> dict:
    """How often each primitive occurs in ``jaxpr`` and the jaxprs inside it."""
    return collections.Counter(eqn.primitive.name for eqn in jaxprs.equations(jaxpr))


def _psums(counts) -> int:
    return sum(n for name, n in counts.items() if name.startswith("psum") or name == "all_gather")


@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
@pytest.mark.parametrize("result", RESULTS)
def test_the_kernel_path_runs_forward_once_and_differentiates_in_jnp(result, epilogue, stand_in_kernels, rng):
    """jax.vjp and jax.jvp over impl="kernel": one kernel call, the forward's, and a derivative
    of jnp ops. The all-reduce's backward needs no collective (its cotangent is the same on
    every rank); reduce_scatter's needs one, the transpose of taking this rank's rows, and with
    the epilogue one more, for norm_weight's gradient over every rank's rows. Forward mode sums
    the tangent over the group once."""
    layout = _LAYOUTS["vmap"]
    arrays, indices = _inputs(rng, groups=3, tp=2, m=5, epilogue=epilogue)
    with jmp.Mailbox(_mesh(layout), "tp", hidden=HIDDEN, capacity_m=18, result=result) as mailbox:
        stand_in_kernels.setattr(mailbox, "on_cuda", True)
        f = _canonical(mailbox, layout, _public_call(mailbox, impl="kernel"))
        cotangents = _random_like(rng, jax.eval_shape(f, arrays, indices))
        pullback = jax.make_jaxpr(lambda a, c: jax.vjp(lambda a: f(a, indices), a)[1](c))
        backward = _count(pullback(arrays, cotangents).jaxpr)
        forward = _count(jax.make_jaxpr(lambda a: jax.jvp(lambda a: f(a, indices), (a,), (a,)))(arrays).jaxpr)
    assert backward.get("ffi_call") == 1 and forward.get("ffi_call") == 1  # jax.vmap's batch: one call
    assert _psums(backward) == ((1 + epilogue) if result == "reduce_scatter" else 0)
    assert _psums(forward) == 1


def test_checkpoint_of_the_kernel_path_cannot_be_differentiated(stand_in_kernels, rng):
    """jax.checkpoint would recompute the kernels in the backward pass, and JAX refuses to
    recompute a custom call with a side effect: an error, not a zero (README)."""
    layout = _LAYOUTS["tp"]
    arrays, indices = _inputs(rng, groups=1, tp=4, m=7)
    with jmp.Mailbox(_mesh(layout), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        stand_in_kernels.setattr(mailbox, "on_cuda", True)
        f = _canonical(mailbox, layout, _public_call(mailbox, impl="kernel", remat=True))
        cotangents = _random_like(rng, jax.eval_shape(f, arrays, indices))
        with pytest.raises(NotImplementedError, match="Effects not supported in partial-eval of `checkpoint`"):
            jax.make_jaxpr(lambda a, c: jax.vjp(lambda a: f(a, indices), a)[1](c))(arrays, cotangents)
