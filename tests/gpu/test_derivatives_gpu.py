"""The op's derivative on NVIDIA GPUs, where its forward runs the kernels.

The derivative is one jnp rule on every path (`jax_moe_publish.derivatives`); on the kernel
path it starts from the kernels' outputs, which with the epilogue are its linearization point.
So the kernel path's gradient (jax.vjp) and tangent (jax.jvp) must match the reference path's
on the same inputs, at tp = 1 and 2 (`_assert_paths_agree`): each path rounds its float32
result to bf16 once, float32 sums may associate differently, and a one-ulp difference of the
forward's ``residual_out`` moves RMSNorm's derivative by about 2^-8 of itself; so each
element may differ by 2^-8 of the sum of both magnitudes plus 2^-8 of the array's RMS, and
the relative norm by 2^-6. The CPU tests (tests/cpu/test_derivatives_cpu.py) hold the
reference path to the float64 model.

A group of tp ranks runs on tp GPUs, or as tp rank processes on fewer (``rank_processes``,
tests/support/rank_runs.py). There the reference path's forward and the derivative's group
sums cannot run: they are XLA collectives, which NCCL refuses between ranks that share a GPU.
The all-reduce's backward needs none (its cotangent is the same on every rank), so
`test_kernel_gradient_of_an_all_reduce_matches_float64` runs there too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp
import numerics
from jax_moe_publish.testing import gpu_matrix, rank_processes

pytestmark = pytest.mark.rank_processes
CAPACITY, M = 64, 5  # m not a multiple of tp = 2
PROBLEM = gpu_matrix.EPILOGUE_PROBLEMS[0]  # hidden 7168, top-k 8, a shared expert
EPS = 1e-6


def _mesh(tp):
    return jax.sharding.Mesh(np.array([d for d in jax.devices() if d.platform == "gpu"][:tp]), ("tp",))


def _skip_where_ranks_share_a_gpu():
    rank = rank_processes.current()
    if rank is not None and rank.gpus and rank.processes > rank.gpus:
        pytest.skip("the reference path's forward and the derivative's group sums are XLA collectives, which "
                    "NCCL refuses between rank processes that share a GPU: this test needs a GPU per rank")


def _inputs(rng, tp, result, epilogue):
    """Every rank's inputs as global arrays (host values): per rank ``[tp, ...]``; the residual
    in the result's layout; and their PartitionSpecs."""
    problems = [numerics.random_problem(rng, m=M, hidden=PROBLEM.hidden, top_k=PROBLEM.top_k,
                                        fp32_weights=PROBLEM.fp32_weights, shared=PROBLEM.include_shared_expert)
                for _ in range(tp)]
    arrays = {"routed_output": np.stack([p.routed for p in problems]),
              "expert_weights": np.stack([p.weights for p in problems]),
              "shared_output": np.stack([p.shared for p in problems])}
    specs = dict.fromkeys(arrays, P("tp"))
    if epilogue:
        residual, norm_weight = numerics.epilogue_inputs(rng, M, PROBLEM.hidden, residual_scale=1.0)
        if result == "reduce_scatter":
            residual = np.stack([numerics.owned(residual, tp, rank) for rank in range(tp)])
        arrays.update(residual=residual, norm_weight=norm_weight)
        specs.update(residual=P("tp") if result == "reduce_scatter" else P(), norm_weight=P())
    return arrays, specs, np.stack([p.indices for p in problems])


def _op(mailbox, impl):
    """The op of global arrays (`sharded_moe_finalize_publish`), its outputs as a list. The
    indices are an argument: a jit may not close over an array that spans processes."""

    def f(arrays, indices):
        epilogue = {} if "residual" not in arrays else dict(
            residual=arrays["residual"], norm_weight=arrays["norm_weight"], norm_eps=EPS)
        return jax.tree.leaves(jmp.sharded_moe_finalize_publish(
            mailbox, arrays["routed_output"], arrays["expert_weights"], indices, arrays["shared_output"],
            routed_scaling_factor=PROBLEM.routed_scaling_factor, impl=impl, **epilogue))

    return f


def _random_like(rng, shapes):
    return [rng.standard_normal(s.shape).astype(np.float32 if s.dtype == jnp.float32 else numerics.BF16)
            for s in shapes]


def _assert_paths_agree(kernel, reference, what):
    kernel64, reference64 = np.asarray(kernel, np.float64), np.asarray(reference, np.float64)
    assert np.any(reference64 != 0), f"{what}: all zero"
    rms = np.sqrt(np.mean(reference64**2))
    bound = numerics.BF16_EPS * (np.abs(kernel64) + np.abs(reference64) + rms) + 1e-30
    numerics.assert_close(kernel, reference64, bound, what=what, max_relative=2.0**-6)


def _paths(results):
    """(tp, result) parameters, each needing its tp GPUs; tp = 1 has the all-reduce only."""
    return [pytest.param(tp, result, marks=pytest.mark.gpus(tp), id=f"tp{tp}-{result}")
            for tp in (1, 2) for result in results if tp > 1 or result == "allreduce"]


@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
@pytest.mark.parametrize("tp,result", _paths(("allreduce", "reduce_scatter")))
def test_kernel_derivatives_match_the_reference_path(tp, result, epilogue, rng):
    _skip_where_ranks_share_a_gpu()
    mesh = _mesh(tp)
    arrays, specs, indices = _inputs(rng, tp, result, epilogue)
    with jmp.Mailbox(mesh, "tp", hidden=PROBLEM.hidden, capacity_m=CAPACITY, result=result) as mailbox:
        placed = {name: rank_processes.place(mesh, specs[name], x) for name, x in arrays.items()}
        placed_indices = rank_processes.place(mesh, P("tp"), indices)
        shapes = jax.eval_shape(_op(mailbox, "reference"), placed, placed_indices)
        out_spec = P("tp") if result == "reduce_scatter" else P()
        cotangents = [rank_processes.place(mesh, out_spec, c) for c in _random_like(rng, shapes)]
        tangents = {name: rank_processes.place(mesh, specs[name], t)
                    for name, t in zip(arrays, _random_like(rng, placed.values()))}
        derivatives = {}
        for impl in ("kernel", "reference"):
            f = _op(mailbox, impl)
            (gradient,) = jax.jit(lambda a, i, c: jax.vjp(lambda a: f(a, i), a)[1](c))(placed, placed_indices,
                                                                                      cotangents)
            _, tangent_out = jax.jit(lambda a, i, t: jax.jvp(lambda a: f(a, i), (a,), (t,)))(placed, placed_indices,
                                                                                           tangents)
            derivatives[impl] = ({name: rank_processes.to_host(g) for name, g in gradient.items()},
                                 [rank_processes.to_host(t) for t in tangent_out])
        mailbox.check()
    (kernel_gradient, kernel_tangents), (reference_gradient, reference_tangents) = (
        derivatives["kernel"], derivatives["reference"])
    for name in arrays:
        _assert_paths_agree(kernel_gradient[name], reference_gradient[name], f"d/d{name}")
    for i, (k, r) in enumerate(zip(kernel_tangents, reference_tangents)):
        _assert_paths_agree(k, r, f"tangent of output {i}")


@pytest.mark.parametrize("tp", [pytest.param(tp, marks=pytest.mark.gpus(tp), id=f"tp{tp}") for tp in (1, 2)])
def test_kernel_gradient_of_an_all_reduce_matches_float64(tp, rng):
    """The kernel path's gradient of ``sum <c, y>`` against the float64 one:
    d/droutedᵣ[j] = sum over (t, k) with idx = j of scale * w * c[t],
    d/dwᵣ[t, k] = scale * <c[t], routedᵣ[idx]>, d/dsharedᵣ = c. Element-wise within the
    float32 sums' roundoff of the magnitude of the terms plus the bf16 (float32) rounding of
    the result; skipped indices' weights and unreferenced rows exactly zero."""
    mesh = _mesh(tp)
    arrays, specs, indices = _inputs(rng, tp, "allreduce", epilogue=False)
    scale, hidden, top_k = PROBLEM.routed_scaling_factor, PROBLEM.hidden, PROBLEM.top_k
    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=CAPACITY) as mailbox:
        placed = {name: rank_processes.place(mesh, specs[name], x) for name, x in arrays.items()}
        f, placed_indices = _op(mailbox, "kernel"), rank_processes.place(mesh, P("tp"), indices)
        (c,) = _random_like(rng, jax.eval_shape(f, placed, placed_indices))
        (gradient,) = jax.jit(lambda a, i, c: jax.vjp(lambda a: f(a, i), a)[1](c))(
            placed, placed_indices, [rank_processes.place(mesh, P(), c)])
        gradient = {name: rank_processes.to_host(g) for name, g in gradient.items()}
        mailbox.check()
    c = c.astype(np.float64)
    routed = arrays["routed_output"].astype(np.float64)
    num_rows = routed.shape[1]
    valid = (indices >= 0) & (indices < num_rows)
    weights = arrays["expert_weights"].astype(np.float64) * scale * valid
    rows = np.stack([routed[r][np.where(valid[r], indices[r], 0)] for r in range(tp)]) * valid[..., None]
    expected_w = scale * valid * np.einsum("th,rtkh->rtk", c, rows)
    magnitude_w = scale * valid * np.einsum("th,rtkh->rtk", np.abs(c), np.abs(rows))
    expected_routed, magnitude_routed = np.zeros_like(routed), np.zeros_like(routed)
    for r, t, k in zip(*np.nonzero(valid)):
        expected_routed[r, indices[r, t, k]] += weights[r, t, k] * c[t]
        magnitude_routed[r, indices[r, t, k]] += np.abs(weights[r, t, k] * c[t])
    unit_w = numerics.F32_EPS if PROBLEM.fp32_weights else numerics.BF16_EPS
    numerics.assert_close(gradient["expert_weights"], expected_w,
                          (hidden + 3) * numerics.F32_EPS * magnitude_w + unit_w * np.abs(expected_w) + 1e-30,
                          what="d/dexpert_weights")
    numerics.assert_close(gradient["routed_output"], expected_routed,
                          ((M * top_k + 2) * numerics.F32_EPS + numerics.BF16_EPS) * magnitude_routed + 1e-30,
                          what="d/drouted_output")
    assert np.array_equal(np.asarray(gradient["shared_output"], np.float64), np.broadcast_to(c, (tp, *c.shape)))
    assert np.all(np.asarray(gradient["expert_weights"])[~valid] == 0)
    referenced = np.zeros((tp, num_rows), bool)
    for r in range(tp):
        referenced[r, indices[r][valid[r]]] = True
    assert np.all(np.asarray(gradient["routed_output"])[~referenced] == 0)
