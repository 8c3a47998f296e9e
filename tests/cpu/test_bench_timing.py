"""The benchmark's timing summary (`bench_moe_publish.summarize`), on synthetic estimates."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))  # its sibling imports
import bench_moe_publish as bench  # noqa: E402


def test_one_round_is_its_median_and_spread():
    rng = np.random.default_rng(0)
    estimates = rng.normal(5.0, 0.2, 30)
    figure = bench.summarize([(estimates, 5.1)])
    assert figure == {"us": 5.1, "p10": pytest.approx(np.percentile(estimates, 10)),
                      "p90": pytest.approx(np.percentile(estimates, 90))}


def test_rounds_report_their_median_round_and_every_round():
    rng = np.random.default_rng(1)
    rounds = [(rng.normal(median, 0.1, 20), median) for median in (7.4, 5.6, 8.2)]
    figure = bench.summarize(rounds)
    assert figure["us"] == 7.4 and figure["rounds_us"] == [7.4, 5.6, 8.2]
    pooled = np.concatenate([estimates for estimates, _ in rounds])
    assert figure["p10"] == pytest.approx(np.percentile(pooled, 10))
    assert figure["p90"] == pytest.approx(np.percentile(pooled, 90))
