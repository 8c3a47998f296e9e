"""Calls that carry the same tokens at different places, for the determinism tests (the kernels
through `gpu_harness`, the reference on CPU devices).

A *probe* is every rank's inputs for `PROBE_TOKENS` tokens. A call of ``m`` tokens carries the
probe at ``offset``: its other tokens are fresh random ones, its routed rows the probe's, so a
probe token's result must not change with ``m``, ``offset`` or the other tokens (batch
invariance). `call_places` puts the probe in calls of every range of the tuning table's
launch shapes, at their end, in their middle and near their start, so that the owner of a
token (``t % tp``) changes too.

The probe's `ZERO_TOKENS` sum to zero on every rank: `SILENT_TOKEN` has no valid index (and,
with a shared expert, a shared row of -0.0, which the float32 sum from +0.0 turns into +0.0);
`NEGATIVE_ZERO_TOKEN` reads routed rows near -1e-38 with weights near 1e-5, whose products
round to a bf16 partial of -0.0, the mailbox's empty marker, which the publish stores as
+0.0. Either way the reduced sum is +0.0. With the epilogue their residual rows are -0.0
too, so ``residual_out`` is ``+0.0 + -0.0 = +0.0`` and ``out`` is
``+0.0 * rsqrt(eps) * norm_weight``: -0.0 in the lanes of a negative weight, except where
the algorithm turns -0.0 into +0.0 (`zero_out`; ``docs/design.md``, Determinism).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import numerics
from jax_moe_publish import protocol, tuning

PROBE_TOKENS = 5  # not a multiple of any tp: the probe's owners wrap around the group
SILENT_TOKEN = 2
NEGATIVE_ZERO_TOKEN = 3
ZERO_TOKENS = (SILENT_TOKEN, NEGATIVE_ZERO_TOKEN)
NEGATIVE_ZERO_BF16 = np.uint16(protocol.EMPTY_BF16)


@dataclasses.dataclass
class Call:
    """Every rank's inputs of one call of ``m`` tokens that carries the probe from ``offset`` on;
    ``residual`` (bf16 [m, hidden], token order) with the epilogue, else None."""

    m: int
    offset: int
    problems: list[numerics.RankInputs]
    residual: np.ndarray | None

    @property
    def window(self) -> slice:
        """The probe's tokens in this call."""
        return slice(self.offset, self.offset + PROBE_TOKENS)

    def residual_rows(self, result: str, rank: int) -> np.ndarray:
        """Rank's residual rows in the layout of ``result``: every token's, or its owned rows."""
        if result == "allreduce":
            return self.residual
        return numerics.owned(self.residual, len(self.problems), rank)


def call_places(capacity_m: int) -> list[tuple[int, int]]:
    """(m, offset) of each call: the probe alone, then in a call of each m of `tuning.range_ms`
    (one per range of the table's launch shapes) and of ``capacity_m`` tokens, at the end, in
    the middle and one token from the start, in turn."""
    if max(tuning.range_ms()) > capacity_m:
        raise ValueError(f"capacity_m={capacity_m}: expected at least {max(tuning.range_ms())}, the largest m "
                         "of tuning.range_ms")
    ms = (*tuning.range_ms(), capacity_m)
    places = (lambda m: m - PROBE_TOKENS, lambda m: (m - PROBE_TOKENS) // 2 + 1, lambda m: 1)
    return [(PROBE_TOKENS, 0), *((m, places[i % len(places)](m)) for i, m in enumerate(ms))]


def probe_problems(rng, tp: int, problem: tuning.Problem, num_rows: int) -> list[numerics.RankInputs]:
    """Every rank's fresh inputs for the probe's tokens, over ``num_rows`` routed rows (at least
    top-k), with the `ZERO_TOKENS`: the first top-k rows are near -1e-38 (any token may read
    them), and `NEGATIVE_ZERO_TOKEN` reads each of them."""
    probes = [
        numerics.random_problem(rng, m=PROBE_TOKENS, hidden=problem.hidden, top_k=problem.top_k, num_rows=num_rows,
                                fp32_weights=problem.fp32_weights, shared=problem.include_shared_expert)
        for _ in range(tp)
    ]
    numerics.silence_token(probes, SILENT_TOKEN)
    tiny = slice(0, problem.top_k)
    for probe in probes:
        probe.routed[tiny] = -rng.uniform(0.5e-38, 1e-38, probe.routed[tiny].shape)
        probe.indices[NEGATIVE_ZERO_TOKEN] = np.arange(problem.top_k)
        probe.weights[NEGATIVE_ZERO_TOKEN] = rng.uniform(0.5e-5, 1e-5, problem.top_k)
        if probe.shared is not None:
            probe.shared[list(ZERO_TOKENS)] = NEGATIVE_ZERO_BF16.view(numerics.BF16)
    return probes


def probe_residual(rng, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """(the probe's residual rows bf16 [PROBE_TOKENS, hidden], the norm weight bf16 [hidden]), fresh:
    `numerics.epilogue_inputs`, with the rows of the `ZERO_TOKENS` -0.0."""
    residual, norm_weight = numerics.epilogue_inputs(rng, PROBE_TOKENS, hidden)
    residual[list(ZERO_TOKENS)] = NEGATIVE_ZERO_BF16.view(numerics.BF16)
    return residual, norm_weight


def calls(rng, probes: list[numerics.RankInputs], capacity_m: int, residual: np.ndarray | None = None) -> list[Call]:
    """A `Call` for each of `call_places`, its other tokens (and residual rows) fresh."""
    return [_embed(rng, probes, m, offset, residual) for m, offset in call_places(capacity_m)]


def _embed(rng, probes, m, offset, residual) -> Call:
    window = slice(offset, offset + PROBE_TOKENS)
    problems = []
    for probe in probes:
        num_rows, hidden = probe.routed.shape
        call = numerics.random_problem(rng, m=m, hidden=hidden, top_k=probe.indices.shape[1], num_rows=num_rows,
                                       fp32_weights=probe.weights.dtype == np.float32, shared=probe.shared is not None)
        call.routed = probe.routed
        call.weights[window] = probe.weights
        call.indices[window] = probe.indices
        if call.shared is not None:
            call.shared[window] = probe.shared
        problems.append(call)
    rows = None
    if residual is not None:
        rows = numerics.epilogue_inputs(rng, m, residual.shape[1])[0]
        rows[window] = residual
    return Call(m, offset, problems, rows)


def token_rows(outputs: list[np.ndarray], result: str, m: int) -> list[np.ndarray]:
    """Each copy of a call's result (raw bf16 bits, rows in the result's layout) in token order,
    [m, hidden]: every rank's own for ``allreduce``; for ``reduce_scatter`` one, gathered from
    the owners (token t is row t // tp of rank t % tp)."""
    if result == "allreduce":
        return [bits[:m] for bits in outputs]
    tp = len(outputs)
    return [np.stack([outputs[t % tp][t // tp] for t in range(m)])]


def bf16_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise distance of two bf16 arrays (raw uint16 bits) in units in the last place:
    the number of bf16 values from one to the other, -0.0 and +0.0 counting as one value."""
    def ordered(bits):
        bits = bits.astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)

    return np.abs(ordered(a) - ordered(b))


def positive_zero(bits: np.ndarray) -> np.ndarray:
    """bf16 bits with -0.0 turned into +0.0, as the two-shot kernels store their results."""
    return np.where(bits == NEGATIVE_ZERO_BF16, np.uint16(0), bits)


def zero_out(norm_weight: np.ndarray, positive: bool) -> np.ndarray:
    """The ``out`` bits of a token whose sum and residual are zero: ``+0.0 * norm_weight``, -0.0
    where the weight is negative, or +0.0 everywhere where the algorithm turns -0.0 into +0.0
    (``positive``)."""
    negative = np.signbit(norm_weight.astype(np.float32)) & (not positive)
    return np.where(negative, NEGATIVE_ZERO_BF16, np.uint16(0))
