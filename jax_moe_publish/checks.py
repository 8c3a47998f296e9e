"""Checks of the public arguments, written once for the op (`op`), its pure-JAX semantics
(`reference`) and the `Mailbox`.

Each raises TypeError or ValueError naming the argument, the value received and what was
expected, while the call is traced: before anything runs, and before a bad shape turns into
a broadcasting error or a bad float into NaN.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_moe_publish import protocol
from jax_moe_publish._abi import FP8_GROUP, RESULTS
from jax_moe_publish.block_scaled import BlockScaled
from jax_moe_publish.experts_config import FP8_BLOCK
from jax_moe_publish.experts_layout import PreparedExperts, Tiling


def checked_int(name: str, value) -> int:
    """The public argument ``name`` as an int. TypeError for a bool (True is no size), for a
    float (64.0 too: the message says to write 64) and for anything else not integral."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, bool):
        got = "a bool"
    elif isinstance(value, numbers.Real) and float(value).is_integer():
        got = f"a float; write {int(value)}"
    else:
        got = type(value).__name__
    raise TypeError(f"{name}={value!r}: expected an int, got {got}")


def checked_float(name: str, value) -> float:
    """The public argument ``name`` as a float. TypeError for a bool and for anything that is
    not a Python or NumPy real number: a jax array has no value at trace time, where the
    kernels are chosen."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    got = "a bool" if isinstance(value, bool) else type(value).__name__
    raise TypeError(f"{name}={value!r}: expected a float, got {got}")


def _in_float32(value: float) -> np.float32:
    """``value`` as the kernels take it: rounded to float32, infinite beyond its range (no
    overflow warning)."""
    with np.errstate(over="ignore"):
        return np.float32(value)


def check_static_scalars(**scalars) -> None:
    """The op's floats are fixed when the call is traced (the kernels are compiled for them), so
    a traced value (under jax.grad, jax.jvp, jax.vmap or jax.jit) has no meaning, and the op
    has no derivative with respect to them."""
    for name, value in scalars.items():
        if isinstance(value, jax.core.Tracer):
            raise TypeError(
                f"{name}: expected a Python float, got a traced {jax.typeof(value).str_short()} "
                f"({type(value).__name__}); {name} is fixed when the call is traced, so the op has no derivative "
                f"with respect to it and takes no traced value (jax.jit and jax.checkpoint of the op trace its "
                f"float arguments too: bind {name} with functools.partial, or mark it static)"
                + _STATIC_SCALAR_HINTS.get(name, "")
            )


_STATIC_SCALAR_HINTS = {
    "routed_scaling_factor": "; for a learned scale, multiply expert_weights by it and pass 1.0",
}


def check_scale(routed_scaling_factor) -> float:
    """``routed_scaling_factor`` as a float that stays finite in float32, where the kernels
    and the reference multiply by it."""
    scale = checked_float("routed_scaling_factor", routed_scaling_factor)
    if not np.isfinite(_in_float32(scale)):
        raise ValueError(f"routed_scaling_factor={routed_scaling_factor!r}: expected a float that is finite "
                         f"in float32 (|x| <= {np.finfo(np.float32).max:.8g}), the precision the kernels use")
    return scale


def check_norm_eps(norm_eps, name: str = "norm_eps") -> float:
    """``norm_eps`` (the argument ``name``) as a float that is finite and > 0 in float32:
    RMSNorm adds it in float32, and 0 or less gives NaN or infinity for a zero row."""
    eps = checked_float(name, norm_eps)
    if not (np.isfinite(_in_float32(eps)) and _in_float32(eps) > 0):
        raise ValueError(f"{name}={norm_eps!r}: expected a finite float > 0 (as float32)")
    return eps


def check_result(result) -> None:
    """``result`` names a layout of the group's sum (`_abi.RESULTS`)."""
    if result not in RESULTS:
        raise ValueError(f"result={result!r}: expected one of {RESULTS}")


def check_array(name, x, ndim, dtypes, shape=None) -> None:
    """``x`` is an array of ``ndim`` dimensions (None: any) of one of ``dtypes`` and, if given, ``shape``."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name}.shape={tuple(x.shape)}: expected {ndim} dimensions")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in dtypes]:
        expected = " or ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{name}.dtype={jnp.dtype(x.dtype).name}: expected {expected}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(x.shape)}: expected {tuple(shape)}")


def check_finalize_arrays(routed_output, expert_weights, permuted_indices, *, mailbox_hidden=None,
                          row_dtypes=(jnp.bfloat16,)) -> tuple[int, int]:
    """The finalize's routed rows, weights and indices; ``(m, top_k)``. ``mailbox_hidden``: the
    row width a mailbox fixes (None: routed_output's own)."""
    check_array("routed_output", routed_output, 2, row_dtypes)
    if mailbox_hidden is not None and routed_output.shape[1] != mailbox_hidden:
        raise ValueError(
            f"routed_output.shape={tuple(routed_output.shape)}: hidden {routed_output.shape[1]} "
            f"differs from the mailbox's hidden={mailbox_hidden}"
        )
    check_array("expert_weights", expert_weights, 2, [jnp.bfloat16, jnp.float32])
    m, top_k = expert_weights.shape
    check_array("permuted_indices", permuted_indices, 2, [jnp.int32])
    if tuple(permuted_indices.shape) != (m, top_k):
        raise ValueError(f"permuted_indices.shape={tuple(permuted_indices.shape)}: expected {(m, top_k)}, "
                         f"one index per weight of expert_weights.shape={tuple(expert_weights.shape)}")
    return m, top_k


def check_shared_output(shared_output, expert_weights, hidden, *, hidden_of: str,
                        row_dtypes=(jnp.bfloat16,)) -> None:
    """One shared expert row per token, as wide as the rows (``hidden_of`` says whose width)."""
    if shared_output is None:
        return
    check_array("shared_output", shared_output, 2, row_dtypes)
    m = expert_weights.shape[0]
    if tuple(shared_output.shape) != (m, hidden):
        raise ValueError(f"shared_output.shape={tuple(shared_output.shape)}: expected {(m, hidden)}, "
                         f"one row per token of expert_weights.shape={tuple(expert_weights.shape)}, "
                         f"of {hidden_of}={hidden}")


def result_rows(m: int, tp: int, result: str) -> tuple[int, str]:
    """Rows of the result of ``m`` tokens in the layout ``result``, and the rule that says why."""
    if result == "reduce_scatter":
        return protocol.owned_rows(m, tp), f"ceil(m / tp) = ceil({m} / {tp}) rows"
    return m, f"m = {m} rows"


def check_epilogue(residual, norm_weight, norm_eps, *, default_eps, rows, rule, hidden) -> bool:
    """Whether the call has the epilogue; raises for half of it, for bad values, and for a
    norm_eps other than ``default_eps`` without it (nothing would read it). ``rows`` and
    ``rule``: the result's rows and why (`result_rows`)."""
    checked_float("norm_eps", norm_eps)
    if residual is None and norm_weight is None:
        if norm_eps != default_eps:
            raise ValueError(f"norm_eps={norm_eps!r}: given without the epilogue, which alone uses it; pass "
                             f"residual and norm_weight too, or leave norm_eps at its default {default_eps}")
        return False
    for name, value, other in (("residual", residual, "norm_weight"), ("norm_weight", norm_weight, "residual")):
        if value is None:
            raise ValueError(f"{name}=None: the epilogue needs both residual and norm_weight; "
                             f"{other} was given, so pass {name} too (or neither)")
    check_epilogue_arrays(residual, norm_weight, shape=(rows, hidden), why=f"{rule}, the shape of the result")
    check_norm_eps(norm_eps)
    return True


FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)


def check_out_dtype(out_dtype, out_scale, *, with_epilogue: bool, hidden: int) -> bool:
    """Whether the call's ``out`` is FP8 (`reference.quantize_fp8`): ``out_dtype`` None or
    bfloat16 (the default) or float8_e4m3fn, FP8 only from the epilogue, with a dynamic
    scale only where 128-column groups tile hidden, and ``out_scale`` only with FP8."""
    try:
        dtype = jnp.dtype(out_dtype) if out_dtype is not None else jnp.dtype(jnp.bfloat16)
    except TypeError:
        dtype = None
    if dtype not in (jnp.dtype(jnp.bfloat16), FP8_DTYPE):
        raise ValueError(f"out_dtype={out_dtype!r}: expected None, jnp.bfloat16 or jnp.float8_e4m3fn")
    fp8 = dtype == FP8_DTYPE
    if out_scale is not None and not fp8:
        raise ValueError(f"out_scale: given with out_dtype={dtype.name}; a scale applies only to "
                         "out_dtype=jnp.float8_e4m3fn")
    if fp8 and not with_epilogue:
        raise ValueError("out_dtype=float8_e4m3fn: only the epilogue's out is quantized; pass residual and "
                         "norm_weight too")
    if fp8 and out_scale is None:
        check_fp8_groups(hidden)
    if out_scale is not None:
        check_fp8_scale(out_scale)
    return fp8


def check_fp8_groups(hidden: int) -> None:
    if hidden % FP8_GROUP:
        raise ValueError(f"hidden={hidden}: a dynamic FP8 scale covers {FP8_GROUP} columns, so hidden must be a "
                         f"multiple of {FP8_GROUP}; give a static out_scale instead")


def check_fp8_scale(scale):
    """A static FP8 scale: a float32 scalar (shape () or (1,)); returned as a scalar."""
    check_array("out_scale", scale, None, [jnp.float32])
    if tuple(scale.shape) not in ((), (1,)):
        raise ValueError(f"out_scale.shape={tuple(scale.shape)}: expected a scalar, () or (1,)")
    return scale.reshape(())


def check_epilogue_arrays(residual, norm_weight, *, shape, why: str) -> None:
    """The epilogue's bf16 residual of ``shape`` (``why`` says whose) and its norm weight, one
    per column."""
    check_array("residual", residual, 2, [jnp.bfloat16])
    if tuple(residual.shape) != tuple(shape):
        raise ValueError(f"residual.shape={tuple(residual.shape)}: expected {tuple(shape)} ({why})")
    check_array("norm_weight", norm_weight, 1, [jnp.bfloat16], shape=(shape[1],))


def check_axis_bound(axis_name, who: str, hint: str) -> int:
    """The size of ``axis_name``, which a shard_map (or another named-axis transform) binds
    around the call; ValueError naming ``who`` and ``hint`` (where to call it) if none does.
    Without it JAX's collectives raise a bare NameError."""
    try:
        return lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"{who}: axis {axis_name!r} is not bound; call it inside {hint}") from None


class ExpertsShape(NamedTuple):
    """The shape of a call of the experts op."""

    m: int
    top_k: int
    experts: int
    hidden: int
    intermediate: int
    fused: bool
    block_scaled: bool = False
    """Some operand is a `BlockScaled` FP8 array."""
    tiling: Tiling | None = None
    """The weights came as a `PreparedExperts` in this tiled order."""
    fp8_weights: bool = False
    """Every weight is a `BlockScaled` of `FP8_BLOCK` x `FP8_BLOCK` blocks, and x is bf16 or
    e4m3 tokens (`fp8_tokens`): what the e4m3 kernels take."""
    fp8_tokens: bool = False
    """With `fp8_weights`, x is a `BlockScaled` of 1 x `FP8_BLOCK` blocks (a scale per token
    and 128 channels): what the kernels with e4m3 tokens take."""
    prepared_shared: bool = False
    """The `PreparedExperts` holds the shared expert after the routed ones (``experts`` does
    not count it)."""


def check_operand(name, a, ndim, shape=None) -> bool:
    """``a`` is a bf16 array of ``ndim`` dimensions (and ``shape``), or a `BlockScaled` of such a
    shape: float8_e4m3fn values, float32 scales of the same leading dimensions whose last two
    divide the values' exactly. True for a `BlockScaled`."""
    if not isinstance(a, BlockScaled):
        check_array(name, a, ndim, [jnp.bfloat16], shape)
        return False
    check_array(f"{name}.values", a.values, ndim, [jnp.float8_e4m3fn], shape)
    check_array(f"{name}.scales", a.scales, ndim, [jnp.float32])
    values, scales = tuple(a.values.shape), tuple(a.scales.shape)
    if scales[:-2] != values[:-2] or any(s < 1 or v % s for v, s in zip(values[-2:], scales[-2:])):
        raise ValueError(f"{name}.scales.shape={scales}: expected {values[:-2] + ('R', 'C')} with R and C dividing "
                         f"{name}.values.shape={values}'s last two (one scale per block)")
    return True


def check_expert_arrays(x, expert_ids, gate_up, down, shared=None) -> ExpertsShape:
    """The experts op's arrays: ``x`` bf16 [m, hidden], ``expert_ids`` int32 [m, top_k], and
    the weights (`check_expert_weights`), or a `PreparedExperts` as ``gate_up`` with ``down``
    None; ``shared`` None or the shared expert's weights (`check_expert_weights` of one
    expert), which a `PreparedExperts` may hold instead. Their `ExpertsShape`."""
    scaled = check_operand("x", x, 2)
    m, hidden = x.shape
    check_array("expert_ids", expert_ids, 2, [jnp.int32])
    if expert_ids.shape[0] != m:
        raise ValueError(f"expert_ids.shape={tuple(expert_ids.shape)}: expected {m} rows, one per token of "
                         f"x.shape={tuple(x.shape)}")
    top_k = expert_ids.shape[1]
    if top_k < 1:
        raise ValueError(f"expert_ids.shape={tuple(expert_ids.shape)}: expected at least one expert per token")
    tiling, prepared_shared = None, False
    if isinstance(gate_up, PreparedExperts):
        if down is not None:
            raise ValueError("down: expected None with a PreparedExperts as gate_up (it holds down), got "
                             f"{type(down).__name__}")
        if gate_up.shared and shared is not None:
            raise ValueError("shared: expected None with a PreparedExperts that holds the shared expert "
                             "(prepare_experts(..., shared=...) put it after the routed experts)")
        tiling, prepared_shared = gate_up.tiling, gate_up.shared
        gate_up, down = gate_up.gate_up, gate_up.down
        if isinstance(gate_up, BlockScaled) != isinstance(down, BlockScaled):
            scaled = "gate_up" if isinstance(gate_up, BlockScaled) else "down"
            raise ValueError(f"gate_up: a PreparedExperts whose {scaled} alone is a BlockScaled; expected both "
                             "weights bf16 or both BlockScaled (prepare_experts makes them so)")
    elif down is None:
        raise ValueError("down: expected bf16 [experts, intermediate, hidden], got None (only a PreparedExperts "
                         "as gate_up holds down)")
    experts, _, intermediate, fused, weights_scaled = check_expert_weights(gate_up, down, hidden=hidden,
                                                                          hidden_from=f"x.shape={tuple(x.shape)}")
    weights = [down, *(gate_up if isinstance(gate_up, (tuple, list)) else (gate_up,))]
    if shared is not None:
        check_shared_expert(shared, hidden=hidden, hidden_from=f"x.shape={tuple(x.shape)}")
    e4m3_weights = all(isinstance(w, BlockScaled) and w.block == (FP8_BLOCK, FP8_BLOCK) for w in weights)
    fp8_tokens = e4m3_weights and scaled and x.block == (1, FP8_BLOCK)
    fp8_weights = e4m3_weights and (not scaled or fp8_tokens)
    return ExpertsShape(m, top_k, experts - prepared_shared, hidden, intermediate, fused,
                        scaled or weights_scaled, tiling, fp8_weights, fp8_tokens, prepared_shared)


def check_expert_weights(gate_up, down, *, hidden: int | None = None, hidden_from: str = "",
                         name: str = "", stacked: bool = True) -> tuple[int, int, int, bool, bool]:
    """The experts' weights: ``gate_up`` bf16 [experts, hidden, 2 * intermediate] or a pair
    ``(gate, up)`` of bf16 [experts, hidden, intermediate], ``down`` bf16 [experts,
    intermediate, hidden] (``hidden`` as given, from ``hidden_from``, else down's), where any
    may instead be a `BlockScaled` FP8 array of that shape (`check_operand`). Not ``stacked``:
    one expert's, without the experts axis (``experts`` is then 1). ``name`` prefixes the
    arrays' names in errors. Returns ``(experts, hidden, intermediate, fused, some BlockScaled)``."""
    lead = 1 if stacked else 0
    axes = "experts, " if stacked else ""
    scaled = [check_operand(f"{name}down", down, 2 + lead)]
    experts = down.shape[0] if stacked else 1
    intermediate, down_hidden = down.shape[lead:]
    hidden = down_hidden if hidden is None else hidden
    if down_hidden != hidden or experts < 1 or intermediate < 1:
        raise ValueError(f"{name}down.shape={tuple(down.shape)}: expected [{axes}intermediate, hidden={hidden}] "
                         f"(hidden of {hidden_from}), {axes}intermediate >= 1")
    leading = (experts,) * lead
    if isinstance(gate_up, (tuple, list)):
        if len(gate_up) != 2:
            raise ValueError(f"{name}gate_up: a {type(gate_up).__name__} of {len(gate_up)} arrays, expected one "
                             f"array [{axes}hidden, 2 * intermediate] or a pair (gate, up)")
        for part_name, part in zip((f"{name}gate_up[0] (gate)", f"{name}gate_up[1] (up)"), gate_up):
            scaled.append(check_operand(part_name, part, 2 + lead, shape=(*leading, hidden, intermediate)))
        fused = False
    else:
        scaled.append(check_operand(f"{name}gate_up", gate_up, 2 + lead, shape=(*leading, hidden, 2 * intermediate)))
        fused = True
    return experts, hidden, intermediate, fused, any(scaled)


def check_shared_expert(shared, *, hidden: int | None = None,
                        hidden_from: str = "") -> tuple[int, int, int, bool, bool]:
    """The shared expert's weights ``shared = (gate_up, down)``: one expert's
    (`check_expert_weights` without the experts axis), named ``shared.*`` in errors."""
    if not isinstance(shared, (tuple, list)) or len(shared) != 2:
        raise ValueError(f"shared: expected a pair (gate_up, down) of the shared expert's weights, gate_up "
                         f"[hidden, 2 * intermediate] or (gate, up) and down [intermediate, hidden], got "
                         f"{type(shared).__name__}")
    return check_expert_weights(*shared, hidden=hidden, hidden_from=hidden_from, name="shared.", stacked=False)
