"""NumPy float64 model of the op, random problems, and the one tolerance check the tests use."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16
BF16_EPS = 2.0**-8  # unit roundoff of bf16 (8 significand bits)
F32_EPS = 2.0**-24
POISON_BF16 = np.uint16(0x7FC1)  # a NaN pattern no computation here produces


@dataclasses.dataclass
class RankInputs:
    """One rank's inputs (NumPy) of a finalize."""

    routed: np.ndarray  # bf16 [num_rows, hidden]
    weights: np.ndarray  # bf16 or f32 [m, top_k]
    indices: np.ndarray  # int32 [m, top_k]
    shared: np.ndarray | None  # bf16 [m, hidden]


def random_problem(rng, *, m, hidden, top_k, num_rows=None, fp32_weights=False, shared=True,
                   invalid_fraction=0.2) -> RankInputs:
    """Fresh random inputs; about ``invalid_fraction`` of the indices are -1 or out of range."""
    num_rows = num_rows or max(1, m * top_k // 2)
    routed = rng.standard_normal((num_rows, hidden), dtype=np.float32).astype(BF16)
    weights = rng.uniform(0.05, 1.0, (m, top_k)).astype(np.float32 if fp32_weights else BF16)
    indices = rng.integers(0, num_rows, (m, top_k), dtype=np.int32)
    invalid = rng.random((m, top_k)) < invalid_fraction
    bad_values = rng.choice(np.array([-1, -7, num_rows, num_rows + 5, 2**31 - 1], np.int32), (m, top_k))
    indices = np.where(invalid, bad_values, indices).astype(np.int32)
    shared_out = rng.standard_normal((m, hidden), dtype=np.float32).astype(BF16) if shared else None
    return RankInputs(routed, weights, indices, shared_out)


def finalize_f64(problem: RankInputs, scale: float):
    """(exact partial, sum of |terms|) in float64, per element."""
    routed = problem.routed.astype(np.float64)
    num_rows = routed.shape[0]
    m, top_k = problem.indices.shape
    exact = np.zeros((m, routed.shape[1]))
    magnitude = np.zeros_like(exact)
    for k in range(top_k):
        idx = problem.indices[:, k]
        valid = (idx >= 0) & (idx < num_rows)
        if not valid.any():  # also the case with no routed rows at all
            continue
        w = np.where(valid, problem.weights[:, k].astype(np.float64) * scale, 0.0)
        term = w[:, None] * routed[np.where(valid, idx, 0)] * valid[:, None]
        exact += term
        magnitude += np.abs(term)
    if problem.shared is not None:
        shared = problem.shared.astype(np.float64)
        exact += shared
        magnitude += np.abs(shared)
    return exact, magnitude


def expected_sum(problems: list[RankInputs], scale: float):
    """(float64 sum over ranks of the exact partials, element-wise error bound of a bf16 result).

    The bound covers float32 accumulation of each partial, its bf16 rounding,
    and the final bf16 rounding of the sum.
    """
    top_k = problems[0].indices.shape[1]
    total = 0.0
    bound = 0.0
    for problem in problems:
        exact, magnitude = finalize_f64(problem, scale)
        total = total + exact
        bound = bound + (top_k + 2) * F32_EPS * magnitude + BF16_EPS * np.abs(exact)
    bound = bound + BF16_EPS * (np.abs(total) + bound) + 1e-30
    return total, bound


def expected_residual_out(total, bound, residual):
    """(float64 ``total + residual``, element-wise bound of ``residual_out``): the bound of the
    bf16 sum ``y`` plus the second bf16 rounding, after the residual add."""
    exact = total + np.asarray(residual).astype(np.float64)
    return exact, bound + BF16_EPS * (np.abs(exact) + bound) + 1e-30


def expected_rmsnorm(residual_out, norm_weight, eps):
    """(float64 RMSNorm of the bf16 ``residual_out`` as computed, element-wise bound of ``out``).

    The model starts from the result's own ``residual_out``, the rounding point that
    the kernel and the reference share. The bound covers float32 evaluation (the mean
    square of ``hidden`` positive terms in any order, its rsqrt, two products) and the
    final bf16 rounding.
    """
    x = np.asarray(residual_out).astype(np.float64)
    weight = np.asarray(norm_weight).astype(np.float64)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    exact = x / np.sqrt(mean_square + float(np.float32(eps))) * weight
    float32_relative = (x.shape[-1] / 2 + 8) * F32_EPS
    magnitude = np.abs(exact) * (1 + float32_relative)
    return exact, BF16_EPS * magnitude + float32_relative * np.abs(exact) + 1e-30


def assert_close(out, reference, bound, *, what="output", max_relative=1e-2):
    """``out`` (bf16) against a float64 reference: every element within ``bound``, and
    ``‖out − ref‖ / ‖ref‖ <= max_relative``. Any poison or NaN left in ``out`` fails."""
    out64 = np.asarray(out).astype(np.float64)
    assert out64.shape == reference.shape, f"{what}: shape {out64.shape} != {reference.shape}"
    assert np.all(np.isfinite(out64)), f"{what}: {np.sum(~np.isfinite(out64))} non-finite elements"
    error = np.abs(out64 - reference)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), (
        f"{what}: {np.sum(error > bound)} elements outside the bound; worst at {worst}: "
        f"got {out64[worst]}, expected {reference[worst]} ± {bound[worst]}"
    )
    norm = np.linalg.norm(reference)
    relative = np.linalg.norm(out64 - reference) / max(norm, 1e-30)
    assert relative <= max_relative, f"{what}: relative error {relative:.3e} > {max_relative}"
    return relative


def tokenless_rows(rows: int, tp: int, rank: int, m: int) -> np.ndarray:
    """Mask of a reduce_scatter rank's ``rows`` output rows that hold no token: row i holds
    token i * tp + rank, and there are ``m`` tokens."""
    return np.arange(rows) * tp + rank >= m


def owned(x: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """Rows t of ``x`` with t % tp == rank, zero-padded to ceil(m / tp) rows."""
    rows = -(-x.shape[0] // tp)
    out = np.zeros((rows,) + x.shape[1:], x.dtype)
    picked = x[rank::tp]
    out[: len(picked)] = picked
    return out


def make_negative_zero(problems: list[RankInputs], rng) -> list[RankInputs]:
    """Turn ``problems`` (in place) into inputs whose partials round to bf16 -0.0.

    Routed values near -1e-38 times weights near 1e-5 (scale <= 2.5, top-k <= 10)
    give float32 sums near -1e-42, far below half of bf16's smallest subnormal
    (about 4.6e-41), so each rounds to -0.0. Every third token has only -1
    indices: its partial is just the shared row, -0.0 (or nothing).
    """
    for problem in problems:
        problem.routed = (-rng.uniform(0.5e-38, 1e-38, problem.routed.shape)).astype(BF16)
        problem.weights = rng.uniform(0.5e-5, 1e-5, problem.weights.shape).astype(problem.weights.dtype)
        problem.indices[::3] = -1
        if problem.shared is not None:
            problem.shared = np.full(problem.shared.shape, -0.0, BF16)
    return problems


def epilogue_inputs(rng, rows: int, hidden: int, *, residual_scale: float = 64.0):
    """(residual bf16 [rows, hidden], norm_weight bf16 [hidden]), fresh.

    The residual is far larger than a reduced sum of `random_problem` partials, so
    that ``bf16(y + residual)`` drops low bits of ``y``: the rounding point matters.
    """
    residual = (rng.standard_normal((rows, hidden)) * residual_scale).astype(BF16)
    weight = rng.normal(1.0, 0.5, hidden).astype(BF16)
    return residual, weight


def silence_token(problems: list[RankInputs], token: int) -> None:
    """Make every rank's partial of ``token`` exactly zero (in place): no valid index, zero shared row."""
    for problem in problems:
        problem.indices[token] = -1
        if problem.shared is not None:
            problem.shared[token] = 0


def assert_epilogue_close(out, residual_out, total, bound, residual, norm_weight, eps, *, what="") -> None:
    """Both outputs of the epilogue: ``residual_out`` against ``total + residual`` (float64,
    with the bound of the sum), then ``out`` against the float64 RMSNorm of that
    ``residual_out``."""
    exact, residual_bound = expected_residual_out(total, bound, residual)
    assert_close(residual_out, exact, residual_bound, what=f"{what} residual_out")
    normed, normed_bound = expected_rmsnorm(residual_out, norm_weight, eps)
    assert_close(out, normed, normed_bound, what=f"{what} out")


FP8_GROUP = 128
FP8_MAX = 448.0


def e4m3_half_ulp(v: np.ndarray) -> np.ndarray:
    """Half the spacing of float8_e4m3fn values around ``v`` (float64): 3 mantissa bits, the
    smallest normal exponent -6 (below it, subnormals spaced 2**-9)."""
    exponent = np.floor(np.log2(np.maximum(np.abs(v), 2.0**-6)))
    return 2.0 ** (exponent - 3) / 2


def assert_fp8_close(q, scales, x, *, static_scale=None, what="fp8 out") -> None:
    """``q`` (float8_e4m3fn) and ``scales`` (float32 [rows, hidden / 128], None with
    ``static_scale``) against a float64 model of quantizing the bf16 ``x``: each dynamic scale
    exactly its group's amax times float32(1 / 448), rounded to float32, each value within half an e4m3 ulp of
    ``x / scale`` (plus the float32 roundings of ``x * (1 / scale)``) or ±448 beyond it, an all-zero
    group's scale and values zero. Finite inputs only."""
    x64 = np.asarray(x).astype(np.float64)
    assert np.all(np.isfinite(x64)), f"{what}: the model takes finite inputs"
    rows, hidden = x64.shape
    if static_scale is None:
        groups = x64.reshape(rows, -1, FP8_GROUP)
        want = np.max(np.abs(groups), axis=-1).astype(np.float32) * np.float32(1 / FP8_MAX)
        got = np.asarray(scales)
        assert got.dtype == np.float32 and got.shape == want.shape, f"{what}: scales {got.dtype} {got.shape}"
        assert np.array_equal(got, want), f"{what}: {np.sum(got != want)} scales differ from amax * (1 / 448)"
        divisor = np.repeat(want.astype(np.float64), FP8_GROUP, axis=1)
    else:
        divisor = np.full_like(x64, float(np.float32(static_scale)))
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(divisor == 0, 0.0, x64 / divisor)
    v = np.clip(v, -FP8_MAX, FP8_MAX)
    q64 = np.asarray(q).astype(np.float64)
    assert np.asarray(q).dtype == ml_dtypes.float8_e4m3fn, f"{what}: dtype {np.asarray(q).dtype}"
    assert np.all(np.isfinite(q64)), f"{what}: {np.sum(~np.isfinite(q64))} non-finite values"
    error = np.abs(q64 - v)
    # x * (1 / s): the reciprocal's and the product's float32 roundings.
    allowed = e4m3_half_ulp(v) + np.abs(v) * 3 * F32_EPS
    bad = error > allowed
    assert not np.any(bad), (f"{what}: {np.sum(bad)} values beyond half an e4m3 ulp, e.g. {q64[bad][:4]} "
                             f"for {v[bad][:4]}")
    assert np.all(q64[divisor == 0] == 0), f"{what}: an all-zero group has nonzero values"


def assert_group_close(out, expected, bound, *, result: str, tp: int) -> None:
    """A group's result against the float64 sum: the whole [m, hidden] for an all-reduce,
    or each rank's owned rows of a [tp, ceil(m/tp), hidden] reduce-scatter."""
    if result != "reduce_scatter":
        assert_close(out, expected, bound)
        return
    assert out.shape == (tp, -(-expected.shape[0] // tp), expected.shape[1])
    for rank in range(tp):
        assert_close(out[rank], owned(expected, tp, rank), owned(bound, tp, rank), what=f"rank {rank}")


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INDEX_PATTERNS = ("valid", "all -1", "duplicates", "below range", "above range", "mixed")


def pattern_indices(rng, pattern: str, m: int, top_k: int, num_rows: int) -> np.ndarray:
    """int32 [m, top_k] indices of one rank; with no routed rows every index is invalid."""
    if num_rows == 0 or pattern == "all -1":
        return np.full((m, top_k), -1, np.int32)
    valid = rng.integers(0, num_rows, (m, top_k))
    below = rng.choice([-1, -2, INT32_MIN, int(rng.integers(INT32_MIN, 0))], (m, top_k))
    above = rng.choice([num_rows, num_rows + 1, INT32_MAX, int(rng.integers(num_rows, INT32_MAX))], (m, top_k))
    if pattern == "valid":
        out = valid
    elif pattern == "duplicates":
        # Every expert of a token on one row, and a few rows shared by all tokens.
        out = np.repeat(rng.integers(0, min(num_rows, 3), (m, 1)), top_k, axis=1)
    elif pattern == "below range":
        out = np.where(rng.random((m, top_k)) < 0.5, below, valid)
    elif pattern == "above range":
        out = np.where(rng.random((m, top_k)) < 0.5, above, valid)
    else:
        duplicate = np.repeat(valid[:, :1], top_k, axis=1)
        out = np.choose(rng.integers(0, 5, (m, top_k)), [valid, below, above, duplicate, np.full_like(valid, -1)])
    return out.astype(np.int32)


# --- the experts op ------------------------------------------------------------------------

SILU_LIPSCHITZ = 1.1
"""A bound of |silu'| (its maximum is about 1.0998, near x = 2.4)."""
SILU_F32_RELATIVE = 16 * F32_EPS
"""A bound of the float32 silu's relative error (an approximate exp, a division)."""


@dataclasses.dataclass
class ExpertsInputs:
    """One rank's inputs (NumPy) of the experts op."""

    x: np.ndarray  # bf16 [m, hidden]
    expert_ids: np.ndarray  # int32 [m, top_k]
    gate: np.ndarray  # bf16 [experts, hidden, intermediate]
    up: np.ndarray  # bf16 [experts, hidden, intermediate]
    down: np.ndarray  # bf16 [experts, intermediate, hidden]

    @property
    def gate_up(self) -> np.ndarray:
        """The fused layout: bf16 [experts, hidden, 2 * intermediate], gate columns first."""
        return np.concatenate([self.gate, self.up], axis=-1)


def random_experts(rng, *, m, hidden, intermediate, experts, top_k, skipped_fraction=0.1,
                   hot_experts=None) -> ExpertsInputs:
    """Fresh inputs with unit-scale activations: weights of variance 1 / fan-in (distinct per
    expert), about ``skipped_fraction`` of the ids outside ``[0, experts)``, each token's valid
    ids distinct (drawn as a router would), and, with ``hot_experts``, every id among that many
    experts (several tokens per expert)."""
    x = rng.standard_normal((m, hidden), dtype=np.float32).astype(BF16)
    pool = experts if hot_experts is None else min(hot_experts, experts)
    choices = np.stack([rng.permutation(pool)[:top_k] if top_k <= pool else rng.integers(0, pool, top_k)
                        for _ in range(m)]).astype(np.int32)
    skipped = rng.random((m, top_k)) < skipped_fraction
    bad = rng.choice(np.array([-1, -3, experts, experts + 9, 2**31 - 1], np.int32), (m, top_k))
    ids = np.where(skipped, bad, choices).astype(np.int32)

    def weights(shape, fan_in):
        # Each value drawn from a fresh pool of 65536 normal values: a quarter of the time of
        # drawing every value, which at hidden 7168 and 32 experts dominated a GPU test's time.
        pool = (rng.standard_normal(1 << 16, dtype=np.float32) / np.sqrt(fan_in)).astype(BF16)
        return pool[rng.integers(0, 1 << 16, shape, dtype=np.uint16)]

    return ExpertsInputs(x, ids, weights((experts, hidden, intermediate), hidden),
                         weights((experts, hidden, intermediate), hidden),
                         weights((experts, intermediate, hidden), intermediate))


def shared_expert_inputs(x, gate, up, down) -> ExpertsInputs:
    """The model's inputs of a shared expert (``gate``, ``up`` [hidden, intermediate], ``down``
    [intermediate, hidden]): one expert that every token of ``x`` names, so that `expected_rows`
    gives its rows [m, hidden] and `expected_activations` its activations."""
    return ExpertsInputs(x, np.zeros((x.shape[0], 1), np.int32), gate[None], up[None], down[None])


def _valid_pairs(inputs: ExpertsInputs):
    """(pair, token, expert) of every pair with a valid id."""
    m, top_k = inputs.expert_ids.shape
    flat = inputs.expert_ids.reshape(-1)
    pairs = np.flatnonzero((flat >= 0) & (flat < inputs.down.shape[0]))
    return pairs, pairs // top_k, flat[pairs]


def _per_expert(rows, ids, weights):
    """(``rows[i] @ weights[ids[i]]``, the same of absolute values), float64, one expert at a time."""
    value = np.zeros((rows.shape[0], weights.shape[2]))
    magnitude = np.zeros_like(value)
    for expert in np.unique(ids):
        chosen = ids == expert
        w = weights[expert].astype(np.float64)
        value[chosen] = rows[chosen] @ w
        magnitude[chosen] = np.abs(rows[chosen]) @ np.abs(w)
    return value, magnitude


def expected_activations(inputs: ExpertsInputs):
    """(float64 ``silu(gate) * up`` of the exact projections, element-wise bound of the kernels'
    bf16 activations): float32 sums of hidden terms, the bf16 roundings of gate and up, a
    float32 silu and product, and the final bf16 rounding. Rows of skipped pairs are exactly 0."""
    m, top_k = inputs.expert_ids.shape
    hidden, intermediate = inputs.gate.shape[1:]
    exact = np.zeros((m * top_k, intermediate))
    bound = np.zeros_like(exact)
    pairs, tokens, ids = _valid_pairs(inputs)
    x = inputs.x.astype(np.float64)[tokens]
    projections = []
    for weights in (inputs.gate, inputs.up):
        value, magnitude = _per_expert(x, ids, weights)
        summed = hidden * F32_EPS * magnitude
        projections.append((value, summed + BF16_EPS * (np.abs(value) + summed)))
    (g, g_error), (u, u_error) = projections
    silu = g / (1 + np.exp(-g))
    h = silu * u
    error = ((np.abs(silu) + SILU_LIPSCHITZ * g_error) * u_error + SILU_LIPSCHITZ * g_error * np.abs(u)
             + (SILU_F32_RELATIVE + F32_EPS) * (np.abs(silu) + SILU_LIPSCHITZ * g_error) * (np.abs(u) + u_error))
    exact[pairs] = h
    bound[pairs] = error + BF16_EPS * (np.abs(h) + error) + 1e-30
    return exact, bound


def expected_rows_from(activations, inputs: ExpertsInputs):
    """(float64 ``activations @ down`` of the bf16 ``activations`` given, element-wise bound of
    the kernels' bf16 rows): float32 sums of intermediate terms and one bf16 rounding. Rows of
    skipped pairs are exactly 0."""
    m, top_k = inputs.expert_ids.shape
    intermediate, hidden = inputs.down.shape[1:]
    exact = np.zeros((m * top_k, hidden))
    bound = np.zeros_like(exact)
    pairs, _, ids = _valid_pairs(inputs)
    h = np.asarray(activations).astype(np.float64)[pairs]
    value, magnitude = _per_expert(h, ids, inputs.down)
    summed = intermediate * F32_EPS * magnitude
    exact[pairs] = value
    bound[pairs] = summed + BF16_EPS * (np.abs(value) + summed) + 1e-30
    return exact, bound


def expected_rows(inputs: ExpertsInputs, activations=None):
    """(float64 rows of the experts op, element-wise bound): `expected_activations` carried
    through down with its bound, then `expected_rows_from`'s float32 sums and rounding.
    ``activations``: `expected_activations`' result where the caller has it."""
    h, h_bound = expected_activations(inputs) if activations is None else activations
    exact, bound = expected_rows_from(h, inputs)
    pairs, _, ids = _valid_pairs(inputs)
    _, carried = _per_expert(h_bound[pairs], ids, inputs.down)
    intermediate = inputs.down.shape[1]
    extra = np.zeros_like(bound)
    extra[pairs] = carried * (1 + intermediate * F32_EPS) + BF16_EPS * carried
    return exact, bound + extra


def assert_rows_zero(out, inputs: ExpertsInputs, *, what="rows"):
    """The rows of the skipped pairs are exactly +0.0 or -0.0 (nothing poisoned is left)."""
    flat = inputs.expert_ids.reshape(-1)
    skipped = np.flatnonzero((flat < 0) | (flat >= inputs.down.shape[0]))
    assert np.all(np.asarray(out).astype(np.float64)[skipped] == 0), f"{what}: a skipped pair's row is not zero"
