"""The checks of the op's arguments (`moe_finalize_publish`, `sharded_moe_finalize_publish`):
every one runs while the call is traced, before anything reaches a device, and names the
argument, its value and what was expected. The checks of single values and arrays that the
reference path shares are `jax_moe_publish.checks`."""

from __future__ import annotations

import warnings

import jax
from jax import lax

from jax_moe_publish import _abi, checks
from jax_moe_publish.config import MAX_TOP_K, KernelConfig
from jax_moe_publish.mailbox import Mailbox

IMPLS = ("auto", "kernel", "reference")


def check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")


def check_inputs(routed_output, expert_weights, permuted_indices, shared_output, mailbox,
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


def check_epilogue(residual, norm_weight, norm_eps, mailbox, m, *, default_eps: float) -> bool:
    """Whether the call has the epilogue (`checks.check_epilogue`), whose residual has the
    shape of the mailbox's result."""
    rows, rule = checks.result_rows(m, mailbox.tp, mailbox.result)
    return checks.check_epilogue(residual, norm_weight, norm_eps, default_eps=default_eps, rows=rows, rule=rule,
                                 hidden=mailbox.hidden)


def check_stacks(mailbox, arrays: dict) -> None:
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


def check_axis(mailbox: Mailbox) -> None:
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


def check_varying(mailbox: Mailbox, partial_inputs: dict) -> None:
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


def check_config(config, mailbox, problem, epilogue) -> None:
    """An explicit ``config`` fits these inputs, the mailbox and its result layout."""
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config: expected a KernelConfig, got {type(config).__name__}")
    # An FP8 out is the call's out_dtype, which sets the config's fp8_out.
    expected = {**vars(problem), "tp": mailbox.tp, "epilogue": epilogue, "fp8_out": "none"}
    for field, value in expected.items():
        if getattr(config, field) != value:
            raise ValueError(f"config.{field}={getattr(config, field)!r}: expected {value!r} for these inputs")
    allowed = tuple(name for name, spec in _abi.ALGORITHMS.items() if spec.group and spec.result == mailbox.result)
    if mailbox.tp > 1 and config.algorithm not in allowed:
        raise ValueError(f"config.algorithm={config.algorithm!r}: expected one of {allowed} for a "
                         f"result={mailbox.result!r} mailbox")
