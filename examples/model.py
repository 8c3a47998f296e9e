"""A float64 NumPy model of `moe_finalize_publish`, independent of JAX, and the check the examples print.

For rank r's inputs and token t (README.md, "What it does")::

    p_r[t] = bf16( sum_k (w[t,k] * scale) * routed_r[idx[t,k]] + shared_r[t] )
    y[t]   = bf16( sum_{r=0..tp-1} p_r[t] )

The model evaluates both sums in float64 and rounds to bf16 where the op does.
The op accumulates in float32 instead, so an element of its result ``y`` can
differ from the model's ``y_ref`` by (u = 2^-8, bf16's unit roundoff; e =
2^-24, float32's; ``mag_r`` the sum of the absolute values of rank r's terms)::

    |y - y_ref| <= (1 + 4u) * ( 2u * (|y_ref| + sum_r |p_r_ref|) + (top_k + tp + 1) * e * sum_r mag_r )

Each partial is rounded once by the op and once by the model, from float32 and
float64 sums that differ by at most (top_k + 2) * e * mag_r: they differ by at
most 2u |p_r_ref| plus that. The float32 sum over the ranks adds at most
(tp - 1) * e * sum_r |p_r|, and the final roundings 2u |y_ref|. The factor
(1 + 4u) covers the second-order terms. So the bound is about one bf16 ulp of
the result and of each partial: a partial that rounds to the other side in
float32 moves the result by one of its ulps.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
U = 2.0**-8  # bf16 unit roundoff (8 significand bits)
E = 2.0**-24  # float32 unit roundoff


def bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to the nearest bf16 (ties to even), as float64."""
    return np.asarray(x, np.float64).astype(BF16).astype(np.float64)


def finalize_publish(routed, weights, indices, shared, scale):
    """The group's result from every rank's inputs, and the element-wise bound of the op's.

    Parameters
    ----------
    routed : [tp, num_rows, hidden]; weights : [tp, m, top_k]; indices : int [tp, m, top_k];
    shared : [tp, m, hidden] or None
        Every rank's op inputs, in rank order (any float dtypes; read as float64).
    scale : float
        The routing scale.

    Returns
    -------
    (y_ref, bound), float64 [m, hidden].
    """
    routed, weights, indices = np.asarray(routed, np.float64), np.asarray(weights, np.float64), np.asarray(indices)
    tp, num_rows, hidden = routed.shape
    top_k = indices.shape[-1]
    if shared is None:
        shared = np.zeros((tp, indices.shape[1], hidden))
    shared = np.asarray(shared, np.float64)
    total = partials = magnitudes = 0.0
    for rank in range(tp):
        valid = (indices[rank] >= 0) & (indices[rank] < num_rows)
        w = np.where(valid, weights[rank] * scale, 0.0)  # [m, top_k]
        terms = w[..., None] * routed[rank][np.where(valid, indices[rank], 0)]  # [m, top_k, hidden]
        partial = bf16(terms.sum(axis=1) + shared[rank])
        total = total + partial  # exact: a few bf16 values in float64
        partials = partials + np.abs(partial)
        magnitudes = magnitudes + np.abs(terms).sum(axis=1) + np.abs(shared[rank])
    y_ref = bf16(total)
    bound = (1 + 4 * U) * (2 * U * (np.abs(y_ref) + partials) + (top_k + tp + 1) * E * magnitudes)
    return y_ref, bound


def add_rmsnorm(y_ref, y_bound, residual, norm_weight, eps: float, residual_out) -> dict:
    """The residual add + RMSNorm after the op, from the model's result and bound.

    ``residual_out = bf16(y + residual)``: its exact value from ``y_ref``, bounded by ``y``'s
    bound and one more bf16 rounding. ``out`` is modelled from the op's own ``residual_out``
    (its rounding point), so its bound is the float32 RMSNorm's (the mean of hidden squares,
    its rsqrt and two products) and one bf16 rounding. Returns float64 ``residual_out``,
    ``residual_bound``, ``out`` and ``out_bound``.
    """
    exact = y_ref + np.asarray(residual, np.float64)
    residual_bound = y_bound + (U + E) * (np.abs(exact) + y_bound)  # the float32 add, then bf16
    x = np.asarray(residual_out, np.float64)
    eps = float(np.float32(eps))
    out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(norm_weight, np.float64)
    hidden = out.shape[-1]
    rms_error = (hidden / 2 + 8) * E * np.abs(out)
    out_bound = rms_error + U * (np.abs(out) + rms_error)
    return dict(residual_out=exact, residual_bound=residual_bound, out=out, out_bound=out_bound)


def check(out, y_ref, bound, what: str) -> bool:
    """Print ``‖out − ref‖ / ‖ref‖`` and the largest element-wise error against the bound;
    True if every element is within its bound (a NaN is not)."""
    out = np.asarray(out, np.float64)
    error = np.abs(out - y_ref)
    outside = ~(error <= bound)
    relative = np.linalg.norm(out - y_ref) / np.linalg.norm(y_ref)
    text = (f"{what} against the float64 model: ‖out−ref‖/‖ref‖ = {relative:.2e}, "
            f"max |out−ref| = {np.max(error):.2e}, ")
    if outside.any():
        worst = np.unravel_index(np.argmax(np.where(outside, error - bound, -np.inf)), error.shape)
        text += (f"{outside.sum()} element(s) beyond the bound (worst: {out[worst]} for {y_ref[worst]} "
                 f"± {bound[worst]:.2e}): FAIL")
    else:
        text += f"at most {np.max(error / np.where(bound > 0, bound, 1)):.2f} of the bound: PASS"
    print(text, flush=True)
    return not outside.any()
