"""The FP8 output of the epilogue on CPU: `reference.quantize_fp8` against a float64 model of
the quantizer, and `moe_finalize_publish(..., out_dtype=jnp.float8_e4m3fn)` on virtual devices
against the quantizer applied to the same call's bf16 ``out``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp
import jaxprs
import numerics
import stand_in_kernels

FP8 = jnp.float8_e4m3fn


def _spread_rows(rng, rows, hidden):
    """bf16 rows whose 128-column groups span 2**-20 to 2**10 in magnitude, one group all zero."""
    x = rng.standard_normal((rows, hidden))
    magnitudes = 2.0 ** rng.integers(-20, 11, (rows, hidden // 128))
    x = (x.reshape(rows, -1, 128) * magnitudes[..., None]).reshape(rows, hidden)
    x[rows // 2, 128:256] = 0
    return x.astype(numerics.BF16)


@pytest.mark.parametrize("rows, hidden", [(5, 7168), (3, 256), (1, 128)])
def test_the_quantizer_matches_float64(rows, hidden):
    x = _spread_rows(np.random.default_rng(), rows, hidden)
    q, scales = jax.jit(jmp.reference.quantize_fp8)(jnp.asarray(x))
    assert q.shape == (rows, hidden) and scales.shape == (rows, hidden // 128)
    numerics.assert_fp8_close(q, scales, x)
    if rows > 1:
        assert np.all(np.asarray(scales)[rows // 2, 1] == 0)


def test_a_static_scale_saturates():
    rng = np.random.default_rng()
    x = (rng.standard_normal((4, 256)) * 300).astype(numerics.BF16)
    scale = jnp.float32(0.5)  # |x| / 0.5 passes 448 for about a third of the values
    q = jmp.reference.quantize_fp8(jnp.asarray(x), scale)
    numerics.assert_fp8_close(q, None, x, static_scale=0.5)
    assert np.mean(np.abs(np.asarray(q).astype(np.float64)) == 448) > 0.1


def test_non_finite_groups_are_as_documented():
    x = np.ones((1, 384), np.float32)
    x[0, 5] = np.nan
    x[0, 130] = np.inf
    x[0, 131] = np.nan  # a NaN and an inf: the NaN wins
    x[0, 260] = -np.inf
    q, scales = jmp.reference.quantize_fp8(jnp.asarray(x.astype(numerics.BF16)))
    q = np.asarray(q).astype(np.float64)[0]
    scales = np.asarray(scales)[0]
    assert np.isnan(scales[0]) and np.all(np.isnan(q[:128]))
    assert np.isnan(scales[1]) and np.all(np.isnan(q[128:256]))
    assert scales[2] == np.inf and np.isnan(q[260]) and np.all(np.delete(q[256:], 4) == 0)


def _stack(problems, field):
    return jnp.asarray(np.stack([getattr(p, field) for p in problems]))


def _epilogue_inputs(tp, result, m, hidden):
    """A mesh of ``tp`` devices, fresh per-rank [tp, ...] stacks (routed, weights, indices,
    shared), and the residual (in the result's layout) and norm weight."""
    rng = np.random.default_rng()
    problems = [numerics.random_problem(rng, m=m, hidden=hidden, top_k=4) for _ in range(tp)]
    residual, norm_weight = numerics.epilogue_inputs(rng, m, hidden)
    if result == "reduce_scatter":
        residual = np.stack([numerics.owned(residual, tp, rank) for rank in range(tp)])
    stacks = [_stack(problems, field) for field in ("routed", "weights", "indices", "shared")]
    return jax.make_mesh((tp,), ("tp",)), stacks, jnp.asarray(residual), jnp.asarray(norm_weight)


def _epilogue_calls(tp, result, m, hidden, **fp8):
    """The sharded op with the epilogue, bf16 and with ``fp8``, on the same fresh inputs."""
    mesh, stacks, residual, norm_weight = _epilogue_inputs(tp, result, m, hidden)
    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=16, result=result) as mailbox:
        def call(**options):
            return jax.jit(lambda *a: jmp.sharded_moe_finalize_publish(
                mailbox, *a, routed_scaling_factor=2.5, residual=residual, norm_weight=norm_weight,
                **options))(*stacks)
        return call(), call(**fp8)


def _rows(x, result):
    """All rows of a result, a reduce-scatter stack flattened."""
    x = np.asarray(x)
    return x.reshape(-1, x.shape[-1]) if result == "reduce_scatter" else x


@pytest.mark.parametrize("tp, result", [(1, "allreduce"), (2, "allreduce"), (4, "allreduce"),
                                        (2, "reduce_scatter"), (4, "reduce_scatter")])
def test_the_op_returns_its_bf16_out_quantized(tp, result):
    (out, residual_out), (q, scales, fp8_residual_out) = _epilogue_calls(tp, result, 7, 512, out_dtype=FP8)
    assert q.dtype == FP8 and scales.dtype == jnp.float32
    assert np.array_equal(np.asarray(fp8_residual_out).view(np.uint16), np.asarray(residual_out).view(np.uint16))
    numerics.assert_fp8_close(_rows(q, result), _rows(scales, result), _rows(out, result))
    if result == "allreduce":
        # Every rank holds the same bits.
        shards = [np.asarray(shard.data).view(np.uint8) for shard in q.addressable_shards]
        assert all(np.array_equal(shards[0], shard) for shard in shards)


def test_the_op_with_a_static_scale():
    scale = jnp.float32(0.01)
    (out, residual_out), (q, fp8_residual_out) = _epilogue_calls(2, "allreduce", 5, 256, out_dtype=FP8,
                                                                 out_scale=scale)
    assert np.array_equal(np.asarray(fp8_residual_out).view(np.uint16), np.asarray(residual_out).view(np.uint16))
    numerics.assert_fp8_close(q, None, out, static_scale=0.01)


def test_vmap_quantizes_each_element():
    mesh = jax.make_mesh((2,), ("tp",))
    rng = np.random.default_rng()
    batch, tp, m, hidden = 2, 2, 3, 256
    problems = [[numerics.random_problem(rng, m=m, hidden=hidden, top_k=2) for _ in range(tp)] for _ in range(batch)]
    # [tp, batch, ...]: each rank's batch.
    stacks = [jnp.stack([jnp.stack([getattr(problems[b][r], field) for b in range(batch)]) for r in range(tp)])
              for field in ("routed", "weights", "indices", "shared")]
    stacks = [jax.device_put(x, jax.sharding.NamedSharding(mesh, P("tp"))) for x in stacks]
    residual, norm_weight = numerics.epilogue_inputs(rng, m, hidden)
    residual, norm_weight = jnp.asarray(residual), jnp.asarray(norm_weight)
    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=8) as mailbox:
        def shard(routed, weights, indices, shared, **options):
            def one(*element):
                return jmp.moe_finalize_publish(*element, mailbox=mailbox, residual=residual,
                                                norm_weight=norm_weight, **options)
            return jax.vmap(one)(routed[0], weights[0], indices[0], shared[0])

        def run(**options):
            return jax.jit(jax.shard_map(lambda *a: shard(*a, **options), mesh=mesh, in_specs=P("tp"),
                                         out_specs=P()))(*stacks)

        out, _ = run()
        q, scales, _ = run(out_dtype=FP8)
    for b in range(batch):
        numerics.assert_fp8_close(q[b], scales[b], out[b], what=f"element {b}")


def _bad_call(hidden=256, with_epilogue=True, **options):
    mesh = jax.make_mesh((2,), ("tp",))
    rng = np.random.default_rng()
    problems = [numerics.random_problem(rng, m=3, hidden=hidden, top_k=2) for _ in range(2)]
    residual, norm_weight = numerics.epilogue_inputs(rng, 3, hidden)
    epilogue = dict(residual=jnp.asarray(residual), norm_weight=jnp.asarray(norm_weight)) if with_epilogue else {}
    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=8) as mailbox:
        jmp.sharded_moe_finalize_publish(mailbox, _stack(problems, "routed"), _stack(problems, "weights"),
                                         _stack(problems, "indices"), _stack(problems, "shared"), **epilogue,
                                         **options)


@pytest.mark.parametrize("case, options, error, words", [
    ("float16", dict(out_dtype=jnp.float16), ValueError, "out_dtype=<class 'jax.numpy.float16'>: expected None"),
    ("e5m2", dict(out_dtype=jnp.float8_e5m2), ValueError, "expected None, jnp.bfloat16 or jnp.float8_e4m3fn"),
    ("no epilogue", dict(with_epilogue=False, out_dtype=FP8), ValueError,
     "only the epilogue's out is quantized; pass residual and norm_weight"),
    ("hidden", dict(hidden=320, out_dtype=FP8), ValueError, "hidden=320: a dynamic FP8 scale covers 128 columns"),
    ("scale without fp8", dict(out_scale=jnp.float32(1)), ValueError, "out_scale: given with out_dtype=bfloat16"),
    ("scale shape", dict(out_dtype=FP8, out_scale=jnp.ones(2, jnp.float32)), ValueError,
     "out_scale.shape=(2,): expected a scalar"),
    ("scale dtype", dict(out_dtype=FP8, out_scale=jnp.ones((), jnp.bfloat16)), TypeError,
     "out_scale.dtype=bfloat16: expected float32"),
])
def test_bad_fp8_arguments_name_the_argument(case, options, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace("<", ".").replace(">", ".")):
        _bad_call(**options)


def test_a_static_scale_of_a_hidden_no_group_tiles_is_accepted():
    (out, _), (q, _) = _epilogue_calls(2, "allreduce", 3, 320, out_dtype=FP8, out_scale=jnp.float32(0.02))
    numerics.assert_fp8_close(q, None, out, static_scale=0.02)
    assert np.asarray(q).dtype == ml_dtypes.float8_e4m3fn


@pytest.mark.parametrize("scaled", [False, True], ids=["group", "static"])
@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
def test_the_kernel_path_quantizes_in_the_kernels(result, scaled, monkeypatch):
    """On CUDA at tp > 1 the FP8 out comes from the epilogue kernels (`KernelConfig.fp8_out`), not
    from XLA: traced with the kernels stood in for, the call loads the FP8 config, passes the
    static scale as the last operand, and returns e4m3 out, float32 scales and bf16
    residual_out in the API's order."""
    loads = stand_in_kernels.install(monkeypatch)
    hidden = 256
    mesh, stacks, residual, norm_weight = _epilogue_inputs(2, result, 5, hidden)
    options = dict(out_dtype=FP8, out_scale=jnp.float32(0.01) if scaled else None)
    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=16, result=result) as mailbox:
        monkeypatch.setattr(mailbox, "on_cuda", True)
        jaxpr = jax.make_jaxpr(lambda *a: jmp.sharded_moe_finalize_publish(
            mailbox, *a, impl="kernel", residual=residual, norm_weight=norm_weight, **options))(*stacks)
    (config, _), = loads
    assert config.fp8_out == ("static" if scaled else "group") and config.epilogue == "rmsnorm"
    calls = jaxprs.equations(jaxpr.jaxpr, "ffi_call")
    assert len(calls) == 1
    operands, results = calls[0].invars, calls[0].outvars
    assert [v.aval.dtype for v in operands[-1:]] == ([jnp.float32] if scaled else [jnp.bfloat16])
    groups = hidden // 128
    expected = [(FP8, hidden), (jnp.bfloat16, hidden)] + ([] if scaled else [(jnp.float32, groups)])
    assert [(v.aval.dtype, v.aval.shape[-1]) for v in results] == expected
    assert [aval.dtype for aval in jaxpr.out_avals] == [FP8] + ([] if scaled else [jnp.float32]) + [jnp.bfloat16]


@pytest.mark.parametrize("scaled", [False, True], ids=["group", "static"])
def test_the_fp8_out_s_tangent_is_the_bf16_out_s_over_its_scale(scaled):
    """jax.jvp through the FP8 op: out's tangent is bf16 out's tangent divided by the scale and
    rounded to e4m3 (0 in a zero group), the scales' is zero, residual_out's is the bf16 call's."""
    tp, m, hidden = 2, 4, 256
    mesh = jax.make_mesh((tp,), ("tp",))
    rng = np.random.default_rng()
    problems = [numerics.random_problem(rng, m=m, hidden=hidden, top_k=4) for _ in range(tp)]
    residual, norm_weight = (jnp.asarray(x) for x in numerics.epilogue_inputs(rng, m, hidden))
    routed, weights, indices, shared = (_stack(problems, f) for f in ("routed", "weights", "indices", "shared"))
    d_routed = jnp.asarray(rng.standard_normal(routed.shape), jnp.bfloat16)
    d_residual = jnp.asarray(rng.standard_normal(residual.shape), jnp.bfloat16)
    scale = jnp.float32(0.05)
    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=8) as mailbox:
        def op(routed, residual, **options):
            return jmp.sharded_moe_finalize_publish(mailbox, routed, weights, indices, shared, residual=residual,
                                                    norm_weight=norm_weight, **options)

        def tangents(**options):
            return jax.jvp(lambda r, x: op(r, x, **options), (routed, residual), (d_routed, d_residual))

        (_, _), (d_out, d_residual_out) = tangents()
        fp8_out, fp8_tangent = tangents(out_dtype=FP8, out_scale=scale if scaled else None)
    divisor = scale if scaled else jnp.repeat(fp8_out[1], 128, axis=-1)
    want = jnp.where(divisor == 0, 0.0, d_out.astype(jnp.float32) / jnp.where(divisor == 0, 1.0, divisor)).astype(FP8)
    assert np.array_equal(np.asarray(fp8_tangent[0]).view(np.uint8), np.asarray(want).view(np.uint8))
    if not scaled:
        assert not np.any(np.asarray(fp8_tangent[1]))
    assert np.array_equal(np.asarray(fp8_tangent[-1]).view(np.uint16), np.asarray(d_residual_out).view(np.uint16))
