"""The benchmarks' timing (`timing.paired_estimates`, on a fake machine) and its summary
(`timing.summarize`, on synthetic estimates)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import timing  # noqa: E402


def test_one_round_is_the_median_and_spread_of_its_estimates():
    rng = np.random.default_rng(0)
    estimates = rng.normal(5.0, 0.2, 30)
    figure = timing.summarize([estimates])
    assert figure == {"us": pytest.approx(np.median(estimates)), "p10": pytest.approx(np.percentile(estimates, 10)),
                      "p90": pytest.approx(np.percentile(estimates, 90))}


def test_rounds_pool_their_estimates_and_keep_each_round():
    rng = np.random.default_rng(1)
    rounds = [rng.normal(median, 0.1, 20) for median in (7.4, 5.6, 8.2)]
    figure = timing.summarize(rounds)
    pooled = np.concatenate(rounds)
    assert figure["us"] == pytest.approx(np.median(pooled))
    assert figure["p10"] == pytest.approx(np.percentile(pooled, 10))
    assert figure["p90"] == pytest.approx(np.percentile(pooled, 90))
    assert figure["rounds_us"] == pytest.approx([np.median(r) for r in rounds])


@pytest.mark.parametrize("seed", range(20))
def test_the_figure_lies_inside_its_own_spread(seed):
    """Skewed, few and disagreeing rounds (as XLA's between compiles): us stays within p10-p90."""
    rng = np.random.default_rng(seed)
    rounds = [rng.lognormal(rng.uniform(0, 2), rng.uniform(0.01, 1.0), rng.integers(1, 8))
              for _ in range(rng.integers(1, 5))]
    figure = timing.summarize(rounds)
    assert figure["p10"] <= figure["us"] <= figure["p90"], figure


class FakeMachine:
    """Chain programs on a fake clock: a run of ``n`` iterations of ``layers`` calls of a side
    takes ``fixed_s[rep] + n * layers * per_call_us[side] * 1e-6 * slowdown[rep]`` seconds,
    the machine's state ``rep`` moving between the repetitions of
    `timing.paired_estimates` (one short and one long run per side each, after
    one warm-up run per program)."""

    def __init__(self, per_call_us, fixed_s, slowdown, layers, iterations):
        self.per_call_us, self.fixed_s, self.slowdown, self.layers = per_call_us, fixed_s, slowdown, layers
        self.now, self.log = 0.0, []
        self.runs_per_rep = 2 * len(per_call_us)
        self.sides = {side: {n: self._program(side, n) for n in iterations} for side in per_call_us}

    def _program(self, side, n):
        def run(*inputs):
            rep = max(0, len(self.log) - self.runs_per_rep) // self.runs_per_rep  # warm-ups: rep 0's state
            self.now += self.fixed_s[rep] + n * self.layers * self.per_call_us[side] * 1e-6 * self.slowdown[rep]
            self.log.append((side, n, self.now))
            return self

        return run

    def block_until_ready(self):
        return self

    def clock(self):
        return self.now

    def timed_seconds(self, side, n):
        """Each timed run's seconds of program ``(side, n)``, in repetition order."""
        ends = [0.0] + [end for _, _, end in self.log]
        runs = [(s, k, ends[i + 1] - ends[i]) for i, (s, k, _) in enumerate(self.log)][self.runs_per_rep:]
        return np.array([seconds for s, k, seconds in runs if (s, k) == (side, n)])


# At the fourth repetition the machine moves: a run's fixed cost rises by 2 ms (a run's fixed
# cost moves between batches of runs on 2x H200, benchmarks/README.md) and its calls run 1.6
# times faster. Short runs then sort by their fixed cost, long runs by their calls.
FIXED_S = [0.0, 0.0, 0.0, 2e-3, 2e-3]
SLOWDOWN = [1.6, 1.6, 1.6, 1.0, 1.0]
LAYERS, ITERATIONS = 32, (36, 164)


def test_paired_estimates_pair_by_run_under_drift():
    """Each repetition's estimate is its own long run less its own short run: the moving fixed
    cost cancels, and ours over XLA is exact in every repetition. The i-th fastest long run
    less the i-th fastest short run, from the same runs, mixes the repetitions."""
    per_call_us = {"ours": 1.0, "xla": 4.0}
    machine = FakeMachine(per_call_us, FIXED_S, SLOWDOWN, LAYERS, ITERATIONS)
    estimates = timing.paired_estimates(machine.sides, (), len(FIXED_S), LAYERS, ITERATIONS, clock=machine.clock)
    for side, us in per_call_us.items():
        assert estimates[side] == pytest.approx(us * np.array(SLOWDOWN))
    assert timing.paired_ratio([estimates["ours"]], [estimates["xla"]]) == pytest.approx(
        {"ratio": 0.25, "p10": 0.25, "p90": 0.25})
    # Pairing by quantile, the same runs would have given other figures.
    few, many = ITERATIONS
    calls = (many - few) * LAYERS
    by_quantile = {side: (np.sort(machine.timed_seconds(side, many)) - np.sort(machine.timed_seconds(side, few)))
                   / calls * 1e6 for side in per_call_us}
    assert np.median(by_quantile["ours"]) < 0.85 * np.median(estimates["ours"])
    assert np.median(by_quantile["ours"]) / np.median(by_quantile["xla"]) < 0.9 * 0.25


def test_paired_estimates_alternate_the_order_of_the_sides():
    """Warm-up runs first, then every repetition's runs back to back, every other one backwards."""
    machine = FakeMachine({"ours": 1.0, "xla": 2.0, "xla_nccl": 3.0}, [0.0] * 3, [1.0] * 3, LAYERS, ITERATIONS)
    timing.paired_estimates(machine.sides, (), 3, LAYERS, ITERATIONS, clock=machine.clock)
    forwards = [(side, n) for side in ("ours", "xla", "xla_nccl") for n in ITERATIONS]
    assert [(side, n) for side, n, _ in machine.log] == forwards * 2 + forwards[::-1] + forwards


def test_call_estimates_are_one_side_paired_by_run(monkeypatch):
    machine = FakeMachine({"programs": 2.0}, FIXED_S, SLOWDOWN, LAYERS, ITERATIONS)
    paired = timing.paired_estimates
    monkeypatch.setattr(timing, "paired_estimates", lambda *args: paired(*args, clock=machine.clock))
    estimates = timing.call_estimates(machine.sides["programs"], (), len(FIXED_S), LAYERS, ITERATIONS)
    assert estimates == pytest.approx(2.0 * np.array(SLOWDOWN))
