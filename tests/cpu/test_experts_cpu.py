"""The experts op on CPU: its pure-JAX routes (the reference and the gather route) against the
float64 model, every argument check, jit, vmap, shard_map with the intermediate dimension
sharded, derivatives, the kernel path traced with the kernels stood in for (the CUDA branch is
traced, the CPU runs the reference), and the measured table that ``impl="auto"`` reads."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import fp8_experts
from jaxprs import equations
import numerics
from experts_stand_in import STAND_IN, stood_in  # noqa: F401 - the fixture
from jax_moe_publish import (checks, experts, experts_gather, experts_layout, experts_tokamax, experts_tuning,
                             reference)
from jax_moe_publish.block_scaled import BlockScaled
from jax_moe_publish.experts_config import BULK_IN_FLIGHT_BYTES, MAX_PAIRS, SHARED_MEMORY_BYTES, ExpertsConfig
from jax_moe_publish.testing import gpu_matrix

REPO = pathlib.Path(__file__).resolve().parents[2]

SHAPES = [
    # (m, hidden, intermediate, experts, top_k, hot_experts)
    (1, 256, 64, 16, 8, None),
    (7, 512, 96, 40, 6, None),
    (33, 128, 32, 5, 1, None),
    (16, 96, 48, 12, 3, 2),  # hidden no power of two; 16 tokens on 2 experts
    (5, 64, 16, 300, 10, None),  # more experts than pairs
    (3, 128, 32, 64, 4, None),  # the gather route gathers (12 slots of 64 experts)
]
PURE_ROUTES = {"reference": reference.moe_experts_with_activations,
               "gather": experts_gather.moe_experts_with_activations}
PURE_OPS = {"reference": reference.moe_experts, "gather": experts_gather.moe_experts}


def _arrays(inputs: numerics.ExpertsInputs, fused: bool):
    weights = inputs.gate_up if fused else (inputs.gate, inputs.up)
    return inputs.x, inputs.expert_ids, weights, inputs.down


@pytest.mark.parametrize("route", PURE_ROUTES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("m, hidden, intermediate, count, top_k, hot", SHAPES)
def test_pure_routes_match_the_float64_model(rng, route, fused, m, hidden, intermediate, count, top_k, hot):
    inputs = numerics.random_experts(rng, m=m, hidden=hidden, intermediate=intermediate, experts=count, top_k=top_k,
                                     hot_experts=hot)
    y, h = jax.jit(PURE_ROUTES[route])(*_arrays(inputs, fused))
    assert y.shape == (m * top_k, hidden) and y.dtype == jnp.bfloat16
    exact, bound = numerics.expected_activations(inputs)
    numerics.assert_close(np.asarray(h), exact, bound, what="activations")
    exact, bound = numerics.expected_rows_from(np.asarray(h), inputs)
    numerics.assert_close(np.asarray(y), exact, bound, what="rows from the activations")
    exact, bound = numerics.expected_rows(inputs)
    numerics.assert_close(np.asarray(y), exact, bound, what="rows")
    numerics.assert_rows_zero(y, inputs)


def test_the_model_catches_a_wrong_expert(rng):
    """The bound is tight enough that the rows of another expert fail it."""
    inputs = numerics.random_experts(rng, m=6, hidden=256, intermediate=64, experts=8, top_k=2, skipped_fraction=0)
    exact, bound = numerics.expected_rows(inputs)
    wrong = inputs.expert_ids.copy()
    wrong[0, 0] = (wrong[0, 0] + 1) % 8
    y = reference.moe_experts(inputs.x, wrong, inputs.gate_up, inputs.down)
    with pytest.raises(AssertionError, match="outside the bound"):
        numerics.assert_close(np.asarray(y), exact, bound)


def test_the_gather_route_reads_the_weights_in_place_where_a_gather_moves_more():
    assert experts_gather.gather_slots(1, 8, 256) == (8, True)
    assert experts_gather.gather_slots(64, 8, 128) == (128, False)
    assert experts_gather.gather_slots(2, 4, 24) == (8, False)  # 3 x 8 bytes moved >= 24 experts read


@pytest.mark.parametrize("impl", ["auto", "gather"])
@pytest.mark.parametrize("count", [6, 64], ids=["in place", "gathered"])
def test_every_id_skipped_gives_zero_rows(rng, impl, count):
    inputs = numerics.random_experts(rng, m=4, hidden=64, intermediate=32, experts=count, top_k=3,
                                     skipped_fraction=1.0)
    y = experts.moe_experts(*_arrays(inputs, True), impl=impl)
    assert np.all(np.asarray(y).astype(np.float32) == 0)


@pytest.mark.parametrize("impl, route", [("auto", "reference"), ("reference", "reference"), ("gather", "gather")])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
def test_the_op_on_cpu_runs_the_route(rng, impl, route, fused):
    """On CPU auto runs the reference; gather runs on any platform."""
    inputs = numerics.random_experts(rng, m=9, hidden=128, intermediate=32, experts=40, top_k=2)
    got = jax.jit(lambda *a: experts.moe_experts(*a, impl=impl))(*_arrays(inputs, fused))
    want = PURE_OPS[route](*_arrays(inputs, fused))
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def _bad(inputs, **changes):
    args = dict(x=inputs.x, expert_ids=inputs.expert_ids, gate_up=inputs.gate_up, down=inputs.down)
    args.update(changes)
    return args


BAD_ARGUMENTS = [
    (dict(x="x"), TypeError, "x: expected an array, got str"),
    (dict(x=np.zeros((4, 64), np.float32)), TypeError, "x.dtype=float32: expected bfloat16"),
    (dict(x=np.zeros((4, 64, 1), jnp.bfloat16)), ValueError, r"x.shape=\(4, 64, 1\): expected 2 dimensions"),
    (dict(expert_ids=np.zeros((4, 2), np.int64)), TypeError, "expert_ids.dtype=int64: expected int32"),
    (dict(expert_ids=np.zeros((3, 2), np.int32)), ValueError,
     r"expert_ids.shape=\(3, 2\): expected 4 rows, one per token of x.shape=\(4, 64\)"),
    (dict(expert_ids=np.zeros((4, 0), np.int32)), ValueError, "expected at least one expert per token"),
    (dict(down=np.zeros((6, 32, 128), jnp.bfloat16)), ValueError,
     r"down.shape=\(6, 32, 128\): expected \[experts, intermediate, hidden=64\]"),
    (dict(gate_up=np.zeros((6, 64, 32), jnp.bfloat16)), ValueError,
     r"gate_up.shape=\(6, 64, 32\): expected \(6, 64, 64\)"),
    (dict(gate_up=np.zeros((6, 64, 64), np.float32)), TypeError, "gate_up.dtype=float32: expected bfloat16"),
    (dict(gate_up=(np.zeros((6, 64, 32), jnp.bfloat16),) * 3), ValueError,
     r"gate_up: a tuple of 3 arrays, expected one array \[experts, hidden, 2 \* intermediate\] or a pair"),
    (dict(gate_up=(np.zeros((6, 64, 32), jnp.bfloat16), np.zeros((6, 64, 16), jnp.bfloat16))), ValueError,
     r"gate_up\[1\] \(up\).shape=\(6, 64, 16\): expected \(6, 64, 32\)"),
]


@pytest.mark.parametrize("changes, error, match", BAD_ARGUMENTS)
@pytest.mark.parametrize("function", [experts.moe_experts, reference.moe_experts], ids=["op", "reference"])
def test_bad_arguments_are_named(rng, function, changes, error, match):
    inputs = numerics.random_experts(rng, m=4, hidden=64, intermediate=32, experts=6, top_k=2)
    with pytest.raises(error, match=match):
        function(**_bad(inputs, **changes))


def test_bad_op_options_are_named(rng):
    inputs = numerics.random_experts(rng, m=4, hidden=64, intermediate=32, experts=6, top_k=2)
    args = _arrays(inputs, True)
    with pytest.raises(ValueError, match=r"impl='fast': expected one of \('auto', 'kernel', 'gather', 'tokamax', "
                                         r"'reference'\)"):
        experts.moe_experts(*args, impl="fast")
    with pytest.raises(ValueError, match="impl='kernel': no CUDA device in this process"):
        experts.moe_experts(*args, impl="kernel")
    # tokamax is optional: missing, the error says so and how to install it; else no GPU here.
    with pytest.raises(ValueError, match=r"impl='tokamax': (tokamax does not import \(.*\); install it with pip "
                                         r"install 'jax-moe-publish\[tokamax\]'|no CUDA device in this process)"):
        experts.moe_experts(*args, impl="tokamax")
    other = ExpertsConfig.for_shape(hidden=64, intermediate=32, experts=7, top_k=2)
    with pytest.raises(ValueError, match=r"config: experts=7 \(the arrays give 6\)"):
        experts.moe_experts(*args, config=other)
    with pytest.raises(TypeError, match="config: expected a jax_moe_publish.ExpertsConfig, got dict"):
        experts.moe_experts(*args, config={})


@pytest.mark.parametrize("changes, match", [
    (dict(gate_up_split_k=3), r"ExpertsConfig.gate_up_split_k=3: expected one of \(1, 2, 4, 8, 16\)"),
    (dict(gate_up_split_k=16, gate_up_warps_k=8, gate_up_unroll=8),
     r"ExpertsConfig.hidden=7168: expected 16-row steps \(448\) divisible by gate_up_warps_k \* gate_up_unroll "
     r"\* gate_up_split_k = 8 x 8 x 16"),
])
def test_a_k_split_the_kernels_cannot_take_is_named(changes, match):
    with pytest.raises(ValueError, match=match):
        ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=256, top_k=8).replace(**changes)


def test_a_k_split_launches_gate_up_as_clusters():
    """split_k CTAs per gate/up item form one cluster (the launchers size the grid in whole
    clusters), with shared memory for the sums they exchange; down is unchanged."""
    from jax_moe_publish.kernels.experts_program import launch_plan

    base = ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=256, top_k=8)
    split = base.replace(gate_up_split_k=16, gate_up_warps_k=1, gate_up_warps_n=8, gate_up_warp_cols=64,
                         gate_up_unroll=4)
    (gate_up, down), (base_gate_up, base_down) = launch_plan(split), launch_plan(base)
    assert (gate_up.cluster, gate_up.ctas_per_row, gate_up.rows) == (16, 16, "resident")
    assert (base_gate_up.cluster, down.cluster) == (1, 1) and down == base_down
    shape = split.gemm("gate_up")
    assert shape.k_steps_per_warp * shape.split_k * shape.warps_k * 16 == split.hidden
    assert gate_up.smem == base_gate_up.smem - base.gemm("gate_up").reduction_bytes() + shape.partial_bytes() > 0
    assert split.key != base.key


@pytest.mark.parametrize("rings", [("gate_up", "down"), ("gate_up",), ("down",)])
def test_async_loads_give_each_warp_a_ring_of_its_steps(rings):
    """Shared memory for ``unroll`` K steps per warp (each lane's four weight rows and two B
    words per token tile), in the kernels that ask for it; the other launch values stay."""
    from jax_moe_publish.kernels.experts_program import launch_plan

    base = ExpertsConfig.for_shape(hidden=2048, intermediate=96, experts=128, top_k=8)
    ring = base.replace(**{f"{role}_async_loads": True for role in rings})
    for role, (plain, with_ring) in zip(("gate_up", "down"), zip(launch_plan(base), launch_plan(ring))):
        shape = ring.gemm(role)
        assert shape.async_loads == (role in rings)
        per_step = 32 * (4 * shape.warp_cols // 16 + 2 * shape.token_tiles) * 4 if role in rings else 0
        assert with_ring.smem - plain.smem == shape.threads // 32 * shape.unroll * per_step
        assert dataclasses.replace(with_ring, smem=plain.smem) == plain
    assert ring.key != base.key


def test_shapes_the_kernels_refuse_are_named(rng, stood_in):
    inputs = numerics.random_experts(rng, m=4, hidden=48, intermediate=32, experts=6, top_k=2)
    with pytest.raises(ValueError, match=r"impl='kernel': the kernels take no call of this shape: .*hidden=48"):
        experts.moe_experts(*_arrays(inputs, True), impl="kernel")


def _kernel_calls_tokens(jaxpr) -> list[int]:
    """The tokens (x's rows) of each FFI call in ``jaxpr``, in order."""
    return [eqn.invars[0].aval.shape[0] for eqn in equations(jaxpr, "ffi_call")]


def test_a_call_past_the_kernels_pairs_is_several_kernel_calls(rng, stood_in):
    """More than `MAX_PAIRS` pairs: consecutive kernel calls of ``max_m`` tokens, the last of the
    rest, with the call's config; so too a vmapped batch past them."""
    max_m = MAX_PAIRS // 2
    many = numerics.random_experts(rng, m=2 * max_m + 3, hidden=64, intermediate=32, experts=6, top_k=2)
    jaxpr = jax.make_jaxpr(lambda *a: experts.moe_experts(*a, impl="kernel"))(*_arrays(many, True)).jaxpr
    assert _kernel_calls_tokens(jaxpr) == [max_m, max_m, 3]
    assert stood_in[-1][0] == ExpertsConfig.for_shape(hidden=64, intermediate=32, experts=6, top_k=2,
                                                      m=2 * max_m + 3)
    w = numerics.random_experts(rng, m=max_m // 2, hidden=64, intermediate=32, experts=6, top_k=2)
    xs, ids = np.stack([w.x] * 3), np.stack([w.expert_ids] * 3)
    jaxpr = jax.make_jaxpr(jax.vmap(lambda x, i: experts.moe_experts(x, i, w.gate_up, w.down, impl="kernel")))(
        xs, ids).jaxpr
    assert _kernel_calls_tokens(jaxpr) == [max_m, max_m // 2]


def test_token_chunks_keep_every_token_s_rows_in_order(rng):
    """`_in_token_chunks` over a stand-in whose rows tell each token apart, with a BlockScaled x
    and two results (the shared expert's rows beside the routed): the bits of one call."""
    inputs = numerics.random_experts(rng, m=11, hidden=256, intermediate=32, experts=6, top_k=3)
    x = BlockScaled(*reference.quantize_fp8(inputs.x))

    def stand_in(x, expert_ids, gate, up, down):
        values = x.values.astype(jnp.float32) * jnp.repeat(x.scales, 128, axis=1)
        rows = values[:, None, :64] + expert_ids[..., None].astype(jnp.float32)
        return rows.reshape(-1, 64).astype(jnp.bfloat16), (values[:, :32] * gate).astype(jnp.bfloat16)

    whole = stand_in(x, inputs.expert_ids, 3.0, None, None)
    for max_tokens in (1, 4, 10, 11):
        chunked = experts._in_token_chunks(stand_in, max_tokens)(x, inputs.expert_ids, 3.0, None, None)
        for got, want, what in zip(chunked, whole, ("rows", "shared rows")):
            assert got.shape == want.shape, f"{what} in chunks of {max_tokens}"
            assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)), (
                f"{what} in chunks of {max_tokens}")


def test_vmap_is_one_call_per_element(rng):
    batch = [numerics.random_experts(rng, m=5, hidden=64, intermediate=32, experts=6, top_k=2) for _ in range(3)]
    weights = batch[0]
    x = np.stack([b.x for b in batch])
    ids = np.stack([b.expert_ids for b in batch])
    got = jax.vmap(lambda x, ids: experts.moe_experts(x, ids, weights.gate_up, weights.down))(x, ids)
    for b in range(3):
        want = reference.moe_experts(x[b], ids[b], weights.gate_up, weights.down)
        assert np.array_equal(np.asarray(got[b]).view(np.uint16), np.asarray(want).view(np.uint16))


@pytest.mark.parametrize("count", [6, 64], ids=["in place", "gathered"])
def test_the_gather_route_under_vmap_is_one_call_over_the_batch(rng, count):
    """The batch's tokens go through one gather: the same bits as one call over all of them,
    each element within the model's bound."""
    batch = [numerics.random_experts(rng, m=3, hidden=64, intermediate=32, experts=count, top_k=2) for _ in range(4)]
    w = batch[0]
    x, ids = np.stack([b.x for b in batch]), np.stack([b.expert_ids for b in batch])
    got = jax.vmap(lambda x, ids: experts.moe_experts(x, ids, (w.gate, w.up), w.down, impl="gather"))(x, ids)
    assert got.shape == (4, 6, 64)
    whole = experts_gather.moe_experts(x.reshape(12, 64), ids.reshape(12, 2), (w.gate, w.up), w.down)
    assert np.array_equal(np.asarray(got).reshape(24, 64).view(np.uint16), np.asarray(whole).view(np.uint16))
    for b, element in enumerate(batch):
        exact, bound = numerics.expected_rows(dataclasses.replace(w, x=element.x, expert_ids=element.expert_ids))
        numerics.assert_close(np.asarray(got[b]), exact, bound, what=f"element {b}")


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_tensor_parallel_partials_sum_to_the_whole(rng, weights):
    """Four ranks each hold a quarter of the intermediate columns (split layout, sharded on the
    last axis, down on its rows; FP8 weights in 16 x 16 blocks, their scales sharded alike, a
    rank's 16 columns or rows one block wide): the sum of their partial rows is the whole
    layer's, within the bound of four bf16 partials."""
    tp, inter = 4, 64
    shape = dict(m=6, hidden=128, intermediate=inter, top_k=2)
    if weights == "fp8":
        (x, ids, (gate, up), down), inputs = fp8_experts.random_case(rng, **shape, experts_count=5, fused=False,
                                                                     block=(16, 16))
    else:
        inputs = numerics.random_experts(rng, **shape, experts=5)
        x, ids, gate, up, down = inputs.x, inputs.expert_ids, inputs.gate, inputs.up, inputs.down
    mesh = Mesh(np.array(jax.devices()[:tp]), ("tp",))

    def shard(x, ids, gate, up, down):
        partial = experts.moe_experts(x, ids, (gate, up), down)
        return jax.lax.psum(partial.astype(jnp.float32), "tp")

    sharded = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(None, None, "tp"), P(None, None, "tp"),
                                                                  P(None, "tp", None)), out_specs=P()))
    total = np.asarray(sharded(x, ids, gate, up, down))
    exact, bound = numerics.expected_rows(inputs)
    # Each rank rounds its partial to bf16 once more than the whole layer would.
    numerics.assert_close(total, exact, bound + numerics.BF16_EPS * np.abs(exact) * tp, what="sum of partials")


@pytest.mark.parametrize("impl", ["auto", "gather"])
def test_derivative_is_the_reference_s(rng, impl):
    inputs = numerics.random_experts(rng, m=3, hidden=64, intermediate=32, experts=4, top_k=2)
    cotangent = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)

    def loss(function):
        return lambda x, gate_up, down: jnp.sum(function(x, inputs.expert_ids, gate_up, down).astype(jnp.float32)
                                                * cotangent)

    op = functools.partial(experts.moe_experts, impl=impl)
    got = jax.grad(loss(op), argnums=(0, 1, 2))(inputs.x, inputs.gate_up, inputs.down)
    want = jax.grad(loss(reference.moe_experts), argnums=(0, 1, 2))(inputs.x, inputs.gate_up, inputs.down)
    for g, w in zip(got, want):
        assert np.any(np.asarray(w).astype(np.float32) != 0)
        assert np.array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))


# --- the kernel path, traced on CPU ---------------------------------------------------------

def test_the_kernel_path_traces_the_ffi_call_and_runs_the_reference_on_cpu(rng, stood_in):
    inputs = numerics.random_experts(rng, m=5, hidden=64, intermediate=32, experts=6, top_k=2)
    args = _arrays(inputs, False)
    jaxpr = str(jax.make_jaxpr(lambda *a: experts.moe_experts(*a, impl="kernel"))(*args))
    assert STAND_IN in jaxpr and "platform_index" in jaxpr
    config, ordinals = stood_in[-1]
    assert ordinals == [3] and config == ExpertsConfig.for_shape(hidden=64, intermediate=32, experts=6, top_k=2,
                                                                 fused_gate_up=False, m=5)
    # The call's operands are the config's call record: x, ids, gate, up, down; two results.
    call = re.search(rf"ffi_call\[.*?target_name={STAND_IN}", jaxpr, re.S)
    assert call is not None
    got = jax.jit(lambda *a: experts.moe_experts(*a, impl="kernel"))(*args)
    want = reference.moe_experts(*args)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_the_kernel_path_under_vmap_and_grad(rng, stood_in):
    batch = [numerics.random_experts(rng, m=4, hidden=64, intermediate=32, experts=6, top_k=3) for _ in range(2)]
    w = batch[0]
    x, ids = np.stack([b.x for b in batch]), np.stack([b.expert_ids for b in batch])
    got = jax.vmap(lambda x, ids: experts.moe_experts(x, ids, w.gate_up, w.down, impl="kernel"))(x, ids)
    assert got.shape == (2, 12, 64)
    assert np.array_equal(np.asarray(got[1]).view(np.uint16),
                          np.asarray(reference.moe_experts(x[1], ids[1], w.gate_up, w.down)).view(np.uint16))
    grad = jax.grad(lambda x: experts.moe_experts(x, ids[0], w.gate_up, w.down, impl="kernel")
                    .astype(jnp.float32).sum())(x[0])
    assert np.any(np.asarray(grad).astype(np.float32) != 0)


def test_a_vmapped_batch_is_routed_as_a_call_of_its_tokens(rng, stood_in, monkeypatch):
    """auto's route and the kernels' launch shapes of a vmapped batch are those of one call of
    the batch's tokens, not of one element's."""
    w = numerics.random_experts(rng, m=4, hidden=64, intermediate=32, experts=6, top_k=2)
    xs, ids = np.stack([w.x] * 5), np.stack([w.expert_ids] * 5)
    entry = experts_tuning.ExpertsChoice(hidden=64, intermediate=32, experts=6, top_k=2, max_m=4, impl="kernel",
                                         source="benchmarks/results/a-run.json", reason="faster in that run")
    monkeypatch.setattr(experts_tuning, "TABLE", [entry, dataclasses.replace(entry, max_m=32, impl="reference")])

    def jaxpr(impl="auto", batched=True):
        def op(x, i):
            return experts.moe_experts(x, i, w.gate_up, w.down, impl=impl)

        return str(jax.make_jaxpr(jax.vmap(op) if batched else op)(*((xs, ids) if batched else (w.x, w.expert_ids))))

    assert STAND_IN in jaxpr(batched=False) and STAND_IN not in jaxpr()  # 4 tokens; 20
    jaxpr("kernel")
    # 40 ids: past the routing in one warp, which 8 ids (one element's) would take.
    assert stood_in[-1][0] == ExpertsConfig.for_shape(hidden=64, intermediate=32, experts=6, top_k=2, m=20)
    assert not stood_in[-1][0].warp_routing
    assert ExpertsConfig.for_shape(hidden=64, intermediate=32, experts=6, top_k=2, m=4).warp_routing


def test_the_kernel_path_refuses_batched_weights(rng, stood_in):
    w = numerics.random_experts(rng, m=4, hidden=64, intermediate=32, experts=6, top_k=2)
    downs = np.stack([w.down, w.down])
    with pytest.raises(ValueError, match="down: under jax.vmap it differs between batch elements"):
        jax.vmap(lambda d: experts.moe_experts(w.x, w.expert_ids, w.gate_up, d, impl="kernel"))(downs)


def test_the_kernel_path_under_shard_map(rng, stood_in):
    inputs = numerics.random_experts(rng, m=4, hidden=64, intermediate=64, experts=3, top_k=2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    specs = (P(), P(), P(None, None, "tp"), P(None, None, "tp"), P(None, "tp", None))

    def shard(x, ids, gate, up, down):
        return experts.moe_experts(x, ids, (gate, up), down, impl="kernel")[None]

    out = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=P("tp")))(
        inputs.x, inputs.expert_ids, inputs.gate, inputs.up, inputs.down)
    assert out.shape == (2, 8, 64)
    # Each rank's kernels are specialized on its slice: half the intermediate columns.
    assert stood_in[-1][0].intermediate == 32
    for rank in range(2):
        columns = slice(32 * rank, 32 * (rank + 1))
        want = reference.moe_experts(inputs.x, inputs.expert_ids,
                                     (inputs.gate[..., columns], inputs.up[..., columns]), inputs.down[:, columns])
        assert np.array_equal(np.asarray(out[rank]).view(np.uint16), np.asarray(want).view(np.uint16))


def test_auto_takes_the_table_s_route_and_the_kernels_at_a_shape_it_lacks(rng, stood_in, monkeypatch):
    inputs = numerics.random_experts(rng, m=4, hidden=64, intermediate=32, experts=6, top_k=2)

    def jaxpr(inputs=inputs):
        return str(jax.make_jaxpr(lambda *a: experts.moe_experts(*a))(*_arrays(inputs, True)))

    # A shape the table lacks: the kernels up to 16 pairs per expert (8 of 6 experts here), then the reference.
    assert not any((e.hidden, e.intermediate) == (64, 32) for e in experts_tuning.TABLE) and STAND_IN in jaxpr()
    many = numerics.random_experts(rng, m=49, hidden=64, intermediate=32, experts=6, top_k=2)  # 98 pairs
    assert STAND_IN not in jaxpr(many)
    entry = experts_tuning.ExpertsChoice(hidden=64, intermediate=32, experts=6, top_k=2, max_m=4, impl="reference",
                                         source="benchmarks/results/a-run.json", reason="faster in that run")
    monkeypatch.setattr(experts_tuning, "TABLE", [entry])
    assert STAND_IN not in jaxpr()
    monkeypatch.setattr(experts_tuning, "TABLE", [dataclasses.replace(entry, max_m=2),
                                                  dataclasses.replace(entry, max_m=3, impl="kernel")])
    assert STAND_IN in jaxpr()  # m = 4 is past the shape's last entry: its route
    monkeypatch.setattr(experts_tuning, "TABLE", [dataclasses.replace(entry, experts=7)])
    assert STAND_IN in jaxpr()  # an entry of another shape: this one is still unlisted
    # A shape the kernels do not take (hidden not a multiple of 32) runs the reference.
    odd = numerics.random_experts(rng, m=4, hidden=48, intermediate=32, experts=6, top_k=2)
    assert STAND_IN not in jaxpr(odd)
    with pytest.raises(ValueError, match="source='a run': expected the result file of the run"):
        dataclasses.replace(entry, source="a run")


def test_auto_takes_the_gather_route_only_on_cuda(rng, monkeypatch, request):
    """A gather entry sends auto to the gather route where the computation runs on a CUDA
    device (the platform_dependent's branch); on CPU, and in a process without GPUs, auto runs
    the reference."""
    inputs = numerics.random_experts(rng, m=4, hidden=64, intermediate=32, experts=40, top_k=2)
    entry = experts_tuning.ExpertsChoice(hidden=64, intermediate=32, experts=40, top_k=2, max_m=4, impl="gather",
                                         source="benchmarks/results/a-run.json", reason="faster in that run")
    monkeypatch.setattr(experts_tuning, "TABLE", [entry])
    args = _arrays(inputs, True)

    def jaxpr(impl):
        return str(jax.make_jaxpr(lambda *a: experts.moe_experts(*a, impl=impl))(*args))

    plain_dot = re.compile(r"\bdot_general\[")  # the gather route's GEMMs; the reference's are ragged
    assert plain_dot.search(jaxpr("gather")) and not plain_dot.search(jaxpr("reference"))
    assert not plain_dot.search(jaxpr("auto")) and "platform_index" not in jaxpr("auto")
    loads = request.getfixturevalue("stood_in")  # GPUs claimed from here on
    assert plain_dot.search(jaxpr("auto")) and "platform_index" in jaxpr("auto") and not loads
    got = jax.jit(lambda *a: experts.moe_experts(*a))(*args)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(reference.moe_experts(*args)).view(np.uint16))


def test_the_table_refuses_a_shape_s_entries_out_of_order(tmp_path):
    entry = dict(hidden=64, intermediate=32, experts=6, top_k=2, impl="kernel", source="benchmarks/results/a.json",
                 reason="r")
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"entries": [dict(entry, max_m=8), dict(entry, max_m=8, impl="gather")]}))
    with pytest.raises(ValueError, match="with max_m=8 after one with max_m=8; expected a shape's entries in asc"):
        experts_tuning.load_table(table)


SHAPE = {"hidden": 64, "intermediate": 32, "experts": 6, "top_k": 2}


def _run(tmp_path, name, cases, **shape):
    """A bench_moe_experts.py result file with ``cases``: (m, {column: us or None}), of ``SHAPE``
    with ``shape``'s changes."""
    results = [{**SHAPE, **shape, "m": m,
                "columns": {column: ({"us": us} if us is not None else {"why_not": "absent"})
                            for column, us in columns.items()}} for m, columns in cases]
    path = tmp_path / name
    path.write_text(json.dumps({"results": results}))
    return path


def test_the_table_ranks_the_three_routes_in_ranges_of_m(tmp_path, monkeypatch):
    run = _run(tmp_path, "run.json", [
        (8, {"ours": 30.0, "ragged_dot": 40.0, "cudnn": 35.0, "gather": 50.0}),
        (1, {"ours": 10.0, "ragged_dot": 40.0, "tokamax": None, "gather": 12.0}),
        (2, {"ours": 12.0, "ragged_dot": 40.0, "gather": None}),
        (16, {"ours": 60.0, "ragged_dot": 50.0, "gather": 70.0}),
        (32, {"ours": 90.0, "ragged_dot": 80.0, "gather": 70.0}),
        (64, {"ours": 100.0, "ragged_dot": 200.0, "gather": 90.0}),
        (128, {"ours": 100.0, "ragged_dot": 200.0, "gather": 150.0}),
        (256, {"ours": 300.0, "ragged_dot": 200.0, "gather": 250.0}),
        (512, {"ours": 300.0}),  # no reference figure: nothing to rank against
    ])
    entries = experts_tuning.measured_entries([run])
    # The kernels' range at m = 1, 2, 8 is one entry; so is each range of the reference's.
    assert [(e.impl, e.max_m) for e in entries] == [("kernel", 8), ("reference", 16), ("gather", 64), ("kernel", 128),
                                                    ("reference", 256)]
    assert all(e.source == "benchmarks/results/run.json" for e in entries)
    assert entries[0].reason == ("fastest at measured m = 1, 2, 8; at m = 8: kernel 30.0 us, reference 35.0 us "
                                 "(cudnn), gather 50.0 us")
    assert entries[2].reason == ("fastest at measured m = 32, 64; at m = 64: gather 90.0 us, kernel 100.0 us, "
                                 "reference 200.0 us (ragged_dot)")
    # auto_impl's reading of them: a range starts past the previous entry's max_m.
    monkeypatch.setattr(experts_tuning, "TABLE", entries)
    routes = {m: experts_tuning.auto_impl(**SHAPE, m=m)[0] for m in (1, 8, 9, 16, 17, 64, 65, 128, 129, 257)}
    assert routes == {1: "kernel", 8: "kernel", 9: "reference", 16: "reference", 17: "gather", 64: "gather",
                      65: "kernel", 128: "kernel", 129: "reference", 257: "reference"}


@pytest.mark.parametrize("changes, match", [
    (dict(), None),
    (dict(block_scaled=True), "the tokamax route takes bf16 x and weights only; this call has BlockScaled operands"),
    (dict(intermediate=96), r"intermediate=96: the tokamax route takes hidden and intermediate multiples of 64"),
    (dict(hidden=1000, intermediate=40), r"hidden=1000, intermediate=40: the tokamax route takes"),
])
def test_what_the_tokamax_route_cannot_take_is_named(monkeypatch, changes, match):
    """Checked before tokamax traces anything (impl="tokamax" raises with it; auto takes the
    table's other route); tokamax itself is stood in as importable."""
    monkeypatch.setattr(experts_tokamax, "import_error", lambda: None)
    shape = checks.ExpertsShape(**{**dict(m=4, top_k=8, experts=32, hidden=7168, intermediate=256, fused=True),
                                   **changes})
    why = experts_tokamax.why_not(shape)
    assert why is None if match is None else re.match(match, why), why


@pytest.mark.parametrize("m, top_k", [(7, 4), (1, 4), (3, 8), (5, 6)])
def test_the_tokamax_route_hands_tokamax_whole_row_tiles(rng, monkeypatch, m, top_k):
    """Its pairs reach tokamax padded to a multiple of ROW_TILE by skipped pairs, and its rows
    are the reference's: tokamax stood in by jax.lax.ragged_dot, which it claims to match."""
    seen = []

    def ragged_dot(lhs, rhs, group_sizes, *, implementation, **options):
        seen.append((lhs.shape[0], int(np.sum(np.asarray(group_sizes)))))
        assert implementation == experts_tokamax.IMPLEMENTATION
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, **options)

    monkeypatch.setitem(sys.modules, "tokamax", types.SimpleNamespace(ragged_dot=ragged_dot))
    inputs = numerics.random_experts(rng, m=m, hidden=64, intermediate=32, experts=6, top_k=top_k)
    got = experts_tokamax.moe_experts(inputs.x, inputs.expert_ids, inputs.gate_up, inputs.down)
    want = reference.moe_experts(inputs.x, inputs.expert_ids, inputs.gate_up, inputs.down)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    valid = int(np.sum((inputs.expert_ids >= 0) & (inputs.expert_ids < 6)))
    assert [rows % experts_tokamax.ROW_TILE for rows, _ in seen] == [0, 0]
    # At most ROW_TILE - 1 padding tokens, whose pairs no group counts.
    assert all(rows - m * top_k < experts_tokamax.ROW_TILE * top_k and grouped == valid for rows, grouped in seen), seen


def test_the_table_takes_tokamax_only_as_the_ops_route(tmp_path, monkeypatch):
    """A run's tokamax column is a route where it timed jmp.moe_experts(impl="tokamax"), with the
    fastest other route for where tokamax does not import; the runs before that route timed
    tokamax's GEMMs in the benchmark's own grouping, which auto cannot take."""
    cases = [(64, {"ours": 100.0, "ragged_dot": 900.0, "tokamax": 120.0, "gather": 90.0}),
             (128, {"ours": 200.0, "ragged_dot": 900.0, "tokamax": 150.0, "gather": 400.0}),
             (256, {"ours": 300.0, "ragged_dot": 900.0, "tokamax": 250.0, "gather": 400.0}),
             (512, {"ours": 600.0, "ragged_dot": 900.0, "tokamax": 400.0, "gather": 500.0})]
    before = _run(tmp_path, "before.json", cases)
    assert [(e.impl, e.max_m) for e in experts_tuning.measured_entries([before])] == [("gather", 64), ("kernel", 256),
                                                                                        ("gather", 512)]
    run = json.loads(before.read_text())
    for case in run["results"]:
        case["columns"]["tokamax"]["ran"] = experts_tuning.TOKAMAX_RAN
    now = tmp_path / "now.json"
    now.write_text(json.dumps(run))
    entries = experts_tuning.measured_entries([now])
    # tokamax wins from 128; the fastest other route splits its range.
    assert [(e.impl, e.otherwise, e.max_m) for e in entries] == [("gather", None, 64), ("tokamax", "kernel", 256),
                                                                   ("tokamax", "gather", 512)]
    assert entries[1].reason == ("fastest at measured m = 128, 256; at m = 256: tokamax 250.0 us, kernel 300.0 us, "
                                 "gather 400.0 us, reference 900.0 us (ragged_dot)")
    monkeypatch.setattr(experts_tuning, "TABLE", entries)
    assert [experts_tuning.auto_impl(**SHAPE, m=m) for m in (64, 256, 512, 513)] == [
        ("gather", None), ("tokamax", "kernel"), ("tokamax", "gather"), ("tokamax", "gather")]
    with pytest.raises(ValueError, match=r"otherwise=None with impl='tokamax': expected one of \('kernel', 'gather', "
                                         r"'reference'\) with impl='tokamax', else None"):
        dataclasses.replace(entries[1], otherwise=None)
    with pytest.raises(ValueError, match=r"otherwise='gather' with impl='kernel'"):
        dataclasses.replace(entries[0], impl="kernel", otherwise="gather")


def test_the_table_counts_a_reference_out_of_memory_as_lost(tmp_path):
    """DeepSeek-V3's tp = 1 shard at m = 256: ragged_dot asked for 14 GB more than an H100 had."""
    run = _run(tmp_path, "run.json", [(1, {"ours": 10.0, "ragged_dot": 40.0}), (256, {"ours": 300.0, "gather": 400.0})])
    cases = json.loads(run.read_text())
    columns = cases["results"][1]["columns"]
    columns["ragged_dot"] = {"why_not": "JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"}
    columns["xla_triton"] = {"why_not": "JaxRuntimeError: INVALID_ARGUMENT: No such compile option"}
    run.write_text(json.dumps(cases))
    [entry] = experts_tuning.measured_entries([run])
    assert (entry.impl, entry.max_m) == ("kernel", 256)
    assert entry.reason.endswith("at m = 256: kernel 300.0 us, gather 400.0 us, reference failed (ragged_dot)")
    # A reference that could not be built there is absent, not lost: nothing to rank against.
    del cases["results"][1]["columns"]["ragged_dot"]
    run.write_text(json.dumps(cases))
    assert [(e.impl, e.max_m) for e in experts_tuning.measured_entries([run])] == [("kernel", 1)]


def test_auto_keeps_the_route_of_a_shape_s_largest_measured_m_past_it(tmp_path, monkeypatch):
    """Past a shape's last entry auto takes its route; a shape without entries, the kernels up
    to 16 pairs per expert (the measured range), the reference past that."""
    won = _run(tmp_path, "won.json", [(1, {"ours": 50.0, "ragged_dot": 40.0, "gather": 45.0}),
                                      (8, {"ours": 30.0, "ragged_dot": 40.0})])
    lost = _run(tmp_path, "lost.json", [(1, {"ours": 50.0, "ragged_dot": 40.0}), (8, {"ours": 60.0, "ragged_dot": 40.0})],
                hidden=128)
    entries = experts_tuning.measured_entries([won, lost])
    assert [(e.hidden, e.impl, e.max_m) for e in entries] == [(64, "reference", 1), (64, "kernel", 8),
                                                              (128, "reference", 8)]
    monkeypatch.setattr(experts_tuning, "TABLE", entries)
    routes = {(hidden, m): experts_tuning.auto_impl(**{**SHAPE, "hidden": hidden}, m=m)[0]
              for hidden in (64, 128, 256) for m in (1, 8, 9, 1024)}
    assert routes == {(64, 1): "reference", (64, 8): "kernel", (64, 9): "kernel", (64, 1024): "kernel",
                      **{(128, m): "reference" for m in (1, 8, 9, 1024)},
                      (256, 1): "kernel", (256, 8): "kernel", (256, 9): "kernel", (256, 1024): "reference"}
    # 16 pairs per expert: 96 pairs of 6 experts at top-2, m = 48.
    unlisted = {**SHAPE, "hidden": 256}
    assert experts_tuning.UNLISTED_KERNEL_MAX_PAIRS_PER_EXPERT == 16
    assert [experts_tuning.auto_impl(**unlisted, m=m) for m in (48, 49)] == [("kernel", None), ("reference", None)]


def test_a_later_run_s_figures_replace_an_earlier_s(tmp_path):
    first = _run(tmp_path, "first.json", [(1, {"ours": 10.0, "ragged_dot": 40.0}),
                                          (8, {"ours": 10.0, "ragged_dot": 40.0})])
    second = _run(tmp_path, "second.json", [(8, {"ours": 10.0, "ragged_dot": 40.0, "gather": 5.0})])
    other = _run(tmp_path, "other.json", [(1, {"ours": 10.0, "ragged_dot": 40.0})], hidden=128)
    entries = experts_tuning.measured_entries([first, second, other])
    assert [(e.hidden, e.impl, e.max_m, e.source) for e in entries] == [
        (64, "kernel", 1, "benchmarks/results/first.json"), (64, "gather", 8, "benchmarks/results/second.json"),
        (128, "kernel", 1, "benchmarks/results/other.json")]
    assert [(e.impl, e.max_m) for e in experts_tuning.measured_entries([second, first])] == [("kernel", 8)]


def test_the_committed_table_is_what_its_runs_give():
    table = json.loads(experts_tuning.TABLE_FILE.read_text())
    runs = [REPO / run for run in table["runs"]]
    assert runs and all(run.exists() for run in runs), table["runs"]
    assert {entry.source for entry in experts_tuning.TABLE} <= set(table["runs"])
    assert experts_tuning.measured_entries(runs) == experts_tuning.TABLE


def test_the_table_script_writes_what_the_runs_give(tmp_path):
    run = _run(tmp_path, "run.json", [(1, {"ours": 10.0, "ragged_dot": 40.0})])
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"comment": "kept", "entries": []}))
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "experts_table.py"), str(run), "--table", str(table)],
                   check=True, capture_output=True)
    written = json.loads(table.read_text())
    assert written["comment"] == "kept" and written["runs"] == [str(run)]
    assert [experts_tuning.ExpertsChoice(**entry) for entry in written["entries"]] == \
        experts_tuning.measured_entries([run])


@pytest.mark.parametrize("changes", [dict(early_down=True), dict(early_down=True, tiled_weights=True, enable_pdl=False)])
def test_an_early_down_without_its_needs_is_named(changes):
    """``early_down`` prefetches whole tiled items while gate/up runs, under PDL."""
    base = ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=32, top_k=8)
    with pytest.raises(ValueError, match=r"ExpertsConfig.early_down=True: expected False without tiled_weights and "
                                         r"enable_pdl"):
        base.replace(**changes)
    early = base.replace(tiled_weights=True, early_down=True)
    assert early.key != base.replace(tiled_weights=True).key
    assert early.shared_bytes("down") == base.shared_bytes("down")


@pytest.mark.parametrize("changes, message", [
    (dict(down_bulk_loads=True), r"ExpertsConfig.down_bulk_loads=True: expected False without tiled_weights"),
    (dict(tiled_weights=True, gate_up_bulk_loads=True, gate_up_async_loads=True),
     r"ExpertsConfig.gate_up_bulk_loads=True: expected False with gate_up_async_loads"),
    (dict(tiled_weights=True, gate_up_bulk_loads=True, gate_up_split_k=2),
     r"ExpertsConfig.gate_up_bulk_loads=True: expected False with gate_up_split_k > 1"),
    (dict(tiled_weights=True, down_bulk_loads=True, down_unroll=1),
     r"ExpertsConfig.down_unroll=1: expected at least 2 stages with down_bulk_loads"),
    (dict(tiled_weights=True, gate_up_bulk_loads=True, gate_up_unroll=24),
     r"ExpertsConfig.gate_up_warps_k=8: expected shared memory within 232448 bytes"),
])
def test_bulk_loads_without_their_needs_are_named(changes, message):
    base = ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=32, top_k=8)
    with pytest.raises(ValueError, match=message):
        base.replace(**changes)


def test_bulk_loads_add_a_copying_warp_and_their_ring():
    """A round is warps_k K steps of the item's tiled block and each token's slice of K; the ring
    holds unroll of them, each with two mbarriers; K's steps need only be whole rounds. The
    copying warp is one more warp of the routing (`kernels.expert_routing`)."""
    base = ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=32, top_k=8).replace(tiled_weights=True)
    bulk = base.replace(down_bulk_loads=True, down_warps_k=2, down_warps_n=4, down_warp_cols=64, down_unroll=3)
    down = bulk.gemm("down")
    assert (down.compute_threads, down.threads) == (256, 288)
    assert down.round_bytes == 2 * 16 * 256 * 2 and down.round_token_bytes == 2 * 16 * 2
    assert down.bulk_stage_bytes == down.round_bytes + 16 * (64 + 16)
    # The ring, and the routing's offsets of the copying warp (one int32 per expert).
    assert bulk.shared_bytes("down") - base.shared_bytes("down") == 3 * (down.bulk_stage_bytes + 16) + 32 * 4
    assert bulk.gemm("gate_up") == base.gemm("gate_up") and bulk.key != base.key
    # 16 K steps in rounds of 2, into 3 stages: 16 % (2 * 3) != 0 is allowed.
    assert down.k // 16 % (down.warps_k * down.unroll) != 0


BULK_CONFIGS = [c for c in gpu_matrix.experts_configs() if c.gate_up_bulk_loads] + [
    ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate, experts=256, top_k=8, fp8_weights=fp8,
                            fp8_tokens=fp8).with_bulk_loads()
    for hidden, intermediate, fp8 in ((7168, 2048, False), (7168, 2048, True), (2048, 96, False))]
"""The GPU test configs with bulk loads, and `with_bulk_loads` at shards of 64-column gate/up warps."""


@pytest.mark.parametrize("config", BULK_CONFIGS, ids=lambda c: c.key)
@pytest.mark.parametrize("role", ["gate_up", "down"])
def test_a_bulk_stage_is_the_round_of_the_tiled_order(config, role):
    """What the compute warps read of a stage is what the copying warp copied there: the round's
    block of the tiled weights, each byte once, and each token's K rows of the round; no two
    lanes of a B load read different words of one bank."""
    s = config.gemm(role)
    rounds = s.k // 16 // s.warps_k
    lane_rows = [(w_k, w_n, row, lane) for w_k in range(s.warps_k) for w_n in range(s.warps_n) for row in range(4)
                 for lane in range(32)]
    for r in (0, rounds - 1):
        read = [r * s.round_bytes + s.stage_weight_offset(*at) for at in lane_rows]
        assert read == [s.tiled_offset(0, r * s.warps_k + w_k, w_n, row, lane) for w_k, w_n, row, lane in lane_rows]
    spans = sorted(s.stage_weight_offset(*at) for at in lane_rows)
    assert spans == list(range(0, s.round_bytes, s.tile_lane_bytes))
    for w_k in range(s.warps_k):
        for q in range(4):
            # Token t's slice holds its K rows r * warps_k * 16 on; the lane reads rows w_k * 16 + 2q on.
            start = s.stage_token_offset(0, w_k, q) - s.round_bytes
            assert start == (w_k * 16 + 2 * q) * s.token_bytes and start + 10 * s.token_bytes <= s.round_token_bytes
        for j in range(s.token_tiles):
            for second in (0, 8 * s.token_bytes):
                words = {}
                for lane in range(32):
                    word = (s.stage_token_offset(j * 8 + lane // 4, w_k, lane % 4) + second) // 4
                    words.setdefault(word % 32, set()).add(word)
                assert all(len(same_bank) == 1 for same_bank in words.values()), words
    assert s.bulk_stage_bytes == s.stage_token_offset(s.tokens_per_pass, 0, 0)


@pytest.mark.parametrize("hidden, intermediate, experts, fp8", [(7168, 256, 256, False), (7168, 256, 256, True),
                                                                (7168, 2048, 256, False), (2048, 96, 128, False),
                                                                (4096, 1536, 128, True)])
def test_with_bulk_loads_keeps_the_tiled_order_and_fills_its_rings(hidden, intermediate, experts, fp8):
    """The same warps as the default (so the same `prepare_experts` order), each ring at least
    64 KiB of weights where shared memory allows, never past it."""
    base = ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate, experts=experts, top_k=8,
                                   fp8_weights=fp8)
    bulk = base.with_bulk_loads()
    assert experts_layout.Tiling.of(bulk) == experts_layout.Tiling.of(base)
    for role in ("gate_up", "down"):
        shape = bulk.gemm(role)
        assert shape.bulk_loads and shape.unroll >= 2
        assert bulk.shared_bytes(role) <= SHARED_MEMORY_BYTES
        one_more = bulk.shared_bytes(role) + shape.bulk_stage_bytes + 16
        assert shape.unroll * shape.round_bytes >= BULK_IN_FLIGHT_BYTES or one_more > SHARED_MEMORY_BYTES
        assert (shape.unroll - 1) * shape.round_bytes < BULK_IN_FLIGHT_BYTES


def test_e4m3_at_a_short_hidden_keeps_fewer_steps_in_flight():
    """for_shape's e4m3 configs at 16 or fewer K steps per gate/up warp (Qwen3-30B) hold at most
    4 gate/up steps and 1 down step in flight (ptxas spilled at 8 and 3); DeepSeek-V3's and
    Qwen3-235B's are those of bf16 weights."""
    short = ExpertsConfig.for_shape(hidden=2048, intermediate=768, experts=128, top_k=8, fp8_weights=True)
    assert (short.gate_up_unroll, short.down_unroll) == (4, 1)
    for hidden, intermediate in ((7168, 256), (4096, 384)):
        e4m3 = ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate, experts=128, top_k=8,
                                       fp8_weights=True)
        bf16 = ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate, experts=128, top_k=8)
        assert (e4m3.gate_up_unroll, e4m3.down_unroll) == (bf16.gate_up_unroll, bf16.down_unroll)


def test_gate_up_may_take_its_own_token_tiles():
    """`gate_up_token_tiles` changes gate/up's passes only: down's shape, the tiled order and,
    while None, the cubin's name stay; a value outside [1, 4] is refused by name."""
    config = ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=256, top_k=8, m=256)
    config = config.replace(tiled_weights=True)
    wide = config.replace(gate_up_token_tiles=4)
    assert (wide.gemm("gate_up").token_tiles, wide.gemm("down").token_tiles) == (4, config.token_tiles)
    assert wide.gemm("gate_up").tokens_per_pass == 32 and wide.gemm("down") == config.gemm("down")
    assert experts_layout.Tiling.of(wide) == experts_layout.Tiling.of(config)
    assert config.gate_up_token_tiles is None and wide.key != config.key
    assert ExpertsConfig.from_dict(wide.to_dict()) == wide
    assert config.replace(gate_up_token_tiles=np.int64(4)).key == wide.key  # as the other int fields
    for bad in (0, 5, True, 2.0):
        with pytest.raises(ValueError, match=rf"ExpertsConfig.gate_up_token_tiles={bad!r}: expected"):
            config.replace(gate_up_token_tiles=bad)


def test_three_gate_up_tiles_where_the_pairs_per_expert_are_many():
    """for_shape gives gate/up three token tiles, down keeping two, at 16 or more pairs per
    expert on average (`three_gate_up_tiles`: m >= 256 at top-8 of 128 experts), bf16 weights;
    none where m is not given. The tiled order is the same, so that prepared weights serve each
    m's config."""
    def tiles(hidden, intermediate, experts, m, **options):
        config = ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate, experts=experts, top_k=8, m=m,
                                         **options)
        return config.gemm("gate_up").token_tiles, config.gemm("down").token_tiles

    for hidden, intermediate in ((2048, 768), (2048, 96), (4096, 192)):
        assert [tiles(hidden, intermediate, 128, m) for m in (255, 256, 1024, None)] == [(2, 2), (3, 2), (3, 2), (2, 2)]
    assert tiles(7168, 256, 256, 512, fp8_weights=True) == (2, 2)
    shapes = [checks.ExpertsShape(m, 8, 128, 2048, 96, True) for m in (255, 256)]
    assert [experts._default_config(shape).gate_up_token_tiles for shape in shapes] == [None, 3]
    assert len({experts_layout.Tiling.of(experts._default_config(shape)) for shape in shapes}) == 1


def test_three_token_tiles_where_the_experts_and_their_pairs_are_many():
    """for_shape gives both kernels three token tiles at 256 or more experts and 8 or more pairs
    per expert on average (`three_token_tiles`: m >= 256 at DeepSeek-V3's top-8 of 256, each
    shard), bf16 weights, with the shared expert held too; not at 128 experts, nor where m is
    not given. The tiled order stays the one prepared weights have."""
    def tiles(intermediate, experts, m, **options):
        config = ExpertsConfig.for_shape(hidden=7168, intermediate=intermediate, experts=experts, top_k=8, m=m,
                                         **options)
        return config.gemm("gate_up").token_tiles, config.gemm("down").token_tiles

    for intermediate in (2048, 1024, 512, 256):
        assert [tiles(intermediate, 256, m) for m in (255, 256, 1024, None)] == [(2, 2), (3, 3), (3, 3), (2, 2)]
        assert tiles(intermediate, 256, 256, shared_expert=True) == (3, 3)
    assert tiles(256, 256, 256, fp8_weights=True) == (2, 2)
    assert [tiles(256, 128, m) for m in (128, 256)] == [(2, 2), (3, 2)]
    shapes = [checks.ExpertsShape(m, 8, 256, 7168, 256, True) for m in (255, 256)]
    assert [experts._default_config(shape).token_tiles for shape in shapes] == [2, 3]
    assert len({experts_layout.Tiling.of(experts._default_config(shape)) for shape in shapes}) == 1


def test_gate_up_items_may_cover_several_column_blocks():
    """`gate_up_column_blocks` widens gate/up's items over blocks of the same tiled order: a
    lane's columns of each block in turn (`GemmShape.tile_column`), half the items per expert;
    down, the order and, at 1, the cubin's name stay; what it cannot take is refused by name."""
    config = ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=256, top_k=8, m=256)
    config = config.replace(tiled_weights=True)
    wide = config.replace(gate_up_column_blocks=2, gate_up_unroll=4)
    one, two = config.gemm("gate_up"), wide.gemm("gate_up")
    assert (two.block_columns, two.item_columns, two.items_per_expert) == (16, 32, one.items_per_expert // 2)
    assert [one.tile_column(i) for i in range(one.mma_tiles)] == [0, 2]
    assert [two.tile_column(i) for i in range(two.mma_tiles)] == [0, 2, 16, 18]
    assert two.tile_item_bytes == one.tile_item_bytes and wide.gemm("down") == config.gemm("down")
    assert experts_layout.Tiling.of(wide) == experts_layout.Tiling.of(config)
    assert config.gate_up_column_blocks == 1 and wide.key != config.key
    assert config.replace(gate_up_column_blocks=np.int64(2), gate_up_unroll=4).key == wide.key
    for bad in (0, 5, True):
        with pytest.raises(ValueError, match=rf"ExpertsConfig.gate_up_column_blocks={bad!r}: expected"):
            config.replace(gate_up_column_blocks=bad)
    for field, value in (("fp8_weights", True), ("gate_up_async_loads", True), ("gate_up_bulk_loads", True),
                         ("gate_up_split_k", 2)):
        with pytest.raises(ValueError, match=rf"ExpertsConfig.{field}={value!r}: expected .*gate_up_column_blocks=2"):
            wide.replace(**{field: value})
    with pytest.raises(ValueError, match=r"ExpertsConfig.intermediate=96: expected a multiple of .* 64 columns"):
        ExpertsConfig(hidden=2048, intermediate=96, experts=128, top_k=8, gate_up_column_blocks=4)


def test_one_token_tile_for_small_experts_and_few_pairs_per_expert():
    """for_shape gives one token tile where it measured faster (`one_token_tile`): Qwen3-30B's
    tp 2, 4 and 8 shards (hidden 2048, intermediate at most 384) at m * top_k <= 4 * experts
    (m <= 64 at top-8 of 128), bf16 weights; two elsewhere (Qwen3-235B's tp 8 shard, as many
    bytes per expert as Qwen3-30B's tp 2, among them), and where m is not given. The tiled
    order is the same at every m, so that prepared weights serve each m's config."""
    def tiles(hidden, intermediate, m, **options):
        return ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate, experts=128, top_k=8, m=m,
                                       **options).token_tiles

    for intermediate in (384, 192, 96):
        assert [tiles(2048, intermediate, m) for m in (1, 16, 64, 65, 256, None)] == [1, 1, 1, 2, 2, 2]
    assert tiles(2048, 128, 1, fp8_weights=True) == 2 and tiles(2048, 128, 1) == 1
    for hidden, intermediate in ((2048, 768), (4096, 192), (4096, 384), (7168, 256)):
        assert [tiles(hidden, intermediate, m) for m in (1, 64, None)] == [2, 2, 2]
    shapes = [checks.ExpertsShape(m, 8, 128, 2048, 96, True) for m in (1, 64, 65)]
    assert [experts._default_config(shape).token_tiles for shape in shapes] == [1, 1, 2]
    assert len({experts_layout.Tiling.of(experts._default_config(shape)) for shape in shapes}) == 1
