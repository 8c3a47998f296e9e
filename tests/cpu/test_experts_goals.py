"""`benchmarks/experts_goals.py`: each goal's verdict at its bounds, on runs built here."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import experts_goals as goals

COPY_RATE = 2.5e12  # bytes per s: 1 MB per 0.4 µs


def case(shape="qwen3-30b-a3b", tp=8, m=16, active_mb=40.0, **us):
    """A case of a run with ``us`` per column (None: the column has no figure, with a reason)."""
    columns = {name: ({"why_not": "not here"} if value is None else {"us": value}) for name, value in us.items()}
    return {"shape": shape, "tp": tp, "m": m, "active_bytes_per_call": active_mb * 1e6, "columns": columns}


def write_run(tmp_path, name, *cases):
    path = tmp_path / name
    path.write_text(json.dumps({"floor": {"bytes_per_s": COPY_RATE}, "results": list(cases)}))
    return path


@pytest.mark.parametrize("active_mb, us, met", [
    (40.0, 1.25 * 16.0, True),  # 40 MB: floor 16 µs, bound 1.25x
    (40.0, 1.26 * 16.0, False),
    (10.0, 4.0 + 4.0, True),  # 10 MB: floor 4 µs, bound floor + 4
    (10.0, 4.0 + 4.1, False),
])
def test_near_floor_bound(tmp_path, active_mb, us, met):
    path = write_run(tmp_path, "run.json", case(active_mb=active_mb, ours_prepared=us))
    [row] = goals.run_goals([path], "ours_prepared")
    assert row["floor_us"] == pytest.approx(active_mb * 0.4)
    assert row["near_floor"] is met


def test_never_slower_names_the_fastest_other_route_and_skips_routes_without_figures(tmp_path):
    path = write_run(tmp_path, "run.json",
                     case(m=1, ours_prepared=10.0, ragged_dot=80.0, tokamax=12.0, gather=9.5, cudnn=None),
                     case(m=4, ours_prepared=10.0, ragged_dot=80.0, tokamax=12.0, cudnn=None))
    slower, faster = goals.run_goals([path], "ours_prepared")
    assert (slower["best_other"], slower["best_other_us"], slower["never_slower"]) == ("gather", 9.5, False)
    assert (faster["best_other"], faster["never_slower"]) == ("tokamax", True)
    assert faster["ragged_dot_speedup"] == pytest.approx(8.0)


@pytest.mark.parametrize("shape, m, ragged_us, goal", [
    ("deepseek-v3", 1, 150.0, True),
    ("deepseek-v3", 1, 149.0, False),
    ("deepseek-v3", 4, 50.0, None),  # the goal is at m = 1 only
    ("qwen3-235b-a22b", 1, 50.0, None),
])
def test_ragged_dot_goal_at_deepseek_v3_m1_only(tmp_path, shape, m, ragged_us, goal):
    path = write_run(tmp_path, "run.json", case(shape=shape, m=m, ours_prepared=10.0, ragged_dot=ragged_us))
    [row] = goals.run_goals([path], "ours_prepared")
    assert row["ragged_dot_goal"] is goal


def test_a_later_run_replaces_a_case_and_a_case_without_the_column_is_left_out(tmp_path):
    first = write_run(tmp_path, "first.json", case(m=1, ours_prepared=30.0), case(m=2, ours_prepared=30.0))
    second = write_run(tmp_path, "second.json", case(m=1, ours_prepared=12.0), case(m=4, ours_prepared=None))
    rows = goals.run_goals([first, second], "ours_prepared")
    assert [(row["m"], row["us"], row["run"]) for row in rows] == [(1, 12.0, "second.json"), (2, 30.0, "first.json")]


def test_markdown_counts_the_misses(tmp_path):
    path = write_run(tmp_path, "run.json",
                     case(shape="deepseek-v3", m=1, ours_prepared=20.0, ragged_dot=100.0),  # floor 16: met
                     case(m=2, ours_prepared=40.0, tokamax=30.0))  # floor 16: missed, and slower
    text = goals.markdown(goals.run_goals([path], "ours_prepared"), "ours_prepared")
    assert text.splitlines()[-1] == ("2 cases: near the floor missed in 1, slower than another route in 1, "
                                     "under 15x ragged_dot in 1 of 1 (deepseek-v3, m = 1).")


def test_auto_is_judged_as_the_route_the_table_gives(tmp_path, monkeypatch):
    """--column auto: the table's route at each case (its other route where the run has no
    tokamax figure, the last entry's route past its m; at a shape without entries the kernels
    up to 16 pairs per expert, then the reference), against every other column."""
    shard = dict(hidden=2048, intermediate=192, experts=128, top_k=8)
    monkeypatch.setattr(goals.experts_tuning, "TABLE", [goals.experts_tuning.ExpertsChoice(
        **shard, max_m=64, impl="tokamax", otherwise="kernel", source="benchmarks/results/t.json", reason="test")])
    path = write_run(tmp_path, "run.json",
                     case(m=16, ours=12.0, tokamax=10.0, gather=11.0, ragged_dot=50.0) | shard,
                     case(m=32, ours=12.0, tokamax=None, gather=11.0, ragged_dot=50.0) | shard,
                     case(m=128, ours=20.0, tokamax=30.0, ragged_dot=50.0) | shard,
                     case(tp=4, m=128, ours=20.0, tokamax=30.0, ragged_dot=50.0) | shard | dict(experts=64),
                     case(tp=2, m=128, ours=20.0, tokamax=30.0, ragged_dot=50.0) | shard | dict(experts=32))
    run = json.loads(path.read_text())
    for each in run["results"]:
        if "us" in each["columns"]["tokamax"]:
            each["columns"]["tokamax"]["ran"] = goals.experts_tuning.TOKAMAX_RAN
    path.write_text(json.dumps(run))
    rows = goals.run_goals([path], goals.AUTO)
    assert [(row["m"], row["column"], row["best_other"], row["never_slower"]) for row in rows] == [
        (16, "tokamax", "gather", True), (32, "ours", "gather", False), (128, "tokamax", "ours", False),
        (128, "ours", "tokamax", True), (128, "ragged_dot", "ours", False)]
    assert "| 16 | 10.0 (tokamax) |" in goals.markdown(rows, goals.AUTO)
