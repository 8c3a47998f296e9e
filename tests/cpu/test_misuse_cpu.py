"""Misuse of the public op on virtual CPU devices, where it runs the reference.

* A mailbox belongs to one mesh: a call on another mesh, the same devices in another order
  included, is refused when it is lowered, before anything runs.
* A partial that does not vary along the mailbox's axis is refused where shard_map tracks
  varying axes; with that check off the op cannot tell, and warns once per mesh and axis.
* A shard_map manual over the mailbox's axis only (``axis_names``) is checked as one manual
  over every axis, and the kernels' FFI call is made once per device there too.
* ``jax.vmap`` makes one call over the whole batch's tokens, on every path: the mailbox's
  capacity_m must hold them, and the results are each batch element's.
* Scalars: a bool is no scale, size or eps; a float is no size; shape errors name both arrays.
  A scale must be finite in float32, the kernels' precision; norm_eps is refused without the
  epilogue, which alone reads it. A Mailbox's hidden and capacity_m are bounded
  (`mailbox.MAX_HIDDEN`, `mailbox.MAX_SLOT_ELEMENTS`), and its mesh is a concrete Mesh.
* `sharded_moe_finalize_publish` takes arrays, outside any shard_map (it makes its own).
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp
import jaxprs
import numerics
import stand_in_kernels as stand_in_kernels_module
from jax_moe_publish import mailbox as mailbox_module
from jax_moe_publish import op_checks

HIDDEN, TOP_K, SCALE = 64, 3, 2.5
FIELDS = ("routed", "weights", "indices", "shared")


def _mesh(shape, axes, order=None):
    """A mesh of the first virtual devices; ``order`` permutes them before the reshape."""
    devices = np.array(jax.devices()[: math.prod(shape)])
    return jax.sharding.Mesh((devices if order is None else devices[list(order)]).reshape(shape), axes)


def _problems(rng, count, m=5, **kwargs):
    return [numerics.random_problem(rng, m=m, hidden=HIDDEN, top_k=TOP_K, **kwargs) for _ in range(count)]


def _stacks(problems):
    return [jnp.asarray(np.stack([getattr(p, field) for p in problems])) for field in FIELDS]


def _one_call(mailbox):
    """A shard's call on its [1, ...] slices of the stacked inputs."""

    def shard(routed, weights, indices, shared):
        return jmp.moe_finalize_publish(routed[0], weights[0], indices[0], shared[0], mailbox=mailbox,
                                        routed_scaling_factor=SCALE)

    return shard


def _per_rank_step(mesh, mailbox, axis="tp", check_vma=True):
    """shard_map of one call: rank r's inputs at index r of ``axis``, the all-reduce out."""
    return jax.shard_map(_one_call(mailbox), mesh=mesh, in_specs=P(axis), out_specs=P(), check_vma=check_vma)


# --- a mailbox belongs to one mesh -------------------------------------------------------------


def test_mailbox_on_an_equal_mesh_made_again_runs():
    rng = np.random.default_rng()
    problems = _problems(rng, 2)
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        out = jax.jit(_per_rank_step(_mesh((2,), ("tp",)), mailbox))(*_stacks(problems))
    numerics.assert_close(out, *numerics.expected_sum(problems, SCALE))


@pytest.mark.parametrize("under_jit", [True, False], ids=["jit", "eager"])
def test_same_devices_in_another_order_are_refused_before_running(under_jit):
    rng = np.random.default_rng()
    stacks = _stacks(_problems(rng, 2))
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        step = _per_rank_step(_mesh((2,), ("tp",), order=(1, 0)), mailbox)
        with pytest.raises(ValueError) as raised:
            # Refused when lowered, where the devices are known: nothing has run by then.
            jax.jit(step).lower(*stacks) if under_jit else step(*stacks)
    message = str(raised.value)
    assert "belongs to the mesh {'tp': 2} on devices [0, 1]" in message
    assert "the call runs on the mesh {'tp': 2} on devices [1, 0]" in message


def test_context_mesh_of_other_devices_is_refused():
    rng = np.random.default_rng()
    stacks = _stacks(_problems(rng, 2))

    def shard(routed, weights, indices, shared):
        return jmp.moe_finalize_publish(routed[0], weights[0], indices[0], shared[0], mailbox=mailbox)

    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        with jax.set_mesh(_mesh((2,), ("tp",), order=(1, 0))):
            step = jax.jit(jax.shard_map(shard, in_specs=P("tp"), out_specs=P()))
            with pytest.raises(ValueError, match=r"on devices \[1, 0\]"):
                step.lower(*stacks)


@pytest.mark.parametrize("other_axes,order,words", [
    (("dp", "tp"), (0, 2, 1, 3), ["on devices [[0, 1], [2, 3]]", "on devices [[0, 2], [1, 3]]"]),
    (("tp", "dp"), None, ["{'dp': 2, 'tp': 2} on devices", "the call runs on the mesh {'tp': 2, 'dp': 2}"]),
], ids=["other groups", "axes swapped"])
def test_two_dim_mesh_of_other_groups_is_refused(other_axes, order, words):
    rng = np.random.default_rng()
    stacks = [x.reshape(2, 2, *x.shape[1:]) for x in _stacks(_problems(rng, 4))]

    def shard(routed, weights, indices, shared):
        return jmp.moe_finalize_publish(routed[0, 0], weights[0, 0], indices[0, 0], shared[0, 0],
                                        mailbox=mailbox)[None]

    with jmp.Mailbox(_mesh((2, 2), ("dp", "tp")), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        other = _mesh((2, 2), other_axes, order)
        step = jax.jit(jax.shard_map(shard, mesh=other, in_specs=P("dp", "tp"), out_specs=P("dp")))
        with pytest.raises(ValueError) as raised:
            step.lower(*stacks)
    for word in words:
        assert word in str(raised.value)


@pytest.mark.parametrize("check_vma", [True, False], ids=["checked", "unchecked"])
def test_a_call_manual_over_tp_only_is_checked_against_the_mailbox_mesh(check_vma, unwarned):
    """``axis_names={'tp'}``: the (dp, tp) mesh's devices are compared when the call is lowered
    (another order is refused), with ``check_vma=False`` the op warns, and a mailbox on dp,
    an axis the shard_map leaves to XLA, finds no axis to sum over."""
    rng = np.random.default_rng()
    stacks = _stacks(_problems(rng, 2))

    def step(mesh, mailbox):
        return jax.jit(jax.shard_map(_one_call(mailbox), mesh=mesh, in_specs=P("tp"), out_specs=P(),
                                     axis_names={"tp"}, check_vma=check_vma))

    with jmp.Mailbox(_mesh((2, 2), ("dp", "tp")), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            step(mailbox.mesh, mailbox).lower(*stacks)
        assert len(_unchecked_warnings(record)) == (0 if check_vma else 1)
        with pytest.raises(ValueError, match=r"on devices \[\[0, 2\], \[1, 3\]\]"):
            step(_mesh((2, 2), ("dp", "tp"), order=(0, 2, 1, 3)), mailbox).lower(*stacks)
    if check_vma:
        with jmp.Mailbox(_mesh((2, 2), ("dp", "tp")), "dp", hidden=HIDDEN, capacity_m=8) as on_dp:
            with pytest.raises(ValueError, match="axis 'dp' is not bound"):
                step(on_dp.mesh, on_dp).lower(*stacks)


def test_abstract_mesh_of_the_mailbox_axes_runs():
    """An AbstractMesh names no devices: its axes are compared, its devices come from the inputs."""
    rng = np.random.default_rng()
    problems = _problems(rng, 2)
    mesh = _mesh((2,), ("tp",))

    def shard(routed, weights, indices, shared):
        return jmp.moe_finalize_publish(routed[0], weights[0], indices[0], shared[0], mailbox=mailbox,
                                        routed_scaling_factor=SCALE)

    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        stacks = [jax.device_put(x, jax.sharding.NamedSharding(mesh, P("tp"))) for x in _stacks(problems)]
        out = jax.jit(jax.shard_map(shard, mesh=mesh.abstract_mesh, in_specs=P("tp"), out_specs=P()))(*stacks)
    numerics.assert_close(out, *numerics.expected_sum(problems, SCALE))


# --- the partial varies along the mailbox's axis -------------------------------------------------


def test_partial_invariant_along_the_mailbox_axis_is_refused():
    """A (dp, tp) mesh, the mailbox on dp, the inputs sharded along tp: every dp rank would
    publish the same partial."""
    rng = np.random.default_rng()
    stacks = _stacks(_problems(rng, 2))
    mesh = _mesh((2, 2), ("dp", "tp"))
    with jmp.Mailbox(mesh, "dp", hidden=HIDDEN, capacity_m=8) as mailbox:
        with pytest.raises(ValueError) as raised:
            jax.jit(_per_rank_step(mesh, mailbox, axis="tp")).lower(*stacks)
    message = str(raised.value)
    for word in ["no input of the partial varies along the mailbox's axis 'dp'", "routed_output varies along 'tp'",
                 "shared_output varies along 'tp'", "2 times it"]:
        assert word in message


def test_replicated_inputs_are_refused():
    rng = np.random.default_rng()
    problem = _problems(rng, 1)[0]
    mesh = _mesh((2,), ("tp",))

    def shard(*arrays):
        return jmp.moe_finalize_publish(*arrays, mailbox=mailbox)

    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        step = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P(), out_specs=P()))
        with pytest.raises(ValueError, match="routed_output varies along no axis, expert_weights varies along no axis"):
            step.lower(*(jnp.asarray(getattr(problem, field)) for field in FIELDS))


@pytest.mark.parametrize("varying", ["routed", "weights", "indices", "shared"])
def test_one_input_that_varies_is_enough(varying):
    """The other inputs replicated, ``varying`` sharded: the ranks' partials differ."""
    rng = np.random.default_rng()
    base, other = _problems(rng, 2)
    problems = [base, numerics.RankInputs(**{field: getattr(other if field == varying else base, field)
                                          for field in FIELDS})]
    mesh = _mesh((2,), ("tp",))

    def shard(*arrays):
        arrays = [x[0] if field == varying else x for x, field in zip(arrays, FIELDS)]
        return jmp.moe_finalize_publish(*arrays, mailbox=mailbox, routed_scaling_factor=SCALE)

    inputs = [stack if field == varying else stack[0] for stack, field in zip(_stacks(problems), FIELDS)]
    in_specs = tuple(P("tp") if field == varying else P() for field in FIELDS)
    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        out = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=P()))(*inputs)
    numerics.assert_close(out, *numerics.expected_sum(problems, SCALE))


@pytest.fixture
def unwarned(monkeypatch):
    """No (mesh, axis) warned about yet for calls without the varying-axes check."""
    monkeypatch.setattr(op_checks, "_UNCHECKED_VARYING_WARNED", set())


UNCHECKED_WORDS = ["the shard_map does not track varying axes (check_vma=False)",
                   "Run the shard_map with check_vma=True (its default) to have it checked",
                   "This warns once per mesh and axis"]


def _unchecked_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "does not track varying axes" in str(w.message)]


@pytest.mark.parametrize("how", ["pcast", "check_vma=False"])
def test_identical_partials_sum_tp_times_where_the_caller_says_so(how, unwarned):
    """Marked varying with pcast, or with shard_map's check off (the op cannot tell then, and
    warns): replicated inputs publish one partial per rank, and the result is tp times it."""
    rng = np.random.default_rng()
    problem = _problems(rng, 1)[0]
    mesh = _mesh((4,), ("tp",))

    def shard(routed, *rest):
        if how == "pcast":
            routed = jax.lax.pcast(routed, "tp", to="varying")
        return jmp.moe_finalize_publish(routed, *rest, mailbox=mailbox, routed_scaling_factor=SCALE)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
            step = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=how == "pcast"))
            out = step(*(jnp.asarray(getattr(problem, field)) for field in FIELDS))
    numerics.assert_close(out, *numerics.expected_sum([problem] * 4, SCALE))
    found = _unchecked_warnings(record)
    if how == "pcast":
        assert found == [], "the varying-axes check is on: nothing to warn about"
    else:
        assert len(found) == 1 and "mailbox's axis 'tp' of the mesh {'tp': 4}" in found[0]
        assert "the result 4 times it, without an error" in found[0]


def test_the_wrong_axis_without_the_varying_axes_check_warns_once_per_mesh_and_axis(unwarned):
    """A (dp, tp) mesh, the inputs sharded along tp, check_vma=False: a mailbox on dp sums
    one partial twice, which the op cannot see. It warns when the call is traced, once for
    (mesh, 'dp') however often and with whichever Mailbox, and again for (mesh, 'tp')."""
    rng = np.random.default_rng()
    problems = _problems(rng, 2)
    mesh = _mesh((2, 2), ("dp", "tp"))

    def step(mailbox):
        return jax.jit(_per_rank_step(mesh, mailbox, axis="tp", check_vma=False))

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with jmp.Mailbox(mesh, "dp", hidden=HIDDEN, capacity_m=8) as on_dp:
            doubled = step(on_dp)(*_stacks(problems))
            step(on_dp).lower(*_stacks(problems))  # traced again: no second warning
        with jmp.Mailbox(mesh, "dp", hidden=HIDDEN, capacity_m=8) as again:
            step(again).lower(*_stacks(problems))  # another Mailbox on the same mesh and axis
        on_dp_warnings = _unchecked_warnings(record)
        with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as on_tp:
            out = step(on_tp)(*_stacks(problems))
    # Device (dp 0, tp 0) sums its own partial over dp: rank 0's, twice; out_specs=P() keeps its.
    numerics.assert_close(doubled, *numerics.expected_sum([problems[0]] * 2, SCALE), what="dp's sum of one partial")
    numerics.assert_close(out, *numerics.expected_sum(problems, SCALE))
    assert len(on_dp_warnings) == 1, on_dp_warnings
    for word in UNCHECKED_WORDS + ["mailbox's axis 'dp' of the mesh {'dp': 2, 'tp': 2}", "the result 2 times it",
                                   "a Mailbox made for another axis than the one the inputs are sharded along"]:
        assert word in on_dp_warnings[0], f"{word!r} missing from: {on_dp_warnings[0]}"
    found = _unchecked_warnings(record)
    assert len(found) == 2 and "mailbox's axis 'tp' of the mesh {'dp': 2, 'tp': 2}" in found[1]


def test_a_checked_call_and_a_group_of_one_do_not_warn(unwarned):
    """Where shard_map tracks varying axes the op checks instead; a group of one sums nothing."""
    rng = np.random.default_rng()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
            jax.jit(_per_rank_step(mailbox.mesh, mailbox)).lower(*_stacks(_problems(rng, 2)))
        mesh = _mesh((2, 1), ("dp", "tp"))
        stacks = [x.reshape(2, 1, *x.shape[1:]) for x in _stacks(_problems(rng, 2))]

        def shard(routed, weights, indices, shared):
            return jmp.moe_finalize_publish(routed[0, 0], weights[0, 0], indices[0, 0], shared[0, 0],
                                            mailbox=single)[None]

        with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as single:
            jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp"),
                                  check_vma=False)).lower(*stacks)
    assert _unchecked_warnings(record) == []


# --- jax.vmap: one call over the batch's tokens -----------------------------------------------------

BATCH, EPS = 3, 1e-6


def _batch_problems(rng, tp, m, routed_batched, **kwargs):
    """[rank][batch element] problems; without a batched routed_output every element of a rank
    reads the rank's rows."""
    problems = [_problems(rng, BATCH, m=m, num_rows=7, **kwargs) for _ in range(tp)]
    if not routed_batched:
        for rank in problems:
            for problem in rank[1:]:
                problem.routed = rank[0].routed
    return problems


def _vmap_step(mailbox, routed_batched, epilogue):
    """jit(shard_map(vmap(op))): per-rank inputs [tp, batch, ...] (routed [tp, rows, hidden] when
    not batched), residual [batch, m, hidden] (reduce_scatter: [tp, batch, rows, hidden])."""
    scatter = mailbox.result == "reduce_scatter"

    def one(routed, weights, indices, shared, residual, norm_weight):
        return jmp.moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox,
                                        routed_scaling_factor=SCALE, residual=residual, norm_weight=norm_weight,
                                        norm_eps=EPS)

    def shard(routed, weights, indices, shared, residual=None, norm_weight=None):
        if residual is not None and scatter:
            residual = residual[0]
        in_axes = (0 if routed_batched else None, 0, 0, 0, 0 if residual is not None else None, None)
        out = jax.vmap(one, in_axes=in_axes)(routed[0], weights[0], indices[0], shared[0], residual, norm_weight)
        return jax.tree.map(lambda x: x[None], out) if scatter else out

    in_specs = (P("tp"),) * 4 + ((P("tp") if scatter else P(), P()) if epilogue else ())
    return jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=in_specs,
                                 out_specs=P("tp") if scatter else P()))


def _vmap_inputs(problems, routed_batched, epilogue_inputs=None):
    tp = len(problems)
    stacks = [np.stack([np.stack([getattr(p, field) for p in rank]) for rank in problems]) for field in FIELDS]
    if not routed_batched:
        stacks[0] = stacks[0][:, 0]
    if epilogue_inputs is not None:
        residual, norm_weight, result = epilogue_inputs
        if result == "reduce_scatter":
            residual = np.stack([np.stack([numerics.owned(r, tp, rank) for r in residual]) for rank in range(tp)])
        stacks += [residual, norm_weight]
    return [jnp.asarray(x) for x in stacks]


@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("routed_batched", [True, False], ids=["routed batched", "routed per rank"])
def test_vmap_gives_each_batch_element_its_result(result, routed_batched):
    tp, m = 2, 5  # m not a multiple of tp
    rng = np.random.default_rng()
    problems = _batch_problems(rng, tp, m, routed_batched)
    with jmp.Mailbox(_mesh((tp,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=18, result=result) as mailbox:
        step = _vmap_step(mailbox, routed_batched, epilogue=False)
        inputs = _vmap_inputs(problems, routed_batched)
        out = np.asarray(step(*inputs))
        jaxpr = jax.make_jaxpr(step)(*inputs).jaxpr
    for b in range(BATCH):
        expected, bound = numerics.expected_sum([rank[b] for rank in problems], SCALE)
        if result == "allreduce":
            numerics.assert_close(out[b], expected, bound, what=f"element {b}")
        else:
            for rank in range(tp):
                numerics.assert_close(out[rank, b], numerics.owned(expected, tp, rank),
                                      numerics.owned(bound, tp, rank), what=f"element {b}, rank {rank}")
    # One call: one reduction over the batch's tokens, each element's padded to a multiple of tp.
    tokens = BATCH * (6 if result == "reduce_scatter" else m)
    assert _operand_shapes(jaxpr, "psum_invariant") == [[(tokens, HIDDEN)]]


def _operand_shapes(jaxpr, primitive: str) -> list:
    """Per equation of ``primitive`` in ``jaxpr`` and the jaxprs inside it, its operands' shapes."""
    return [[v.aval.shape for v in eqn.invars] for eqn in jaxprs.equations(jaxpr, primitive)]


@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
def test_vmap_with_the_epilogue_gives_each_batch_element_its_result(result):
    tp, m = 2, 5
    rng = np.random.default_rng()
    problems = _batch_problems(rng, tp, m, routed_batched=True)
    residual = np.stack([numerics.epilogue_inputs(rng, m, HIDDEN)[0] for _ in range(BATCH)])
    norm_weight = numerics.epilogue_inputs(rng, 1, HIDDEN)[1]
    inputs = _vmap_inputs(problems, True, (residual, norm_weight, result))
    if result == "reduce_scatter":
        # The residual rows of no token hold garbage: they must come out zero all the same.
        tokenless = numerics.tokenless_rows(inputs[4].shape[2], tp, 1, m)
        inputs[4] = inputs[4].at[1, :, tokenless].set(jnp.nan)
    with jmp.Mailbox(_mesh((tp,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=18, result=result) as mailbox:
        out, residual_out = map(np.asarray, _vmap_step(mailbox, True, epilogue=True)(*inputs))
    for b in range(BATCH):
        total, bound = numerics.expected_sum([rank[b] for rank in problems], SCALE)
        if result == "allreduce":
            numerics.assert_epilogue_close(out[b], residual_out[b], total, bound, residual[b], norm_weight, EPS,
                                           what=f"element {b}")
            continue
        for rank in range(tp):
            numerics.assert_epilogue_close(
                out[rank, b], residual_out[rank, b], numerics.owned(total, tp, rank), numerics.owned(bound, tp, rank),
                numerics.owned(residual[b], tp, rank), norm_weight, EPS, what=f"element {b}, rank {rank}")
        unused = numerics.tokenless_rows(out.shape[2], tp, 1, m)
        assert np.all(out[1, b][unused] == 0) and np.all(residual_out[1, b][unused] == 0)


@pytest.mark.parametrize("shared", [True, False], ids=["shared expert", "no shared expert"])
def test_vmap_outside_shard_map_is_the_same_fold(shared):
    tp, m = 2, 3
    rng = np.random.default_rng()
    problems = _batch_problems(rng, tp, m, routed_batched=True, shared=shared, fp32_weights=True)
    fields = FIELDS if shared else FIELDS[:3]

    def shard(routed, weights, indices, shared_output=None):
        return jmp.moe_finalize_publish(routed[0], weights[0], indices[0],
                                        None if shared_output is None else shared_output[0], mailbox=mailbox,
                                        routed_scaling_factor=SCALE)[None]

    inputs = [jnp.asarray(np.stack([np.stack([getattr(p, field) for p in rank]) for rank in problems]))
              for field in fields]  # [tp, batch, ...]
    # Each element's 3 tokens padded to 4, a multiple of tp: 12 tokens in all.
    with jmp.Mailbox(_mesh((tp,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=12, result="reduce_scatter") as mailbox:
        per_call = jax.shard_map(shard, mesh=mailbox.mesh, in_specs=P("tp"), out_specs=P("tp"))
        out = np.asarray(jax.jit(jax.vmap(per_call, in_axes=1, out_axes=1))(*inputs))
    for b in range(BATCH):
        expected, bound = numerics.expected_sum([rank[b] for rank in problems], SCALE)
        for rank in range(tp):
            numerics.assert_close(out[rank, b], numerics.owned(expected, tp, rank), numerics.owned(bound, tp, rank))


def test_vmap_over_an_empty_batch_is_refused():
    rng = np.random.default_rng()
    inputs = [x[:, :0] for x in _vmap_inputs(_batch_problems(rng, 2, 3, routed_batched=True), True)]
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        with pytest.raises(ValueError, match="jax.vmap over an empty batch: expected at least one batch element"):
            _vmap_step(mailbox, True, epilogue=False).lower(*inputs)


@pytest.mark.parametrize("result,capacity,words", [
    ("allreduce", 14, ["jax.vmap over a batch of 3", "3 x 5 (m=5) = 15", "capacity_m=14", "capacity_m >= 15"]),
    ("reduce_scatter", 17, ["3 x 6 (m=5, padded to a multiple of tp=2) = 18", "capacity_m=17"]),
])
def test_vmap_batch_beyond_capacity_is_refused(result, capacity, words):
    """Each element's m = 5 fits, the batch's tokens do not: the same error on every path."""
    rng = np.random.default_rng()
    problems = _batch_problems(rng, 2, 5, routed_batched=True)
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=capacity, result=result) as mailbox:
        step = _vmap_step(mailbox, True, epilogue=False)
        with pytest.raises(ValueError) as raised:
            step.lower(*_vmap_inputs(problems, True))
    for word in words:
        assert word in str(raised.value)


def test_vmap_over_norm_weight_is_refused():
    rng = np.random.default_rng()
    problem = _problems(rng, 1, m=2)[0]
    residual, norm_weight = numerics.epilogue_inputs(rng, 2, HIDDEN)
    mesh = _mesh((2,), ("tp",))

    def shard(routed, weights, indices, shared, residual, norm_weight):
        routed = jax.lax.pcast(routed, "tp", to="varying")
        return jax.vmap(lambda w, n: jmp.moe_finalize_publish(routed, w, indices, shared, mailbox=mailbox,
                                                              residual=residual, norm_weight=n))(weights, norm_weight)

    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        step = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P(), out_specs=P()))
        with pytest.raises(ValueError, match="norm_weight: under jax.vmap it differs between batch elements"):
            step.lower(jnp.asarray(problem.routed), jnp.asarray(np.stack([problem.weights] * 2)),
                       jnp.asarray(problem.indices), jnp.asarray(problem.shared), jnp.asarray(residual),
                       jnp.asarray(np.stack([norm_weight] * 2)))


STAND_IN_TARGET = stand_in_kernels_module.TARGET


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """The kernel path with its FFI call stood in for (`stand_in_kernels`)."""
    stand_in_kernels_module.install(monkeypatch)


def test_vmap_reaches_the_kernels_as_one_call(stand_in_kernels, monkeypatch):
    """The kernel path, its FFI call stood in for by one without a vmap rule (jax.vmap of it
    raises): the call that remains is one, of the batch's tokens, routed rows stacked."""
    rng = np.random.default_rng()
    tp, m = 2, 3
    problems = _batch_problems(rng, tp, m, routed_batched=True)
    with jmp.Mailbox(_mesh((tp,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=12, result="reduce_scatter") as mailbox:
        monkeypatch.setattr(mailbox, "on_cuda", True)
        jaxpr = jax.make_jaxpr(_vmap_step(mailbox, True, epilogue=False))(*_vmap_inputs(problems, True)).jaxpr
    # Each element's 3 tokens padded to 4; 7 routed rows per element.
    assert _operand_shapes(jaxpr, "ffi_call") == [[(BATCH * 7, HIDDEN), (BATCH * 4, TOP_K), (BATCH * 4, TOP_K),
                                                   (BATCH * 4, HIDDEN)]]


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto axes", "explicit axes"])
def test_the_kernel_path_manual_over_tp_only_makes_one_call_per_device(stand_in_kernels, monkeypatch, axis_type):
    """In a shard_map manual over tp only, XLA's partitioner refuses a side-effecting call that it
    would replicate over dp ("Side-effect ops cannot be replicated"): the op's FFI call sits in
    a nested shard_map manual over dp, once per device. Compiling the stand-in gets past the
    partitioner and stops where no handler serves its target."""
    rng = np.random.default_rng()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"), axis_types=(axis_type,) * 2)
    stacks = [jax.device_put(x, jax.sharding.NamedSharding(mesh, P("tp"))) for x in _stacks(_problems(rng, 2))]
    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        monkeypatch.setattr(mailbox, "on_cuda", True)
        step = jax.jit(jax.shard_map(_one_call(mailbox), mesh=mesh, in_specs=P("tp"), out_specs=P(),
                                     axis_names={"tp"}))
        assert _operand_shapes(jax.make_jaxpr(step)(*stacks).jaxpr, "ffi_call") == [
            [(7, HIDDEN), (5, TOP_K), (5, TOP_K), (5, HIDDEN)]]
        with pytest.raises(jax.errors.JaxRuntimeError, match=f"No FFI handler registered for {STAND_IN_TARGET}"):
            step.lower(*stacks).compile()


# --- scalars and shapes ------------------------------------------------------------------------

BAD_MAILBOX_SCALARS = [
    (dict(capacity_m=True), ["capacity_m=True: expected an int, got a bool"]),
    (dict(capacity_m=64.0), ["capacity_m=64.0: expected an int, got a float; write 64"]),
    (dict(capacity_m=64.5), ["capacity_m=64.5: expected an int, got float"]),
    (dict(capacity_m="64"), ["capacity_m='64': expected an int, got str"]),
    (dict(hidden=7168.0), ["hidden=7168.0: expected an int, got a float; write 7168"]),
    (dict(hidden=False), ["hidden=False: expected an int, got a bool"]),
    (dict(timeout_s=True), ["timeout_s=True: expected a float, got a bool"]),
    (dict(process_timeout_s="5"), ["process_timeout_s='5': expected a float, got str"]),
]


@pytest.mark.parametrize("change,words", BAD_MAILBOX_SCALARS, ids=[str(c[0]) for c in BAD_MAILBOX_SCALARS])
def test_bad_mailbox_scalars_say_what_is_wrong(change, words):
    kwargs = {"hidden": HIDDEN, "capacity_m": 8, **change}
    with pytest.raises(TypeError) as raised:
        jmp.Mailbox(_mesh((2,), ("tp",)), "tp", **kwargs)
    for word in words:
        assert word in str(raised.value)


def test_mailbox_needs_a_concrete_mesh():
    with pytest.raises(TypeError, match=r"mesh: expected a jax.sharding.Mesh, got list; make one of the devices, "
                                        r"e.g. jax.make_mesh"):
        jmp.Mailbox(jax.devices(), "tp", hidden=HIDDEN, capacity_m=8)
    abstract = _mesh((2,), ("tp",)).abstract_mesh
    with pytest.raises(TypeError, match=r"mesh=AbstractMesh\(.*\): expected a jax.sharding.Mesh of devices, got an "
                                        r"AbstractMesh, which names none; pass the concrete Mesh"):
        jmp.Mailbox(abstract, "tp", hidden=HIDDEN, capacity_m=8)


MAILBOX_BOUNDS = [
    (dict(hidden=65544), ["hidden=65544: expected a positive multiple of 8, at most 65536"]),
    (dict(hidden=65536, capacity_m=32769), ["capacity_m=32769: expected at most 32768 with hidden=65536",
                                            "capacity_m * hidden may be at most 2**31"]),
    (dict(hidden=7168, capacity_m=10**6), ["capacity_m=1000000: expected at most 299593 with hidden=7168"]),
    (dict(hidden=8, capacity_m=np.int64(2**62)), ["capacity_m=np.int64(4611686018427387904): expected at most "
                                                  "268435456 with hidden=8"]),
]


@pytest.mark.parametrize("change,words", MAILBOX_BOUNDS, ids=[str(c[0]) for c in MAILBOX_BOUNDS])
def test_mailbox_sizes_are_bounded(change, words):
    with pytest.raises(ValueError) as raised:
        jmp.Mailbox(_mesh((2,), ("tp",)), "tp", **{"hidden": HIDDEN, "capacity_m": 8, **change})
    for word in words:
        assert word in str(raised.value)


def test_mailbox_at_the_bounds_is_made():
    assert mailbox_module.MAX_HIDDEN == 65536 and mailbox_module.MAX_SLOT_ELEMENTS == 2**31
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=65536, capacity_m=32768) as mailbox:
        assert mailbox.capacity_m * mailbox.hidden == 2**31


BAD_OP_VALUES = [
    # Finite in float64, infinite in float32 (beyond 3.4028235e38), where the kernels scale.
    (dict(routed_scaling_factor=1e39), ["routed_scaling_factor=1e+39: expected a float that is finite in float32"]),
    (dict(routed_scaling_factor=-3.5e38), ["routed_scaling_factor=-3.5e+38: expected a float that is finite"]),
    # Without residual and norm_weight nothing reads norm_eps.
    (dict(norm_eps=1e-5), ["norm_eps=1e-05: given without the epilogue, which alone uses it",
                           "pass residual and norm_weight too, or leave norm_eps at its default 1e-06"]),
    (dict(norm_eps=float("nan")), ["norm_eps=nan: given without the epilogue"]),
]


@pytest.mark.parametrize("change,words", BAD_OP_VALUES, ids=[str(c[0]) for c in BAD_OP_VALUES])
def test_bad_op_values_say_what_is_wrong(change, words):
    rng = np.random.default_rng()
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        with pytest.raises(ValueError) as raised:
            jmp.sharded_moe_finalize_publish(mailbox, *_stacks(_problems(rng, 2, m=3)), **change)
    for word in words:
        assert word in str(raised.value)


def test_scale_at_float32_max_runs():
    rng = np.random.default_rng()
    problems = _problems(rng, 2, m=3, invalid_fraction=1.0)  # every index -1: nothing is scaled
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        out = jmp.sharded_moe_finalize_publish(mailbox, *_stacks(problems),
                                               routed_scaling_factor=float(np.finfo(np.float32).max))
    numerics.assert_close(out, *numerics.expected_sum(problems, 1.0))


def test_sharded_takes_arrays():
    rng = np.random.default_rng()
    stacks = _stacks(_problems(rng, 2, m=3))
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        with pytest.raises(TypeError, match=r"routed_output: expected an array \[tp=2, \.\.\.\] with the TP rank "
                                            r"leading, got list; convert it with jnp.asarray"):
            jmp.sharded_moe_finalize_publish(mailbox, np.asarray(stacks[0], np.float32).tolist(), *stacks[1:])
        with pytest.raises(TypeError, match="norm_weight: expected an array, got tuple"):
            jmp.sharded_moe_finalize_publish(mailbox, *stacks, residual=jnp.zeros((3, HIDDEN), jnp.bfloat16),
                                             norm_weight=(1.0,) * HIDDEN)
    with pytest.raises(TypeError, match="mailbox: expected a jax_moe_publish.Mailbox, got NoneType"):
        jmp.sharded_moe_finalize_publish(None, *stacks)


def test_sharded_inside_shard_map_says_to_call_the_per_shard_op():
    rng = np.random.default_rng()
    stacks = _stacks(_problems(rng, 2, m=3))
    mesh = _mesh((2,), ("tp",))
    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        step = jax.jit(jax.shard_map(lambda *local: jmp.sharded_moe_finalize_publish(mailbox, *local), mesh=mesh,
                                     in_specs=P("tp"), out_specs=P()))
        with pytest.raises(ValueError, match=r"sharded_moe_finalize_publish: called inside a jax.shard_map "
                                             r"\(over 'tp'\), but it makes its own .* call moe_finalize_publish"):
            step.lower(*stacks)


def test_a_reduce_scatter_result_with_replicated_out_specs_is_refused():
    """Rank r's rows differ between ranks: where shard_map checks varying axes (its default),
    JAX refuses ``out_specs=P()`` for them (the op cannot see out_specs; the Mailbox's
    ``result`` documents ``P(axis_name)``)."""
    rng = np.random.default_rng()
    mesh = _mesh((2,), ("tp",))
    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=8, result="reduce_scatter") as mailbox:
        with pytest.raises(ValueError, match=r"out_specs is P\(\) which implies that the corresponding output value "
                                             r"is replicated across mesh axis 'tp'"):
            jax.jit(_per_rank_step(mesh, mailbox)).lower(*_stacks(_problems(rng, 2, m=3)))


BAD_OP_SCALARS = [
    (dict(routed_scaling_factor=True), ["routed_scaling_factor=True: expected a float, got a bool"]),
    (dict(routed_scaling_factor=np.bool_(True)), ["routed_scaling_factor=np.True_: expected a float, got bool"]),
    (dict(routed_scaling_factor="2.5"), ["routed_scaling_factor='2.5': expected a float, got str"]),
    (dict(routed_scaling_factor=jnp.float32(2.5)), ["expected a float, got ArrayImpl"]),
    (dict(norm_eps=False), ["norm_eps=False: expected a float, got a bool"]),
]


@pytest.mark.parametrize("change,words", BAD_OP_SCALARS, ids=[str(c[0]) for c in BAD_OP_SCALARS])
def test_bad_op_scalars_say_what_is_wrong(change, words):
    rng = np.random.default_rng()
    problems = _problems(rng, 2, m=3)
    residual, norm_weight = numerics.epilogue_inputs(rng, 3, HIDDEN)
    epilogue = dict(residual=jnp.asarray(residual), norm_weight=jnp.asarray(norm_weight)) if "norm_eps" in change else {}
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        with pytest.raises(TypeError) as raised:
            jmp.sharded_moe_finalize_publish(mailbox, *_stacks(problems), **epilogue, **change)
    for word in words:
        assert word in str(raised.value)


@pytest.mark.parametrize("field,change,words", [
    ("indices", lambda x: x[:, :2], ["permuted_indices.shape=(2, 3): expected (3, 3)", "expert_weights.shape=(3, 3)"]),
    ("indices", lambda x: x[:, :, :1], ["permuted_indices.shape=(3, 1): expected (3, 3)", "expert_weights.shape=(3, 3)"]),
    ("weights", lambda x: x[:, :1], ["permuted_indices.shape=(3, 3): expected (1, 3)", "expert_weights.shape=(1, 3)"]),
    ("shared", lambda x: x[:, :2], ["shared_output.shape=(2, 64): expected (3, 64)", "expert_weights.shape=(3, 3)",
                                    "hidden=64"]),
], ids=["indices m", "indices top_k", "weights m", "shared m"])
def test_shape_mismatch_names_both_arrays_and_shapes(field, change, words):
    rng = np.random.default_rng()
    stacks = dict(zip(FIELDS, _stacks(_problems(rng, 2, m=3))))
    stacks[field] = change(stacks[field])
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        with pytest.raises(ValueError) as raised:
            jmp.sharded_moe_finalize_publish(mailbox, *(stacks[f] for f in FIELDS))
    for word in words:
        assert word in str(raised.value)


def test_int64_indices_reach_the_op_wrapped_to_int32():
    """With x64 off JAX makes int64 indices int32 before the op sees them: 2**32 + 1 becomes
    row 1, a valid index (as the README says)."""
    assert not jax.config.jax_enable_x64
    rng = np.random.default_rng()
    problems = _problems(rng, 2, m=3, invalid_fraction=0.0)
    wide = np.stack([p.indices for p in problems]).astype(np.int64)
    wide[:, :, 0] = 2**32 + 1
    for problem, rank_indices in zip(problems, wide):
        problem.indices = rank_indices.astype(np.int32)  # what the op sees: row 1
    stacks = _stacks(problems)
    with jmp.Mailbox(_mesh((2,), ("tp",)), "tp", hidden=HIDDEN, capacity_m=8) as mailbox:
        out = jmp.sharded_moe_finalize_publish(mailbox, stacks[0], stacks[1], jnp.asarray(wide), stacks[3],
                                               routed_scaling_factor=SCALE)
    assert np.all(np.stack([p.indices for p in problems])[:, :, 0] == 1)
    numerics.assert_close(out, *numerics.expected_sum(problems, SCALE))
