"""The experts op's goals, read from ``bench_moe_experts.py`` runs: per case, met or missed.

    python benchmarks/experts_goals.py benchmarks/results/RUN.json ... [--column ours_prepared]

- **near the floor**: ``column`` within `NEAR_FLOOR_RATIO` of the floor where a call's active
  weight bytes are at least `LARGE_CALL_BYTES`, within the floor + `SMALL_CALL_SLACK_US` below;
- **over ragged_dot**: at least `RAGGED_DOT_SPEEDUP` times `ragged_dot`'s time at DeepSeek-V3,
  m = 1 (the other cases print the ratio, with no goal);
- **never slower**: no other route of a JAX user (`OTHER_ROUTES`) faster than ``column``.

``--column auto`` judges ``impl="auto"`` on the weights' rows: each case's figure is that of
the route the committed table (`experts_tuning.auto_impl`) gives its shard and m (its
``otherwise`` where the run has no figure of the tokamax route: none, or one of tokamax's
GEMMs alone, from before the route), and the kernels' column counts among the other routes.

The floor is the run's own: the active experts' weight bytes at the copy rate measured in the
same run (the JSON's ``floor``). A column without figures in a case (it could not run, with its
reason in the JSON) does not count. Exit status 0 whatever was missed: a report, not a test.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from jax_moe_publish import experts_tuning  # noqa: E402
from jax_moe_publish.experts_tuning import REFERENCE_ROUTES  # noqa: E402

NEAR_FLOOR_RATIO = 1.25
LARGE_CALL_BYTES = 32e6
SMALL_CALL_SLACK_US = 4.0
RAGGED_DOT_SPEEDUP = 15.0
RAGGED_DOT_GOAL_SHAPE, RAGGED_DOT_GOAL_M = "deepseek-v3", 1
OTHER_ROUTES = (*REFERENCE_ROUTES, "tokamax", "gather")
AUTO = "auto"
ROUTE_COLUMNS = {**experts_tuning.ROUTE_COLUMNS, "reference": "ragged_dot"}
"""The benchmark's column of each ``impl`` on the weights' rows (``impl="reference"`` runs
ragged_dot's default lowering)."""


def floor_us(case: dict, run: dict) -> float:
    """The case's floor: its active weight bytes per call at the run's copy rate."""
    return case["active_bytes_per_call"] / run["floor"]["bytes_per_s"] * 1e6


def near_floor_bound_us(case: dict, run: dict) -> float:
    """The most µs the near-floor goal allows the case."""
    floor = floor_us(case, run)
    if case["active_bytes_per_call"] >= LARGE_CALL_BYTES:
        return NEAR_FLOOR_RATIO * floor
    return floor + SMALL_CALL_SLACK_US


def auto_column(case: dict) -> str:
    """The column of the route ``impl="auto"`` takes at ``case``'s shard and m."""
    route, otherwise = experts_tuning.auto_impl(hidden=case["hidden"], intermediate=case["intermediate"],
                                                experts=case["experts"], top_k=case["top_k"], m=case["m"])
    if route == "tokamax" and experts_tuning.timed_route(case["columns"], "tokamax") is None:
        route = otherwise
    return ROUTE_COLUMNS[route]


def case_goals(case: dict, run: dict, column: str) -> dict | None:
    """One case's verdicts for ``column`` (`AUTO`: the route auto takes), or None where it has
    no figure there."""
    columns = case["columns"]
    judged = auto_column(case) if column == AUTO else column
    ours = columns.get(judged, {}).get("us")
    if ours is None:
        return None
    candidates = (*OTHER_ROUTES, experts_tuning.KERNEL_COLUMN) if column == AUTO else OTHER_ROUTES
    others = {name: columns[name]["us"] for name in candidates
              if name != judged and columns.get(name, {}).get("us") is not None}
    best = min(others, key=others.get) if others else None
    ragged = others.get("ragged_dot")
    ragged_goal = case["shape"] == RAGGED_DOT_GOAL_SHAPE and case["m"] == RAGGED_DOT_GOAL_M
    bound = near_floor_bound_us(case, run)
    return {
        "shape": case["shape"], "tp": case["tp"], "m": case["m"], "column": judged, "us": ours,
        "floor_us": floor_us(case, run), "bound_us": bound, "near_floor": ours <= bound,
        "best_other": best, "best_other_us": others.get(best),
        "never_slower": best is None or ours <= others[best],
        "ragged_dot_speedup": None if ragged is None else ragged / ours,
        "ragged_dot_goal": None if not ragged_goal or ragged is None else ragged / ours >= RAGGED_DOT_SPEEDUP,
    }


def run_goals(paths: list[pathlib.Path], column: str) -> list[dict]:
    """Every case of the runs, in their order; a case measured again in a later run replaces it."""
    cases = {}
    for path in paths:
        run = json.loads(path.read_text())
        for case in run["results"]:
            goals = case_goals(case, run, column)
            if goals is not None:
                cases[(goals["shape"], goals["tp"], goals["m"])] = goals | {"run": path.name}
    return list(cases.values())


def markdown(rows: list[dict], column: str) -> str:
    """The table and the count of each goal's misses."""
    def mark(ok):
        return "-" if ok is None else ("met" if ok else "**missed**")

    lines = [f"| shard | m | {column} µs | floor µs | bound µs | near floor | best other route | over it "
             "| never slower | ragged_dot over it |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        best = "-" if row["best_other"] is None else f"{row['best_other']} {row['best_other_us']:.1f}"
        over = "-" if row["best_other"] is None else f"{row['us'] / row['best_other_us']:.2f}"
        speedup = "-" if row["ragged_dot_speedup"] is None else f"{row['ragged_dot_speedup']:.1f}"
        if row["ragged_dot_goal"] is not None:
            speedup += f" ({mark(row['ragged_dot_goal'])})"
        us = f"{row['us']:.1f}" if row["column"] == column else f"{row['us']:.1f} ({row['column']})"
        lines.append(f"| {row['shape']} tp {row['tp']} | {row['m']} | {us} | {row['floor_us']:.1f} "
                     f"| {row['bound_us']:.1f} | {mark(row['near_floor'])} | {best} | {over} "
                     f"| {mark(row['never_slower'])} | {speedup} |")
    ragged = [row for row in rows if row["ragged_dot_goal"] is not None]
    lines += ["", f"{len(rows)} cases: near the floor missed in {sum(not row['near_floor'] for row in rows)}, "
              f"slower than another route in {sum(not row['never_slower'] for row in rows)}, "
              f"under {RAGGED_DOT_SPEEDUP:g}x ragged_dot in {sum(not row['ragged_dot_goal'] for row in ragged)} "
              f"of {len(ragged)} ({RAGGED_DOT_GOAL_SHAPE}, m = {RAGGED_DOT_GOAL_M})."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="bench_moe_experts.py result JSONs")
    parser.add_argument("--column", default="ours_prepared",
                        help=f"our column to judge, or {AUTO!r} (default: ours_prepared)")
    args = parser.parse_args(argv)
    print(markdown(run_goals(args.runs, args.column), args.column))
    return 0


if __name__ == "__main__":
    sys.exit(main())
