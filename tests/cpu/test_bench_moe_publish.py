"""`benchmarks/bench_moe_publish.py` on CPU: the all-reduce reader of the optimized HLO
(`hlo_text`), the XLA chain's finalize inside its timed loop (`chains`, read from the optimized
HLO), and a ``--cpu`` plumbing run of every case at tp = 1, 2, 4 and 8 (times meaningless);
for FP8 problems also the quantizer inside the loop, the kernel sets the op launches against
those the benchmark builds, and a ``--cpu`` run with the ``ours_jnp_quantizer`` column."""

from __future__ import annotations

import json
import math
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import jax_moe_publish as jmp

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_moe_publish as bench  # noqa: E402
import chains  # noqa: E402
import hlo_text  # noqa: E402
import report  # noqa: E402
import stand_in_kernels  # noqa: E402
import timing  # noqa: E402

BENCHMARK = BENCHMARKS / "bench_moe_publish.py"
LAYERS = 2
FP8_PROBLEMS = ["deepseek-v3+rmsnorm+fp8", "qwen3-moe+rmsnorm+fp8static"]

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
    assert hlo_text.all_reduce_implementations(HLO) == {
        "all-reduce-start: KERNEL_STRATEGY_TRITON_ONE_SHOT": 1,
        "all-reduce-start: default": 1,
        "all-reduce: default": 1,
        "fusion: KERNEL_STRATEGY_TRITON_TWO_SHOT": 1,
    }
    assert hlo_text.all_reduce_implementations("ENTRY %main {\n  %a = f32[2] add(f32[2] %x, f32[2] %y)\n}") == {}


@pytest.mark.parametrize("problem", ["deepseek-v3", "qwen3-moe", "deepseek-v3+rmsnorm"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("side", ["xla", "ours"])
def test_chain_runs_its_finalize_in_the_timed_loop(side, problem, tp):
    """Each layer's finalize is in the loop body and none of it is hoisted before the loop: XLA's
    gather of routed rows, weighted sum (a dot) and at tp > 1 psum, once per layer; ours on the
    reference path (the jnp finalize of --cpu runs, tied like XLA's), one gather per routed row
    of a token and a psum, per layer. Untied, XLA hoists both sides' gathers out of the loop
    (tests/conftest.py gives 4 virtual CPU devices)."""
    layers, m = 3, 3
    spec = chains.problem_spec(problem)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))
    with jmp.Mailbox(mesh, "tp", hidden=spec["hidden"], capacity_m=m) as mailbox:
        inputs = chains.chain_inputs(mesh, m, spec, jax.random.key(0), layers)
        program = chains.make_chain(side, mailbox, spec, None, timing.SHORT, layers=layers, op_impl="reference")
        hlo = program.lower(*inputs).compile().as_text()
    assert_finalize_in_loop(side, spec, tp, layers, hlo)


def assert_finalize_in_loop(side, spec, tp, layers, hlo):
    """`test_chain_runs_its_finalize_in_the_timed_loop`'s counts in ``hlo``, a chain of ``side``."""
    inside, outside = hlo_text.loop_body_opcodes(hlo)
    if side in chains.XLA_COLUMNS:
        finalize = {"gather": layers, "dot": layers, "all-reduce": layers if tp > 1 else 0}
    else:
        finalize = {"gather": layers * spec["top_k"], "all-reduce": layers}
    assert {op: inside.get(op, 0) for op in finalize} == finalize, inside
    assert not {op: outside[op] for op in ("gather", "dot", "all-reduce") if op in outside}, outside


def fp8_conversions(hlo):
    """Conversions to float8_e4m3fn in ``hlo``: ``(in the loop body, outside it)``, as
    `hlo_text.loop_body_opcodes` counts them once renamed to an opcode of their own."""
    inside, outside = hlo_text.loop_body_opcodes(re.sub(r"(= f8e4m3fn\[[^\]]*\]\S* )convert\(", r"\1to-fp8(", hlo))
    return inside.get("to-fp8", 0), outside.get("to-fp8", 0)


@pytest.mark.parametrize("problem", FP8_PROBLEMS)
@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_chains_quantize_every_layer_in_the_timed_loop(problem, tp, rng):
    """Every column of an FP8 problem (ours and, at tp > 1, ours_jnp_quantizer on the reference
    path; XLA's) keeps its finalize in the loop and converts to e4m3 once per layer there, none
    before it: its quantized out feeds the next layer, so XLA can neither drop nor hoist the
    quantizer. Their outputs are finite; ours and ours_jnp_quantizer run the same bf16 out through
    the same quantizer, so they agree bit for bit, and XLA's within the benchmark's 1e-2."""
    layers, m = 3, 3
    spec = chains.problem_spec(problem)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))
    sides = ["ours", *chains.quantizer_columns(spec, tp), "xla"]
    assert (chains.OURS_JNP_QUANTIZER in sides) == (tp > 1)
    outputs = {}
    with jmp.Mailbox(mesh, "tp", hidden=spec["hidden"], capacity_m=m) as mailbox:
        inputs = chains.chain_inputs(mesh, m, spec, jax.random.key(rng.integers(2**31)), layers)
        for side in sides:
            program = chains.make_chain(side, mailbox, spec, None, timing.SHORT, layers=layers,
                                        op_impl="reference").lower(*inputs).compile()
            hlo = program.as_text()
            assert_finalize_in_loop(side, spec, tp, layers, hlo)
            assert fp8_conversions(hlo) == (layers, 0), side
            outputs[side] = np.asarray(program(*inputs).addressable_data(0)).astype(np.float64)
            assert np.all(np.isfinite(outputs[side])), side
    if tp > 1:
        assert np.array_equal(outputs["ours"], outputs[chains.OURS_JNP_QUANTIZER])
    assert np.linalg.norm(outputs["ours"] - outputs["xla"]) <= 1e-2 * np.linalg.norm(outputs["xla"])


def test_fp8_problem_names():
    """``--fp8``'s case names, and what `chains.problem_spec` reads from them."""
    args = bench.parse(["--list-configs", "--problems", "qwen3-moe", "--epilogue", "--fp8", "static", "group"])
    names = bench.case_problems(args)
    assert names == ["qwen3-moe", "qwen3-moe+rmsnorm", "qwen3-moe+rmsnorm+fp8", "qwen3-moe+rmsnorm+fp8static"]
    specs = [chains.problem_spec(name) for name in names]
    assert [(s["epilogue"], s["fp8_out"]) for s in specs] == [
        (False, "none"), (True, "none"), (True, "group"), (True, "static")]
    assert all({**s, "epilogue": False, "fp8_out": "none"} == specs[0] for s in specs)
    # FP8 is the epilogue's out only.
    with pytest.raises(ValueError, match="maybe followed by '\\+rmsnorm'"):
        chains.problem_spec("qwen3-moe+fp8")


def test_the_listed_kernel_sets_are_those_the_fp8_chains_launch(monkeypatch, rng):
    """``--list-configs``/``--build-kernels`` hold exactly the kernel sets that ours and
    ours_jnp_quantizer launch on a GPU (the op's own choice, traced with the kernels stood in
    for): at tp > 1 the FP8 sets for ours and their bf16 twins for ours_jnp_quantizer."""
    m = 3
    args = bench.parse(["--list-configs", "--problems", "deepseek-v3", "--fp8", "group", "static",
                        "--tp", "1", "2", "--m", str(m)])
    listed = bench.needed_configs(args, args.tp, with_variants=False)
    loads = stand_in_kernels.install(monkeypatch)
    for tp in args.tp:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))
        for name in bench.case_problems(args):
            spec = chains.problem_spec(name)
            with jmp.Mailbox(mesh, "tp", hidden=spec["hidden"], capacity_m=m) as mailbox:
                monkeypatch.setattr(mailbox, "on_cuda", True)
                inputs = chains.chain_inputs(mesh, m, spec, jax.random.key(rng.integers(2**31)), 1)
                for algorithm in bench.case_algorithms(args, tp):
                    config = chains.case_config(name, tp, algorithm, m)
                    for side in ("ours", *chains.quantizer_columns(spec, tp)):
                        first = len(loads)
                        jax.make_jaxpr(chains.make_chain(side, mailbox, spec, config, 1, layers=1))(*inputs)
                        # The op launches the case's config in ours, its bf16 twin in the column.
                        launched = config if side == "ours" else chains.op_config(config)
                        assert [c for c, _ in loads[first:]] == [launched], (name, tp, algorithm, side)
    assert set(listed) == {config for config, _ in loads}
    assert {config.fp8_out for config in listed if config.tp > 1} == {"none", "group", "static"}
    assert {config.fp8_out for config in listed if config.tp == 1} == {"none"}


def test_loop_body_opcodes_follows_the_loop_body_and_its_fusions():
    hlo = """
HloModule chain, entry_computation_layout={(f32[4]{0})->f32[4]{0}}
%fused_gather (p0: f32[4]) -> f32[4] {
  %g = f32[4]{0} gather(f32[4]{0} %p0, s32[1]{0} %i), offset_dims={}
  ROOT %n = f32[4]{0} negate(f32[4]{0} %g)
}
%command_buffer (p1: f32[4]) -> f32[4] {
  ROOT %f.2 = f32[4]{0} fusion(f32[4]{0} %p1), kind=kLoop, calls=%fused_gather
}
%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %x = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %t), index=1
  %f.1 = f32[4]{0} fusion(f32[4]{0} %x), kind=kLoop, calls=%fused_gather
  %c = f32[4]{0} call(f32[4]{0} %f.1), to_apply=%command_buffer
  ROOT %r = (s32[], /*index=1*/f32[4]{0}) tuple(s32[] %i, f32[4]{0} %c)
}
%cond (t.1: (s32[], f32[4])) -> pred[] {
  ROOT %lt = pred[] compare(s32[] %a, s32[] %b), direction=LT
}
ENTRY %main (x.1: f32[4]) -> f32[4] {
  %f.0 = f32[4]{0} fusion(f32[4]{0} %x.1), kind=kLoop, calls=%fused_gather
  %w = (s32[], /*index=1*/f32[4]{0}) while((s32[], f32[4]{0}) %t.0), condition=%cond, body=%body
  ROOT %o = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %w), index=1
}
"""
    inside, outside = hlo_text.loop_body_opcodes(hlo)
    # Each call of the fused computation counts, the one before the loop outside.
    assert inside == {"get-tuple-element": 1, "fusion": 2, "call": 1, "tuple": 1, "gather": 2, "negate": 2}
    assert outside == {"fusion": 1, "gather": 1, "negate": 1, "while": 1, "get-tuple-element": 1}
    # The body's fusion kernels: its own and the command buffer's, not what they fuse.
    assert hlo_text.loop_body_fusions(hlo) == 2
    assert hlo_text.loop_body_fusions(hlo.replace(" while(", " call(")) is None


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
        # The ratio is ours over the faster column per repetition: its median, inside its spread.
        assert r["xla_best"] in timed and set(r["paired_ratio"]) == set(timed), what
        ratio = r["paired_ratio"][r["xla_best"]]
        assert r["ratio"] == ratio["ratio"] and ratio["p10"] <= ratio["ratio"] <= ratio["p90"], what
        assert all(r["relative_difference"][column] <= 1e-2 for column in timed), what
        # One psum per layer in XLA's loop body, none at tp = 1.
        assert sum(r["xla"]["all_reduce"].values()) == (LAYERS if r["tp"] > 1 else 0), (what, r["xla"])
        assert all(r[column]["fusions_per_layer"] > 0 for column in timed), what
        assert all(r[side]["p10"] <= r[side]["us"] <= r[side]["p90"] for side in ("ours", *timed)), what
    assert "| deepseek-v3+rmsnorm | 8 | twoshot | 3 |" in run.stdout


def test_cpu_run_times_the_fp8_columns(tmp_path):
    """An FP8 problem's ``--cpu`` run: ours_jnp_quantizer timed beside ours at tp > 1 (not at
    tp = 1, where it is ours), in paired_ratio but not xla_best, its output equal to ours."""
    out = tmp_path / "cpu.json"
    problem = "qwen3-moe+rmsnorm+fp8"
    run = subprocess.run(
        [sys.executable, str(BENCHMARK), "--cpu", "--tp", "1", "2", "--algorithms", "twoshot", "--m", "3",
         "--problems", problem, "--layers", str(LAYERS), "--iterations", "2", "6", "--reps", "3",
         "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"
    results = {r["tp"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {1, 2} and all(r["problem"] == problem for r in results.values())
    column = chains.OURS_JNP_QUANTIZER
    assert column not in results[1] and column not in results[1]["paired_ratio"]
    r = results[2]
    assert all(math.isfinite(r[column][field]) for field in ("us", "p10", "p90")), r[column]
    assert column in r["paired_ratio"] and r["xla_best"] in chains.XLA_COLUMNS
    assert r["relative_difference"][column] == 0
    assert r[column]["fusions_per_layer"] > 0


def test_report_names_the_cases_where_xla_fused_layers():
    def case(m, per_layer):
        return {"problem": "deepseek-v3", "tp": 1, "algorithm": "direct", "m": m,
                "xla": {"us": 1.0, "fusions_per_layer": per_layer}}

    data = {"results": [case(1, 7 / 32), case(64, 2.0), case(128, None)]}
    note = report.fused_layers_note(data)
    assert "deepseek-v3 tp=1 m=1 xla (0.22)" in note and "m=64" not in note and "m=128" not in note
    assert report.fused_layers_note({"results": [case(64, 2.0)]}) == ""
