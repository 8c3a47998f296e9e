"""The benchmark's timing summary (`bench_moe_publish.summarize`), on synthetic estimates."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))  # its sibling imports
import bench_moe_publish as bench  # noqa: E402


def test_one_round_is_the_median_and_spread_of_its_estimates():
    rng = np.random.default_rng(0)
    estimates = rng.normal(5.0, 0.2, 30)
    figure = bench.summarize([estimates])
    assert figure == {"us": pytest.approx(np.median(estimates)), "p10": pytest.approx(np.percentile(estimates, 10)),
                      "p90": pytest.approx(np.percentile(estimates, 90))}


def test_rounds_pool_their_estimates_and_keep_each_round():
    rng = np.random.default_rng(1)
    rounds = [rng.normal(median, 0.1, 20) for median in (7.4, 5.6, 8.2)]
    figure = bench.summarize(rounds)
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
    figure = bench.summarize(rounds)
    assert figure["p10"] <= figure["us"] <= figure["p90"], figure


def test_call_estimates_pair_the_sorted_runs(monkeypatch):
    """The i-th fastest long run less the i-th fastest short run, per call, in us."""
    seconds = {"short": [3.0, 1.0, 2.0], "long": [9.0, 7.0, 5.0]}  # in run order
    monkeypatch.setattr(bench, "time_runs", lambda program, inputs, reps: np.array(seconds[program]))
    estimates = bench.call_estimates({4: "short", 12: "long"}, (), 3, layers=2, iterations=(4, 12))
    # sorted long (5, 7, 9) less sorted short (1, 2, 3), over (12 - 4) * 2 = 16 calls
    assert estimates == pytest.approx(np.array([4.0, 5.0, 6.0]) / 16 * 1e6)
