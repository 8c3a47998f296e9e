"""A float64 NumPy model of one layer of the MoE block (`moe_block.py`), sharing no code
with it, and the element-wise bounds that `compare` checks: `numpy_layer` for the whole
layer, `op_part` for the op's part of it (the finalize, the group's sum and the residual add
+ RMSNorm), from the block's own finalize arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

import model  # the op's float64 model (examples/ is on sys.path)

if TYPE_CHECKING:
    from moe_block import MoEConfig

#
# Exact float64 values from the bf16 inputs, and bounds on what the block computes, from its
# rounding points: float32 accumulation, the bf16 rounding (unit roundoff 2**-8) of each GEMM
# output, of the SwiGLU, of each rank's partial, of the group's sum and of the epilogue's two
# outputs.
#
# The whole layer's bound is probabilistic: a worst-case bound (every rounding at its
# extreme, aligned) grows like the contraction length and at hidden 7168 exceeds the values
# themselves. So each rounding error is modelled as independent, mean zero and uniform
# within its bound (variance (u |v|)^2 / 3, an upper bound on ulp^2 / 12), propagated to
# first order through each stage (variances through squared weights), and the bound is
# SIGMAS standard deviations, plus the result's own last rounding at its worst. The op's
# part (`op_part`) keeps worst-case bounds: its sums are short.

BF16_U = 2.0**-8
F32_U = 2.0**-24
SIGMAS = 6.0


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _rounding_var(value, unit=BF16_U):
    """Variance of one rounding of ``value``: uniform within +-``unit * |value|``."""
    return (unit * value) ** 2 / 3


def _sum_var(magnitude, terms: int):
    """Variance of a float32 sum of ``terms`` terms whose |terms| sum to ``magnitude``: one
    rounding of at most ``magnitude`` per addition."""
    return terms * _rounding_var(magnitude, F32_U)


def _bound(value, var):
    """The probabilistic bound of a bf16 result: SIGMAS standard deviations of its error so
    far, and its own rounding at its worst."""
    spread = SIGMAS * np.sqrt(var)
    return spread + BF16_U * (np.abs(value) + spread)


def numpy_route(config: MoEConfig, logits, logit_var, bias=None):
    """The router in float64, token by token, with the variance of the block's float32 router.

    ``logits`` float64 [m, experts]; ``logit_var`` the variance of the block's float32
    logits' errors. Returns ``(experts [m, top_k], weights [m, top_k], weight_var [m, top_k],
    ambiguous [m])``: a token is ambiguous where the float32 router could pick other experts
    (a gap at a selection boundary within SIGMAS standard deviations).
    """
    m, num_experts = logits.shape
    k = config.top_k
    experts = np.zeros((m, k), np.int64)
    weights = np.zeros((m, k))
    weight_var = np.zeros((m, k))
    ambiguous = np.zeros(m, bool)

    def tie(a_value, b_value, a_var, b_var):
        return a_value - b_value <= SIGMAS * np.sqrt(a_var + b_var)

    for t in range(m):
        z, z_var = logits[t], logit_var[t]
        if config.router == "softmax":
            p = np.exp(z - z.max())
            p /= p.sum()
            # dp_e / p_e = dz_e - sum_j p_j dz_j, then float32 exp, sum and division.
            p_var = p**2 * (z_var + np.sum(p**2 * z_var) + _rounding_var(num_experts + 8, F32_U))
            ranked = np.argsort(-p, kind="stable")
            chosen = ranked[:k]
            if k < num_experts:
                a, b = ranked[k - 1], ranked[k]
                ambiguous[t] = tie(p[a], p[b], p_var[a], p_var[b])
            w = p[chosen] / p[chosen].sum()
            # dw_k / w_k = dz_k - sum_j w_j dz_j over the chosen.
            w_var = w**2 * (z_var[chosen] + np.sum(w**2 * z_var[chosen]) + _rounding_var(k + num_experts + 8, F32_U))
        else:
            s = 1 / (1 + np.exp(-z))
            c = s + np.asarray(bias, np.float64)
            s_var = (s * (1 - s)) ** 2 * z_var + _rounding_var(8, F32_U)
            c_var = s_var + _rounding_var(c, F32_U)
            size = num_experts // config.groups
            group_score = np.array([np.sort(c[g * size:(g + 1) * size])[-2:].sum() for g in range(config.groups)])
            # The top two of a group: at most twice its largest variance.
            group_var = np.array([2 * c_var[g * size:(g + 1) * size].max() for g in range(config.groups)])
            group_var += _rounding_var(group_score, F32_U)
            group_rank = np.argsort(-group_score, kind="stable")
            if config.kept_groups < config.groups:
                a, b = group_rank[config.kept_groups - 1], group_rank[config.kept_groups]
                ambiguous[t] |= tie(group_score[a], group_score[b], group_var[a], group_var[b])
            candidates = np.concatenate([np.arange(g * size, (g + 1) * size) for g in group_rank[:config.kept_groups]])
            masked = np.full(num_experts, -np.inf)
            masked[candidates] = c[candidates]
            ranked = np.argsort(-masked, kind="stable")
            chosen = ranked[:k]
            if k < len(candidates):
                a, b = ranked[k - 1], ranked[k]
                ambiguous[t] |= tie(c[a], c[b], c_var[a], c_var[b])
            total = s[chosen].sum()
            w = s[chosen] / total
            # dw_k = (ds_k - w_k sum_j ds_j) / total, then the float32 sum and division.
            w_var = (s_var[chosen] + w**2 * s_var[chosen].sum()) / total**2 + _rounding_var(w * (k + 2), F32_U)
        experts[t], weights[t], weight_var[t] = chosen, w, w_var
    return experts, weights, weight_var, ambiguous


def _gemm_var(a, a_var, w, spec):
    """(exact ``a @ w``, variance of the block's bf16 result's error) for a computed input
    ``a`` whose errors have variance ``a_var``: the input's through ``w**2``, float32
    accumulation over the contraction, then the bf16 rounding."""
    exact = np.einsum(spec, a, w, optimize=True)
    magnitude = np.einsum(spec, np.abs(a), np.abs(w), optimize=True)
    var = np.einsum(spec, a_var, w * w, optimize=True) + _sum_var(magnitude, w.shape[-2])
    return exact, var + _rounding_var(exact)


def _expert_var(x, gate_up, down, x_spec, down_spec):
    """(exact ``down(silu(gate x) * up x)``, variance of the block's bf16 rows' errors)."""
    h, h_var = _gemm_var(x, np.zeros_like(x), gate_up, x_spec)
    g, u = np.split(h, 2, axis=-1)
    g_var, u_var = np.split(h_var, 2, axis=-1)
    sigmoid = 1 / (1 + np.exp(-g))
    silu = g * sigmoid
    slope = sigmoid * (1 + g * (1 - sigmoid))
    a = silu * u
    # float32 evaluation of sigmoid (absolute), silu and the product; |silu(z)| <= |z|
    a_var = (slope * u) ** 2 * g_var + silu**2 * u_var + _rounding_var(10 * g * u, F32_U)
    return _gemm_var(a, a_var + _rounding_var(a), down, down_spec)


def _rmsnorm(residual_out, norm_weight, eps: float):
    rms = np.sqrt(np.mean(residual_out * residual_out, axis=-1, keepdims=True) + eps)
    return residual_out / rms * norm_weight, rms


def numpy_layer(config: MoEConfig, layer, x, residual, tp: int, experts=None) -> dict:
    """One layer in float64 from its bf16 inputs, with element-wise probabilistic bounds of
    the block's error (SIGMAS standard deviations, see above).

    ``layer`` maps the parameter names of `param_specs` to global arrays (NumPy or JAX);
    only the routed experts' slices are read (``layer["gate_up"][:, e]``), one expert at a
    time. Returns float64 ``out``, ``out_bound``, ``residual_out``, ``residual_bound`` [m,
    hidden], and masks [m]: ``ambiguous``, tokens where the float32 router may choose
    other experts than the float64 one; ``rerouted``, tokens whose ``experts`` (the block's
    choice, int [m, top_k], if given) differ from the model's. Compare the other tokens; a
    rerouted token that is not ambiguous is a routing error (``unexplained``).

    Every rounding point of the block (module docstring) is modelled; a backend that
    keeps more precision (XLA may fuse away a bf16 convert) has less error.
    """
    x, residual = _f64(x), _f64(residual)
    m, hidden = x.shape
    router = _f64(layer["router"]).T  # stored [experts, hidden]
    logits = x @ router
    logit_var = _sum_var(np.abs(x) @ np.abs(router), hidden + 1)
    bias = _f64(layer["bias"]) if config.router == "sigmoid-grouped" else None
    chosen, weights, weight_var, ambiguous = numpy_route(config, logits, logit_var, bias)
    rerouted = np.zeros(m, bool) if experts is None else np.any(
        np.sort(np.asarray(experts), axis=1) != np.sort(chosen, axis=1), axis=1)
    scale = config.routed_scaling_factor
    partial = np.zeros((tp, m, hidden))
    var = np.zeros_like(partial)
    magnitude = np.zeros_like(partial)  # sum of |terms| of the float32 finalize
    for e in np.unique(chosen):
        tokens, picks = np.nonzero(chosen == e)  # a token picks an expert at most once
        y, y_var = _expert_var(x[tokens], _f64(layer["gate_up"][:, e]), _f64(layer["down"][:, e]),
                               "nh,rhj->rnj", "rni,rih->rnh")
        w = (weights[tokens, picks] * scale)[None, :, None]
        w_var = (weight_var[tokens, picks] * scale**2)[None, :, None]
        partial[:, tokens] += w * y
        var[:, tokens] += w**2 * y_var + w_var * y**2
        magnitude[:, tokens] += np.abs(w * y)
    if config.shared:
        y, y_var = _expert_var(x, _f64(layer["shared_gate_up"]), _f64(layer["shared_down"]),
                               "mh,rhj->rmj", "rmi,rih->rmh")
        partial += y
        var += y_var
        magnitude += np.abs(y)
    # Each rank's partial: float32 sum of top_k + 1 terms and the scale's product, bf16.
    var += _sum_var(magnitude, config.top_k + 2) + _rounding_var(partial)
    total = partial.sum(axis=0)
    total_var = var.sum(axis=0) + _sum_var(np.abs(partial).sum(axis=0), tp)
    residual_out = total + residual
    residual_var = total_var + _rounding_var(residual_out)
    eps = float(np.float32(config.norm_eps))
    out, rms = _rmsnorm(residual_out, _f64(layer["norm"]), eps)
    # d out_i = w_i (dx_i / rms - x_i sum_j x_j dx_j / (hidden rms^3)); dropping the negative
    # covariance of the two terms bounds the variance from above. Then the float32 evaluation.
    coupling = np.sum(residual_out**2 * residual_var, axis=-1, keepdims=True) / (hidden**2 * rms**4)
    out_var = (_f64(layer["norm"]) / rms) ** 2 * (residual_var + residual_out**2 * coupling)
    out_var += _rounding_var(out * (hidden / 2 + 8), F32_U)
    return dict(out=out, out_bound=_bound(out, out_var), residual_out=residual_out,
                residual_bound=_bound(residual_out, total_var), ambiguous=ambiguous, rerouted=rerouted,
                unexplained=rerouted & ~ambiguous)


def op_part(config, parts, residual, norm_weight, residual_out) -> dict:
    """The op's part of the layer in float64 from the block's own finalize arguments, with the
    op's tight bounds (`model.finalize_publish`, `model.add_rmsnorm`).

    ``parts`` holds every rank's arguments (`moe_block.make_parts`: routed [tp, rows, hidden],
    weights and indices [tp, m, top_k], shared [tp, m, hidden] or None); ``residual_out`` is
    the block's, from which ``out`` is modelled (the op's rounding point). Returns float64
    ``residual_out``, ``residual_bound``, ``out``, ``out_bound``.
    """
    y, y_bound = model.finalize_publish(*parts, config.routed_scaling_factor)
    return model.add_rmsnorm(y, y_bound, residual, norm_weight, config.norm_eps, residual_out)


def compare(got, exact, bound, rows=None) -> dict:
    """A bf16 result against a float64 model: ``relative`` (‖got − exact‖ / ‖exact‖), ``bound_use``
    (the largest |got − exact| / bound), ``outside`` (elements past the bound), over the
    ``rows`` selected (a mask over the first axis; all by default)."""
    got = _f64(got)
    if rows is not None:
        got, exact, bound = got[rows], exact[rows], bound[rows]
    error = np.abs(got - exact)
    finite = bool(np.all(np.isfinite(got)))
    # An exact result has a zero bound: any error there is infinitely far outside it.
    use = np.divide(error, bound, out=np.where(error > 0, np.inf, 0.0), where=bound > 0)
    return dict(relative=float(np.linalg.norm(got - exact) / max(np.linalg.norm(exact), 1e-300)),
                bound_use=float(np.max(use)) if use.size else 0.0,
                outside=int(np.sum(~(error <= bound))) if finite else int(got.size))
