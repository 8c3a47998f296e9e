"""The experts op with `BlockScaled` FP8 operands, on CPU: the pure routes against a float64 model
of the same dequantized blocks, FP8 activations from the epilogue's quantizer, the named errors,
and the op under vmap (under shard_map: `test_experts_cpu`'s tensor-parallel test)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_experts
import numerics
from experts_stand_in import STAND_IN, stood_in  # noqa: F401 - the fixture
import jax_moe_publish as jmp
from jax_moe_publish import _abi, experts, experts_gather, reference

ROUTES = {"reference": reference.moe_experts, "gather": experts_gather.moe_experts}


def _check(out, model, what):
    exact, bound = numerics.expected_rows(model)
    numerics.assert_close(out, exact, bound, what=what)
    numerics.assert_rows_zero(out, model, what=what)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("m, block, fp8_x", [(1, (128, 128), False), (5, (128, 128), True), (12, (32, 64), False)])
def test_fp8_weights_match_the_model_of_their_blocks(rng, route, fused, m, block, fp8_x):
    args, model = fp8_experts.random_case(rng, m=m, hidden=256, intermediate=128, experts_count=6, top_k=3, fused=fused,
                            block=block, fp8_x=fp8_x)
    _check(jax.jit(ROUTES[route])(*args), model, f"{route} m={m}")


def test_the_model_catches_a_wrong_block_scale(rng):
    """The check can fail: one expert's first gate block read with twice its scale."""
    (x, ids, gate_up, down), model = fp8_experts.random_case(rng, m=8, hidden=256, intermediate=128, experts_count=2, top_k=2,
                                               fused=True)
    wrong = jmp.BlockScaled(gate_up.values, gate_up.scales.at[0, 0, 0].multiply(2))
    with pytest.raises(AssertionError, match="outside the bound"):
        _check(reference.moe_experts(x, ids, wrong, down), model, "wrong scale")


def test_the_op_takes_fp8_operands_on_every_pure_path(rng):
    """auto (the reference on CPU), jit, and vmap over FP8 tokens: one call over the batch."""
    args, model = fp8_experts.random_case(rng, m=4, hidden=256, intermediate=128, experts_count=5, top_k=2, fused=True,
                            fp8_x=True)
    _check(jax.jit(experts.moe_experts)(*args), model, "auto")
    x, ids, gate_up, down = args
    batch = jax.tree.map(lambda a: jnp.stack([a, a[::-1]]), (x, ids))
    out = jax.vmap(experts.moe_experts, in_axes=(0, 0, None, None))(*batch, gate_up, down)
    _check(out[0], model, "vmap element 0")
    reversed_model = dataclasses.replace(model, x=model.x[::-1], expert_ids=model.expert_ids[::-1])
    _check(out[1], reversed_model, "vmap element 1")


@pytest.mark.parametrize("case", ["32x64-blocks", "fp8-x-with-bf16-weights", "x-blocks-of-1x64"])
def test_the_kernels_refuse_what_they_do_not_take_by_name(rng, case):
    """impl="kernel" names why before anything runs (weight blocks other than 128 x 128, e4m3
    tokens with bf16 weights, token blocks other than 1 x 128), not a missing device."""
    block = (32, 64) if case == "32x64-blocks" else (128, 128)
    (x, ids, gate_up, down), _ = fp8_experts.random_case(rng, m=2, hidden=256, intermediate=128, experts_count=4,
                                                         top_k=2, fused=False, block=block,
                                                         fp8_x=case != "32x64-blocks")
    if case == "fp8-x-with-bf16-weights":
        gate_up, down = tuple(w.dequantize().astype(jnp.bfloat16) for w in gate_up), down.dequantize().astype(
            jnp.bfloat16)
    if case == "x-blocks-of-1x64":
        x = jmp.BlockScaled(x.values, jnp.repeat(x.scales, 2, axis=-1))
    with pytest.raises(ValueError, match=r"impl='kernel': the kernels take bf16 x and weights, or every weight a "
                                         r"BlockScaled of 128 x 128 blocks \(e4m3 weights\) with x bf16 or a "
                                         r"BlockScaled of 1 x 128 blocks"):
        experts.moe_experts(x, ids, gate_up, down, impl="kernel")


@pytest.mark.parametrize("fp8_x", [False, True], ids=["bf16-x", "fp8-x"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
def test_the_kernel_path_takes_e4m3_weights(rng, stood_in, fused, fp8_x, monkeypatch):  # noqa: F811
    """128 x 128 blocks with bf16 x, or with e4m3 x of 1 x 128 blocks: the kernels' config has
    ``fp8_weights`` (and ``fp8_tokens``), the FFI call gets the values, then the weights' scales,
    then the tokens' (`_abi.EXPERTS_OPERANDS`), and the CPU runs the reference."""
    args, model = fp8_experts.random_case(rng, m=3, hidden=256, intermediate=128, experts_count=4, top_k=2,
                                          fused=fused, fp8_x=fp8_x)
    jaxpr = str(jax.make_jaxpr(lambda *a: experts.moe_experts(*a, impl="kernel"))(*args))
    config, _ = stood_in[-1]
    assert config == jmp.ExpertsConfig.for_shape(hidden=256, intermediate=128, experts=4, top_k=2,
                                                 fused_gate_up=fused, fp8_weights=True, fp8_tokens=fp8_x, m=3)
    assert STAND_IN in jaxpr
    layout = ["gate_up"] if fused else ["gate", "up"]
    args_record = [(o["name"], o["dtype"], o["shape"]) for o in _abi.call_operands(config) if o["io"] == "arg"]
    scales = [(f"{name}_scales", "f32", [4, 2, 2 if fused else 1]) for name in layout]
    assert args_record == [("x", "e4m3" if fp8_x else "bf16", [256]), ("expert_ids", "s32", [2]),
                           *[(name, "e4m3", [4, 256, 256 if fused else 128]) for name in layout],
                           ("down", "e4m3", [4, 128, 256]), *scales, ("down_scales", "f32", [4, 1, 2]),
                           *([("x_scales", "f32", [2])] if fp8_x else [])]
    _check(jax.jit(lambda *a: experts.moe_experts(*a, impl="kernel"))(*args), model, "kernel path on CPU")
    # auto follows the table of bf16 weights: the e4m3 kernels where it names the kernels, and
    # where it names tokamax (bf16 only) with the kernels for the calls tokamax cannot take.
    for route, loads in (("kernel", 1), ("gather", 0), (("tokamax", "kernel"), 1)):
        choice = route if isinstance(route, tuple) else (route, None)
        monkeypatch.setattr(experts.experts_tuning, "auto_impl", lambda choice=choice, **shape: choice)
        before = len(stood_in)
        # A new function per route: jit's cache would otherwise keep the first route's trace.
        _check(jax.jit(lambda *a: experts.moe_experts(*a))(*args), model, f"auto on CPU, the table naming {route}")
        assert len(stood_in) == before + loads, route
        assert not loads or stood_in[-1][0] == config


@pytest.mark.parametrize("change, error, match", [
    (lambda w: jmp.BlockScaled(w.values.astype(jnp.bfloat16), w.scales), TypeError,
     r"down.values.dtype=bfloat16: expected float8_e4m3fn"),
    (lambda w: jmp.BlockScaled(w.values, w.scales.astype(jnp.bfloat16)), TypeError,
     r"down.scales.dtype=bfloat16: expected float32"),
    (lambda w: jmp.BlockScaled(w.values, w.scales[:, :, :1].repeat(3, axis=2)), ValueError,
     r"down.scales.shape=\(4, 1, 3\): expected \(4, 'R', 'C'\) with R and C dividing "
     r"down.values.shape=\(4, 128, 256\)'s last two"),
    (lambda w: jmp.BlockScaled(w.values[:, :, :128], w.scales[:, :, :1]), ValueError,
     r"down.shape=\(4, 128, 128\): expected \[experts, intermediate, hidden=256\]"),
])
def test_bad_fp8_operands_are_named(rng, change, error, match):
    (x, ids, gate_up, down), _ = fp8_experts.random_case(rng, m=2, hidden=256, intermediate=128, experts_count=4, top_k=2,
                                           fused=True)
    with pytest.raises(error, match=match):
        experts.moe_experts(x, ids, gate_up, change(down))


def test_quantize_names_a_shape_its_block_does_not_divide():
    with pytest.raises(ValueError, match=r"x.shape=\(4, 100, 128\): expected at least 2 dimensions, the last two "
                                         r"multiples of block=\(128, 128\)"):
        jmp.BlockScaled.quantize(jnp.ones((4, 100, 128)))


def test_the_derivative_in_x_through_fp8_weights_is_the_reference_s(rng):
    (x, ids, gate_up, down), _ = fp8_experts.random_case(rng, m=3, hidden=256, intermediate=128, experts_count=4, top_k=2,
                                           fused=True)

    def loss(function):
        return jax.grad(lambda x: jnp.sum(function(x, ids, gate_up, down).astype(jnp.float32)))

    got, want = loss(experts.moe_experts)(x), loss(reference.moe_experts)(x)
    assert np.any(np.asarray(want, np.float32) != 0)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("changes, match", [
    (dict(intermediate=64), r"intermediate=64: expected a multiple of 128 with fp8_weights"),
    (dict(hidden=384, gate_up_split_k=2, gate_up_warps_k=4, gate_up_unroll=1),
     r"gate_up_split_k=2: expected hidden / gate_up_split_k a multiple of 128 with fp8_weights \(each CTA's rows "
     r"whole scale blocks; hidden=384\)"),
])
def test_e4m3_configs_the_kernels_do_not_take_are_named(changes, match):
    """Scale blocks must be whole: in each weight, and in each CTA's rows of a K split. The
    tiled order, the ring and a K split of whole blocks are taken."""
    base = jmp.ExpertsConfig.for_shape(hidden=256, intermediate=128, experts=4, top_k=2)
    base.replace(fp8_weights=True, tiled_weights=True, gate_up_async_loads=True, down_async_loads=True,
                 gate_up_split_k=2, gate_up_warps_k=4)
    shape = dict(hidden=changes.pop("hidden", 256), intermediate=changes.pop("intermediate", 128))
    with pytest.raises(ValueError, match=match):
        jmp.ExpertsConfig.for_shape(**shape, experts=4, top_k=2).replace(fp8_weights=True, **changes)