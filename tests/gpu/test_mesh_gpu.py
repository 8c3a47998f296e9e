"""The op on the kernel path on 2-D meshes of four and eight NVIDIA GPUs, and under jax.vmap.

(dp, tp) meshes of (2, 2), (2, 4) and (4, 2), TP in either position: each dp index is a TP
group of its own, with its own data, reduced over its tp ranks only (all-reduce and
reduce-scatter). A mailbox refuses the same GPUs in other places before any kernel runs.
Under ``jax.vmap`` the kernels get one call over the batch's tokens. Kernels come from the
``tests`` preset (the tuning table's configs for `gpu_matrix.DEFAULT_PROBLEMS`, every m). On
fewer GPUs than the mesh has devices, a test runs as one rank process per device
(``rank_processes``).
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
CAPACITY = 64
PROBLEM = gpu_matrix.DEFAULT_PROBLEMS[0]
FIELDS = ("routed", "weights", "indices", "shared")
AXIS_ORDERS = [("dp", "tp"), ("tp", "dp")]
SHAPES = [pytest.param({"dp": dp, "tp": tp}, marks=pytest.mark.gpus(dp * tp), id=f"dp{dp}-tp{tp}")
          for dp, tp in ((2, 2), (2, 4), (4, 2))]
"""(dp, tp) sizes of the meshes, each on dp * tp GPUs."""


def _gpus(count):
    return [d for d in jax.devices() if d.platform == "gpu"][:count]


def _mesh_2d(axes, shape, order=None):
    """A mesh of ``shape`` ({axis: size}) with ``axes`` in that order, over the first GPUs in
    ``order`` (default: in turn)."""
    count = shape["dp"] * shape["tp"]
    gpus = _gpus(count)
    order = range(count) if order is None else order
    return jax.sharding.Mesh(np.array([gpus[i] for i in order]).reshape([shape[a] for a in axes]), axes)


def _problems(rng, count, m):
    return [numerics.random_problem(rng, m=m, hidden=PROBLEM.hidden, top_k=PROBLEM.top_k,
                                    fp32_weights=PROBLEM.fp32_weights, shared=PROBLEM.include_shared_expert)
            for _ in range(count)]


def _group_stacks(groups):
    """[dp, tp, ...] stacks of per-device problems: group d's rank t at [d, t]."""
    return [np.stack([np.stack([getattr(p, field) for p in group]) for group in groups]) for field in FIELDS]


def _step_2d(mailbox):
    """jit(shard_map) of one kernel call per device; every device's own result comes back."""
    scatter = mailbox.result == "reduce_scatter"

    def shard(routed, weights, indices, shared):
        out = jmp.moe_finalize_publish(routed[0, 0], weights[0, 0], indices[0, 0], shared[0, 0], mailbox=mailbox,
                                       routed_scaling_factor=PROBLEM.routed_scaling_factor, impl="kernel")
        return out[None, None] if scatter else out[None]

    return jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=P("dp", "tp"),
                                 out_specs=P("dp", "tp") if scatter else P("dp")))


def _by_position(mesh, out, dims=2):
    """{(dp index, tp index): that device's own output, its last ``dims`` dimensions}."""
    by_device = rank_processes.gather(out)
    dp_axis, tp_axis = mesh.axis_names.index("dp"), mesh.axis_names.index("tp")
    return {(place[dp_axis], place[tp_axis]): by_device[device].reshape(by_device[device].shape[-dims:])
            for place, device in np.ndenumerate(mesh.devices)}


def _check_groups(outputs, groups, result):
    """Each group's devices against the float64 sum of that group's partials; an all-reduce
    gives its group's devices the same bits."""
    tp = len(groups[0])
    for d, group in enumerate(groups):
        expected, bound = numerics.expected_sum(group, PROBLEM.routed_scaling_factor)
        for t in range(tp):
            what = f"group {d}, rank {t}"
            if result == "reduce_scatter":
                numerics.assert_close(outputs[d, t], numerics.owned(expected, tp, t), numerics.owned(bound, tp, t),
                                      what=what)
            else:
                numerics.assert_close(outputs[d, t], expected, bound, what=what)
                assert np.array_equal(outputs[d, t].view(np.uint16), outputs[d, 0].view(np.uint16)), what


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("axes", AXIS_ORDERS, ids=["-".join(a) for a in AXIS_ORDERS])
def test_two_dim_mesh_reduces_each_group_over_tp_only(axes, result, shape, rng):
    mesh = _mesh_2d(axes, shape)
    with jmp.Mailbox(mesh, "tp", hidden=PROBLEM.hidden, capacity_m=CAPACITY, result=result) as mailbox:
        step = _step_2d(mailbox)
        for m in (1, 37, CAPACITY):
            groups = [_problems(rng, shape["tp"], m) for _ in range(shape["dp"])]
            stacks = [rank_processes.place(mesh, P("dp", "tp"), x) for x in _group_stacks(groups)]
            _check_groups(_by_position(mesh, step(*stacks)), groups, result)
        mailbox.check()


@pytest.mark.gpus(4)
@pytest.mark.parametrize("order", [(0, 2, 1, 3), (1, 0, 3, 2)], ids=["other groups", "ranks swapped"])
def test_same_gpus_in_other_places_are_refused_before_any_kernel_runs(order, rng):
    """Refused when lowered; the mailbox, untouched, then serves a call on its own mesh."""
    shape = {"dp": 2, "tp": 2}
    mesh = _mesh_2d(("dp", "tp"), shape)
    with jmp.Mailbox(mesh, "tp", hidden=PROBLEM.hidden, capacity_m=CAPACITY, result="reduce_scatter") as mailbox:
        groups = [_problems(rng, 2, 5) for _ in range(2)]
        stacks = _group_stacks(groups)

        def shard(routed, weights, indices, shared):
            return jmp.moe_finalize_publish(routed[0, 0], weights[0, 0], indices[0, 0], shared[0, 0],
                                            mailbox=mailbox, routed_scaling_factor=PROBLEM.routed_scaling_factor,
                                            impl="kernel")[None, None]

        other = _mesh_2d(("dp", "tp"), shape, order)
        wrong = jax.jit(jax.shard_map(shard, mesh=other, in_specs=P("dp", "tp"), out_specs=P("dp", "tp")))
        with pytest.raises(ValueError, match="but the call runs on the mesh"):
            wrong.lower(*(rank_processes.place(other, P("dp", "tp"), x) for x in stacks))
        placed = [rank_processes.place(mesh, P("dp", "tp"), x) for x in stacks]
        _check_groups(_by_position(mesh, _step_2d(mailbox)(*placed)), groups, "reduce_scatter")
        mailbox.check()


BATCH = 3


def _vmapped_step(mailbox, in_specs, out_specs, take):
    """jit(shard_map(vmap(op))) over [..., batch, ...] per-device stacks; ``take`` picks a
    device's block out of its shard."""
    scatter = mailbox.result == "reduce_scatter"

    def one(routed, weights, indices, shared):
        return jmp.moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox,
                                        routed_scaling_factor=PROBLEM.routed_scaling_factor, impl="kernel")

    def shard(*stacks):
        out = jax.vmap(one)(*(take(x) for x in stacks))
        return out[None, None] if scatter else out[None]

    return jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=in_specs, out_specs=out_specs))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
def test_vmap_on_a_two_dim_mesh_is_one_kernel_call_per_group(result, shape, rng):
    """A batch of 3 calls of m = 5 (not a multiple of tp) per device, routed rows per element."""
    mesh = _mesh_2d(("dp", "tp"), shape)
    m = 5
    with jmp.Mailbox(mesh, "tp", hidden=PROBLEM.hidden, capacity_m=CAPACITY, result=result) as mailbox:
        # [dp][tp][batch] problems; stacks [dp, tp, batch, ...]
        elements = [[_problems(rng, BATCH, m) for _ in range(shape["tp"])] for _ in range(shape["dp"])]
        stacks = [np.stack([np.stack([np.stack([getattr(p, field) for p in rank]) for rank in group])
                            for group in elements]) for field in FIELDS]
        placed = [rank_processes.place(mesh, P("dp", "tp"), x) for x in stacks]
        scatter = result == "reduce_scatter"
        step = _vmapped_step(mailbox, P("dp", "tp"), P("dp", "tp") if scatter else P("dp"), lambda x: x[0, 0])
        outputs = _by_position(mesh, step(*placed), dims=3)
        mailbox.check()
    for b in range(BATCH):
        groups = [[rank[b] for rank in group] for group in elements]
        _check_groups({place: out[b] for place, out in outputs.items()}, groups, result)


@pytest.mark.gpus(1)
def test_vmap_on_one_gpu_is_one_direct_kernel_call(rng):
    """tp = 1: the direct kernel writes a batch of 4 calls of m = 9 as one call of 36 tokens."""
    mesh = jax.sharding.Mesh(np.array(_gpus(1)), ("tp",))
    with jmp.Mailbox(mesh, "tp", hidden=PROBLEM.hidden, capacity_m=CAPACITY) as mailbox:
        elements = _problems(rng, 4, 9)
        stacks = [jnp.asarray(np.stack([getattr(p, field) for p in elements]))[None] for field in FIELDS]
        step = _vmapped_step(mailbox, P("tp"), P("tp"), lambda x: x[0])
        out = np.asarray(step(*stacks))[0]
    for b, problem in enumerate(elements):
        numerics.assert_close(out[b], *numerics.expected_sum([problem], PROBLEM.routed_scaling_factor),
                              what=f"element {b}")
