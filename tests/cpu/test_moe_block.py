"""The model-shaped MoE block (`examples/moe_block.py`) on virtual CPU devices: both routers
against NumPy transliterations of the published gates, both GEMM paths and both routers
against the float64 NumPy model, and `benchmarks/bench_moe_block.py`: what its columns run
and a ``--cpu`` plumbing run."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_moe_block as block  # noqa: E402
import chains  # noqa: E402
import hlo_text  # noqa: E402
import moe_block as mb  # noqa: E402
import moe_block_model as bm  # noqa: E402
import timing  # noqa: E402

import jax_moe_publish as jmp  # noqa: E402
from jax_moe_publish import checks, experts, tuning  # noqa: E402

BENCHMARK = ROOT / "benchmarks" / "bench_moe_block.py"
# Small dimensions: every split over 2 and 4 ranks, 8 groups of 2 experts for DeepSeek-V3's router.
SMALL = dict(hidden=64, intermediate=64, experts=16, shared_intermediate=32, top_k=4)
MAX_RELATIVE = 1e-2


def published_deepseek_gate(logits, bias, groups, kept_groups, top_k):
    """DeepSeek-V3's published gate (``Gate.forward``: sigmoid scores, the score-correction
    bias, group-limited top-k, weights the unbiased scores normalized), transliterated to
    float64 NumPy; ``route_scale`` is left to the finalize."""
    scores = 1 / (1 + np.exp(-logits))
    original_scores = scores
    scores = scores + bias
    m = scores.shape[0]
    scores = scores.reshape(m, groups, -1)
    group_scores = -np.sort(-scores, axis=-1)[..., :2].sum(axis=-1)
    indices = np.argsort(-group_scores, axis=-1, kind="stable")[:, :kept_groups]
    mask = np.ones((m, groups), bool)
    np.put_along_axis(mask, indices, False, axis=1)
    scores = np.where(mask[:, :, None], -np.inf, scores).reshape(m, -1)
    indices = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(original_scores, indices, axis=1)
    return indices, weights / weights.sum(axis=-1, keepdims=True)


def published_qwen3_gate(logits, top_k):
    """Qwen3-MoE's published routing (softmax over the experts, top-k, ``norm_topk_prob``),
    in float64 NumPy."""
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    indices = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(p, indices, axis=1)
    return indices, weights / weights.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-moe"])
def test_routers_match_the_published_gates(name):
    config = mb.PROBLEMS[name]
    rng = np.random.default_rng()
    m = 64
    logits = rng.standard_normal((m, config.experts)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(config.experts)).astype(np.float32)
    logits64, bias64 = logits.astype(np.float64), bias.astype(np.float64)
    if config.router == "softmax":
        expected, expected_weights = published_qwen3_gate(logits64, config.top_k)
        got = mb.route_logits(config, jnp.asarray(logits))
    else:
        expected, expected_weights = published_deepseek_gate(logits64, bias64, config.groups, config.kept_groups,
                                                             config.top_k)
        got = mb.route_logits(config, jnp.asarray(logits), jnp.asarray(bias))
        # The group limit decides: a plain top-k of the biased scores picks otherwise.
        plain = np.argsort(-(1 / (1 + np.exp(-logits64)) + bias64), axis=-1, kind="stable")[:, :config.top_k]
        assert np.sum(np.any(np.sort(plain) != np.sort(expected), axis=1)) >= m // 4
    model, model_weights, _, ambiguous = bm.numpy_route(config, logits64, np.zeros_like(logits64),
                                                        bias64 if config.router != "softmax" else None)
    np.testing.assert_array_equal(model, expected)
    np.testing.assert_allclose(model_weights, expected_weights, rtol=1e-12)
    # float32 against float64: the same experts in the same order, but at a near-tie.
    experts, weights = (np.asarray(a) for a in got)
    assert ambiguous.sum() <= 2, f"{ambiguous.sum()} near-ties among {m} random tokens"
    np.testing.assert_array_equal(experts[~ambiguous], expected[~ambiguous])
    np.testing.assert_allclose(weights[~ambiguous], expected_weights[~ambiguous], rtol=1e-5)


def test_scaled_configs_keep_a_valid_grouped_router():
    for count, groups in [(256, (8, 4)), (64, (8, 4)), (16, (8, 4)), (24, (8, 4)), (12, (6, 4)),
                          (10, (5, 4)), (8, (4, 4))]:
        config = mb.scaled(mb.DEEPSEEK_V3, experts=count)
        assert (config.groups, config.kept_groups) == groups, count
        assert config.kept_groups * (config.experts // config.groups) >= config.top_k
    assert "64 experts (scaled down from 256)" in mb.scaled(mb.DEEPSEEK_V3, experts=64).describe()
    assert mb.scaled(mb.QWEN3_30B_A3B, experts=32).groups == 1
    with pytest.raises(ValueError, match="top_k=8: expected in"):
        mb.scaled(mb.QWEN3_30B_A3B, experts=4)
    with pytest.raises(ValueError, match="kept_groups=1: expected enough groups"):
        dataclasses.replace(mb.DEEPSEEK_V3, kept_groups=1, top_k=40)
    with pytest.raises(ValueError, match="does not split over tp=3"):
        mb.DEEPSEEK_V3.check_tp(3)
    # 3 layers of DeepSeek-V3 fit one H200 at tp = 1; the fitting count is a multiple of the groups.
    assert 3 * mb.DEEPSEEK_V3.weight_bytes(1) < 0.55 * 141e9
    fits = mb.max_experts(mb.DEEPSEEK_V3, 1, 8, 100 * 10**9)
    assert fits % 8 == 0 and 8 * mb.scaled(mb.DEEPSEEK_V3, experts=fits).weight_bytes(1) <= 100 * 10**9
    assert 8 * mb.scaled(mb.DEEPSEEK_V3, experts=fits + 8).weight_bytes(1) > 100 * 10**9


def _check(result, what, max_relative=MAX_RELATIVE):
    assert result["outside"] == 0 and result["relative"] <= max_relative, f"{what}: {result}"


# m = 1: the decode path gathers the active experts' weights; m = 5 (not a multiple of tp): it reads them in place.
# A shared expert of the routed experts' intermediate (DeepSeek-V3's own ratio): the prepared
# weights hold it, and the experts op computes its rows.
@pytest.mark.parametrize("name,tp,m,changes", [("deepseek-v3", 2, 5, {}), ("deepseek-v3", 4, 1, {}),
                                               ("deepseek-v3", 2, 3, dict(shared_intermediate=64)),
                                               ("qwen3-moe", 4, 5, {}), ("qwen3-moe", 2, 1, {})])
def test_block_matches_the_numpy_model(name, tp, m, changes):
    config = mb.scaled(mb.PROBLEMS[name], **{**SMALL, **changes})
    assert mb.holds_shared(config) == bool(changes)
    seed = int(np.random.default_rng().integers(2**31))
    mesh = jax.make_mesh((tp,), (mb.TP,), devices=jax.devices()[:tp])
    params_key, input_key = jax.random.split(jax.random.key(seed))
    params = mb.init_params(params_key, config, mesh, 1, prepared=True)
    layer = params[0]
    x, residual = mb.init_inputs(input_key, config, mesh, m)
    outs = {}
    with jmp.Mailbox(mesh, mb.TP, hidden=config.hidden, capacity_m=m) as mailbox:
        for path in mb.PATHS:
            what = f"{name} tp={tp} m={m} {path} seed={seed}"
            one = mb.make_decode(config, mesh, functools.partial(mb.moe_layer, config, path=path, finalize="ours",
                                                                 mailbox=mailbox), 1)
            out, residual_out = jax.block_until_ready(one(params, x, residual))
            for result in (out, residual_out):
                copies = mb.rank_copies(result)
                assert len(copies) == tp and all(np.array_equal(c, copies[0]) for c in copies), what
            parts, experts = jax.block_until_ready(mb.make_parts(config, mesh, path)(layer, x))
            model = bm.numpy_layer(config, layer, x, residual, tp, experts=experts)
            assert not model["unexplained"].any(), f"{what}: routed otherwise without a near-tie"
            keep = ~model["rerouted"]
            _check(bm.compare(out, model["out"], model["out_bound"], keep), f"{what} block out")
            _check(bm.compare(residual_out, model["residual_out"], model["residual_bound"], keep),
                   f"{what} block residual_out")
            op = bm.op_part(config, parts, residual, layer["norm"], residual_out)
            _check(bm.compare(residual_out, op["residual_out"], op["residual_bound"]), f"{what} op residual_out")
            _check(bm.compare(out, op["out"], op["out_bound"]), f"{what} op out")
            # The checks have teeth: the routed scale 25 % off leaves the block's probabilistic
            # bound, 5 % off the op part's tight one.
            for factor, check in ((1.25, "block"), (1.05, "op")):
                wrong = dataclasses.replace(config, routed_scaling_factor=factor * config.routed_scaling_factor)
                if check == "block":
                    wrong_model = bm.numpy_layer(wrong, layer, x, residual, tp)
                    missed = bm.compare(out, wrong_model["out"], model["out_bound"], keep)
                else:
                    wrong_model = bm.op_part(wrong, parts, residual, layer["norm"], residual_out)
                    missed = bm.compare(residual_out, wrong_model["residual_out"], op["residual_bound"])
                assert missed["outside"] > 0, f"{what}: the {check} check misses a scale {factor} times off"
            outs[path] = np.asarray(out, np.float64)
        xla = mb.make_decode(config, mesh, functools.partial(mb.moe_layer, config, path="ragged", finalize="xla"), 1)
        xla_out = np.asarray(jax.block_until_ready(xla(params, x, residual))[0], np.float64)
        mailbox.check()
    for path, out in outs.items():
        assert np.linalg.norm(out - xla_out) / np.linalg.norm(xla_out) <= 1e-2, f"{name} {path} against xla"


def test_block_benchmark_times_our_op_with_its_finalize_in_the_loop(monkeypatch):
    """Our column calls `moe_finalize_publish` with `OP_IMPLS`' impl (the kernels on GPUs, the
    reference path here), never "auto": at DeepSeek-V3's tp = 1 and small m "auto" runs XLA's
    jnp path (the algorithm table's xla entry), as the DeepSeek-V3 m = 1 figures of ours in
    benchmarks/results/2026-12-01-h200-tp1-moe-block.json did. The op-alone chains keep both
    sides' finalize in the timed loop: in their optimized HLO every gather of routed rows (and
    ours' psum) is in the loop body, none before it."""
    config = mb.scaled(mb.DEEPSEEK_V3, **SMALL)
    layers, m = 2, 3
    problem = tuning.Problem(hidden=config.hidden, top_k=config.top_k, include_shared_expert=config.shared)
    assert tuning.algorithm_for(problem, 1, m, "allreduce").algorithm == "xla"  # what "auto" would run here
    assert block.OP_IMPLS["gpu"] == "kernel"
    impl = block.OP_IMPLS["cpu"]
    impls = []
    publish = jmp.moe_finalize_publish

    def spy(*args, impl="auto", **kwargs):
        impls.append(impl)
        return publish(*args, impl=impl, **kwargs)

    monkeypatch.setattr(jmp, "moe_finalize_publish", spy)
    mesh = jax.make_mesh((1,), (mb.TP,), devices=jax.devices()[:1])
    params_key, input_key, chain_key = jax.random.split(jax.random.key(0), 3)
    params = mb.init_params(params_key, config, mesh, 1, prepared=True)
    x, residual = mb.init_inputs(input_key, config, mesh, m)
    with jmp.Mailbox(mesh, mb.TP, hidden=config.hidden, capacity_m=m) as mailbox:
        for variant in (*mb.PATHS, *set(block.NO_GEMM.values())):
            step = mb.make_decode(config, mesh, block.layer_fn(config, variant, "ours", mailbox, impl), 1)
            step.lower(params, x, residual)
        programs = block.op_programs(mailbox, config, layers, (timing.SHORT,), impl)
        inputs = chains.chain_inputs(mesh, m, block.op_spec(config), chain_key, layers)
        hlo = {side: programs[side][timing.SHORT].lower(*inputs).compile().as_text() for side in mb.FINALIZES}
    assert impls == [impl] * (len(mb.PATHS) + 2 + layers), impls
    expected = {"ours": {"gather": layers * config.top_k, "all-reduce": layers},
                "xla": {"gather": layers, "dot": layers}}
    for side, finalize in expected.items():
        inside, outside = hlo_text.loop_body_opcodes(hlo[side])
        assert {op: inside.get(op, 0) for op in finalize} == finalize, (side, inside)
        assert not {op: outside[op] for op in ("gather", "dot", "all-reduce") if op in outside}, (side, outside)


@pytest.mark.parametrize("shared_intermediate", [64, 32], ids=["shared expert held", "shared expert apart"])
def test_the_benchmark_builds_the_experts_kernels_its_paths_load(monkeypatch, shared_intermediate):
    """``--build-kernels`` builds, for the ``ours`` and ``prepared`` paths at each m, the set
    `moe_experts` loads for the block's weights of one rank: on prepared weights with the shared
    expert where they hold it (a DeepSeek-V3 tp = 1 run once found that set missing)."""
    config = mb.scaled(mb.DEEPSEEK_V3, **{**SMALL, "shared_intermediate": shared_intermediate})
    ms = (1, 5)
    monkeypatch.setattr(block, "ARGS", argparse.Namespace(m=list(ms), paths=["ours", "prepared"]))
    built = set(block.kernel_configs([config], 1))
    mesh = jax.make_mesh((1,), (mb.TP,), devices=jax.devices()[:1])
    params_key, input_key = jax.random.split(jax.random.key(0))
    layer = mb.local_params(config, mb.init_params(params_key, config, mesh, 1, prepared=True)[0])
    assert layer["prepared"].shared == mb.holds_shared(config) == (shared_intermediate == config.intermediate)
    for m in ms:
        x, _ = mb.init_inputs(input_key, config, mesh, m)
        expert_ids, _ = mb.route(config, layer, x)
        for weights in ((layer["gate_up"], layer["down"]), (layer["prepared"], None)):
            shape = checks.check_expert_arrays(x, expert_ids, *weights)
            assert experts._default_config(shape) in built, (m, len(weights))


@pytest.mark.parametrize("path", ["ragged", "prepared"])
def test_the_least_bytes_count_the_experts_of_the_timed_steps(monkeypatch, path):
    """`timed_active_experts` is the mean, over the layers and the steps the estimate times
    (FEW to MANY - 1, each step's input the previous one's output), of the experts each
    layer's router picks: here counted one layer at a time in Python."""
    config = mb.scaled(mb.QWEN3_30B_A3B, **{**SMALL, "shared_intermediate": None})
    few, many, layers, m = 1, 3, 2, 2
    monkeypatch.setattr(block, "ARGS", argparse.Namespace(iterations=[few, many], cpu=True))
    mesh = jax.make_mesh((1,), (mb.TP,), devices=jax.devices()[:1])
    params_key, input_key = jax.random.split(jax.random.key(1))
    params = mb.init_params(params_key, config, mesh, layers, prepared=path == "prepared")
    x, residual = mb.init_inputs(input_key, config, mesh, m)
    with jmp.Mailbox(mesh, mb.TP, hidden=config.hidden, capacity_m=m) as mailbox:
        got = block.timed_active_experts(config, mesh, mailbox, path, (params, x, residual))
        fn = block.layer_fn(config, path, "ours", mailbox, block.op_impl())
        one_layer = mb.make_decode(config, mesh, fn, 1)
        picked = []
        for _ in range(many):
            for layer in params:
                experts, _ = jax.jit(functools.partial(mb.route, config))(mb.local_params(config, layer), x)
                picked.append(np.unique(np.asarray(experts)).size)
                x, residual = one_layer([layer], x, residual)
    assert got == np.mean(picked[few * layers:])
    assert 1 <= got <= config.experts


def test_the_benchmark_names_the_block_s_paths():
    assert block.PATHS == mb.PATHS


def test_cpu_benchmark_plumbing(tmp_path):
    out, png = tmp_path / "block.json", tmp_path / "block.png"
    # The plot needs matplotlib, which the package does not require.
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    run = subprocess.run(
        [sys.executable, str(BENCHMARK), "--cpu", "--tp", "2", "--problems", "deepseek-v3", "--m", "3",
         "--layers", "2", "--iterations", "1", "3", "--reps", "2", "--op-layers", "2", "--out", str(out), *plot],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"
    assert "a plumbing check, its times mean nothing" in run.stdout
    data = json.loads(out.read_text())
    environment = data["environment"]
    assert environment["platform"] == "cpu" and environment["plumbing_check"] and environment["tp"] == 2
    assert environment["layers"] == 2 and environment["iterations"] == [1, 3] and data["copy_bytes_per_s"] is None
    assert environment["op_impl"] == block.OP_IMPLS["cpu"]
    assert data["problems"]["deepseek-v3"]["experts"] == 16
    assert [(r["problem"], r["m"], r["path"]) for r in data["results"]] == [("deepseek-v3", 3, path)
                                                                           for path in mb.PATHS]
    for r in data["results"]:
        for side in ("ours", "xla", "ours_no_gemm", "xla_no_gemm"):
            assert all(math.isfinite(r["step_us"][side][f]) for f in ("us", "p10", "p90")), (r["path"], side)
        assert all(math.isfinite(r["op"][side]["us"]) for side in ("ours", "xla")) and r["op"]["layers"] == 2
        layers = r["layers"]
        saved = r["step_us"]["xla"]["us"] - r["step_us"]["ours"]["us"]
        assert math.isclose(r["saved_us_per_layer"], saved / layers)
        assert math.isclose(r["no_gemm_share"]["ours"], r["step_us"]["ours_no_gemm"]["us"] / r["step_us"]["ours"]["us"])
        assert r["saved_over_op"] is None or math.isfinite(r["saved_over_op"])
        assert r["never_slower"] == (saved >= 0)
        weights = r["weights"]
        assert 0 < weights["least_bytes"] <= weights["read_bytes"] and 1 <= weights["active_experts"] <= 16
        assert all(value <= 1e-2 for value in r["relative_difference"].values()), r["relative_difference"]
        assert r["no_gemm"] == block.NO_GEMM[r["path"]]
        assert set(r["relative_difference"]) == {*mb.PATHS, "no_gemm_sorted", "no_gemm_pairs",
                                                 *(f"{path}_vs_ragged" for path in mb.PATHS[1:])}
    assert not plot or png.stat().st_size > 0
