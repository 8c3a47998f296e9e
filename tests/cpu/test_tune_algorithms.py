"""`benchmarks/tune_algorithms.py`: the measured entries of a sweep, and its ``--cpu`` plumbing
run (times meaningless) against a table outside the package."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from jax_moe_publish import tuning

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import tune_algorithms  # noqa: E402

ROW = 7168 * 2


def _rows(*fastest):
    """One synthetic timing row per m = 1, 2, 4, ..., the named path 1 us faster than the rest."""
    return [{"m": 1 << i, "us": {path: 5.0 - (path == best) for path in ("oneshot", "twoshot", "xla")}}
            for i, best in enumerate(fastest)]


def test_measured_entries_reach_the_largest_m_each_path_won():
    entries = tune_algorithms.measured_entries(_rows("xla", "oneshot", "oneshot", "twoshot"), 8, 7168, "sweep.json",
                                               shared_expert=True)
    assert [(e["algorithm"], e["max_bytes"], e.get("shared_expert")) for e in entries] == [
        ("xla", ROW, True), ("oneshot", 4 * ROW, None), ("twoshot", None, None)]
    assert all(e["source"] == "measured" and "sweep.json" in e["reason"] for e in entries)
    assert "fastest at m = 2 on tp = 8" in entries[1]["reason"] and "m = 4" in entries[1]["reason"]


def test_measured_entries_end_with_a_kernel_where_xla_won_last():
    rows = _rows("oneshot", "xla")
    rows[-1]["us"]["twoshot"] = 4.5  # the faster kernel at the largest m
    entries = tune_algorithms.measured_entries(rows, 4, 7168, "sweep.json", shared_expert=False)
    assert [(e["algorithm"], e["max_bytes"]) for e in entries] == [
        ("oneshot", ROW), ("xla", 2 * ROW), ("twoshot", None)]


def test_cpu_sweep_rewrites_only_the_given_table(tmp_path):
    before = tuning.TABLE_FILE.read_text()
    out, table = tmp_path / "sweep.json", tmp_path / "algorithms.json"
    run = subprocess.run([sys.executable, tune_algorithms.__file__, "--measure", "--cpu", "--m", "3", "--reps", "3",
                          "--out", str(out), "--table", str(table)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"
    assert tuning.TABLE_FILE.read_text() == before
    figures, data = json.loads(out.read_text()), json.loads(table.read_text())
    assert figures["environment"]["plumbing_check"] is True
    expected = {(tp, f"{result}/{epilogue}") for tp in tune_algorithms.MEASURED_TPS
                for result, epilogue in tune_algorithms.measured_cases(tp)[0]}
    assert {(r["tp"], r["case"]) for r in figures["results"]} == expected
    assert (1, "allreduce/none") in expected and (8, "allreduce/rmsnorm") in expected
    for tp, case in expected:
        entries = data["tables"][case][str(tp)]
        assert all(e["source"] == "measured" and str(out) in e["reason"] for e in entries), entries
        assert entries[-1]["max_bytes"] is None
        assert entries[-1]["algorithm"] in tune_algorithms.measured_cases(tp)[1], entries
    # The rest of the table is the package's, untouched.
    package = json.loads(before)
    assert data["model"] == package["model"] and data["tables"]["reduce_scatter/none"] == package["tables"][
        "reduce_scatter/none"] and data["tables"]["allreduce/rmsnorm"]["1"] == package["tables"]["allreduce/rmsnorm"]["1"]
