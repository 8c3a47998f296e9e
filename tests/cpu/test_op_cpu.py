"""The public API on virtual CPU devices: reference semantics, sharding, mailbox and input validation."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp
import numerics
from jax_moe_publish import config as config_module

SCALES = (1.0, 2.5)


def _stack(problems, field):
    values = [getattr(p, field) for p in problems]
    return None if values[0] is None else jnp.asarray(np.stack(values))


def _run_sharded(mailbox, problems, scale):
    return np.asarray(
        jmp.sharded_moe_finalize_publish(
            mailbox, _stack(problems, "routed"), _stack(problems, "weights"),
            _stack(problems, "indices"), _stack(problems, "shared"), routed_scaling_factor=scale,
        )
    )


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize(
    "hidden,top_k,m,fp32_weights,shared,invalid",
    [
        (64, 8, 5, False, True, 0.2),
        (2880, 10, 3, True, True, 0.3),
        (5120, 1, 2, False, False, 0.0),
        (256, 6, 7, True, False, 1.0),  # every index skipped
    ],
)
def test_reference_finalize_matches_float64(hidden, top_k, m, fp32_weights, shared, invalid, scale):
    rng = np.random.default_rng()
    problem = numerics.random_problem(rng, m=m, hidden=hidden, top_k=top_k, fp32_weights=fp32_weights,
                                      shared=shared, invalid_fraction=invalid)
    out = jmp.reference.moe_finalize(
        jnp.asarray(problem.routed), jnp.asarray(problem.weights), jnp.asarray(problem.indices),
        None if problem.shared is None else jnp.asarray(problem.shared), routed_scaling_factor=scale,
    )
    expected, bound = numerics.expected_sum([problem], scale)
    numerics.assert_close(out, expected, bound)


def test_reference_reads_bf16_inputs_made_in_the_same_program():
    """Inputs that the op's own program computes (bf16 GEMMs, as an expert layer's) are read at
    bf16 precision, as the kernels read them from memory: XLA may keep such a bf16 result in
    float32 (excess precision), so the same program's result must equal the result on stored
    bf16 inputs."""
    rng = np.random.default_rng()
    m, top_k, hidden, rows, inner = 8, 4, 256, 32, 64

    def bf16(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)

    rows_in, tokens_in, w, residual = bf16(rows, inner), bf16(m, inner), bf16(inner, hidden), bf16(m, hidden)
    weights = jnp.asarray(rng.random((m, top_k)), jnp.float32)
    indices = jnp.asarray(rng.integers(0, rows, (m, top_k)), jnp.int32)
    norm_weight = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), jnp.bfloat16)

    def experts(rows_in, tokens_in, w, residual):
        return jax.nn.silu(rows_in @ w), tokens_in @ w, residual * 1.2345

    def layer(routed, shared, residual):
        y = jmp.reference.moe_finalize(routed, weights, indices, shared, routed_scaling_factor=2.5)
        return (y, *jmp.reference.add_rmsnorm(y, residual, norm_weight, eps=1e-6))

    fused = jax.jit(lambda *a: layer(*experts(*a)))(rows_in, tokens_in, w, residual)
    stored = jax.jit(layer)(*jax.jit(experts)(rows_in, tokens_in, w, residual))
    for name, a, b in zip(("y", "out", "residual_out"), fused, stored):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), name


def _reference_args(m=3, hidden=64, top_k=4):
    """Valid arguments of every public `jmp.reference` function, fresh."""
    args = _valid_args(m=m, hidden=hidden, top_k=top_k)
    residual, norm_weight = numerics.epilogue_inputs(np.random.default_rng(), m, hidden)
    return dict(args, y=args["shared_output"], residual=jnp.asarray(residual), norm_weight=jnp.asarray(norm_weight))


FINALIZE_ARGS = ("routed_output", "expert_weights", "permuted_indices", "shared_output")


def _finalize(a, **kwargs):
    return jmp.reference.moe_finalize(*(a[n] for n in FINALIZE_ARGS), **kwargs)


def _add_rmsnorm(a, eps=1e-6):
    return jmp.reference.add_rmsnorm(a["y"], a["residual"], a["norm_weight"], eps=eps)


def _publish_in_shard_map(a, result="allreduce", **kwargs):
    """`jmp.reference.moe_finalize_publish` on replicated inputs, inside shard_map over tp = 2."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))

    def shard(*arrays):
        return jmp.reference.moe_finalize_publish(*arrays, axis_name="tp", result=result, **kwargs)

    return jax.shard_map(shard, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(
        *(a[n] for n in FINALIZE_ARGS))


BAD_REFERENCE_CALLS = [
    # (case, call of the valid arguments, exception, words the message must contain)
    ("publish outside shard_map", lambda a: jmp.reference.moe_finalize_publish(*(a[n] for n in FINALIZE_ARGS),
                                                                               axis_name="tp"), ValueError,
     ["reference.moe_finalize_publish: axis 'tp' is not bound; call it inside jax.shard_map over that axis"]),
    ("reduce outside shard_map", lambda a: jmp.reference.reduce_over_group(a["y"], "tp", "allreduce"), ValueError,
     ["reference.reduce_over_group: axis 'tp' is not bound"]),
    ("rows outside shard_map", lambda a: jmp.reference.rows_with_tokens(2, 3, "tp"), ValueError,
     ["reference.rows_with_tokens: axis 'tp' is not bound"]),
    ("eps negative", lambda a: _add_rmsnorm(a, eps=-1e-6), ValueError,
     ["eps=-1e-06: expected a finite float > 0 (as float32)"]),
    ("eps zero", lambda a: jmp.reference.rms_normalize(a["y"].astype(jnp.float32), a["norm_weight"], eps=0.0),
     ValueError, ["eps=0.0: expected a finite float > 0"]),
    ("eps traced", lambda a: jax.jit(lambda eps: _add_rmsnorm(a, eps))(1e-6), TypeError,
     ["eps: expected a Python float, got a traced float32[]"]),
    ("residual rows", lambda a: jmp.reference.add_rmsnorm(a["y"], a["residual"][:2], a["norm_weight"], eps=1e-6),
     ValueError, ["residual.shape=(2, 64): expected (3, 64) (the shape of y)"]),
    ("norm_weight hidden", lambda a: jmp.reference.add_rmsnorm(a["y"], a["residual"], a["norm_weight"][:32], eps=1e-6),
     ValueError, ["norm_weight.shape=(32,): expected (64,)"]),
    ("y dtype", lambda a: jmp.reference.add_rmsnorm(a["y"].astype(jnp.float32), a["residual"], a["norm_weight"],
                                                    eps=1e-6), TypeError, ["y.dtype=float32: expected bfloat16"]),
    ("indices m", lambda a: _finalize(dict(a, permuted_indices=a["permuted_indices"][:2])), ValueError,
     ["permuted_indices.shape=(2, 4): expected (3, 4), one index per weight of expert_weights.shape=(3, 4)"]),
    ("shared hidden", lambda a: _finalize(dict(a, shared_output=a["shared_output"][:, :32])), ValueError,
     ["shared_output.shape=(3, 32): expected (3, 64)", "of routed_output's hidden=64"]),
    ("routed dtype", lambda a: _finalize(dict(a, routed_output=a["routed_output"].astype(jnp.float32))), TypeError,
     ["routed_output.dtype=float32: expected bfloat16"]),
    ("scale beyond float32", lambda a: _finalize(a, routed_scaling_factor=1e39), ValueError,
     ["routed_scaling_factor=1e+39: expected a float that is finite in float32"]),
    ("scale traced", lambda a: jax.jit(lambda scale: _finalize(a, routed_scaling_factor=scale))(2.5), TypeError,
     ["routed_scaling_factor: expected a Python float, got a traced float32[]"]),
    ("float32 part, int16 indices", lambda a: jmp.reference.moe_finalize_float32(
        a["routed_output"].astype(jnp.float32), a["expert_weights"], a["permuted_indices"].astype(jnp.int16)),
     TypeError, ["permuted_indices.dtype=int16: expected int32"]),
    ("epilogue half", lambda a: _publish_in_shard_map(a, residual=a["residual"]), ValueError,
     ["norm_weight=None: the epilogue needs both residual and norm_weight"]),
    ("scatter residual rows", lambda a: _publish_in_shard_map(a, "reduce_scatter", residual=a["residual"],
                                                             norm_weight=a["norm_weight"]), ValueError,
     ["residual.shape=(3, 64): expected (2, 64) (ceil(m / tp) = ceil(3 / 2) rows, the shape of the result)"]),
    ("eps without epilogue", lambda a: _publish_in_shard_map(a, norm_eps=1e-5), ValueError,
     ["norm_eps=1e-05: given without the epilogue"]),
    ("positive_zero of float32", lambda a: jmp.reference.positive_zero(a["y"].astype(jnp.float32)), TypeError,
     ["x.dtype=float32: expected bfloat16"]),
    ("owned_rows of 3 dimensions", lambda a: jmp.reference.owned_rows(a["y"][None], 2, 0), ValueError,
     ["x.shape=(1, 3, 64): expected [m, n], 2 dimensions"]),
]


@pytest.mark.parametrize("case,call,error,words", BAD_REFERENCE_CALLS, ids=[c[0] for c in BAD_REFERENCE_CALLS])
def test_reference_functions_check_their_arguments(case, call, error, words):
    """`jmp.reference` is public: its functions check what the op checks, with the op's messages,
    where a bad shape would broadcast, a bad eps give NaN and a missing axis a bare NameError."""
    with pytest.raises(error) as raised:
        call(_reference_args())
    for word in words:
        assert word in str(raised.value), f"{word!r} missing from: {raised.value}"


def test_reference_functions_run_on_their_valid_arguments():
    """The checks take what the op and its derivative pass: float32 rows for the float32 parts."""
    a = _reference_args()
    y = _finalize(a, routed_scaling_factor=2.5)
    float32_rows = jmp.reference.moe_finalize_float32(
        a["routed_output"].astype(jnp.float32), a["expert_weights"], a["permuted_indices"],
        a["shared_output"].astype(jnp.float32), routed_scaling_factor=2.5)
    assert np.array_equal(np.asarray(float32_rows.astype(jnp.bfloat16)), np.asarray(y))
    out, residual_out = jmp.reference.add_rmsnorm(y, a["residual"], a["norm_weight"], eps=1e-6)
    assert out.shape == residual_out.shape == (3, 64)
    assert np.array_equal(np.asarray(_publish_in_shard_map(a, routed_scaling_factor=2.5)),
                          np.asarray((2 * y.astype(jnp.float32)).astype(jnp.bfloat16)))


@pytest.mark.parametrize("mesh_shape,axes", [((4,), ("tp",)), ((2, 2), ("dp", "tp"))])
@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
def test_sharded_reference_matches_float64(mesh_shape, axes, result):
    mesh = jax.make_mesh(mesh_shape, axes)
    tp = mesh.shape["tp"]
    rng = np.random.default_rng()
    m, hidden = 7, 128  # m not a multiple of tp
    problems = [numerics.random_problem(rng, m=m, hidden=hidden, top_k=4) for _ in range(tp)]
    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=16, result=result) as mailbox:
        out = _run_sharded(mailbox, problems, 2.5)
    expected, bound = numerics.expected_sum(problems, 2.5)
    numerics.assert_group_close(out, expected, bound, result=result, tp=tp)


@pytest.mark.parametrize("axes", [("dp", "tp"), ("tp", "dp")])
@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
def test_two_dim_mesh_reduces_each_group_over_tp_only(axes, result):
    """A (2, 2) mesh with TP in either position: one group per dp index, each with its own
    data, reduced over its tp ranks only."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), axes)
    dp, tp, m, hidden = 2, 2, 7, 128  # m not a multiple of tp
    rng = np.random.default_rng()
    groups = [[numerics.random_problem(rng, m=m, hidden=hidden, top_k=4) for _ in range(tp)] for _ in range(dp)]
    stacks = [jnp.asarray(np.stack([np.stack([getattr(p, field) for p in group]) for group in groups]))
              for field in ("routed", "weights", "indices", "shared")]  # [dp, tp, ...]
    scatter = result == "reduce_scatter"

    def shard(routed, weights, indices, shared):
        out = jmp.moe_finalize_publish(routed[0, 0], weights[0, 0], indices[0, 0], shared[0, 0], mailbox=mailbox,
                                       routed_scaling_factor=2.5)
        return out[None, None] if scatter else out[None]

    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=16, result=result) as mailbox:
        out_specs = P("dp", "tp") if scatter else P("dp")
        out = np.asarray(jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P("dp", "tp"), out_specs=out_specs))(*stacks))
    for index, group in enumerate(groups):
        expected, bound = numerics.expected_sum(group, 2.5)
        numerics.assert_group_close(out[index], expected, bound, result=result, tp=tp)


@pytest.mark.parametrize("tokens", ["tokens replicated", "tokens along dp"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto axes", "explicit axes"])
@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
def test_shard_map_manual_over_tp_only_matches_float64(tokens, axis_type, epilogue, result):
    """``shard_map(..., axis_names={"tp"})`` on a (dp, tp) mesh: manual over tp, dp left to XLA
    (Mesh's default axis type, Auto, and make_mesh's, Explicit), the tokens replicated over
    dp or sharded along it. The body sees every token along dp, and each dp group's result
    is the sum over its tp ranks."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"), axis_types=(axis_type,) * 2)
    along_dp = tokens == "tokens along dp"
    tp, m, hidden, eps = 2, 6 if along_dp else 5, 128, 1e-6  # 6 tokens split over dp; 5 not a multiple of tp
    scatter = result == "reduce_scatter"
    rng = np.random.default_rng()
    problems = [numerics.random_problem(rng, m=m, hidden=hidden, top_k=4) for _ in range(tp)]
    residual, norm_weight = numerics.epilogue_inputs(rng, m, hidden)
    ranked = [_stack(problems, field) for field in ("routed", "weights", "indices", "shared")]
    specs = [P("tp")] * 4
    placements = [P("tp")] + [P("tp", "dp") if along_dp else P("tp")] * 3
    if epilogue:
        ranked += [jnp.asarray(np.stack([numerics.owned(residual, tp, r) for r in range(tp)]) if scatter else residual),
                   jnp.asarray(norm_weight)]
        specs += [P("tp") if scatter else P(), P()]
        placements += specs[4:]

    def shard(routed, weights, indices, shared, residual=None, norm_weight=None):
        if scatter and residual is not None:
            residual = residual[0]
        out = jmp.moe_finalize_publish(routed[0], weights[0], indices[0], shared[0], mailbox=mailbox,
                                       routed_scaling_factor=2.5, residual=residual, norm_weight=norm_weight,
                                       norm_eps=eps)
        return jax.tree.map(lambda x: x[None], out) if scatter else out

    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=8, result=result) as mailbox:
        inputs = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x, spec in zip(ranked, placements)]
        step = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=tuple(specs), out_specs=P("tp") if scatter else P(),
                                     axis_names={"tp"}))
        out = jax.tree.map(np.asarray, step(*inputs))
    total, bound = numerics.expected_sum(problems, 2.5)
    if not epilogue:
        numerics.assert_group_close(out, total, bound, result=result, tp=tp)
    elif not scatter:
        numerics.assert_epilogue_close(*out, total, bound, residual, norm_weight, eps)
    else:
        for rank in range(tp):
            numerics.assert_epilogue_close(out[0][rank], out[1][rank], numerics.owned(total, tp, rank),
                                           numerics.owned(bound, tp, rank), numerics.owned(residual, tp, rank),
                                           norm_weight, eps, what=f"rank {rank}")


def test_reversed_mesh_ranks_follow_the_axis_not_the_device_id():
    devices = jax.devices()[:2][::-1]
    mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
    rng = np.random.default_rng()
    problems = [numerics.random_problem(rng, m=5, hidden=64, top_k=3) for _ in range(2)]
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8, result="reduce_scatter") as mailbox:
        out = _run_sharded(mailbox, problems, 1.0)
    expected, bound = numerics.expected_sum(problems, 1.0)
    for rank in range(2):
        numerics.assert_close(out[rank], numerics.owned(expected, 2, rank), numerics.owned(bound, 2, rank) + 1e-30)


def test_groups_of_size_one_reduce_nothing():
    mesh = jax.make_mesh((2, 1), ("dp", "tp"))
    rng = np.random.default_rng()
    problem = numerics.random_problem(rng, m=4, hidden=64, top_k=2)
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=4) as mailbox:
        assert mailbox.tp == 1
        out = _run_sharded(mailbox, [problem], 2.5)
    expected, bound = numerics.expected_sum([problem], 2.5)
    numerics.assert_close(out, expected, bound)


def test_negative_zero_partials_sum_to_positive_zero():
    mesh = jax.make_mesh((2,), ("tp",))
    # A tiny negative product rounds to bf16 -0.0; all-skipped tokens give shared = -0.0.
    routed = np.full((2, 4, 64), -1e-38, np.float32).astype(numerics.BF16)
    weights = np.full((2, 3, 2), 1e-5, np.float32)
    indices = np.array([[[0, 1], [-1, -1], [2, -1]]] * 2, np.int32)
    shared = np.full((2, 3, 64), -0.0, np.float32).astype(numerics.BF16)
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=4) as mailbox:
        out = jmp.sharded_moe_finalize_publish(mailbox, jnp.asarray(routed), jnp.asarray(weights),
                                               jnp.asarray(indices), jnp.asarray(shared))
    bits = np.asarray(out).view(np.uint16)
    assert np.all(bits == 0), "every element is +0.0"


# --- the residual add + RMSNorm epilogue --------------------------------------------------------

SILENT_TOKEN = 5  # its partials are zero on every rank, and so is its residual row


def _epilogue_call(mesh, result, problems, residual, norm_weight, eps, scale=2.5):
    """The sharded op with the epilogue; ``residual`` is [m, hidden], passed in the result's layout."""
    tp = mesh.shape["tp"]
    if result == "reduce_scatter":
        residual = np.stack([numerics.owned(residual, tp, rank) for rank in range(tp)])
        # Rows of no token hold garbage: they must not be read.
        for rank in range(tp):
            residual[rank][numerics.tokenless_rows(residual.shape[1], tp, rank, len(problems[0].indices))] = 7.0
    with jmp.Mailbox(mesh, "tp", hidden=norm_weight.shape[0], capacity_m=16, result=result) as mailbox:
        out, residual_out = jmp.sharded_moe_finalize_publish(
            mailbox, _stack(problems, "routed"), _stack(problems, "weights"), _stack(problems, "indices"),
            _stack(problems, "shared"), routed_scaling_factor=scale, residual=jnp.asarray(residual),
            norm_weight=jnp.asarray(norm_weight), norm_eps=eps,
        )
    return np.asarray(out), np.asarray(residual_out)


@pytest.mark.parametrize("hidden, result, eps", [
    (2048, "allreduce", 1e-5), (2048, "reduce_scatter", 1e-6), (5120, "allreduce", 1e-6),
    (5120, "reduce_scatter", 1e-5), (7168, "allreduce", 1e-6), (7168, "reduce_scatter", 1e-5),
])
def test_reference_epilogue_matches_float64(hidden, result, eps):
    mesh = jax.make_mesh((2,), ("tp",))
    tp, m = 2, 7  # m not a multiple of tp
    rng = np.random.default_rng()
    problems = [numerics.random_problem(rng, m=m, hidden=hidden, top_k=4) for _ in range(tp)]
    numerics.silence_token(problems, SILENT_TOKEN)
    residual, norm_weight = numerics.epilogue_inputs(rng, m, hidden)
    residual[SILENT_TOKEN] = 0
    out, residual_out = _epilogue_call(mesh, result, problems, residual, norm_weight, eps)

    total, bound = numerics.expected_sum(problems, 2.5)
    exact_sum = total + residual.astype(np.float64)
    # The data makes the residual add's rounding point matter.
    assert np.mean(exact_sum.astype(numerics.BF16).astype(np.float64) != exact_sum) > 0.5
    if result == "allreduce":
        numerics.assert_epilogue_close(out, residual_out, total, bound, residual, norm_weight, eps)
        silent = [(out[SILENT_TOKEN], residual_out[SILENT_TOKEN])]
    else:
        silent = []
        for rank in range(tp):
            numerics.assert_epilogue_close(
                out[rank], residual_out[rank], numerics.owned(total, tp, rank),
                numerics.owned(bound, tp, rank), numerics.owned(residual, tp, rank), norm_weight, eps,
                what=f"rank {rank}",
            )
            # Rows of no token are zero, whatever their residual rows held.
            unused = numerics.tokenless_rows(out.shape[1], tp, rank, m)
            assert np.all(out[rank][unused] == 0) and np.all(residual_out[rank][unused] == 0)
        silent = [(out[SILENT_TOKEN % tp][SILENT_TOKEN // tp], residual_out[SILENT_TOKEN % tp][SILENT_TOKEN // tp])]
    for row in silent:  # eps keeps a zero row finite: 0 * rsqrt(eps) * w
        assert all(np.all(np.asarray(x, np.float64) == 0) for x in row)


def test_reference_epilogue_in_a_group_of_one():
    mesh = jax.make_mesh((2, 1), ("dp", "tp"))
    rng = np.random.default_rng()
    problem = numerics.random_problem(rng, m=4, hidden=256, top_k=2)
    residual, norm_weight = numerics.epilogue_inputs(rng, 4, 256)
    out, residual_out = _epilogue_call(mesh, "allreduce", [problem], residual, norm_weight, 1e-6)
    total, bound = numerics.expected_sum([problem], 2.5)
    numerics.assert_epilogue_close(out, residual_out, total, bound, residual, norm_weight, 1e-6)


def test_cpu_mailbox_allocates_nothing_and_closes_once():
    mesh = jax.make_mesh((4,), ("tp",))
    mailbox = jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8)
    assert not mailbox.on_cuda and mailbox.status() == []
    mailbox.check()
    with mailbox:
        assert not mailbox.closed
    assert mailbox.closed
    mailbox.close()
    with pytest.raises(ValueError, match="closed"):
        mailbox.check_open()


# --- bad input -------------------------------------------------------------------------------

MESH_AXES = ("tp",)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2,), MESH_AXES)


def _valid_args(m=3, hidden=64, top_k=4):
    rng = np.random.default_rng()
    problem = numerics.random_problem(rng, m=m, hidden=hidden, top_k=top_k)
    return dict(routed_output=jnp.asarray(problem.routed), expert_weights=jnp.asarray(problem.weights),
                permuted_indices=jnp.asarray(problem.indices), shared_output=jnp.asarray(problem.shared))


def _call_in_shard_map(mesh, mailbox, args, **kwargs):
    def shard(routed, weights, indices, shared):
        # Replicated inputs, marked as each rank's own: a partial that does not vary is refused.
        routed = jax.lax.pcast(routed, MESH_AXES, to="varying")
        return jmp.moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox, **kwargs)

    names = ("routed_output", "expert_weights", "permuted_indices", "shared_output")
    return jax.shard_map(shard, mesh=mesh, in_specs=P(), out_specs=P())(*(args[n] for n in names))


BAD_INPUTS = [
    # (case, change to the valid arguments, exception, words the message must contain)
    ("routed dtype", dict(routed_output=lambda a: a.astype(jnp.float32)), TypeError, ["routed_output.dtype=float32", "bfloat16"]),
    ("routed rank", dict(routed_output=lambda a: a[None]), ValueError, ["routed_output.shape", "2 dimensions"]),
    ("routed hidden", dict(routed_output=lambda a: a[:, :32]), ValueError, ["routed_output.shape", "hidden=64"]),
    ("weights dtype", dict(expert_weights=lambda a: a.astype(jnp.int32)), TypeError, ["expert_weights.dtype=int32"]),
    ("indices dtype", dict(permuted_indices=lambda a: a.astype(jnp.int16)), TypeError, ["permuted_indices.dtype=int16", "int32"]),
    ("indices m", dict(permuted_indices=lambda a: a[:2]), ValueError,
     ["permuted_indices.shape=(2, 4)", "(3, 4)", "expert_weights.shape=(3, 4)"]),
    ("indices top_k", dict(permuted_indices=lambda a: a[:, :3]), ValueError,
     ["permuted_indices.shape=(3, 3)", "expert_weights.shape=(3, 4)"]),
    ("shared m", dict(shared_output=lambda a: a[:2]), ValueError,
     ["shared_output.shape=(2, 64)", "(3, 64)", "expert_weights.shape=(3, 4)"]),
    ("shared dtype", dict(shared_output=lambda a: a.astype(jnp.float32)), TypeError, ["shared_output.dtype=float32"]),
]


@pytest.mark.parametrize("case,change,error,words", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_arrays_name_the_argument(mesh, case, change, error, words):
    args = _valid_args()
    for name, edit in change.items():
        args[name] = edit(args[name])
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8) as mailbox, pytest.raises(error) as raised:
        _call_in_shard_map(mesh, mailbox, args)
    for word in words:
        assert word in str(raised.value)


BAD_CALLS = [
    ("m above capacity", dict(m=9), {}, ValueError, ["m=9", "capacity_m=8"]),
    ("top_k too large", dict(top_k=65), {}, ValueError, ["top_k=65"]),
    ("scale not finite", {}, dict(routed_scaling_factor=float("nan")), ValueError, ["routed_scaling_factor=nan"]),
    ("impl unknown", {}, dict(impl="cuda"), ValueError, ["impl='cuda'"]),
    ("kernel on cpu", {}, dict(impl="kernel"), ValueError, ["impl='kernel'", "not on CUDA"]),
    ("config type", {}, dict(config="fast"), TypeError, ["config", "KernelConfig"]),
    ("config hidden", {}, dict(config=jmp.KernelConfig(hidden=128, top_k=4, tp=2)), ValueError, ["config.hidden=128"]),
    ("config scale", {}, dict(config=jmp.KernelConfig(hidden=64, top_k=4, tp=2)), ValueError, ["config.routed_scaling_factor=1.0"]),
]


@pytest.mark.parametrize("case,shape,kwargs,error,words", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_name_the_argument(mesh, case, shape, kwargs, error, words):
    args = _valid_args(**shape)
    kwargs = {"routed_scaling_factor": 2.5, **kwargs}
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8) as mailbox, pytest.raises(error) as raised:
        _call_in_shard_map(mesh, mailbox, args, **kwargs)
    for word in words:
        assert word in str(raised.value)


def _norm_args(m=3, hidden=64, rows=None):
    rng = np.random.default_rng()
    residual, norm_weight = numerics.epilogue_inputs(rng, m if rows is None else rows, hidden)
    return dict(residual=jnp.asarray(residual), norm_weight=jnp.asarray(norm_weight))


BAD_EPILOGUES = [
    # (case, mailbox result layout, change to valid epilogue arguments, exception, words the message must contain)
    ("residual only", "allreduce", dict(norm_weight=None), ValueError, ["norm_weight=None", "residual was given"]),
    ("norm_weight only", "allreduce", dict(residual=None), ValueError, ["residual=None", "norm_weight was given"]),
    ("residual type", "allreduce", dict(residual=[[1.0]]), TypeError, ["residual: expected an array", "list"]),
    ("residual dtype", "allreduce", dict(residual=jnp.zeros((3, 64), jnp.float32)), TypeError,
     ["residual.dtype=float32", "bfloat16"]),
    ("residual rank", "allreduce", dict(residual=jnp.zeros((64,), jnp.bfloat16)), ValueError,
     ["residual.shape=(64,)", "2 dimensions"]),
    ("residual rows", "allreduce", dict(residual=jnp.zeros((2, 64), jnp.bfloat16)), ValueError,
     ["residual.shape=(2, 64)", "(3, 64)", "m = 3 rows"]),
    ("residual hidden", "allreduce", dict(residual=jnp.zeros((3, 32), jnp.bfloat16)), ValueError,
     ["residual.shape=(3, 32)", "(3, 64)"]),
    ("scatter residual rows", "reduce_scatter", dict(residual=jnp.zeros((3, 64), jnp.bfloat16)), ValueError,
     ["residual.shape=(3, 64)", "(2, 64)", "ceil(m / tp) = ceil(3 / 2) rows"]),
    ("weight dtype", "allreduce", dict(norm_weight=jnp.ones((64,), jnp.float32)), TypeError,
     ["norm_weight.dtype=float32", "bfloat16"]),
    ("weight rank", "allreduce", dict(norm_weight=jnp.ones((1, 64), jnp.bfloat16)), ValueError,
     ["norm_weight.shape=(1, 64)", "1 dimensions"]),
    ("weight hidden", "allreduce", dict(norm_weight=jnp.ones((32,), jnp.bfloat16)), ValueError,
     ["norm_weight.shape=(32,)", "(64,)"]),
    ("eps nan", "allreduce", dict(norm_eps=float("nan")), ValueError, ["norm_eps=nan", "finite float > 0"]),
    ("eps inf", "allreduce", dict(norm_eps=float("inf")), ValueError, ["norm_eps=inf"]),
    ("eps zero", "allreduce", dict(norm_eps=0.0), ValueError, ["norm_eps=0.0"]),
    ("eps negative", "allreduce", dict(norm_eps=-1e-6), ValueError, ["norm_eps=-1e-06"]),
    ("eps float32 zero", "allreduce", dict(norm_eps=1e-50), ValueError, ["norm_eps=1e-50", "as float32"]),
    ("eps float32 inf", "allreduce", dict(norm_eps=1e39), ValueError,
     ["norm_eps=1e+39", "finite float > 0 (as float32)"]),
    ("eps str", "allreduce", dict(norm_eps="1e-6"), TypeError, ["norm_eps='1e-6'", "expected a float", "str"]),
    ("eps bool", "allreduce", dict(norm_eps=True), TypeError, ["norm_eps=True", "bool"]),
    ("config without epilogue", "allreduce",
     dict(config=jmp.KernelConfig(hidden=64, top_k=4, tp=2, routed_scaling_factor=2.5)), ValueError,
     ["config.epilogue='none'", "expected 'rmsnorm'"]),
]


@pytest.mark.parametrize("case,result,change,error,words", BAD_EPILOGUES, ids=[c[0] for c in BAD_EPILOGUES])
def test_bad_epilogue_arguments_name_the_argument(mesh, case, result, change, error, words):
    rows = 2 if result == "reduce_scatter" else 3
    kwargs = {"routed_scaling_factor": 2.5, **_norm_args(rows=rows), "norm_eps": 1e-6, **change}
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8, result=result) as mailbox, pytest.raises(error) as raised:
        _call_in_shard_map(mesh, mailbox, _valid_args(), **kwargs)
    for word in words:
        assert word in str(raised.value)


def test_epilogue_config_without_residual_is_refused(mesh):
    config = jmp.KernelConfig(hidden=64, top_k=4, tp=2, routed_scaling_factor=2.5, epilogue="rmsnorm")
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8) as mailbox:
        with pytest.raises(ValueError, match="config.epilogue='rmsnorm': expected 'none'"):
            _call_in_shard_map(mesh, mailbox, _valid_args(), routed_scaling_factor=2.5, config=config)


def test_sharded_scatter_residual_wants_the_rank_axis_first(mesh):
    args = _valid_args()
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8, result="reduce_scatter") as mailbox:
        with pytest.raises(ValueError, match=r"residual.shape=\(2, 64\): expected \[tp=2, ceil\(m/tp\), hidden\]"):
            jmp.sharded_moe_finalize_publish(
                mailbox, args["routed_output"][None].repeat(2, 0), args["expert_weights"][None].repeat(2, 0),
                args["permuted_indices"][None].repeat(2, 0), **_norm_args(rows=2),
            )


def test_the_docstring_names_every_algorithm_that_takes_the_epilogue():
    """`moe_finalize_publish`'s ``config`` paragraph says which algorithms take the epilogue:
    those of `config.EPILOGUE_ALGORITHMS`, the table the checks read."""
    doc = inspect.getdoc(jmp.moe_finalize_publish)
    paragraph = doc.split("config : KernelConfig")[1].split("residual :")[0]
    after = " ".join(paragraph.split('``epilogue="rmsnorm"``')[1].split())
    for algorithm in config_module.EPILOGUE_ALGORITHMS:
        assert f"``{algorithm}``" in after, f"{algorithm!r} missing from: {after}"


@pytest.mark.parametrize("algorithm", config_module.EPILOGUE_ALGORITHMS)
def test_every_epilogue_algorithm_is_accepted_with_the_epilogue(mesh, algorithm):
    """Each algorithm of `config.EPILOGUE_ALGORITHMS`, on the mailbox of its layout, passes the
    op's checks with the epilogue (the reference path then runs as without the config); a
    fused twoshot one is refused by the config itself."""
    result = "reduce_scatter" if algorithm == "reduce_scatter" else "allreduce"
    config = jmp.KernelConfig(hidden=64, top_k=4, tp=2, algorithm=algorithm, routed_scaling_factor=2.5,
                              epilogue="rmsnorm")
    rng = np.random.default_rng()
    problems = [numerics.random_problem(rng, m=3, hidden=64, top_k=4) for _ in range(2)]
    residual, norm_weight = numerics.epilogue_inputs(rng, 3, 64)
    if result == "reduce_scatter":
        residual = np.stack([numerics.owned(residual, 2, rank) for rank in range(2)])
    stacks = [_stack(problems, field) for field in ("routed", "weights", "indices", "shared")]
    epilogue = dict(routed_scaling_factor=2.5, impl="reference", residual=jnp.asarray(residual),
                    norm_weight=jnp.asarray(norm_weight))
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8, result=result) as mailbox:
        configured = jmp.sharded_moe_finalize_publish(mailbox, *stacks, config=config, **epilogue)
        plain = jmp.sharded_moe_finalize_publish(mailbox, *stacks, **epilogue)
    for a, b in zip(configured, plain):
        assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    if algorithm == "twoshot":
        with pytest.raises(ValueError, match="KernelConfig.epilogue='rmsnorm': expected 'none' with a fused twoshot"):
            config.replace(fuse_reduce=True)


def test_twoshot_config_on_a_reduce_scatter_mailbox_is_refused(mesh):
    config = jmp.KernelConfig(hidden=64, top_k=4, tp=2, algorithm="twoshot", routed_scaling_factor=2.5)
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8, result="reduce_scatter") as mailbox:
        with pytest.raises(ValueError, match="config.algorithm='twoshot'"):
            _call_in_shard_map(mesh, mailbox, _valid_args(), routed_scaling_factor=2.5, config=config)


def test_call_outside_shard_map_is_refused(mesh):
    args = _valid_args()
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8) as mailbox:
        with pytest.raises(ValueError, match="axis 'tp' is not bound"):
            jmp.moe_finalize_publish(**args, mailbox=mailbox)


def test_mailbox_from_another_mesh_is_refused():
    small = jax.make_mesh((2,), ("tp",))
    large = jax.make_mesh((2, 2), ("dp", "tp"))
    with jmp.Mailbox(small, "tp", hidden=64, capacity_m=8) as mailbox:
        with pytest.raises(ValueError, match=r"belongs to the mesh \{'tp': 2\} on devices \[0, 1\], but the call "
                                             r"runs on the mesh \{'dp': 2, 'tp': 2\}"):
            _call_in_shard_map(large, mailbox, _valid_args())


def test_closed_mailbox_is_refused(mesh):
    mailbox = jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8)
    mailbox.close()
    with pytest.raises(ValueError, match="is closed"):
        _call_in_shard_map(mesh, mailbox, _valid_args())


@pytest.mark.parametrize("manual_over", ["tp", "every axis"])
def test_a_function_compiled_before_close_raises_when_it_runs_again(manual_over):
    """On CPU no kernel finds a closed mailbox halted: the compiled call asks the host each time
    it runs, on a shard_map manual over every axis or over tp only. A call dispatched before
    close() runs on the open mailbox; one after fails, diagnose() and check() name the close,
    and a new Mailbox, traced again, runs."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    args = _valid_args()

    def step_on(mailbox):
        def shard(routed, weights, indices, shared):
            routed = jax.lax.pcast(routed, "tp", to="varying")
            return jmp.moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox)

        axis_names = {"tp"} if manual_over == "tp" else {"dp", "tp"}
        return jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=axis_names))

    names = ("routed_output", "expert_weights", "permuted_indices", "shared_output")
    mailbox = jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8)
    step = step_on(mailbox)
    expected = np.asarray(step(*(args[n] for n in names)))
    in_flight = step(*(args[n] for n in names))
    mailbox.close()
    assert np.array_equal(np.asarray(in_flight), expected), "a call made before close() must run as before"
    with pytest.raises(jmp.MailboxStatusError) as raised, mailbox.diagnose():
        np.asarray(step(*(args[n] for n in names)))
    message = str(raised.value)
    for words in (f"mailbox {mailbox.id} is closed", "a function compiled before close() called the op on it again",
                  "trace the function again with a new Mailbox"):
        assert words in message, f"{words!r} missing from: {message}"
    assert message in str(raised.value.__cause__), "XLA's error carries the host check's message"
    with pytest.raises(jmp.MailboxStatusError, match=f"mailbox {mailbox.id} is closed"):
        mailbox.check()
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8) as renewed:
        assert np.array_equal(np.asarray(step_on(renewed)(*(args[n] for n in names))), expected)


def test_not_a_mailbox_is_refused(mesh):
    with pytest.raises(TypeError, match="mailbox: expected a jax_moe_publish.Mailbox"):
        _call_in_shard_map(mesh, "mailbox", _valid_args())


BAD_MAILBOXES = [
    (dict(axis_name="ep"), ValueError, "axis_name='ep'"),
    (dict(hidden=60), ValueError, "hidden=60"),
    (dict(capacity_m=0), ValueError, "capacity_m=0"),
    (dict(result="allgather"), ValueError, "result='allgather'"),
    (dict(timeout_s=-1), ValueError, "timeout_s=-1"),
    (dict(on_timeout="hang"), ValueError, "on_timeout='hang'"),
    (dict(process_timeout_s=0), ValueError, "process_timeout_s=0"),
]


@pytest.mark.parametrize("change,error,words", BAD_MAILBOXES, ids=[str(c[0]) for c in BAD_MAILBOXES])
def test_bad_mailbox_arguments(mesh, change, error, words):
    kwargs = {"axis_name": "tp", "hidden": 64, "capacity_m": 8, **change}
    with pytest.raises(error, match=words.replace("(", r"\(")):
        jmp.Mailbox(mesh, **kwargs)


def test_sharded_wrapper_wants_the_rank_axis_first(mesh):
    args = _valid_args()
    with jmp.Mailbox(mesh, "tp", hidden=64, capacity_m=8) as mailbox:
        with pytest.raises(ValueError, match=r"routed_output.shape=\(\d+, 64\): expected \[tp=2"):
            jmp.sharded_moe_finalize_publish(mailbox, args["routed_output"], args["expert_weights"][None],
                                             args["permuted_indices"][None])
