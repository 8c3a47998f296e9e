"""How the benchmarks time a call: two loop counts per program, the sides paired by run.

A *side* (ours, or an XLA column) is a jitted program per loop count, each a ``fori_loop``
over a chain of ``layers`` calls (`chains.make_chain`). Time per call = ``(T(164
iterations) - T(36 iterations)) / (128 * 32)``: one dispatch per run, so host dispatch
cancels, and the loop's own cost per iteration is spread over 32 calls. Every program runs
once to warm up. Then each of ``reps`` repetitions runs every side's two programs back to
back, the sides in turn, and every other repetition runs the same sequence backwards (ours
36, ours 164, XLA 36, XLA 164; then XLA 164, XLA 36, ours 164, ours 36), so that no side
always runs first and a drift linear in time cancels over two repetitions
(`paired_estimates`). A side's per-call estimate of a repetition is its long run less its
short run: two adjacent runs, so a fixed cost that moves between batches of runs cancels.
``us`` is the median of a side's estimates and ``p10``/``p90`` their 10th and 90th
percentiles: one estimator, so ``p10 <= us <= p90`` (`summarize`). The ratio of ours over
another side is taken per repetition, from estimates of adjacent runs, and ``ratio`` is the
median of these ratios (`paired_ratio`).

Every run in ``benchmarks/results/`` predates this pairing: those up to ``ac40515`` took
``us`` from the median T of each program (63 of the 1234 figures of ours and XLA's then in
``benchmarks/results/`` lie outside their own spread), and the MoE block runs of 2026-12-01
paired the i-th fastest long run with the i-th fastest short run, each side's runs timed in
a batch of their own; in all of them ``ratio`` is ours' ``us`` over XLA's.

The counts are 128 iterations (4096 calls) apart: on 2x H200 a run of ours has a fixed cost
of 2 to 3 ms that moves between batches of runs, which over fewer calls reads as a different
time per call. In ``benchmarks/results/2026-11-30-h200x2-iteration-counts.json`` the
estimate from 4 and 36 iterations was off the one from 36 and 260 by -0.93 to +0.58 us,
while two rounds of the latter agreed within 0.16 us. The runs of 2026-11-30 before that
used 4 and 36 iterations (and earlier 4 and 12); the JSON records the iterations.

XLA's path still differs between separately compiled programs by up to 3 us at small m
(ours, with these counts, by under 0.25 us): a benchmark may time several *rounds*, each
with freshly built programs, and pool their estimates (`summarize`).

Nothing here needs JAX: a program is anything whose result has ``block_until_ready``.
"""

from __future__ import annotations

import time

import numpy as np

LAYERS = 32
SHORT, LONG = 36, 164  # loop iterations of the two timed programs (module docstring)


def time_run(fn, args, clock=time.perf_counter):
    """Seconds of one run of ``fn(*args)``, to its result's readiness."""
    start = clock()
    fn(*args).block_until_ready()
    return clock() - start


def time_runs(fn, args, reps):
    """Seconds of each of ``reps`` runs of ``fn(*args)`` after a warm-up run."""
    fn(*args).block_until_ready()
    return np.array([time_run(fn, args) for _ in range(reps)])


def paired_estimates(sides, inputs, reps, layers=LAYERS, iterations=(SHORT, LONG), clock=time.perf_counter):
    """Per-call estimates in us of every side, paired by run (module docstring).

    ``sides[name][n]`` is a side's program of ``n`` loop iterations over ``layers`` calls, for
    the two counts of ``iterations``. Each program runs once to warm up. Then each of ``reps``
    repetitions runs every side's short and long program, the sides in turn, the whole
    sequence reversed in every other repetition (so that no side always runs first, and a
    drift linear in time cancels over two repetitions). A side's estimate of a repetition
    is its long run less its short run, over the calls between them: two adjacent runs, and
    the sides' estimates of one repetition come from adjacent runs too.

    Returns
    -------
    dict of name: float array of ``reps`` estimates, in repetition order.
    """
    few, many = iterations
    runs = [(name, n) for name in sides for n in (few, many)]
    for name, n in runs:
        sides[name][n](*inputs).block_until_ready()
    seconds = {run: np.empty(reps) for run in runs}
    for rep in range(reps):
        for name, n in (runs if rep % 2 == 0 else runs[::-1]):
            seconds[name, n][rep] = time_run(sides[name][n], inputs, clock)
    calls = (many - few) * layers
    return {name: (seconds[name, many] - seconds[name, few]) / calls * 1e6 for name in sides}


def call_estimates(programs, inputs, reps, layers=LAYERS, iterations=(SHORT, LONG)):
    """`paired_estimates` of one side, ``programs[n]``."""
    return paired_estimates({"programs": programs}, inputs, reps, layers, iterations)["programs"]


def summarize(rounds):
    """One side's figures from its rounds (`paired_estimates` results, each from its own
    programs), all of one estimator over the rounds' estimates pooled: ``us`` their
    median, ``p10`` and ``p90`` their 10th and 90th percentiles (so p10 <= us <= p90), and
    with several rounds each round's median (``rounds_us``)."""
    estimates = np.concatenate(rounds)
    result = {"us": float(np.median(estimates)), "p10": float(np.percentile(estimates, 10)),
              "p90": float(np.percentile(estimates, 90))}
    if len(rounds) > 1:
        result["rounds_us"] = [float(np.median(round_estimates)) for round_estimates in rounds]
    return result


def paired_ratio(ours_rounds, other_rounds):
    """Ours over another side, one ratio per repetition of the same round (their estimates
    from adjacent runs), pooled over the rounds: ``ratio`` the median, ``p10`` and ``p90``."""
    ratios = np.concatenate([ours / other for ours, other in zip(ours_rounds, other_rounds, strict=True)])
    return {"ratio": float(np.median(ratios)), "p10": float(np.percentile(ratios, 10)),
            "p90": float(np.percentile(ratios, 90))}


def per_call_us(programs, inputs, reps, layers=LAYERS):
    """`summarize` of one round of ``programs``."""
    return summarize([call_estimates(programs, inputs, reps, layers)])

