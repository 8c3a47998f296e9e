"""The public op: MoE finalize fused with the reduction over the TP group, and optionally
with the residual add + RMSNorm that follows it in a transformer layer.

`moe_finalize_publish` runs on one shard inside ``shard_map``;
`sharded_moe_finalize_publish` wraps the ``shard_map`` for global arrays.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from jax_moe_publish import _launch, checks, derivatives, protocol, reference, tuning
from jax_moe_publish.aot.store import default_store
from jax_moe_publish.config import MAX_TOP_K, KernelConfig
from jax_moe_publish.mailbox import Mailbox

IMPLS = ("auto", "kernel", "reference")


def _check_inputs(routed_output, expert_weights, permuted_indices, shared_output, mailbox,
                  routed_scaling_factor):
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"mailbox: expected a jax_moe_publish.Mailbox, got {type(mailbox).__name__}")
    mailbox.check_open()
    m, top_k = checks.check_finalize_arrays(routed_output, expert_weights, permuted_indices,
                                            mailbox_hidden=mailbox.hidden)
    if routed_output.shape[0] >= 2**31:
        raise ValueError(f"routed_output.shape[0]={routed_output.shape[0]}: expected fewer than 2**31 rows")
    if not 1 <= m <= mailbox.capacity_m:
        raise ValueError(
            f"m={m} (expert_weights.shape[0]): expected 1 <= m <= capacity_m={mailbox.capacity_m}"
        )
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k={top_k} (expert_weights.shape[1]): expected 1 <= top_k <= {MAX_TOP_K}")
    checks.check_shared_output(shared_output, expert_weights, mailbox.hidden, hidden_of="the mailbox's hidden")
    checks.check_scale(routed_scaling_factor)


def _check_epilogue(residual, norm_weight, norm_eps, mailbox, m) -> bool:
    """Whether the call has the epilogue (`checks.check_epilogue`), whose residual has the
    shape of the mailbox's result."""
    rows, rule = checks.result_rows(m, mailbox.tp, mailbox.result)
    default = inspect.signature(moe_finalize_publish).parameters["norm_eps"].default
    return checks.check_epilogue(residual, norm_weight, norm_eps, default_eps=default, rows=rows, rule=rule,
                                 hidden=mailbox.hidden)


def _check_stacks(mailbox, arrays: dict) -> None:
    """`sharded_moe_finalize_publish`'s arguments: a Mailbox, a call outside any shard_map (it
    makes its own), arrays (None where optional), the per-rank ones ``[tp, ...]``; the
    per-shard op checks the rest."""
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"mailbox: expected a jax_moe_publish.Mailbox, got {type(mailbox).__name__}")
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if manual:
        raise ValueError(
            f"sharded_moe_finalize_publish: called inside a jax.shard_map (over {', '.join(map(repr, manual))}), "
            "but it makes its own shard_map over mailbox.mesh from global [tp, ...] arrays; inside a "
            "shard_map, call moe_finalize_publish on this rank's arrays instead"
        )
    tp = mailbox.tp
    # The layout of each [tp, ...] argument; a reduce-scatter residual is one too.
    layouts = dict.fromkeys(["routed_output", "expert_weights", "permuted_indices", "shared_output"],
                            f"[tp={tp}, ...] with the TP rank leading")
    if mailbox.result == "reduce_scatter":
        layouts["residual"] = f"[tp={tp}, ceil(m/tp), hidden], the layout of the reduce-scatter result"
    for name, x in arrays.items():
        if x is None:
            continue
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            hint = "; convert it with jnp.asarray" if isinstance(x, (list, tuple)) else ""
            layout = f" {layouts[name]}" if name in layouts else ""
            raise TypeError(f"{name}: expected an array{layout}, got {type(x).__name__}{hint}")
        if name in layouts and (len(x.shape) != 3 or x.shape[0] != tp):
            raise ValueError(f"{name}.shape={tuple(x.shape)}: expected {layouts[name]}")


def _check_axis(mailbox: Mailbox) -> None:
    """The call is traced inside shard_map over the mailbox's axis (manual over it, and over
    other axes or not), on a mesh of the mailbox's axes (its devices are compared when the call
    is lowered: `_on_mailbox_mesh_p`)."""
    checks.check_axis_bound(mailbox.axis_name, "moe_finalize_publish",
                            "jax.shard_map manual over the mailbox's axis (or use sharded_moe_finalize_publish)")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(f"moe_finalize_publish: axis {mailbox.axis_name!r} is bound, but not by jax.shard_map "
                         "(jax.vmap's axis_name?); call it inside jax.shard_map over the mailbox's mesh")
    mailbox.check_mesh(mesh)


def _varying_axes(x) -> frozenset:
    """The mesh axes along which ``x`` (a traced array) differs between shards, as shard_map's
    varying-axes check tracks them (none where that check is off)."""
    return jax.typeof(x).mat.varying


def _tracks_varying_axes(axis: str) -> bool:
    """Whether the enclosing shard_map tracks varying axes (``check_vma=True``): axis_index
    varies along its axis exactly then. Read from the ShapeDtypeStruct itself, which
    jax.typeof cannot rebuild in a shard_map manual over some axes only."""
    index = jax.eval_shape(lambda: lax.axis_index(axis)).manual_axis_type
    return index is not None and axis in index.varying


_UNCHECKED_VARYING_WARNED: set = set()
"""(mesh, axis) pairs whose calls without the varying-axes check have been warned about."""


def _check_varying(mailbox: Mailbox, partial_inputs: dict) -> None:
    """This rank's partial differs along the mailbox's axis: the sum of one partial published by
    every rank is ``tp`` times it. Only shard_map's varying-axes check (``check_vma=True``)
    knows; without it the op cannot tell and warns once per mesh and axis."""
    axis = mailbox.axis_name
    if mailbox.tp == 1:
        return
    if not _tracks_varying_axes(axis):
        if (mailbox.mesh, axis) not in _UNCHECKED_VARYING_WARNED:
            _UNCHECKED_VARYING_WARNED.add((mailbox.mesh, axis))
            warnings.warn(
                f"moe_finalize_publish: the shard_map does not track varying axes (check_vma=False), so the op "
                f"cannot check that this rank's partial varies along the mailbox's axis {axis!r} of the mesh "
                f"{dict(mailbox.mesh.shape)}: inputs replicated along {axis!r}, or a Mailbox made for another "
                f"axis than the one the inputs are sharded along, make every rank publish the same partial and "
                f"the result {mailbox.tp} times it, without an error. Run the shard_map with check_vma=True "
                f"(its default) to have it checked. This warns once per mesh and axis.",
                UserWarning, stacklevel=3,
            )
        return
    varying = {name: _varying_axes(x) for name, x in partial_inputs.items() if x is not None}
    if not any(axis in axes for axes in varying.values()):
        found = ", ".join(f"{name} varies along {' and '.join(map(repr, sorted(axes))) or 'no axis'}"
                          for name, axes in varying.items())
        raise ValueError(
            f"moe_finalize_publish: no input of the partial varies along the mailbox's axis {axis!r} "
            f"({found}), so all {mailbox.tp} ranks would publish the same partial and the result would "
            f"be {mailbox.tp} times it; expected at least one input sharded along {axis!r} (or, for that "
            f"sum, marked with jax.lax.pcast(x, {axis!r}, to='varying'))"
        )


def _manual_over_every_axis(fn, *args):
    """``fn(*args)`` in a region manual over every mesh axis. XLA's partitioner refuses an op
    with side effects (the kernels' FFI call, a host callback) that it would replicate over
    the axes a shard_map leaves to it ("Side-effect ops cannot be replicated"), so inside a
    shard_map manual over some axes a nested one takes the others: each of their devices
    calls ``fn`` on the whole of ``args``, as the body sees them (one value along those axes)."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)
    if not auto:
        return fn(*args)
    return jax.shard_map(fn, in_specs=P(), out_specs=P(), axis_names=auto)(*args)


def _replicated_along_explicit_axes(x):
    """``x`` whole on every device of the axes a shard_map leaves to XLA: one call takes all of
    its tokens (the kernels' one FFI call per device, `_manual_over_every_axis`), and the
    reference's gathers and reshapes of tokens sharded along an explicit axis have no
    sharding JAX could choose. Values of auto axes carry no sharding here."""
    if x is None or not any(jax.typeof(x).sharding.spec):
        return x
    return jax.reshard(x, P())


def _check_open_when_run(mailbox: Mailbox) -> None:
    """Each time the compiled call runs, every device asks the host whether the mailbox is still
    open (`Mailbox.check_open_at_run_time`): on the reference path no kernel finds a closed
    mailbox halted. Only where the mailbox has no memory: on CUDA devices that round trip
    would cost every call."""

    def check():
        jax.debug.callback(mailbox.check_open_at_run_time, partitioned=True)
        return ()

    _manual_over_every_axis(check)


def _lower_on_mailbox_mesh(ctx, indices, *, mailbox):
    # Inside shard_map the axis context holds the mesh the call is partitioned on; it is
    # abstract (no devices) only where no concrete mesh is known then.
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is not None:
        mailbox.check_mesh(mesh)
    return [indices]


# The identity on a call's indices whose lowering compares the call's mesh, devices included,
# with the mailbox's: while shard_map's body is traced only the abstract mesh is known.
_on_mailbox_mesh_p = jex_core.Primitive("jax_moe_publish_on_mailbox_mesh")
_on_mailbox_mesh_p.def_abstract_eval(lambda indices, *, mailbox: indices)
mlir.register_lowering(_on_mailbox_mesh_p, _lower_on_mailbox_mesh)


def _problem(mailbox, expert_weights, shared_output, scale) -> tuning.Problem:
    return tuning.Problem(
        hidden=mailbox.hidden, top_k=expert_weights.shape[1], routed_scaling_factor=float(scale),
        include_shared_expert=shared_output is not None,
        fp32_weights=jnp.dtype(expert_weights.dtype) == jnp.float32,
    )


def _table_epilogue(mailbox, fused_norm) -> str:
    """The epilogue the kernels fuse: with tp = 1 it runs in jnp after the direct kernel."""
    return "rmsnorm" if fused_norm and mailbox.tp > 1 else "none"


def _check_config(config, mailbox, problem, epilogue) -> None:
    """An explicit ``config`` fits these inputs, the mailbox and its result layout."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig, got {type(config).__name__}")
    expected = {**vars(problem), "tp": mailbox.tp, "epilogue": epilogue}
    for field, value in expected.items():
        if getattr(config, field) != value:
            raise ValueError(f"config.{field}={getattr(config, field)!r}: expected {value!r} for these inputs")
    allowed = {"allreduce": ("oneshot", "twoshot"), "reduce_scatter": ("reduce_scatter",)}[mailbox.result]
    if mailbox.tp > 1 and config.algorithm not in allowed:
        raise ValueError(f"config.algorithm={config.algorithm!r}: expected one of {allowed} for a "
                         f"result={mailbox.result!r} mailbox")


def moe_finalize_publish(
    routed_output: jax.Array,
    expert_weights: jax.Array,
    permuted_indices: jax.Array,
    shared_output: jax.Array | None = None,
    *,
    mailbox: Mailbox,
    routed_scaling_factor: float = 1.0,
    impl: str = "auto",
    config: KernelConfig | None = None,
    residual: jax.Array | None = None,
    norm_weight: jax.Array | None = None,
    norm_eps: float = 1e-6,
):
    """MoE finalize of this rank's experts, reduced over the TP group (one shard).

    Call inside ``jax.shard_map`` over ``mailbox.axis_name`` of ``mailbox.mesh`` (the same
    devices in the same places, compared when the call is lowered; manual over the other
    axes or not), with inputs whose partial varies along that axis (checked where shard_map
    tracks varying axes; with ``check_vma=False`` it warns once per mesh and axis). Every
    rank of the group makes every call, in the same order (never under a rank-dependent
    ``lax.cond``). A function compiled before `Mailbox.close` fails when it runs again
    where it reads the mailbox's memory (tp > 1 on GPUs) and on CPU (a host check).
    With ``tp`` ranks and rank ``r``'s partial

    ``p_r[t] = bf16( sum_k (w[t,k] * scale) * routed[idx[t,k]] + shared[t] )``

    (float32 accumulation in expert order; indices outside ``[0, num_rows)``,
    such as -1, are skipped and never read), the result is

    ``y[t] = bf16( sum_{r=0}^{tp-1} float32(p_r[t]) )``

    summed in rank order, so it is bitwise identical on every rank. A partial's
    -0.0 counts as +0.0. With tp = 1 it is ``p_0`` itself.

    With ``residual`` and ``norm_weight`` the reduce also applies the epilogue
    of a transformer layer, rounding to bf16 exactly at these points::

        residual_out[t] = bf16( float32(y[t]) + float32(residual[t]) )
        out[t] = bf16( x * rsqrt(mean(x^2) + norm_eps) * float32(norm_weight) ),  x = float32(residual_out[t])

    (mean over hidden, in float32), and returns ``(out, residual_out)``, both
    bitwise identical on every rank. With tp = 1 the direct kernel computes
    ``y`` and ``jnp`` the epilogue, with the same rounding points.

    Under ``jax.vmap`` a batch is one call over all of its tokens, element b's after element
    b - 1's (with a ``reduce_scatter`` mailbox each element's m padded to a multiple of tp),
    so ``capacity_m`` must hold them all; each element gets its own result. ``norm_weight``
    is then the same for the whole batch.

    ``jax.grad``, ``jax.vjp`` and ``jax.jvp`` pass through on every path
    (`jax_moe_publish.derivatives`): the forward is this call's, the derivative that of the
    float32 math at the forward's values, every bf16 rounding taken as the identity
    (straight-through), in jnp. ``permuted_indices`` has none (its cotangent is float0), nor
    have ``routed_scaling_factor`` and ``norm_eps``, static floats: a traced one raises.

    Parameters
    ----------
    routed_output : bf16 [num_rows, hidden]
        This rank's routed expert output rows.
    expert_weights : bf16 or float32 [m, top_k]
    permuted_indices : int32 [m, top_k]
    shared_output : bf16 [m, hidden] or None
        This rank's shared expert output.
    mailbox : Mailbox
        Made on the mesh the call runs on, for its axis, ``hidden`` and ``capacity_m >= m``.
    routed_scaling_factor : float
    impl : {"auto", "kernel", "reference"}
        ``auto``: the kernels on CUDA devices, the pure-JAX reference elsewhere,
        where the tuning table finds XLA's path faster (``xla``, for example
        tp = 1 at m = 1 with a shared expert) and where the mailbox's TP group
        spans hosts (it warns once per mailbox then; ``kernel`` raises).
    config : KernelConfig, optional
        The algorithm (``oneshot`` or ``twoshot`` for an all-reduce mailbox,
        ``reduce_scatter`` for a reduce-scatter one) and launch shapes; by default
        the tuning table's choice for the problem and its m (`jax_moe_publish.tuning`).
        With the epilogue and tp > 1 it must have ``epilogue="rmsnorm"``, which
        ``oneshot``, ``twoshot`` and ``reduce_scatter`` all take
        (`config.EPILOGUE_ALGORITHMS`), ``twoshot`` unfused only
        (``fuse_reduce=False``: the owner of a token normalizes its row and fans
        both outputs out).
    residual : bf16, the shape of the result, or None
        The residual stream: [m, hidden], or for a ``reduce_scatter`` mailbox
        this rank's rows [ceil(m / tp), hidden] (row i: token ``i * tp + rank``;
        a row of no token is not read).
    norm_weight : bf16 [hidden] or None
        RMSNorm weight. Give both ``residual`` and ``norm_weight``, or neither.
    norm_eps : float
        Added to the mean square; finite and > 0 in float32.

    Returns
    -------
    bf16 [m, hidden], or for a ``reduce_scatter`` mailbox bf16
    [ceil(m / tp), hidden]: row i holds token ``i * tp + rank``, zero past m.
    With the epilogue, ``(out, residual_out)`` of that shape each, both zero
    in rows of no token.
    """
    checks.check_static_scalars(routed_scaling_factor=routed_scaling_factor, norm_eps=norm_eps)
    _check_inputs(routed_output, expert_weights, permuted_indices, shared_output, mailbox,
                  routed_scaling_factor)
    fused_norm = _check_epilogue(residual, norm_weight, norm_eps, mailbox, expert_weights.shape[0])
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    _check_axis(mailbox)
    _check_varying(mailbox, dict(routed_output=routed_output, expert_weights=expert_weights,
                                 permuted_indices=permuted_indices, shared_output=shared_output))
    problem = _problem(mailbox, expert_weights, shared_output, routed_scaling_factor)
    if config is not None:
        _check_config(config, mailbox, problem, _table_epilogue(mailbox, fused_norm))
    scale, norm_eps = float(routed_scaling_factor), float(norm_eps)
    path = _resolve_impl(impl, mailbox)
    if not mailbox.on_cuda:
        _check_open_when_run(mailbox)
    publish = _folding_vmap_batches(mailbox, functools.partial(
        _publish, mailbox=mailbox, impl=path, config=config, problem=problem,
        scale=scale, norm_eps=norm_eps,
        # Where XLA's own path is faster (the table's "xla"), auto takes it, on every device.
        table_may_choose_xla=impl == "auto" and config is None,
    ))
    # The derivative wraps the fold, so that jax.vmap batches the kernels' call and the jnp
    # tangent each its own way (`derivatives`).
    publish = derivatives.straight_through(publish, axis_name=mailbox.axis_name, result=mailbox.result,
                                           scale=scale, norm_eps=norm_eps)
    arrays = (routed_output, expert_weights, permuted_indices, shared_output, residual, norm_weight)
    return publish(*map(_replicated_along_explicit_axes, arrays))


def _publish(routed_output, expert_weights, permuted_indices, shared_output, residual, norm_weight, *,
             mailbox, impl, config, problem, scale, norm_eps, table_may_choose_xla):
    """One checked call, unbatched: under jax.vmap it holds the tokens of the whole batch."""
    permuted_indices = _on_mailbox_mesh_p.bind(permuted_indices, mailbox=mailbox)
    m = expert_weights.shape[0]
    fused_norm = residual is not None
    table_epilogue = _table_epilogue(mailbox, fused_norm)
    if table_may_choose_xla and tuning.algorithm_for(problem, mailbox.tp, m, mailbox.result,
                                                     table_epilogue).algorithm == "xla":
        impl = "reference"
    epilogue = dict(residual=residual, norm_weight=norm_weight, norm_eps=norm_eps)
    if impl == "reference":
        return reference.moe_finalize_publish(
            routed_output, expert_weights, permuted_indices, shared_output,
            axis_name=mailbox.axis_name, routed_scaling_factor=scale, result=mailbox.result, **epilogue,
        )
    if config is None:
        config = tuning.kernel_config(problem, tp=mailbox.tp, m=m, result=mailbox.result, epilogue=table_epilogue)
    set_id = _launch.load(default_store().get(config), mailbox.local_ordinals)
    if fused_norm and mailbox.tp == 1:
        y = _call_kernels(set_id, mailbox, routed_output, expert_weights, permuted_indices, shared_output,
                          scale, {})
        return reference.add_rmsnorm(y, residual, norm_weight, eps=norm_eps)
    return _call_kernels(set_id, mailbox, routed_output, expert_weights, permuted_indices, shared_output,
                         scale, epilogue if fused_norm else {})


def _folding_vmap_batches(mailbox: Mailbox, publish):
    """``publish`` (of the six array arguments) under ``jax.vmap``: one call whose tokens are
    the whole batch's (`_fold_batch`), on every path, so the kernels' FFI call never sees a
    batch."""

    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return publish(*arrays)

    @call.def_vmap
    def fold(batch, batched, *arrays):
        folded, unfold = _fold_batch(mailbox, batch, batched, *arrays)
        out = unfold(call(*folded))
        return out, jax.tree.map(lambda _: True, out)

    return call


def _fold_batch(mailbox, batch, batched, routed_output, expert_weights, permuted_indices, shared_output,
                residual, norm_weight):
    """A jax.vmap batch of ``batch`` calls as the arguments of one call, and the function that
    splits that call's result into the batch's results.

    Batch element b's tokens follow element b - 1's. With a reduce_scatter mailbox each
    element's m tokens are padded to a multiple of tp with tokens that read nothing, so that
    rank r's rows of every element stay in order (row i: token ``i * tp + r``); with the
    epilogue the rows of padding tokens are zeroed, as the rows of no token are. Batched
    routed rows are stacked and each element's valid indices moved to its block."""
    if batch == 0:
        raise ValueError("jax.vmap over an empty batch: expected at least one batch element")
    if batched[5]:
        raise ValueError("norm_weight: under jax.vmap it differs between batch elements, but one call "
                         "takes one norm weight; expected the same norm_weight for the whole batch "
                         "(in_axes=None for it)")
    tp, m, hidden = mailbox.tp, expert_weights.shape[-2], mailbox.hidden
    scatter = mailbox.result == "reduce_scatter"
    tokens = protocol.owned_rows(m, tp) * tp if scatter else m
    if batch * tokens > mailbox.capacity_m:
        padded = f", padded to a multiple of tp={tp}" if tokens != m else ""
        raise ValueError(
            f"jax.vmap over a batch of {batch}: one call takes the batch's tokens, {batch} x {tokens} "
            f"(m={m}{padded}) = {batch * tokens}, but the mailbox holds capacity_m={mailbox.capacity_m}; "
            f"expected a Mailbox with capacity_m >= {batch * tokens}, or a smaller batch"
        )

    def per_element(x, is_batched):
        return x if is_batched else jnp.broadcast_to(x, (batch, *x.shape))

    def as_tokens(x, fill):  # [batch, m, ...] -> [batch * tokens, ...]
        x = jnp.pad(x, [(0, 0), (0, tokens - m)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(batch * tokens, *x.shape[2:])

    routed_batched, weights_batched, indices_batched, shared_batched, residual_batched, _ = batched
    indices = per_element(permuted_indices, indices_batched)
    if routed_batched:
        num_rows = routed_output.shape[1]
        if batch * num_rows >= 2**31:
            raise ValueError(f"jax.vmap over a batch of {batch} with routed_output batched: one call takes "
                             f"{batch} x {num_rows} = {batch * num_rows} routed rows; expected fewer than 2**31")
        valid = (indices >= 0) & (indices < num_rows)
        block = (jnp.arange(batch, dtype=jnp.int32) * num_rows)[:, None, None]
        indices = jnp.where(valid, indices + block, -1)
        routed_output = routed_output.reshape(batch * num_rows, hidden)
    folded = (
        routed_output,
        as_tokens(per_element(expert_weights, weights_batched), 0),
        as_tokens(indices, -1),
        None if shared_output is None else as_tokens(per_element(shared_output, shared_batched), 0),
        None if residual is None else per_element(residual, residual_batched).reshape(-1, hidden),
        norm_weight,
    )

    def unfold(out):
        out = jax.tree.map(lambda x: x.reshape(batch, -1, hidden), out)
        if residual is None or tokens == m:
            return out
        has_token = reference.rows_with_tokens(protocol.owned_rows(m, tp), m, mailbox.axis_name)[None]
        return jax.tree.map(lambda x: jnp.where(has_token, x, jnp.zeros_like(x)), out)

    return folded, unfold


def _resolve_impl(impl: str, mailbox: Mailbox) -> str:
    """``kernel`` or ``reference`` for this mailbox; ``auto`` falls back where the kernels cannot run."""
    if mailbox.spans_hosts:
        if impl == "kernel":
            raise ValueError(f"impl='kernel': mailbox={mailbox!r} cannot run the kernels, as NVLink "
                             f"does not join its hosts: {mailbox.hosts_message()}. Use impl='auto' "
                             "(XLA's collectives) or keep each TP group on one host")
        if impl == "auto" and mailbox.on_cuda and mailbox.first_host_fallback():
            warnings.warn(f"mailbox={mailbox!r}: {mailbox.hosts_message()}; NVLink does not join hosts, "
                          "so moe_finalize_publish runs the reference (XLA's psum over NCCL) instead of "
                          "the kernels", RuntimeWarning, stacklevel=3)
        return "reference" if impl == "auto" else impl
    if impl == "auto":
        return "kernel" if mailbox.on_cuda else "reference"
    if impl == "kernel" and not mailbox.on_cuda:
        raise ValueError(f"impl='kernel': mailbox={mailbox!r} is not on CUDA devices; use impl='auto' "
                         "or 'reference'")
    return impl


def _call_kernels(set_id, mailbox, routed_output, expert_weights, permuted_indices, shared_output, scale,
                  epilogue):
    """The FFI call of a loaded kernel set, one per device; ``epilogue`` holds residual,
    norm_weight and norm_eps for the fused epilogue, or is empty."""
    norm_eps = {"norm_eps": epilogue["norm_eps"]} if epilogue else {}

    def call(routed_output, expert_weights, permuted_indices, shared_output, epilogue_arrays):
        epilogue = {**epilogue_arrays, **norm_eps}
        # The results have the reference's types, varying-axes marking included: the
        # all-reduce is identical on every rank, like a psum.
        result_type = jax.eval_shape(
            lambda: reference.moe_finalize_publish(
                routed_output, expert_weights, permuted_indices, shared_output,
                axis_name=mailbox.axis_name, routed_scaling_factor=scale, result=mailbox.result, **epilogue,
            )
        )
        return _launch.call(set_id, mailbox.id if mailbox.tp > 1 else 0, result_type, routed_output,
                            expert_weights, permuted_indices, shared_output, mailbox.hidden, epilogue)

    arrays = {name: x for name, x in epilogue.items() if name != "norm_eps"}
    return _manual_over_every_axis(call, routed_output, expert_weights, permuted_indices, shared_output, arrays)


def sharded_moe_finalize_publish(
    mailbox: Mailbox,
    routed_output: jax.Array,
    expert_weights: jax.Array,
    permuted_indices: jax.Array,
    shared_output: jax.Array | None = None,
    *,
    routed_scaling_factor: float = 1.0,
    impl: str = "auto",
    config: KernelConfig | None = None,
    residual: jax.Array | None = None,
    norm_weight: jax.Array | None = None,
    norm_eps: float = 1e-6,
):
    """`moe_finalize_publish` on global arrays whose leading axis is the TP rank.

    Inputs are ``[tp, ...]`` stacks of the per-rank arguments (routed_output
    ``[tp, num_rows, hidden]``, expert_weights and permuted_indices
    ``[tp, m, top_k]``, shared_output ``[tp, m, hidden]``), laid out along
    ``mailbox.axis_name`` of ``mailbox.mesh`` and replicated over its other
    axes; rank r's arguments are at index r.

    ``residual`` has the layout of the result: all-reduce ``[m, hidden]``
    (replicated), reduce-scatter ``[tp, ceil(m/tp), hidden]`` (index r: rank
    r's rows). ``norm_weight`` is ``[hidden]`` (replicated).

    Returns
    -------
    All-reduce mailbox: bf16 [m, hidden], the group's sum (replicated).
    Reduce-scatter mailbox: bf16 [tp, ceil(m/tp), hidden]; index r holds
    rank r's rows (tokens ``i * tp + r``).
    With the epilogue, ``(out, residual_out)``, each of that layout.
    """
    _check_stacks(mailbox, dict(routed_output=routed_output, expert_weights=expert_weights,
                                permuted_indices=permuted_indices, shared_output=shared_output,
                                residual=residual, norm_weight=norm_weight))
    axis = mailbox.axis_name
    args = [routed_output, expert_weights, permuted_indices] + ([] if shared_output is None else [shared_output])
    scatter = mailbox.result == "reduce_scatter"
    in_specs = [P(axis)] * len(args)
    # The epilogue's inputs come last; the per-shard op checks them.
    if residual is not None:
        args.append(residual)
        in_specs.append(P(axis) if scatter else P())
    if norm_weight is not None:
        args.append(norm_weight)
        in_specs.append(P())
    args = [jax.device_put(x, jax.sharding.NamedSharding(mailbox.mesh, spec)) for x, spec in zip(args, in_specs)]
    ranked_count = 4 if shared_output is not None else 3

    def shard(*local):
        routed, weights, indices = (x[0] for x in local[:3])
        shared = local[3][0] if ranked_count > 3 else None
        rest = iter(local[ranked_count:])
        local_residual = next(rest) if residual is not None else None
        local_weight = next(rest) if norm_weight is not None else None
        if scatter and local_residual is not None:
            local_residual = local_residual[0]
        result = moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox,
                                      routed_scaling_factor=routed_scaling_factor, impl=impl, config=config,
                                      residual=local_residual, norm_weight=local_weight, norm_eps=norm_eps)
        return jax.tree.map(lambda out: out[None], result) if scatter else result

    out_specs = P(axis) if scatter else P()
    return jax.shard_map(shard, mesh=mailbox.mesh, in_specs=tuple(in_specs), out_specs=out_specs)(*args)
