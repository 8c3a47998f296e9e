"""`benchmarks/chain_timeline.py`: the per-call summary of a trace's kernel events."""

from __future__ import annotations

import json
import pathlib
import sys
from types import SimpleNamespace

import jax
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import chain_timeline


def test_the_span_less_the_kernels_is_the_idle_time_per_call():
    # Two calls, each gate/up (100 ns) then down (50 ns), with gaps of 10, 30 and 20 ns.
    events = [(1000, 100, "gate_up"), (1110, 50, "down"), (1190, 100, "gate_up"), (1310, 50, "down")]
    summary = chain_timeline.summarize(events, calls=2)
    assert summary["span_us"] == pytest.approx((1360 - 1000) / 1e3 / 2)
    assert summary["kernels"] == {"gate_up": {"us": pytest.approx(0.1), "launches": 1.0},
                                  "down": {"us": pytest.approx(0.05), "launches": 1.0}}
    assert list(summary["kernels"]) == ["gate_up", "down"]  # the costliest first
    assert summary["kernels_us"] == pytest.approx(0.15)
    assert summary["idle_us"] == pytest.approx((10 + 30 + 20) / 1e3 / 2)


def test_the_span_ends_at_the_last_kernel_to_finish():
    # A long kernel that starts first and ends last, a short one inside it.
    summary = chain_timeline.summarize([(0, 500, "long"), (100, 50, "short")], calls=1)
    assert summary["span_us"] == pytest.approx(0.5)


def test_kernel_names_are_cut_and_their_launches_counted_together():
    long = "fusion_" + "x" * 200
    summary = chain_timeline.summarize([(0, 10, long + "a"), (20, 10, long + "b")], calls=1)
    (name,) = summary["kernels"]
    assert len(name) == chain_timeline.NAME_CHARS
    assert summary["kernels"][name]["launches"] == 2


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no kernel events"):
        chain_timeline.summarize([], calls=1)


@pytest.mark.parametrize("argv, expected", [(["--iterations", "0"], "--iterations 0: expected at least 1"),
                                            (["--cpu"], "--cpu: a timeline is the GPU's kernels")])
def test_bad_arguments_are_refused_by_name(argv, expected, capsys):
    with pytest.raises(SystemExit):
        chain_timeline.parse(argv)
    assert expected in capsys.readouterr().err


def _trace(planes):
    """A stand-in for `jax.profiler.ProfileData`: planes of named lines of ``(start_ns, duration_ns,
    name)`` events."""
    return SimpleNamespace(planes=[
        SimpleNamespace(name=name, lines=[
            SimpleNamespace(name=line, events=[SimpleNamespace(start_ns=start, duration_ns=duration, name=event)
                                               for start, duration, event in events])
            for line, events in lines.items()])
        for name, lines in planes.items()])


def test_kernel_events_are_the_gpu_planes_stream_lines_in_start_order(monkeypatch):
    trace = _trace({
        "/device:GPU:0": {"Stream #13(Compute)": [(300, 5, "down"), (100, 7, "gate_up")],
                          "XLA Ops": [(100, 7, "an op, not a kernel")]},
        "/host:CPU": {"Stream of the host": [(50, 1, "host")]},
    })
    monkeypatch.setattr(chain_timeline.ProfileData, "from_file", lambda path: trace)
    assert chain_timeline.kernel_events("trace.xplane.pb") == [(100, 7, "gate_up"), (300, 5, "down")]


def test_a_trace_without_kernel_events_is_refused_with_what_it_holds(monkeypatch):
    trace = _trace({"/host:CPU": {"python": [(50, 1, "host")]}, "/device:GPU:0": {"XLA Ops": []}})
    monkeypatch.setattr(chain_timeline.ProfileData, "from_file", lambda path: trace)
    with pytest.raises(ValueError, match=r"no kernel events.*/host:CPU: \['python'\].*/device:GPU:0: \['XLA Ops'\]"):
        chain_timeline.kernel_events("trace.xplane.pb")


def test_every_column_s_program_is_built_and_handed_to_the_timeline(monkeypatch, tmp_path):
    """The script's cases, built on the CPU with its plumbing sizes (the trace itself needs a
    GPU): every column compiles and its program reaches `timeline`, none is recorded as not built."""
    import bench_moe_experts as bench

    args = bench.parse(["--cpu", "--shapes", "qwen3-30b-a3b", "--tp", "2", "--m", "2",
                        "--columns", "ragged_dot", "gather", "ours"])
    args.iterations, args.timeline_out = 2, str(tmp_path / "timeline.json")
    monkeypatch.setattr(chain_timeline, "parse", lambda argv=None: args)
    timed = []

    def timeline(compiled, inputs, iterations, calls):
        timed.append((isinstance(compiled, jax.stages.Compiled), iterations, calls))
        return chain_timeline.summarize([(0, 1000, "kernel")], calls)

    monkeypatch.setattr(chain_timeline, "timeline", timeline)
    assert chain_timeline.main() == 0
    results = json.loads((tmp_path / "timeline.json").read_text())["results"]
    assert sorted(r["column"] for r in results) == ["gather", "ours", "ragged_dot"]
    assert not [r for r in results if "why_not" in r], results
    assert timed == [(True, 2, 2 * r["layers"]) for r in results]
