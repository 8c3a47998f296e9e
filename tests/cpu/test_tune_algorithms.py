"""`benchmarks/tune_algorithms.py`: the measured entries of a sweep, the merge of its parts
(synthetic ones, and the part of a ``--cpu`` plumbing run, times meaningless) and what it
refuses, and ``--model`` against the committed table."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jax_moe_publish import tuning

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import tune_algorithms  # noqa: E402

ROW = 7168 * 2
SPLIT = ((1, 2, 4), (8, 16, 32), (64, 128, 256), (512,), (1024,))
"""tools/multi_gpu_run.sh's split of the sweep's m."""


def _rows(*fastest):
    """One synthetic timing row per m = 1, 2, 4, ..., the named path 1 us faster than the rest."""
    return [{"m": 1 << i, "us": {path: 5.0 - (path == best) for path in ("oneshot", "twoshot", "xla")},
             "cited": "sweep.json"} for i, best in enumerate(fastest)]


def test_measured_entries_reach_the_largest_m_each_path_won():
    entries = tune_algorithms.measured_entries(_rows("xla", "oneshot", "oneshot", "twoshot"), 8, 7168,
                                               shared_expert=True)
    assert [(e["algorithm"], e["max_bytes"], e.get("shared_expert")) for e in entries] == [
        ("xla", ROW, True), ("oneshot", 4 * ROW, None), ("twoshot", None, None)]
    assert all(e["source"] == "measured" and "sweep.json" in e["reason"] for e in entries)
    assert "fastest at m = 2 on tp = 8" in entries[1]["reason"] and "m = 4" in entries[1]["reason"]


def test_measured_entries_end_with_a_kernel_where_xla_won_last():
    rows = _rows("oneshot", "xla")
    rows[-1]["us"]["twoshot"] = 4.5  # the faster kernel at the largest m
    entries = tune_algorithms.measured_entries(rows, 4, 7168, shared_expert=False)
    assert [(e["algorithm"], e["max_bytes"]) for e in entries] == [
        ("oneshot", ROW), ("xla", 2 * ROW), ("twoshot", None)]


def _figure(path: str, epilogue: str, m: int) -> float:
    """A fixed machine: XLA fastest at m = 1, one-shot up to m = 32, two-shot beyond; the
    epilogue adds 1 us to each."""
    return {"oneshot": 4 + m / 16, "twoshot": 6 + m / 64, "xla": 3.9 + m / 8}[path] + (epilogue != "none")


def _part(tp: int, ms, device="NVIDIA H200", commit="0123abc") -> dict:
    """A part as `tune_algorithms.measure` writes it, its figures `_figure`'s."""
    cases, algorithms = tune_algorithms.measured_cases(tp)
    results = [{"tp": tp, "m": m, "case": f"{result}/{epilogue}", "xla": {},
                "us": {path: _figure(path, epilogue, m) for path in (*algorithms, "xla")}}
               for m in ms for result, epilogue in cases]
    return {"tp": tp, "m": list(ms), "problem": {"name": "deepseek-v3", "hidden": 7168, "shared_expert": True},
            "environment": {"gpu": device, "commit": commit, "plumbing_check": False}, "results": results}


def _merged(parts: dict, ms=tune_algorithms.DEFAULT_MS) -> dict:
    data = json.loads(tuning.TABLE_FILE.read_text())
    tune_algorithms.merge(data, parts, list(ms))
    return data


def uncited(data: dict) -> dict:
    """``data`` with every reason's cited part left out: what two merges of the same figures share."""
    return json.loads(re.sub(r" \([\w./-]+\.json\)", "", json.dumps(data)))


def cited_parts(entries: list[dict]) -> list[tuple[int, str]]:
    """Each m of the entries' reasons, in order, with the part its reason cites."""
    return [(int(m), part) for entry in entries
            for m, part in re.findall(r"fastest at m = (\d+) on tp = \d+: [^()]* \(([^()]+)\)", entry["reason"])]


@pytest.mark.parametrize("tp", [2, 8])
def test_the_parts_of_a_split_merge_into_the_table_of_one_sweep(tp):
    pieces = {f"sweep-tp{tp}-m{ms[0]}" + (f"-{ms[-1]}" if len(ms) > 1 else "") + ".json": ms for ms in SPLIT}
    split = _merged({name: _part(tp, ms) for name, ms in pieces.items()})
    whole = _merged({f"sweep-tp{tp}.json": _part(tp, tune_algorithms.DEFAULT_MS)})
    assert uncited(split) == uncited(whole)
    package = json.loads(tuning.TABLE_FILE.read_text())
    for case in ("allreduce/none", "allreduce/rmsnorm"):
        entries = split["tables"][case].pop(str(tp))
        assert [(e["algorithm"], e["max_bytes"], e.get("shared_expert")) for e in entries] == [
            ("xla", ROW, True), ("oneshot", 32 * ROW, None), ("twoshot", None, None)], entries
        # Each m's reason cites the part that holds it.
        cited = cited_parts(entries)
        assert [m for m, _ in cited] == list(tune_algorithms.DEFAULT_MS)
        assert all(m in pieces[part] for m, part in cited), cited
        del package["tables"][case][str(tp)]
    assert split == package  # every other entry is the package's


@pytest.mark.parametrize("parts, ms, message", [
    ({"a.json": _part(2, (1, 2, 4)), "c.json": _part(2, (64, 128))}, (1, 2, 4, 8, 16, 32, 64, 128),
     "tp = 2: no part holds m = 8, 16, 32 of allreduce/none and allreduce/rmsnorm (the sweep's m: 1 2 4 8 16 32 "
     "64 128, --m)"),
    ({"a.json": _part(2, (1, 2)), "b.json": _part(4, (4,))}, (1, 2, 4),
     "the parts differ in tp: a.json has 2, b.json has 4"),
    ({"a.json": _part(8, (1,)), "b.json": _part(8, (2,), device="NVIDIA B200")}, (1, 2),
     "the parts differ in device: a.json has NVIDIA H200, b.json has NVIDIA B200"),
    ({"a.json": _part(2, (1,)), "b.json": _part(2, (2,), commit="4567def")}, (1, 2),
     "the parts differ in commit: a.json has 0123abc, b.json has 4567def"),
    ({"a.json": _part(2, (1, 2)), "b.json": _part(2, (2, 4))}, (1, 2, 4),
     "tp = 2, allreduce/none, m = 2: in both a.json and b.json"),
    ({"a.json": _part(2, (1, 3))}, (1, 2), "a.json: m = 3 is not one of the sweep's m, 1 2 (--m)"),
    ({"a.json": {"environment": {}, "results": []}}, (1,), "a.json: not a part of a sweep (it has no tp, m, problem)"),
])
def test_a_merge_that_would_guess_is_refused(parts, ms, message):
    data = json.loads(tuning.TABLE_FILE.read_text())
    with pytest.raises(ValueError, match=re.escape(message)):
        tune_algorithms.merge(data, parts, list(ms))
    assert data == json.loads(tuning.TABLE_FILE.read_text())


def _run(*args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, tune_algorithms.__file__, *args], capture_output=True, text=True,
                          timeout=900, env={**os.environ, **env})


def _output(run: subprocess.CompletedProcess) -> str:
    return f"exit code {run.returncode}\nstdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"


@pytest.mark.parametrize("args, message", [
    (["--measure", "--out", "sweep.json"], "--measure needs --tp and --out"),
    (["--measure", "--tp", "2"], "--measure needs --tp and --out"),
    (["--merge", "a.json"], "--merge needs --table"),
    (["--merge", "a.json", "a.json", "--table", "t.json"], "a part named twice"),
    (["--model", "--tp", "2"], "--tp and --out are --measure's"),
    (["--model", "--cpu"], "--cpu is a plumbing check of --measure"),
])
def test_a_measured_table_goes_only_where_it_is_asked_to(args, message):
    """On a GPU machine the package is installed, so its table is not the checkout's: a table names its file."""
    run = _run(*args)
    assert run.returncode == 2 and message in run.stderr, _output(run)


def test_merge_names_what_is_missing_and_writes_nothing(tmp_path):
    part, table = tmp_path / "sweep-tp2-m1-4.json", tmp_path / "algorithms.json"
    part.write_text(json.dumps(_part(2, (1, 2, 4))))
    run = _run("--merge", str(part), "--table", str(table))
    assert run.returncode == 1 and "--merge: tp = 2: no part holds m = 8, 16, 32, 64, 128, 256, 512, 1024 of " \
                                   "allreduce/none and allreduce/rmsnorm" in run.stderr, _output(run)
    assert not table.exists()


@pytest.mark.parametrize("tp, ms", [(1, ["1", "2"]), (8, ["1"])])
def test_cpu_sweep_is_a_part_and_its_merge(tp, ms, tmp_path):
    """``--measure --table`` writes the part, then the table that ``--merge`` of that part gives;
    the package's table stays as it was."""
    before = tuning.TABLE_FILE.read_text()
    out, table, merged = tmp_path / "sweep.json", tmp_path / "algorithms.json", tmp_path / "merged.json"
    run = _run("--measure", "--cpu", "--tp", str(tp), "--m", *ms, "--reps", "2", "--out", str(out),
               "--table", str(table), JMP_COMMIT="0123abc")
    assert run.returncode == 0, _output(run)
    assert tuning.TABLE_FILE.read_text() == before
    part = json.loads(out.read_text())
    assert (part["tp"], part["m"], part["problem"]["hidden"]) == (tp, [int(m) for m in ms], 7168)
    assert {key: part["environment"][key] for key in ("gpu", "commit", "plumbing_check")} == {
        "gpu": "cpu", "commit": "0123abc", "plumbing_check": True}
    cases, algorithms = tune_algorithms.measured_cases(tp)
    assert [(r["m"], r["case"]) for r in part["results"]] == [
        (int(m), f"{result}/{epilogue}") for m in ms for result, epilogue in cases]
    assert all(set(r["us"]) == {*algorithms, "xla"} for r in part["results"])
    run = _run("--merge", str(out), "--m", *ms, "--table", str(merged))
    assert run.returncode == 0, _output(run)
    assert merged.read_text() == table.read_text()
    data, package = json.loads(table.read_text()), json.loads(before)
    for result, epilogue in cases:
        entries = data["tables"][f"{result}/{epilogue}"].pop(str(tp))
        assert all(e["source"] == "measured" and str(out) in e["reason"] for e in entries), entries
        assert entries[-1]["max_bytes"] is None and entries[-1]["algorithm"] in algorithms, entries
        del package["tables"][f"{result}/{epilogue}"][str(tp)]
    assert data == package  # the rest of the table is the package's


def test_model_rewrites_the_model_entries_of_every_tp_above_one_and_nothing_else():
    """Every all-``model`` tp, tp = 2 with the epilogue among them, gets the model's entries
    again; the measured and argued entries beside them stay."""
    committed = json.loads(tuning.TABLE_FILE.read_text())
    data, stale = copy.deepcopy(committed), []
    for result, epilogue in tune_algorithms.CASES:
        for tp, entries in data["tables"][f"{result}/{epilogue}"].items():
            if all(entry["source"] == "model" for entry in entries):
                entries[:] = [dict(max_bytes=None, algorithm="twoshot", source="model", reason="model: stale")]
                stale.append((f"{result}/{epilogue}", tp))
    assert ("allreduce/rmsnorm", "2") in stale and ("allreduce/none", "2") not in stale
    tune_algorithms.rewrite_model(data)
    assert data == committed


def test_model_reproduces_the_committed_table(tmp_path):
    """``--model`` on a copy with stale model entries rewrites it to the committed table, byte for byte."""
    copied = tmp_path / "algorithms.json"
    data = json.loads(tuning.TABLE_FILE.read_text())
    data["tables"]["allreduce/rmsnorm"]["2"][0]["reason"] = "model: stale"
    data["tables"]["allreduce/none"]["8"][0]["max_bytes"] = 1
    copied.write_text(json.dumps(data, indent=1) + "\n")
    run = _run("--model", "--table", str(copied))
    assert run.returncode == 0, _output(run)
    assert copied.read_text() == tuning.TABLE_FILE.read_text()
