"""`benchmarks/bench_moe_experts.py` on CPU: every layer of a column's chain stays in the timed
loop (read from the optimized HLO), and a ``--cpu`` run at tiny dimensions writes every
column (figures or ``why_not``), routing that is the router's, and a floor that follows from
it; its ``--plot`` step writes a PNG. The run's times mean nothing."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_moe_experts as bench
import experts_columns
import experts_draws
import hlo_text
import numerics

import jax_moe_publish as jmp
from experts_stand_in import stood_in  # noqa: F401 - the fixture
from jax_moe_publish import experts_gather

BENCHMARK = BENCHMARKS / "bench_moe_experts.py"
SHAPE = "deepseek-v3"  # the grouped sigmoid router, the more involved of the two
TPS = (1, 2)
M = 3
SEED = 5
MIN_PASS_MB = 0.2  # two layers at both tps: small programs, quick to compile
# On CPU the kernels, JAX's Pallas Triton lowering, cuDNN, XLA's Triton emitter and tokamax's GPU
# kernels cannot run.
OURS = tuple(column.name for column in experts_columns.COLUMNS if column.route == "ours")
TIMED_ON_CPU = ("ours", "ours_prepared", "ragged_dot", "gather", "ours_fp8", "ours_fp8_prepared", "gather_fp8",
                "ours_fp8_tokens_prepared", "ours_shared_prepared", "ours_prepared_xla_shared", "ours_bulk_prepared",
                "ours_fp8_bulk_prepared")


@pytest.mark.parametrize("name", TIMED_ON_CPU)
def test_chain_keeps_every_layer_in_the_timed_loop(name):
    """Each layer's sort (the expert order; the gather route's distinct experts, where it gathers)
    and its two GEMMs (four with the shared expert's) are in the loop body and nothing of them
    before it: the tie to the previous layer's output keeps XLA from hoisting a layer, or
    dropping a layer's shared rows."""
    args = types.SimpleNamespace(ours_impl="auto", seed=0, min_pass_mb=1e9, cpu=True, columns=[name])
    config = experts_draws.shape_config(args, SHAPE)
    layers, m, tp = 3, 2, 1
    column = next(column for column in experts_columns.COLUMNS if column.name == name)
    # The CPU's HLO also where a GPU is the default device.
    with jax.default_device(jax.devices("cpu")[0]):
        xs, ids, _ = experts_draws.case_routing(args, config, tp, m, layers)
        inputs = (experts_draws.draw_weights(args, config, tp, layers), xs, ids, jnp.zeros((), jnp.float32),
                  (jnp.zeros((m * config.top_k, config.hidden), jnp.bfloat16),
                   jnp.zeros((m, config.hidden), jnp.bfloat16)))
        compiled, _ = bench.compile_column(column, args, layers, inputs)
    inside, outside = hlo_text.loop_body_opcodes(compiled.as_text())
    sorts = layers if column.route != "gather" or experts_gather.gather_slots(m, config.top_k, config.experts)[1] else 0
    dots = (4 if column.shared else 2) * layers
    assert {op: inside.get(op, 0) for op in ("sort", "dot")} == {"sort": sorts, "dot": dots}, inside
    assert not {op: outside[op] for op in ("sort", "dot", "gather", "scatter") if op in outside}, outside


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The JSON of a --cpu run of DeepSeek-V3 at tp = 1 and 2, m = 3, one repetition."""
    out = tmp_path_factory.mktemp("experts") / "experts.json"
    # A guard against a hang, not a time limit: every column's programs compile here, at two tps,
    # which took over 15 minutes on a 2-core host shared with another test run.
    run = subprocess.run([sys.executable, str(BENCHMARK), "--cpu", "--shapes", SHAPE, "--tp", *map(str, TPS),
                          "--m", str(M), "--reps", "1", "--seed", str(SEED), "--min-pass-mb", str(MIN_PASS_MB),
                          "--out", str(out)],
                         check=False, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"
    return out, json.loads(out.read_text())


def test_the_kernels_built_are_those_ours_columns_load(stood_in):
    """``--build-kernels`` (`bench.ours_configs`) builds every config that ours' columns load
    when their chains are traced, and no other."""
    layers, m = 2, 2
    args = types.SimpleNamespace(ours_impl=bench.OURS_IMPLS["gpu"], seed=0, min_pass_mb=1e9, cpu=True,
                                 columns=list(OURS), shapes=[SHAPE], tp=list(TPS), m=[m])
    config = experts_draws.shape_config(args, SHAPE)
    with jax.default_device(jax.devices("cpu")[0]):
        for tp in TPS:
            xs, ids, _ = experts_draws.case_routing(args, config, tp, m, layers)
            weights = experts_draws.draw_weights(args, config, tp, layers)
            for column in experts_columns.COLUMNS:
                if column.name in OURS:
                    inputs = (weights, xs, ids, jnp.zeros((), jnp.float32),
                              (jnp.zeros((m * config.top_k, config.hidden), jnp.bfloat16),
                               jnp.zeros((m, config.hidden), jnp.bfloat16)))
                    bench.compile_column(column, args, layers, inputs)
    loaded = {config for config, _ in stood_in}
    assert {(c.fp8_weights, c.fp8_tokens, c.shared_expert, c.tiled_weights) for c in loaded} == {
        (False, False, False, False), (False, False, False, True), (True, False, False, False),
        (True, False, False, True), (True, True, False, True), (False, False, True, True)}
    assert {c.fp8_weights for c in loaded if c.gate_up_bulk_loads and c.down_bulk_loads} == {False, True}
    assert loaded == set(bench.ours_configs(args))


def test_cpu_run_has_every_column_with_figures_or_why_not(cpu_run):
    _, data = cpu_run
    environment = data["environment"]
    assert environment["platform"] == "cpu" and environment["plumbing_check"] and environment["ours_impl"] == "auto"
    assert set(data["columns"]) == set(experts_columns.COLUMN_NAMES)
    assert environment["min_pass_bytes"] == MIN_PASS_MB * 1e6
    assert [(r["shape"], r["tp"], r["m"]) for r in data["results"]] == [(SHAPE, tp, M) for tp in TPS]
    for r in data["results"]:
        what = f"{r['shape']} tp={r['tp']}"
        assert set(r["columns"]) == {*experts_columns.COLUMN_NAMES, "floor", "floor_fp8", "floor_shared"}, what
        for name in experts_columns.COLUMN_NAMES:
            entry = r["columns"][name]
            if name not in TIMED_ON_CPU:
                assert entry["why_not"] and "us" not in entry, (what, name, entry)
                continue
            assert "why_not" not in entry, (what, name, entry["why_not"])
            assert all(math.isfinite(entry[field]) for field in ("us", "p10", "p90")), (what, name)
            assert entry["p10"] <= entry["us"] <= entry["p90"], (what, name)
            assert entry["iterations"][0] < entry["iterations"][1], (what, name)
            column = experts_columns.COLUMNS_BY_NAME[name]
            floor = "floor_fp8" if column.fp8 else "floor_shared" if column.shared else "floor"
            assert not column.shared or entry["shared_relative_difference"] <= bench.MAX_DIFFERENCE, (what, name)
            assert entry["floor_fraction"] == pytest.approx(r["columns"][floor]["us"] / entry["us"]), (what, name)
            if name != "ours":
                ratio = entry["over_ours"]
                assert ratio["p10"] <= ratio["ratio"] <= ratio["p90"], (what, name)
                # Each column against the first of its operands' kind; the first e4m3-weight one
                # against ours, the e4m3-token one against the first e4m3-weight one.
                first_of_kind = name in ("ours_fp8", "ours_fp8_tokens_prepared")
                first = {"ours_fp8": "ours", "ours_fp8_tokens_prepared": "ours_fp8"}.get(name, (
                    "ours_fp8" if experts_columns.COLUMNS_BY_NAME[name].fp8 else "ours"))
                bound = bench.MAX_FP8_DIFFERENCE if first_of_kind else bench.MAX_DIFFERENCE
                assert entry["checked_against"] == first, (what, name)
                assert entry["relative_difference"] <= bound, (what, name)
                # A quantization computes another function.
                assert not first_of_kind or entry["relative_difference"] > 0, (what, name)
        assert r["columns"]["ours"]["ran"] == "jmp.moe_experts(impl='auto')" and r["checked_against"] == "ours"


def test_cpu_run_floor_and_active_experts_follow_the_routing(cpu_run):
    """The recorded routing is the router's (drawn again here), the same for a layer at every
    tp; the counts, bytes and floor follow from it."""
    _, data = cpu_run
    environment = data["environment"]
    bandwidth = data["floor"]["bytes_per_s"]
    assert bandwidth == data["floors"]["copy"]["bytes_per_s"] > 0
    args = types.SimpleNamespace(seed=SEED, min_pass_mb=environment["min_pass_bytes"] / 1e6, cpu=True,
                                 columns=list(data["columns"]))
    masks = {}
    for r in data["results"]:
        what = f"{r['shape']} tp={r['tp']}"
        active = r["active_experts"]
        counts = active["per_layer"]
        assert len(counts) == len(active["bitmask_per_layer"]) == r["layers"] >= environment["min_layers"], what
        assert counts == [int(mask, 16).bit_count() for mask in active["bitmask_per_layer"]], what
        # Each token's top-k experts are distinct.
        assert all(r["top_k"] <= count <= min(r["experts"], M * r["top_k"]) for count in counts), what
        config = experts_draws.shape_config(args, r["shape"])
        # On the CPU, as the run drew it: a GPU's router logits may differ in the last bit.
        with jax.default_device(jax.devices("cpu")[0]):
            _, _, drawn = experts_draws.case_routing(args, config, r["tp"], M, r["layers"])
        assert [experts_draws.active_bitmask(a, r["experts"]) for a in drawn] == active["bitmask_per_layer"], what
        for layer, mask in enumerate(active["bitmask_per_layer"]):
            assert masks.setdefault((r["shape"], layer), mask) == mask, f"{what} layer {layer}: not the same at every tp"
        assert r["intermediate"] == r["model_intermediate"] // r["tp"], what
        assert r["expert_bytes"] == 3 * r["hidden"] * r["intermediate"] * 2, what
        assert active["mean"] == pytest.approx(np.mean(counts)), what
        assert r["active_bytes_per_call"] == pytest.approx(active["mean"] * r["expert_bytes"]), what
        assert r["pass_bytes"] == sum(counts) * r["expert_bytes"], what
        assert r["pass_bytes"] >= environment["min_pass_bytes"] or r["layers_cut_by_budget"], what
        floor = r["columns"]["floor"]
        assert floor["bytes"] == r["active_bytes_per_call"], what
        assert floor["us"] == pytest.approx(r["active_bytes_per_call"] / bandwidth * 1e6), what
        # e4m3: a byte per weight, a float32 per 128 x 128 block.
        blocks = 3 * (r["hidden"] // 128) * (r["intermediate"] // 128)
        fp8_floor = r["columns"]["floor_fp8"]
        assert fp8_floor["bytes"] == pytest.approx(active["mean"] * (r["expert_bytes"] / 2 + 4 * blocks)), what
        assert fp8_floor["us"] == pytest.approx(fp8_floor["bytes"] / bandwidth * 1e6), what
        # The shared expert's bytes, once per call.
        shared_floor = r["columns"]["floor_shared"]
        shared_bytes = 3 * r["hidden"] * (config.shared_intermediate // r["tp"]) * 2
        assert shared_floor["bytes"] == pytest.approx(r["active_bytes_per_call"] + shared_bytes), what
        assert shared_floor["us"] == pytest.approx(shared_floor["bytes"] / bandwidth * 1e6), what


def test_plot_writes_a_png(cpu_run, tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("the --plot step needs matplotlib, which is not installed here")
    out, _ = cpu_run
    png = tmp_path / "experts.png"
    run = subprocess.run([sys.executable, str(BENCHMARK), "--plot", str(out), "--png", str(png)],
                         check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("timed", [False, True])
def test_the_profiling_program_runs_its_calls(timed):
    """`profile_experts.py`'s plumbing, on the reference path (the kernels need a GPU): every
    variant runs (here one of another tiled order) and its rows are checked against the default's."""
    run = subprocess.run([sys.executable, str(BENCHMARK.with_name("profile_experts.py")), "--shape", "qwen3-30b-a3b",
                          "--tp", "8", "--m", "3", "--calls", "2", "--impl", "reference",
                          "--variant", "tiled_weights=true,down_warps_n=1"] + (["--time"] * timed),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "qwen3-30b-a3b tp=8 (intermediate 96) m=3:" in run.stdout and "active experts" in run.stdout
    assert ("us per call over" in run.stdout) == timed
    assert run.stdout.count("rows vs default 0.0e+00") == 2, run.stdout


def test_the_profiling_variants_change_the_default_launch_shapes():
    import profile_experts

    for fp8 in (False, True):
        args = profile_experts.argparse.Namespace(tp=8, m=1, fp8=fp8, variant=["gate_up_warp_cols=64",
                                                                               "down_warps_k=1,enable_pdl=false"])
        default, wide, no_split = profile_experts.configs(args, experts_draws.SHAPES["deepseek-v3"])
        assert default == jmp.ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=256, top_k=8,
                                                      fp8_weights=fp8, m=1)
        assert wide == default.replace(gate_up_warp_cols=64)
        assert no_split == default.replace(down_warps_k=1, enable_pdl=False)
        assert len({default.key, wide.key, no_split.key}) == 3


def test_a_variant_column_runs_beside_ours_prepared(tmp_path):
    """``--variants``: a column of ours_prepared with launch-shape changes, timed in the same run,
    checked against ours_prepared's rows, and its kernels among those ``--build-kernels`` builds."""
    out = tmp_path / "variants.json"
    # Three paired repetitions of 5 ms: the median difference stays above a loaded host's noise,
    # which one pair of 1 ms runs did not (a CI run once timed -423 µs).
    argv = ["--cpu", "--shapes", SHAPE, "--tp", "2", "--m", str(M), "--reps", "3", "--target-ms", "5",
            "--seed", str(SEED), "--min-pass-mb", str(MIN_PASS_MB), "--columns", "ours_prepared",
            "--variants", "token_tiles=3"]
    run = subprocess.run([sys.executable, str(BENCHMARK), *argv, "--out", str(out)], check=False,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"
    name = "ours_prepared:token_tiles=3"
    assert f"{name} " in run.stdout
    entry = json.loads(out.read_text())["results"][0]["columns"][name]
    assert entry["us"] > 0 and entry["checked_against"] == "ours_prepared", entry
    args = bench.parse(argv)
    shape = experts_draws.shape_config(args, SHAPE)
    config = jmp.ExpertsConfig.for_shape(hidden=shape.hidden, intermediate=shape.intermediate // 2,
                                         experts=shape.experts, top_k=shape.top_k, m=M)
    assert config.token_tiles != 3
    assert bench.ours_configs(args) == [config.replace(tiled_weights=True),
                                        config.replace(tiled_weights=True, token_tiles=3)]


def test_a_rows_variant_is_ours_with_any_launch_shape_change():
    """``--variants rows:...``: a column of ours (the weights' rows) whose config, loaded in the
    run and built by ``--build-kernels``, is the op's default with the changes, the tiled
    order's fields among them."""
    args = bench.parse(["--shapes", "qwen3-30b-a3b", "--tp", "1", "--m", "1", "--columns", "ours",
                        "--variants", "rows:gate_up_warp_cols=64"])
    column, = args.variant_columns
    assert (column.name, column.route, column.prepared) == ("ours:gate_up_warp_cols=64", "ours", False)
    default = jmp.ExpertsConfig.for_shape(hidden=2048, intermediate=768, experts=128, top_k=8, m=1)
    assert default.gate_up_warp_cols == 32 and not default.tiled_weights
    wide = default.replace(gate_up_warp_cols=64)
    assert bench.ours_configs(args) == [default, wide]
    gate_up = jax.ShapeDtypeStruct((128, 2048, 2 * 768), jnp.bfloat16)
    assert experts_columns.rows_variant_config(gate_up, (1, 8), column) == wide
    # Its layer on CPU (auto: the reference) takes the config the op checks against the call.
    rng = np.random.default_rng(SEED)
    w = numerics.random_experts(rng, m=3, hidden=64, intermediate=32, experts=6, top_k=2)
    column, = bench.parse(["--cpu", "--variants", "rows:token_tiles=3"]).variant_columns
    layer = experts_columns.layer_function(column, bench.parse(["--cpu"]))
    got = layer({"gate_up": w.gate_up, "down": w.down}, w.x, w.expert_ids)
    want = jmp.reference.moe_experts(w.x, w.expert_ids, w.gate_up, w.down)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.parametrize("variant, expected", [
    ("gate_up_warp_cols=64", "'gate_up_warp_cols' is not a launch-shape field that keeps the weights' tiled order"),
    ("fp8_weights=true", "'fp8_weights' is not a launch-shape field"),
    ("no_such_field=1", "'no_such_field' is not a launch-shape field"),
    ("token_tiles", "expected [rows:]FIELD=VALUE"),
    ("token_tiles=7", "--variants token_tiles=7 at deepseek-v3 tp=8: ExpertsConfig.token_tiles=7"),
    ("rows:fp8_weights=true", "'fp8_weights' is not a launch-shape field; expected"),
    ("rows:token_tiles=7", "--variants rows:token_tiles=7 at deepseek-v3 tp=8: ExpertsConfig.token_tiles=7"),
])
def test_a_variant_outside_the_tiled_order_or_the_config_is_refused(variant, expected, capsys):
    with pytest.raises(SystemExit):
        bench.parse(["--variants", variant])
    assert expected in capsys.readouterr().err
