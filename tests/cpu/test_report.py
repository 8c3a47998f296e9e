"""`benchmarks/report.py`: the floor, tables, plot and merging (CPU only).

Every result here is synthetic, written in this file; none is a measurement.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from jax_moe_publish import traffic

REPORT_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "report.py"
_spec = importlib.util.spec_from_file_location("bench_report", REPORT_PATH)
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

# Synthetic device limits: 4 TB/s copy (read + write), 400 GB/s peer, 2 µs per call.
FLOORS = {
    "copy": {"bytes_per_s": 4e12},
    "p2p": {"bytes_per_s": 4e11},
    "empty_call": {"us": 2.0, "p10": 1.9, "p90": 2.2, "what": "tiny dependent XLA kernel"},
}


def synthetic_case(problem, tp, algorithm, m, ours_us, xla_us, *, hidden, top_k, shared):
    """One result row shaped like the benchmark's, with made-up times."""
    moved = traffic.bytes_per_rank(algorithm=algorithm, tp=tp, m=m, hidden=hidden, top_k=top_k,
                                   shared_expert=shared)
    floor = report.case_floor(moved, FLOORS)
    return {
        "problem": problem, "tp": tp, "algorithm": algorithm, "m": m,
        "ours": {"us": ours_us, "p10": ours_us * 0.95, "p90": ours_us * 1.1},
        "xla": {"us": xla_us, "p10": xla_us * 0.95, "p90": xla_us * 1.1},
        "relative_difference": 1e-3, "ratio": ours_us / xla_us,
        "floor": floor, "ours_over_floor": ours_us / floor["us"],
    }


def synthetic_run(command_buffer=True, slowdown=1.0):
    deepseek = dict(hidden=7168, top_k=8, shared=True)
    results = [
        synthetic_case("deepseek-v3", 1, "direct", 1, 3.0 * slowdown, 6.0, **deepseek),
        synthetic_case("deepseek-v3", 1, "direct", 64, 8.0 * slowdown, 12.0, **deepseek),
        synthetic_case("deepseek-v3", 2, "oneshot", 1, 5.5 * slowdown, 15.7, **deepseek),
        synthetic_case("deepseek-v3", 2, "oneshot", 64, 9.0 * slowdown, 25.0, **deepseek),
        synthetic_case("deepseek-v3", 2, "twoshot", 1, 7.0 * slowdown, 15.9, **deepseek),
        synthetic_case("deepseek-v3", 2, "twoshot", 64, 10.0 * slowdown, 25.2, **deepseek),
    ]
    environment = {"date": "2000-01-01", "gpu": "synthetic GPU", "gpus": ["a", "b"], "jax": "0.0",
                   "commit": "0" * 40, "command_buffer": command_buffer}
    return {"environment": environment, "floors": FLOORS, "results": results}


def test_case_floor_takes_the_slowest_term():
    small = report.case_floor({"hbm": 4e6, "nvlink": 4e5}, FLOORS)  # 1 µs, 1 µs: the call dominates
    assert small["us"] == 2.0 and small["bound"] == "empty call"
    large = report.case_floor({"hbm": 4e7, "nvlink": 4e7}, FLOORS)  # 10 µs of HBM, 100 µs of NVLink
    assert large["hbm_us"] == pytest.approx(10.0)
    assert large["us"] == pytest.approx(100.0) and large["bound"] == "nvlink"


def test_case_floor_needs_p2p_for_nvlink_traffic():
    with pytest.raises(ValueError, match="p2p"):
        report.case_floor({"hbm": 1.0, "nvlink": 1.0}, {**FLOORS, "p2p": None})


def test_markdown_table_rows():
    table = report.markdown_table(synthetic_run())
    lines = table.splitlines()
    assert lines[0] == ("| problem | tp | algorithm | m | ours µs (p10–p90) | xla µs | ratio | floor µs | "
                        "ours/floor |")
    assert len(lines) == 2 + 6
    # m=1, oneshot: ours 5.5 (5.22–6.05), ratio 5.5 / 15.7; the 2 µs call is the floor.
    expected = "| deepseek-v3 | 2 | oneshot | 1 | 5.50 (5.22–6.05) | 15.70 | 0.350 | 2.00 (empty call) | 2.75 |"
    assert expected in lines
    assert "command buffers" not in table


def test_markdown_table_shows_the_nccl_column_where_a_case_has_it():
    data = synthetic_run()
    # tp = 2, oneshot, m = 1: NCCL forced took 12.0 us, faster than XLA's default 15.7.
    data["results"][2]["xla_nccl"] = {"us": 12.0, "p10": 11.5, "p90": 12.5}
    data["results"][2]["ratio"] = 5.5 / 12.0
    lines = report.markdown_table(data).splitlines()
    assert "| xla µs | xla nccl µs | ratio |" in lines[0]
    assert "| deepseek-v3 | 2 | oneshot | 1 | 5.50 (5.22–6.05) | 15.70 | 12.00 | 0.458 |" in lines[4]
    assert "| 1 | 3.00 (2.85–3.30) | 6.00 | – | 0.500 |" in lines[2]


def test_runs_that_named_the_algorithm_mode_still_read(tmp_path):
    data = synthetic_run()
    for case in data["results"]:
        case["mode"] = case.pop("algorithm")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert [case["algorithm"] for case in report.load([path])["results"]] == [
        "direct", "direct", "oneshot", "oneshot", "twoshot", "twoshot"]
    assert "| deepseek-v3 | 2 | twoshot | 64 |" in report.markdown_table(report.merge_files([path, path]))


def test_markdown_table_without_floors():
    data = synthetic_run()
    for case in data["results"]:
        del case["floor"], case["ours_over_floor"]
    assert all(line.endswith("| – | – |") for line in report.markdown_table(data).splitlines()[2:])


def test_tuning_table_marks_the_best():
    data = synthetic_run()
    launch = {"threads": 128, "elements_per_thread": 8, "prefetch_group": 4, "reduce_threads": 128}
    data["results"][2]["tuning"] = {"best": 1, "variants": [
        {"launch": launch, "us": 5.5, "p10": 5.4, "p90": 5.7, "same_bits_as_default": True},
        {"launch": {**launch, "threads": 256}, "us": 5.0, "p10": 4.9, "p90": 5.2,
         "same_bits_as_default": True},
    ]}
    rows = report.tuning_table(data).splitlines()[2:]
    assert len(rows) == 2
    assert "**threads=256, elements_per_thread=8, prefetch_group=4, reduce_threads=128**" in rows[1]
    assert "| 0.909 |" in rows[1]
    assert report.tuning_table(synthetic_run()) == ""


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib, which the package does not require")
    path = tmp_path / "plot.png"
    report.plot(synthetic_run(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_files_adds_the_command_buffer_column(tmp_path):
    paths = []
    for name, command_buffer, slowdown in (("on.json", True, 1.0), ("off.json", False, 2.0)):
        path = tmp_path / name
        path.write_text(json.dumps(synthetic_run(command_buffer, slowdown)))
        paths.append(path)
    merged = report.merge_files(paths)
    assert [run["path"] for run in merged["runs"]] == [str(p) for p in paths]
    assert len(merged["results"]) == 12
    lines = report.markdown_table(merged).splitlines()
    assert "| m | command buffers |" in lines[0]
    # Each case's runs sit together, command buffers on first.
    assert lines[2].startswith("| deepseek-v3 | 1 | direct | 1 | on | 3.00 ")
    assert lines[3].startswith("| deepseek-v3 | 1 | direct | 1 | off | 6.00 ")
    text = report.render_markdown(merged)
    assert "command buffers on" in text and "command buffers off" in text


def test_cli_writes_markdown(tmp_path, capsys):
    result = tmp_path / "result.json"
    result.write_text(json.dumps(synthetic_run()))
    markdown = tmp_path / "table.md"
    assert report.main([str(result), "--markdown", str(markdown)]) == 0
    text = markdown.read_text()
    assert text in capsys.readouterr().out
    assert "synthetic GPU ×2" in text and "tiny dependent XLA kernel 2.00 µs" in text
