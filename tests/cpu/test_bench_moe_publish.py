"""`benchmarks/bench_moe_publish.py` on CPU: the all-reduce reader of the optimized HLO, and a
``--cpu`` plumbing run of every case at tp = 1, 2, 4 and 8 (times meaningless)."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))  # its sibling imports
import bench_moe_publish as bench  # noqa: E402

BENCHMARK = pathlib.Path(bench.__file__)
LAYERS = 2

# Lines shaped like XLA's optimized HLO text (written here, not captured from a GPU).
HLO = """
HloModule chain
%fused_computation (p: bf16[4,7168]) -> bf16[4,7168] {
  %ar.9 = bf16[4,7168]{1,0} all-reduce(bf16[4,7168]{1,0} %p), replica_groups={{0,1}}, to_apply=%add
}
ENTRY %main {
  %all-reduce-start = bf16[4,7168]{1,0} all-reduce-start(bf16[4,7168]{1,0} %x), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":true,"kernel_strategy":"KERNEL_STRATEGY_TRITON_ONE_SHOT"}}
  %all-reduce-done = bf16[4,7168]{1,0} all-reduce-done(bf16[4,7168]{1,0} %all-reduce-start)
  %all-reduce-start.1 = bf16[4,7168]{1,0} all-reduce-start(bf16[4,7168]{1,0} %all-reduce-done), channel_id=2, to_apply=%add, backend_config={"collective_backend_config":{"kernel_strategy":"KERNEL_STRATEGY_DEFAULT"}}
  %fusion.3 = bf16[4,7168]{1,0} fusion(bf16[4,7168]{1,0} %y), kind=kCustom, calls=%fused_computation, backend_config={"collective_backend_config":{"kernel_strategy":"KERNEL_STRATEGY_TRITON_TWO_SHOT"}}
  %add.2 = bf16[4,7168]{1,0} add(bf16[4,7168]{1,0} %all-reduce-done, bf16[4,7168]{1,0} %fusion.3)
}
"""


def test_all_reduce_implementations_reads_each_strategy():
    assert bench.all_reduce_implementations(HLO) == {
        "all-reduce-start: KERNEL_STRATEGY_TRITON_ONE_SHOT": 1,
        "all-reduce-start: default": 1,
        "all-reduce: default": 1,
        "fusion: KERNEL_STRATEGY_TRITON_TWO_SHOT": 1,
    }
    assert bench.all_reduce_implementations("ENTRY %main {\n  %a = f32[2] add(f32[2] %x, f32[2] %y)\n}") == {}


def test_cpu_run_covers_every_tp_algorithm_and_xla_column(tmp_path):
    out = tmp_path / "cpu.json"
    run = subprocess.run(
        [sys.executable, str(BENCHMARK), "--cpu", "--tp", "1", "2", "4", "8", "--m", "3", "--problems",
         "deepseek-v3", "--epilogue", "--layers", str(LAYERS), "--iterations", "2", "6", "--reps", "3",
         "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"
    data = json.loads(out.read_text())
    environment = data["environment"]
    assert environment["platform"] == "cpu" and environment["plumbing_check"] and data["floors"] is None
    assert environment["layers"] == LAYERS and environment["iterations"] == [2, 6]
    columns = environment["xla_columns"]
    assert columns["xla"] == "timed" and set(columns) == {"xla", "xla_nccl"}, columns
    cases = {(r["problem"], r["tp"], r["algorithm"]) for r in data["results"]}
    expected = {(problem, tp, algorithm) for problem in ("deepseek-v3", "deepseek-v3+rmsnorm")
                for tp in (1, 2, 4, 8) for algorithm in (("direct",) if tp == 1 else ("oneshot", "twoshot"))}
    assert cases == expected and len(data["results"]) == len(expected)
    for r in data["results"]:
        what = f"{r['problem']} tp={r['tp']} {r['algorithm']}"
        timed = [column for column in ("xla", "xla_nccl") if column in r]
        assert timed == (["xla"] if r["tp"] == 1 else [c for c in columns if columns[c] == "timed"]), what
        for side in ("ours", *timed):
            assert all(math.isfinite(r[side][field]) for field in ("us", "p10", "p90")), (what, side)
        assert r["xla_best"] in timed and r["ratio"] == r["ours"]["us"] / r[r["xla_best"]]["us"], what
        assert all(r["relative_difference"][column] <= 1e-2 for column in timed), what
        # One psum per layer in XLA's loop body, none at tp = 1.
        assert sum(r["xla"]["all_reduce"].values()) == (LAYERS if r["tp"] > 1 else 0), (what, r["xla"])
    assert "| deepseek-v3+rmsnorm | 8 | twoshot | 3 |" in run.stdout
