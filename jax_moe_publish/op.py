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
from jax.extend import core as jex_core
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

from jax_moe_publish import _launch, batching, checks, derivatives, op_checks, reference, tuning
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.mailbox import Mailbox

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


def _table_epilogue(mailbox, with_epilogue) -> str:
    """The epilogue the kernels fuse: with tp = 1 it runs in jnp after the direct kernel."""
    return "rmsnorm" if with_epilogue and mailbox.tp > 1 else "none"


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
    out_dtype=None,
    out_scale: jax.Array | None = None,
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
    out_dtype : None, jnp.bfloat16 or jnp.float8_e4m3fn
        With the epilogue, ``jnp.float8_e4m3fn`` returns ``out`` quantized
        (`reference.quantize_fp8`): with a scale per row and 128 columns
        (amax * (1 / 448), float32 ``[rows, hidden / 128]``), or with ``out_scale``.
        At tp > 1 the epilogue kernels quantize where they make ``out``; elsewhere XLA
        does, after the epilogue, with the same bits.
    out_scale : float32 scalar or None
        A static FP8 scale (``out = e4m3(clip(out * (1 / out_scale), ±448))``); None
        for the per-group scales.

    Returns
    -------
    bf16 [m, hidden], or for a ``reduce_scatter`` mailbox bf16
    [ceil(m / tp), hidden]: row i holds token ``i * tp + rank``, zero past m.
    With the epilogue, ``(out, residual_out)`` of that shape each, both zero
    in rows of no token; with an FP8 ``out``, ``(out, out_scales, residual_out)``,
    or ``(out, residual_out)`` with ``out_scale``.
    """
    checks.check_static_scalars(routed_scaling_factor=routed_scaling_factor, norm_eps=norm_eps)
    op_checks.check_inputs(routed_output, expert_weights, permuted_indices, shared_output, mailbox,
                  routed_scaling_factor)
    with_epilogue = op_checks.check_epilogue(residual, norm_weight, norm_eps, mailbox, expert_weights.shape[0],
                                          default_eps=inspect.signature(moe_finalize_publish).parameters["norm_eps"].default)
    fp8 = checks.check_out_dtype(out_dtype, out_scale, with_epilogue=with_epilogue, hidden=mailbox.hidden)
    op_checks.check_impl(impl)
    op_checks.check_axis(mailbox)
    op_checks.check_varying(mailbox, dict(routed_output=routed_output, expert_weights=expert_weights,
                                 permuted_indices=permuted_indices, shared_output=shared_output))
    problem = _problem(mailbox, expert_weights, shared_output, routed_scaling_factor)
    if config is not None:
        op_checks.check_config(config, mailbox, problem, _table_epilogue(mailbox, with_epilogue))
    scale, norm_eps = float(routed_scaling_factor), float(norm_eps)
    path = _resolve_impl(impl, mailbox)
    if not mailbox.on_cuda:
        _check_open_when_run(mailbox)
    fp8_out = "none" if not fp8 else "group" if out_scale is None else "static"
    publish = batching.folding_vmap_batches(mailbox, functools.partial(
        _publish, mailbox=mailbox, impl=path, config=config, problem=problem,
        scale=scale, norm_eps=norm_eps, fp8_out=fp8_out,
        # Where XLA's own path is faster (the table's "xla"), auto takes it, on every device.
        table_may_choose_xla=impl == "auto" and config is None,
    ))
    # The derivative wraps the fold, so that jax.vmap batches the kernels' call and the jnp
    # tangent each its own way (`derivatives`).
    publish = derivatives.straight_through(publish, axis_name=mailbox.axis_name, result=mailbox.result,
                                           scale=scale, norm_eps=norm_eps, fp8_out=fp8_out)
    arrays = (routed_output, expert_weights, permuted_indices, shared_output, residual, norm_weight, out_scale)
    return publish(*map(_replicated_along_explicit_axes, arrays))


def _publish(routed_output, expert_weights, permuted_indices, shared_output, residual, norm_weight, out_scale, *,
             mailbox, impl, config, problem, scale, norm_eps, table_may_choose_xla, fp8_out):
    """One checked call, unbatched: under jax.vmap it holds the tokens of the whole batch. An
    FP8 out (``fp8_out``) is quantized in the epilogue kernels where they run (tp > 1), else
    in XLA after the bf16 epilogue: the same bits either way."""
    permuted_indices = _on_mailbox_mesh_p.bind(permuted_indices, mailbox=mailbox)
    m = expert_weights.shape[0]
    with_epilogue = residual is not None
    table_epilogue = _table_epilogue(mailbox, with_epilogue)
    if impl == "kernel" and config is None:
        # The table's one answer for this call: XLA's path (taken where auto may take it) or
        # the kernels' algorithm.
        choice = tuning.algorithm_for(problem, mailbox.tp, m, mailbox.result, table_epilogue,
                                      kernels_only=not table_may_choose_xla)
        if choice.algorithm == "xla":
            impl = "reference"
        else:
            config = tuning.kernel_config(problem, tp=mailbox.tp, m=m, result=mailbox.result,
                                          epilogue=table_epilogue, algorithm=choice.algorithm)
    epilogue = dict(residual=residual, norm_weight=norm_weight, norm_eps=norm_eps)
    if impl == "reference":
        return _quantized(reference.moe_finalize_publish(
            routed_output, expert_weights, permuted_indices, shared_output,
            axis_name=mailbox.axis_name, routed_scaling_factor=scale, result=mailbox.result, **epilogue,
        ), fp8_out, out_scale)
    if with_epilogue and mailbox.tp == 1:
        y = _call_kernels(_launch.load(config, mailbox.local_ordinals), mailbox, routed_output, expert_weights,
                          permuted_indices, shared_output, scale, {})
        return _quantized(reference.add_rmsnorm(y, residual, norm_weight, eps=norm_eps), fp8_out, out_scale)
    if fp8_out != "none":
        config = config.replace(fp8_out=fp8_out)
        epilogue["out_scale"] = out_scale
    return _call_kernels(_launch.load(config, mailbox.local_ordinals), mailbox, routed_output, expert_weights,
                         permuted_indices, shared_output, scale, epilogue if with_epilogue else {}, fp8_out)


def _quantized(result, fp8_out: str, out_scale):
    """The epilogue's bf16 ``(out, residual_out)`` with ``out`` quantized (`reference.quantize_fp8`):
    ``(out, out_scales, residual_out)``, or ``(out, residual_out)`` with a static scale."""
    if fp8_out == "none":
        return result
    out, residual_out = result
    quantized = reference.quantize_fp8(out, out_scale)
    return (quantized, residual_out) if fp8_out == "static" else (*quantized, residual_out)


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
                  epilogue, fp8_out: str = "none"):
    """The FFI call of a loaded kernel set, one per device; ``epilogue`` holds residual,
    norm_weight and norm_eps for the fused epilogue (and out_scale with a static FP8 out), or
    is empty."""
    norm_eps = {"norm_eps": epilogue["norm_eps"]} if epilogue else {}

    def call(routed_output, expert_weights, permuted_indices, shared_output, epilogue_arrays):
        epilogue = {**epilogue_arrays, **norm_eps}
        out_scale = epilogue.pop("out_scale", None)
        # The results have the reference's types, varying-axes marking included: the
        # all-reduce is identical on every rank, like a psum.
        result_type = jax.eval_shape(
            lambda: _quantized(reference.moe_finalize_publish(
                routed_output, expert_weights, permuted_indices, shared_output,
                axis_name=mailbox.axis_name, routed_scaling_factor=scale, result=mailbox.result, **epilogue,
            ), fp8_out, out_scale)
        )
        if fp8_out != "group":
            return _launch.call(set_id, mailbox.id if mailbox.tp > 1 else 0, result_type, routed_output,
                                expert_weights, permuted_indices, shared_output, mailbox.hidden, epilogue, out_scale)
        # The call's results come in `_abi.OPERANDS` order: out, residual_out, out_scales.
        out_type, scales_type, residual_type = result_type
        out, residual_out, out_scales = _launch.call(
            set_id, mailbox.id, (out_type, residual_type, scales_type), routed_output, expert_weights,
            permuted_indices, shared_output, mailbox.hidden, epilogue, None)
        return out, out_scales, residual_out

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
    out_dtype=None,
    out_scale: jax.Array | None = None,
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
    With the epilogue, ``(out, residual_out)``, each of that layout; with
    ``out_dtype=jnp.float8_e4m3fn``, ``(out, out_scales, residual_out)``, or
    ``(out, residual_out)`` with ``out_scale`` (replicated).
    """
    op_checks.check_stacks(mailbox, dict(routed_output=routed_output, expert_weights=expert_weights,
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
    if out_scale is not None:
        args.append(out_scale)
        in_specs.append(P())
    args = [jax.device_put(x, jax.sharding.NamedSharding(mailbox.mesh, spec)) for x, spec in zip(args, in_specs)]
    ranked_count = 4 if shared_output is not None else 3

    def shard(*local):
        routed, weights, indices = (x[0] for x in local[:3])
        shared = local[3][0] if ranked_count > 3 else None
        rest = iter(local[ranked_count:])
        local_residual = next(rest) if residual is not None else None
        local_weight = next(rest) if norm_weight is not None else None
        local_scale = next(rest) if out_scale is not None else None
        if scatter and local_residual is not None:
            local_residual = local_residual[0]
        result = moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox,
                                      routed_scaling_factor=routed_scaling_factor, impl=impl, config=config,
                                      residual=local_residual, norm_weight=local_weight, norm_eps=norm_eps,
                                      out_dtype=out_dtype, out_scale=local_scale)
        return jax.tree.map(lambda out: out[None], result) if scatter else result

    out_specs = P(axis) if scatter else P()
    return jax.shard_map(shard, mesh=mailbox.mesh, in_specs=tuple(in_specs), out_specs=out_specs)(*args)
