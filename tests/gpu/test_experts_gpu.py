"""The experts op's kernels on one NVIDIA GPU, against the float64 model (`numerics`).

Through the harness (`gpu_harness.ExpertsLauncher`, the C++ launcher's launches with both outputs
poisoned before every call): every config of `gpu_matrix.experts_configs` (heuristic and
hand-picked launch shapes, fused and split gate/up) at m across the 16-token passes, with fresh
data per call, skipped ids, experts no pair names, hot experts that need several passes, and
every id skipped. The activations are checked against the model of the gate/up kernel, the rows
against the model of the down kernel fed the kernels' own activations (a tight bound: one bf16
rounding), and against the end-to-end model. The same inputs twice give the same bits, and a
pair's row does not depend on the other tokens (batch invariance).

Through JAX: `jmp.moe_experts` with impl="kernel" under jit, vmap and in a command buffer
equals the harness's bits, and the reference path is within the model's bound.

The gather route (impl="gather", pure JAX on the GPU) against the same model: its activations
and rows (`experts_gather.moe_experts_with_activations`) at shapes and m where it gathers the
active experts and where it reads them in place, with skipped ids, hot experts and every id
skipped; the op under jit gives its bits, and under vmap each element is within the bound.
With `BlockScaled` FP8 weights and tokens, the gather and reference routes against the model of
the same blocks.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fp8_experts
import gpu_harness
import jax_moe_publish as jmp
import numerics
from jax_moe_publish import experts_gather, experts_layout
from jax_moe_publish.aot.store import default_store
from jax_moe_publish.experts_config import ROUTING_PAIRS_PER_THREAD
from jax_moe_publish.testing import gpu_matrix

pytestmark = pytest.mark.gpus(1)

CONFIGS = [config for config in gpu_matrix.experts_configs() if not (config.fp8_weights or config.shared_expert)]
FP8_CONFIGS = [config for config in gpu_matrix.experts_configs() if config.fp8_weights and not config.shared_expert]
"""e4m3 weights' configs, whose inputs are `BlockScaled` (`test_e4m3_weights_match_the_model_of_their_blocks`)."""
SHARED_CONFIGS = [config for config in gpu_matrix.experts_configs() if config.shared_expert]
"""Configs whose weights hold the shared expert after the routed ones (`test_the_shared_expert_is_one_more_group`)."""
MS = (1, 2, 7, 16, 17, 64, 130)
"""Tokens: one pass and several (16 tokens per pass with two token tiles), one past a pass."""
ROUTING_SPANS = 3
"""Spans of the routing tables' id loads (`ROUTING_PAIRS_PER_THREAD` ids per thread) that
`test_routing_over_several_spans`, the e4m3 test and the shared expert's test cover (a call of
no more routed ids than threads takes one id per thread instead)."""


def _several_spans_m(config) -> int:
    """Tokens whose routed ids fill `ROUTING_SPANS` spans of both kernels' routing (at most the
    config's ``max_m``; the shared expert's pairs take no span)."""
    threads = max(config.gemm(role).threads for role in ("gate_up", "down"))
    return min(config.max_m, -(-ROUTING_SPANS * threads * ROUTING_PAIRS_PER_THREAD // config.top_k))


def _id(config) -> str:
    """The config's key, shortened, whether its weights are in the tiled order and whether its loads
    are bulk copies (words that `tools/gpu_tier.sh` splits its steps by)."""
    bulk = config.gate_up_bulk_loads or config.down_bulk_loads
    return (config.key.removeprefix("experts-").replace("-sm_90a", "") + ("-tiled" if config.tiled_weights else "")
            + ("-bulk" if bulk else ""))


@pytest.fixture(scope="module", params=CONFIGS, ids=_id)
def launcher(request, devices):
    config = request.param
    launcher = gpu_harness.ExpertsLauncher(default_store().get(config), devices.group(1)[0], max_m=max(MS))
    yield launcher
    launcher.close()


def _inputs(rng, config, m, **options):
    return numerics.random_experts(rng, m=m, hidden=config.hidden, intermediate=config.intermediate,
                                   experts=config.experts, top_k=config.top_k, **options)


def _check(out, activations, inputs, what):
    """Activations, rows given them, rows end to end; skipped pairs' rows exactly zero."""
    model_activations = numerics.expected_activations(inputs)
    numerics.assert_close(activations_of_valid(activations, inputs), *model_activations, what=f"{what} activations")
    exact, bound = numerics.expected_rows_from(activations, inputs)
    numerics.assert_close(out, exact, bound, what=f"{what} rows from its activations")
    exact, bound = numerics.expected_rows(inputs, model_activations)
    numerics.assert_close(out, exact, bound, what=f"{what} rows")
    numerics.assert_rows_zero(out, inputs, what=what)


def activations_of_valid(activations, inputs):
    """The kernels' activations with the rows of skipped pairs (never written: poison) zeroed,
    as the model has them; every valid pair's row must have been written."""
    flat = inputs.expert_ids.reshape(-1)
    skipped = (flat < 0) | (flat >= inputs.down.shape[0])
    bits = np.asarray(activations).view(np.uint16)
    assert not np.any(bits[~skipped] == numerics.POISON_BF16), "a valid pair's activations were not written"
    out = np.asarray(activations).copy()
    out[skipped] = 0
    return out


@pytest.mark.parametrize("m", MS)
def test_kernels_match_the_model(launcher, rng, m):
    inputs = _inputs(rng, launcher.config, m)
    out, activations = launcher.run(inputs)
    _check(out, activations, inputs, f"m={m}")


@pytest.mark.parametrize("case", ["hot experts", "every id skipped", "one expert"])
def test_routing_edges(launcher, rng, case):
    m = 64
    if case == "hot experts":
        # Every pair on 3 experts: dozens of tokens per expert, several passes each.
        inputs = _inputs(rng, launcher.config, m, hot_experts=3)
    elif case == "every id skipped":
        inputs = _inputs(rng, launcher.config, m, skipped_fraction=1.0)
    else:
        inputs = _inputs(rng, launcher.config, m, skipped_fraction=0.0)
        inputs.expert_ids[:] = launcher.config.experts - 1
    out, activations = launcher.run(inputs)
    _check(out, activations, inputs, case)


@pytest.mark.parametrize("config", [config for config in CONFIGS if config.warp_routing], ids=_id)
def test_routing_in_one_warp_up_to_its_bound(devices, rng, config):
    """`ExpertsConfig.warp_routing`: at 3 and 4 tokens (24 and 32 ids, one warp's tables) and
    at 5 (40, the CTA's), with skipped ids, hot experts (equal ids within a token) and one
    expert for every id."""
    launcher = gpu_harness.ExpertsLauncher(default_store().get(config), devices.group(1)[0], max_m=5)
    try:
        for m in (3, 4, 5):
            for case, options in (("random", {}), ("hot experts", dict(hot_experts=3)),
                                  ("skipped", dict(skipped_fraction=0.5)), ("one expert", dict(skipped_fraction=0.0))):
                inputs = _inputs(rng, config, m, **options)
                if case == "one expert":
                    inputs.expert_ids[:] = config.experts - 1
                out, activations = launcher.run(inputs)
                _check(out, activations, inputs, f"m={m} {case}")
    finally:
        launcher.close()


def test_routing_over_several_spans(launcher, devices, rng):
    """A call of more pairs than one span of the routing's id loads, with skipped ids: every
    span's pairs reach their experts (the tables are rebuilt from ids loaded again)."""
    config = launcher.config
    m = _several_spans_m(config)
    spans = gpu_harness.ExpertsLauncher(default_store().get(config), devices.group(1)[0], max_m=m)
    try:
        inputs = _inputs(rng, config, m)
        out, activations = spans.run(inputs)
        _check(out, activations, inputs, f"m={m}")
    finally:
        spans.close()


def test_the_same_bits_every_run_and_for_every_batch(launcher, rng):
    """Batch invariance: a token's rows are the same bits alone, twice, and among other tokens
    (in another pass and another slot of its experts' segments)."""
    config = launcher.config
    inputs = _inputs(rng, config, 40)
    first, _ = launcher.run(inputs)
    again, _ = launcher.run(inputs)
    assert np.array_equal(first.view(np.uint16), again.view(np.uint16)), "two runs differ"
    for token in (0, 17, 39):
        alone = numerics.ExpertsInputs(inputs.x[token:token + 1], inputs.expert_ids[token:token + 1], inputs.gate,
                                       inputs.up, inputs.down)
        rows, _ = launcher.run(alone)
        k = config.top_k
        assert np.array_equal(rows.view(np.uint16), first[token * k:(token + 1) * k].view(np.uint16)), (
            f"token {token}'s rows differ alone and among 40 tokens")


def test_the_op_through_jax_is_the_kernels(launcher, rng):
    """jit, vmap and a command buffer (XLA's default on GPUs) give the harness's bits (tiled
    configs: on `jmp.prepare_experts`'s weights)."""
    config = launcher.config
    inputs = _inputs(rng, config, 9)
    want, _ = launcher.run(inputs)
    gate_up, down = inputs.gate_up if config.fused_gate_up else (inputs.gate, inputs.up), inputs.down
    if config.tiled_weights:
        gate_up, down = jax.jit(lambda gate_up, down: jmp.prepare_experts(gate_up, down, config=config))(
            gate_up, down), None
    op = jax.jit(lambda x, ids: jmp.moe_experts(x, ids, gate_up, down, impl="kernel", config=config))
    got = np.asarray(op(inputs.x, inputs.expert_ids))
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    second = _inputs(rng, config, 9)
    batched = jax.vmap(lambda x, ids: jmp.moe_experts(x, ids, gate_up, down, impl="kernel", config=config))
    both = np.asarray(batched(np.stack([inputs.x, second.x]), np.stack([inputs.expert_ids, second.expert_ids])))
    assert np.array_equal(both[0].view(np.uint16), want.view(np.uint16))
    exact, bound = numerics.expected_rows(numerics.ExpertsInputs(second.x, second.expert_ids, inputs.gate, inputs.up,
                                                                 inputs.down))
    numerics.assert_close(both[1], exact, bound, what="vmap's second element")
    reference = np.asarray(jmp.moe_experts(inputs.x, inputs.expert_ids, gate_up, down, impl="reference"))
    exact, bound = numerics.expected_rows(inputs)
    numerics.assert_close(reference, exact, bound, what="reference path")


@pytest.mark.parametrize("config", FP8_CONFIGS, ids=_id)
def test_e4m3_weights_match_the_model_of_their_blocks(devices, rng, config):
    """e4m3 weights with 128 x 128 scale blocks (`BlockScaled`) and bf16 tokens (``fp8_tokens``
    configs: e4m3 tokens with a scale per token and 128 channels, `reference.quantize_fp8`),
    through the harness (outputs poisoned) at m across the passes and the routing's spans, hot
    experts and every id skipped, against the float64 model of the dequantized blocks; twice the same bits; through
    JAX the same bits (tiled configs: their values in the tiled order, and
    `jmp.prepare_experts` through JAX)."""
    spans_m = _several_spans_m(config)
    launcher = gpu_harness.ExpertsLauncher(default_store().get(config), devices.group(1)[0],
                                           max_m=max(*MS, spans_m))
    try:
        # m = 4 with top-8: 32 routed ids, the most that `warp_routing` builds in one warp.
        for m, options in [*((m, {}) for m in MS), (4, {}), (4, dict(hot_experts=3)), (64, dict(hot_experts=3)),
                           (16, dict(skipped_fraction=1.0)), (spans_m, {})]:
            (x, ids, gate_up, down), model = fp8_experts.random_case(
                rng, m=m, hidden=config.hidden, intermediate=config.intermediate, experts_count=config.experts,
                top_k=config.top_k, fused=config.fused_gate_up, fp8_x=config.fp8_tokens, **options)
            if config.tiled_weights:
                tiled = experts_layout.tile(gate_up, down, experts_layout.Tiling.of(config))
                weights = {"gate_up": tiled.gate_up, "down": tiled.down}
            else:
                weights = {"gate_up": gate_up} if config.fused_gate_up else dict(zip(("gate", "up"), gate_up))
                weights["down"] = down
            arrays = {"x": x.values, "x_scales": x.scales} if config.fp8_tokens else {"x": x}
            arrays["expert_ids"] = ids
            for name, w in weights.items():
                arrays.update({name: np.asarray(w.values), f"{name}_scales": np.asarray(w.scales)})
            what = f"m={m} {options or ''}"
            out, activations = launcher.run_arrays(arrays)
            _check(out, activations, model, what)
            again, _ = launcher.run_arrays(arrays)
            assert np.array_equal(again.view(np.uint16), out.view(np.uint16)), f"{what}: two runs differ"
            if m == 7:
                operands = (jmp.prepare_experts(gate_up, down, config=config), None) if config.tiled_weights else (
                    gate_up, down)
                op = jax.jit(lambda x, ids: jmp.moe_experts(x, ids, *operands, impl="kernel", config=config))
                got = np.asarray(op(x, ids))
                assert np.array_equal(got.view(np.uint16), out.view(np.uint16)), "through JAX"
    finally:
        launcher.close()


def _shared_case(rng, config, m, **routing):
    """Routed experts and a shared expert of ``config``'s shape (e4m3 for its FP8 configs): the
    op's ``(x, ids, gate_up, down, shared)``, and the model's inputs of the routed experts and
    of the shared one (a call of one expert that every token names, on the same x)."""
    def draw(experts_count, top_k, **options):
        return fp8_experts.random_case(rng, m=m, hidden=config.hidden, intermediate=config.intermediate,
                                       experts_count=experts_count, top_k=top_k, fused=config.fused_gate_up,
                                       fp8_x=config.fp8_tokens, **options)

    if config.fp8_weights:
        (x, ids, gate_up, down), model = draw(config.experts, config.top_k, **routing)
        (_, _, shared_gate_up, shared_down), shared_model = draw(1, 1, skipped_fraction=0.0)
    else:
        model = _inputs(rng, config, m, **routing)
        shared_model = numerics.random_experts(rng, m=m, hidden=config.hidden, intermediate=config.intermediate,
                                               experts=1, top_k=1, skipped_fraction=0.0)
        x, ids, gate_up, down = model.x, model.expert_ids, model.gate_up, model.down
        shared_gate_up, shared_down = shared_model.gate_up, shared_model.down
    shared_model = numerics.ExpertsInputs(model.x, np.zeros((m, 1), np.int32), shared_model.gate, shared_model.up,
                                          shared_model.down)
    shared = jax.tree.map(lambda w: w[0], (shared_gate_up, shared_down))
    return (x, ids, gate_up, down, shared), model, shared_model


@pytest.mark.parametrize("config", SHARED_CONFIGS, ids=_id)
def test_the_shared_expert_is_one_more_group(devices, rng, config):
    """The shared expert held after the routed experts (`jmp.prepare_experts`'s order), through
    the harness (outputs poisoned) at m across the passes, with hot experts and with every
    routed id skipped, and over several spans of the routing's id loads: the routed rows and
    activations against their float64 model, the
    shared rows and activations against the model of one expert that every token names. The
    same bits twice and for a token alone; through JAX (``prepare_experts(..., shared=...)``,
    ``impl="kernel"``) the same bits."""
    spans_m = _several_spans_m(config)
    launcher = gpu_harness.ExpertsLauncher(default_store().get(config), devices.group(1)[0],
                                           max_m=max(*MS, spans_m))
    try:
        for m, options in [*((m, {}) for m in MS), (64, dict(hot_experts=3)), (16, dict(skipped_fraction=1.0)),
                           (spans_m, {})]:
            (x, ids, gate_up, down, shared), model, shared_model = _shared_case(rng, config, m, **options)
            prepared = jmp.prepare_experts(gate_up, down, shared=shared, config=config)
            weights = {"gate_up": prepared.gate_up, "down": prepared.down}
            arrays = {"x": x.values, "x_scales": x.scales} if config.fp8_tokens else {"x": x}
            arrays["expert_ids"] = ids
            for name, w in weights.items():
                if config.fp8_weights:
                    arrays.update({name: np.asarray(w.values), f"{name}_scales": np.asarray(w.scales)})
                else:
                    arrays[name] = np.asarray(w)
            what = f"m={m} {options or ''}"
            out, activations, shared_rows, shared_activations = launcher.run_arrays(arrays)
            _check(out, activations, model, what)
            _check(shared_rows, shared_activations, shared_model, f"{what} shared expert")
            again = launcher.run_arrays(arrays)
            for got, want in zip(again, (out, activations, shared_rows, shared_activations)):
                assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"{what}: two runs differ"
            if m == 17:
                token = 11
                alone = {**arrays, "expert_ids": ids[token:token + 1]}
                alone.update({name: arrays[name][token:token + 1] for name in ("x", "x_scales") if name in arrays})
                rows, _, shared_row, _ = launcher.run_arrays(alone)
                k = config.top_k
                assert np.array_equal(rows.view(np.uint16), out[token * k:(token + 1) * k].view(np.uint16)), (
                    f"token {token}'s rows differ alone and among {m} tokens")
                assert np.array_equal(shared_row.view(np.uint16), shared_rows[token:token + 1].view(np.uint16)), (
                    f"token {token}'s shared row differs alone and among {m} tokens")
            if m == 7:
                op = jax.jit(lambda x, ids: jmp.moe_experts(x, ids, prepared, impl="kernel", config=config))
                got_rows, got_shared = op(x, ids)
                assert np.array_equal(np.asarray(got_rows).view(np.uint16), out.view(np.uint16)), "rows through JAX"
                assert np.array_equal(np.asarray(got_shared).view(np.uint16), shared_rows.view(np.uint16)), (
                    "shared rows through JAX")
    finally:
        launcher.close()


def test_a_chain_of_layers_in_one_program(rng):
    """Eight layers with their own weights in one jitted loop (a decode step's shape): each
    layer's rows feed the next layer's x, every layer against the model."""
    config = CONFIGS[0]
    layers = [_inputs(rng, config, 5) for _ in range(8)]

    def step(x, ids, weights):
        for gate_up, down in weights:
            rows = jmp.moe_experts(x, ids, gate_up, down, impl="kernel", config=config)
            x = rows.reshape(x.shape[0], config.top_k, -1)[:, 0]
        return x

    x0 = layers[0].x
    weights = [(layer.gate_up, layer.down) for layer in layers]
    got = np.asarray(jax.jit(step)(x0, layers[0].expert_ids, weights))
    x = x0
    for layer in layers:
        rows = np.asarray(jmp.moe_experts(x, layers[0].expert_ids, layer.gate_up, layer.down, impl="kernel",
                                          config=config))
        x = rows.reshape(x.shape[0], config.top_k, -1)[:, 0]
    assert np.array_equal(got.view(np.uint16), x.view(np.uint16))


def test_a_call_past_the_kernels_pairs_matches_the_model(rng):
    """More tokens than one kernel call holds (``max_m``): consecutive calls, every row against
    the model, the last tokens' rows the bits of a call of those tokens alone."""
    config = CONFIGS[0]
    m = config.max_m + 5
    inputs = _inputs(rng, config, m)
    op = jax.jit(lambda x, ids: jmp.moe_experts(x, ids, inputs.gate_up, inputs.down, impl="kernel", config=config))
    got = np.asarray(op(inputs.x, inputs.expert_ids))
    exact, bound = numerics.expected_rows(inputs)
    numerics.assert_close(got, exact, bound, what=f"m={m} in two kernel calls")
    numerics.assert_rows_zero(got, inputs, what=f"m={m}")
    alone = np.asarray(op(inputs.x[-5:], inputs.expert_ids[-5:]))
    assert np.array_equal(got[-5 * config.top_k:].view(np.uint16), alone.view(np.uint16))


GATHER_SHAPES = (*gpu_matrix.EXPERTS_SHAPES, (2048, 96, 128, 8, True))
"""The kernels' test shapes, and Qwen3-30B's tp = 8 shard with all 128 experts (where the
measured table sends impl="auto" to the gather route at m = 64)."""


@pytest.mark.parametrize("case", ["random", "hot experts", "every id skipped"])
@pytest.mark.parametrize("m", (1, 7, 64))
@pytest.mark.parametrize("shape", GATHER_SHAPES, ids=lambda shape: "-".join(map(str, shape)))
def test_the_gather_route_matches_the_model(rng, shape, m, case):
    hidden, intermediate, count, top_k, fused = shape
    options = {"hot experts": dict(hot_experts=3), "every id skipped": dict(skipped_fraction=1.0)}.get(case, {})
    inputs = numerics.random_experts(rng, m=m, hidden=hidden, intermediate=intermediate, experts=count, top_k=top_k,
                                     **options)
    gate_up = inputs.gate_up if fused else (inputs.gate, inputs.up)
    out, activations = jax.jit(experts_gather.moe_experts_with_activations)(inputs.x, inputs.expert_ids, gate_up,
                                                                            inputs.down)
    _check(np.asarray(out), np.asarray(activations), inputs,
           f"{case}, {'gathered' if experts_gather.gather_slots(m, top_k, count)[1] else 'in place'}")
    op = jax.jit(lambda x, ids: jmp.moe_experts(x, ids, gate_up, inputs.down, impl="gather"))
    assert np.array_equal(np.asarray(op(inputs.x, inputs.expert_ids)).view(np.uint16),
                          np.asarray(out).view(np.uint16))


def test_the_gather_route_under_vmap(rng):
    hidden, intermediate, count, top_k, fused = GATHER_SHAPES[-1]
    batch = [numerics.random_experts(rng, m=5, hidden=hidden, intermediate=intermediate, experts=count, top_k=top_k)
             for _ in range(3)]
    w = batch[0]
    gate_up = w.gate_up if fused else (w.gate, w.up)
    op = jax.jit(jax.vmap(lambda x, ids: jmp.moe_experts(x, ids, gate_up, w.down, impl="gather")))
    got = np.asarray(op(np.stack([b.x for b in batch]), np.stack([b.expert_ids for b in batch])))
    for b, element in enumerate(batch):
        exact, bound = numerics.expected_rows(numerics.ExpertsInputs(element.x, element.expert_ids, w.gate, w.up,
                                                                     w.down))
        numerics.assert_close(got[b], exact, bound, what=f"vmap's element {b}")


@pytest.mark.parametrize("route", ["gather", "reference"])
@pytest.mark.parametrize("m", (1, 64))
def test_fp8_operands_on_the_pure_routes_match_the_model(rng, route, m):
    """DeepSeek-V3's tp = 8 shard with 32 experts, its weights in 128 x 128 FP8 blocks and the
    tokens in 1 x 128 ones (the epilogue's FP8 out): XLA's float32 GEMMs on the GPU against
    the float64 model of the same blocks."""
    (x, ids, gate_up, down), model = fp8_experts.random_case(rng, m=m, hidden=7168, intermediate=256,
                                                             experts_count=32, top_k=8, fused=True, fp8_x=True)
    out = np.asarray(jax.jit(lambda *args: jmp.moe_experts(*args, impl=route))(x, ids, gate_up, down))
    exact, bound = numerics.expected_rows(model)
    numerics.assert_close(out, exact, bound, what=f"{route} m={m}")
    numerics.assert_rows_zero(out, model, what=f"{route} m={m}")
