"""The second op: the routed experts of a decode batch, ``down(silu(gate(x)) * up(x))`` for every
token-expert pair, reading each active expert's weights once.

`moe_experts` computes one rank's shard; its rows feed `moe_finalize_publish` directly (row
``t * top_k + k`` is the pair's, the finalize's ``permuted_indices`` are ``t * top_k + k``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jax_moe_publish import (_launch, batching, checks, experts_gather, experts_layout, experts_tokamax, experts_tuning,
                             reference)
from jax_moe_publish.block_scaled import BlockScaled
from jax_moe_publish.experts_config import FP8_BLOCK, ExpertsConfig
from jax_moe_publish.experts_layout import PreparedExperts, Tiling

IMPLS = ("auto", "kernel", "gather", "tokamax", "reference")


def moe_experts(x: jax.Array, expert_ids: jax.Array, gate_up, down: jax.Array | None = None, *, shared=None,
                impl: str = "auto", config: ExpertsConfig | None = None):
    """The routed experts of one rank's shard at decode: every pair of a token and one of its
    ``top_k`` experts through that expert's SwiGLU MLP.

    For each pair ``p = t * top_k + k`` whose id ``e = expert_ids[t, k]`` lies in
    ``[0, experts)``, with bf16 operands and float32 sums::

        gate = bf16( x[t] @ W_gate[e] )        up = bf16( x[t] @ W_up[e] )
        h    = bf16( silu(gate) * up )         (float32)
        y[p] = bf16( h @ W_down[e] )

    and ``y[p] = 0`` for any other id (such as -1). On CUDA devices the kernels read the weights
    of the experts that some pair names, once per pass over up to ``8 * token_tiles`` of the
    expert's pairs, and nothing else; the result is the same bits on every run, whatever m and
    whatever the other tokens.

    Inside ``shard_map`` with the intermediate dimension sharded (tensor parallelism), each rank
    passes its slices (``intermediate = I / tp``) and gets its partial rows, which
    `moe_finalize_publish` sums over the group. With the fused ``gate_up`` a rank's slice must
    hold its gate columns followed by its up columns (as ``[tp, experts, hidden, 2 * I / tp]``
    sharded on the leading axis); the pair ``(gate, up)`` shards column-wise as it is.

    Under ``jax.vmap`` over ``x`` and ``expert_ids`` a batch is one call over all of its tokens
    (the weights are the same for the whole batch), routed as a call of that many tokens (auto's
    route, the kernels' launch shapes). ``jax.grad`` and ``jax.jvp`` pass through
    on every path: the derivative is JAX's derivative of the reference at the same inputs (its
    rules for the float32 math, `jax.lax.ragged_dot` and the bf16 conversions), the forward
    the route's. A derivative under ``jax.vmap`` needs ragged_dot's batching rule, which JAX
    lacks for a batched lhs.

    Parameters
    ----------
    x : bf16 [m, hidden]
        The tokens.
    expert_ids : int32 [m, top_k]
        Each token's experts; an id outside ``[0, experts)`` skips its pair.
    gate_up : bf16 [experts, hidden, 2 * intermediate], or a pair ``(gate, up)`` of bf16
        [experts, hidden, intermediate], or a `PreparedExperts`
        Gate and up projections: fused, gate columns first, or as two arrays (MaxText's
        ``wi_0`` and ``wi_1``). Or every weight in the kernels' tiled order
        (`prepare_experts`), with ``down`` left out: the kernels read it in whole blocks.
    down : bf16 [experts, intermediate, hidden]
        Down projections (MaxText's ``wo``).

        Each of ``x`` and the weights may instead be a `BlockScaled` FP8 array of its shape
        (e4m3 values, a float32 scale per block: DeepSeek-V3's weights with their 128 x 128
        ``weight_scale_inv``, transposed like the weights; or the epilogue's FP8 out and
        scales as ``x``). The reference and gather routes dequantize it to float32 and run
        that GEMM in float32, with the same rounding points. The kernels take e4m3 weights
        of 128 x 128 blocks (every weight, hidden and intermediate multiples of 128) with
        ``x`` bf16 or e4m3 of 1 x 128 blocks (a scale per token and 128 channels): each e4m3
        value widened to bf16 exactly, each 16-row K step's float32 sums times its weight
        block's scale (and its token's) added up (`ExpertsConfig.fp8_weights`, ``fp8_tokens``).
    shared : a pair ``(gate_up, down)``, optional
        The shared expert, which every token uses: ``gate_up`` bf16 [hidden, 2 * I_shared] or
        ``(gate, up)`` of [hidden, I_shared], ``down`` [I_shared, hidden] (this rank's slices,
        like the routed experts'; each may be a `BlockScaled`, as they may). Its rows come out as a second result through XLA's GEMMs
        (`reference.shared_expert`). The kernels compute it as one more expert, beside the
        routed ones in one pass over the weights, where `prepare_experts` holds it
        (``prepare_experts(gate_up, down, shared=...)``; then leave this None).
    impl : {"auto", "kernel", "gather", "tokamax", "reference"}
        ``kernel``: the kernels, on CUDA devices, where they take the shape (hidden a multiple
        of 32, intermediate of 16, at most 1024 experts and top-64); it raises elsewhere. A
        call of more than 8192 pairs (``m * top_k``, ``m * (top_k + 1)`` with a held shared
        expert) runs as consecutive kernel calls of at most that many, each reading its
        active experts' weights (`ExpertsConfig.max_m` tokens each, all with the call's
        config). ``gather``: pure JAX on any platform, the active experts' weights gathered by
        XLA and two batched GEMMs over every token (`experts_gather`; the same
        roundings, intermediates of ``min(m * top_k, experts) * m`` rows: a decode route).
        ``tokamax``: the reference's grouped GEMMs as tokamax's Mosaic GPU kernel, on CUDA
        devices with tokamax installed (the ``tokamax`` extra), bf16 operands, hidden and
        intermediate multiples of 64 (`experts_tokamax`); it raises elsewhere.
        ``reference``: the pure-JAX reference (`reference.moe_experts`, `jax.lax.ragged_dot`).
        ``auto``: on CUDA devices the route that a measured table (`experts_tuning`) found
        fastest at this shape and m (past its largest measured m, the route fastest there; the
        kernels only where they can run, tokamax where it imports, else the entry's next fastest
        route); at a shape the table lacks, the kernels up to 16 pairs per expert (``m * top_k
        <= 16 * E``, the measured range; `experts_tuning.auto_impl`), else the reference; on
        every other platform, the reference.
        With a `PreparedExperts`, ``auto`` is the kernels on CUDA devices where they take the
        shape; the other routes, and ``auto`` elsewhere, undo the tiling in every call first.
        e4m3 weights follow the table of bf16 weights (the kernels read half their bytes).
    config : ExpertsConfig, optional
        The kernels' launch shapes; by default `ExpertsConfig.for_shape`'s for this shape and m. With
        a `PreparedExperts`, the config it was prepared for, with ``tiled_weights``.

    Returns
    -------
    bf16 [m * top_k, hidden]: pair ``t * top_k + k`` in row ``t * top_k + k``. With a shared
    expert (``shared``, or held by the `PreparedExperts`), a pair ``(rows, shared_rows)``,
    ``shared_rows`` bf16 [m, hidden]: `moe_finalize_publish`'s ``shared``.
    """
    shape = checks.check_expert_arrays(x, expert_ids, gate_up, down, shared)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if config is not None:
        _check_config(config, _call_fields(shape), "the arrays' shape"
                      f"{' and of the tiled order they were prepared in' if shape.tiling else ''}")
    why_not = _why_no_kernels(shape, config)
    gpus = [device.local_hardware_id for device in jax.local_devices(backend="gpu")] if _has_gpus() else []
    if impl == "kernel" and (why_not or not gpus):
        raise ValueError(f"impl='kernel': {why_not or 'no CUDA device in this process'}; use impl='auto', "
                         "'gather' or 'reference'")
    why_no_tokamax = experts_tokamax.why_not(shape) if impl == "tokamax" else None
    if impl == "tokamax" and (why_no_tokamax or not gpus):
        raise ValueError(f"impl='tokamax': {why_no_tokamax or 'no CUDA device in this process'}; use impl='auto', "
                         "'kernel', 'gather' or 'reference'")
    if shape.tiling is not None:
        gate, up, down = gate_up.gate_up, None, gate_up.down
    else:
        gate, up = (gate_up, None) if shape.fused else gate_up
    # The pure routes on the weights' rows: tiled weights are put back in them first.
    pure = {name: _untiling(route_fn, shape.tiling, shape.prepared_shared)
            for name, route_fn in (("reference", _reference), ("gather", _gather), ("tokamax", _tokamax))}

    def route_for(m: int):
        """The route of a call of ``m`` tokens: the call's own, or under ``jax.vmap`` the batch's
        (one call over all of its tokens, routed as that call)."""
        call = shape._replace(m=m)
        route = impl
        if impl == "auto":
            # The table holds runs on CUDA devices: on any other platform auto runs the reference.
            route = "reference"
            if gpus and call.tiling is not None:
                # The other routes would undo the tiled order in every call.
                route = "kernel"
            elif gpus:
                route, otherwise = experts_tuning.auto_impl(hidden=call.hidden, intermediate=call.intermediate,
                                                            experts=call.experts, top_k=call.top_k, m=call.m)
                if route == "tokamax" and experts_tokamax.why_not(call):
                    route = otherwise
            if route == "kernel" and why_not:
                route = "reference"
        if route == "kernel":
            kernel_config = config or _default_config(call)
            set_id = _launch.load(kernel_config, gpus)

            def kernels(x, expert_ids, gate, up, down):
                return _call_kernels(set_id, x, expert_ids, gate, up, down, call.prepared_shared)

            return _on_cuda(_in_token_chunks(kernels, kernel_config.max_m), pure["reference"])
        if route == "tokamax" or (route == "gather" and impl == "auto"):
            return _on_cuda(pure[route], pure["reference"])
        return pure[route]

    # A batch is one call on every path: the kernels' FFI call and ragged_dot have no vmap rule
    # for a batched lhs, and the gather route reads each active expert once for the whole batch.
    experts = batching.folding_expert_batches(route_for)
    rows = _differentiable(experts, pure["reference"])(x, expert_ids, gate, up, down)
    if shared is None:
        return rows
    # Given apart from the routed experts' arrays: XLA's GEMMs, which batch and differentiate.
    return rows, reference.shared_expert(x, *shared)


def prepare_experts(gate_up, down, *, shared=None, config: ExpertsConfig | None = None) -> PreparedExperts:
    """One rank's expert weights in the kernels' tiled order, for `moe_experts`.

    ``gate_up`` and ``down`` are `moe_experts`'s weights (fused ``[experts, hidden, 2 *
    intermediate]`` or the pair ``(gate, up)``; ``[experts, intermediate, hidden]``): all bf16,
    or all e4m3 `BlockScaled` of 128 x 128 blocks (the kernels' FP8 weights: their values are
    tiled, their scales kept). ``shared``: the shared expert's ``(gate_up, down)`` as
    `moe_experts` takes it, of the same kind and intermediate as the routed experts': held
    after them, so that the kernels compute it with them and `moe_experts` returns its rows
    too. ``config``: the launch shapes the order is made for (`Tiling`:
    each kernel's ``warps_n`` and ``warp_cols``); by default `ExpertsConfig.for_shape`'s, which
    `moe_experts` then uses. A permutation of the bytes within each expert, exact;
    `PreparedExperts.untiled` undoes it. Pure JAX: run it once (under ``jit``, or inside
    ``shard_map`` on each rank's slices), not in every step.
    """
    experts, hidden, intermediate, fused, scaled = checks.check_expert_weights(gate_up, down, hidden_from="down")
    weights = [down, *(gate_up if not fused else (gate_up,))]
    if shared is not None:
        _, _, shared_intermediate, _, shared_scaled = checks.check_shared_expert(
            shared, hidden=hidden, hidden_from=f"down.shape={tuple(down.shape)}")
        if shared_intermediate != intermediate:
            raise ValueError(f"shared: intermediate {shared_intermediate}, expected the routed experts' {intermediate} "
                             "(the kernels run the shared expert as one more expert); pass it to moe_experts as "
                             "shared= instead, where XLA computes it")
        scaled = scaled or shared_scaled
        weights += jax.tree.leaves(shared, is_leaf=lambda w: isinstance(w, BlockScaled))
    if scaled and not all(isinstance(w, BlockScaled) and w.block == (FP8_BLOCK, FP8_BLOCK) for w in weights):
        blocks = [w.block if isinstance(w, BlockScaled) else "bf16" for w in weights]
        raise ValueError(f"prepare_experts: weights of blocks {blocks} (down first, the shared expert's last); "
                         f"expected every weight bf16, or every weight a BlockScaled of {FP8_BLOCK} x {FP8_BLOCK} "
                         "blocks (the kernels' FP8)")
    if config is None:
        config = ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate, experts=experts, top_k=1)
    else:
        _check_config(config, dict(hidden=hidden, intermediate=intermediate, experts=experts), "the arrays' shape")
    fused_gate_up = _fused(gate_up)
    if shared is not None:
        # The shared expert after the routed ones, as one more of them.
        fused_gate_up, down = jax.tree.map(lambda routed, one: jnp.concatenate([routed, one[None]]),
                                           (fused_gate_up, down), (_fused(shared[0]), shared[1]))
    return experts_layout.tile(fused_gate_up, down, Tiling.of(config), shared=shared is not None)


def _fused(gate_up):
    """Gate and up as one array, gate columns first (values and scales alike)."""
    if not isinstance(gate_up, (tuple, list)):
        return gate_up
    return jax.tree.map(lambda gate, up: jnp.concatenate([gate, up], axis=-1), *gate_up)


def _gate_up(gate, up):
    """The routes' ``(gate, up)`` as the reference's ``gate_up``: the fused array where up is None."""
    return gate if up is None else (gate, up)


def _reference(x, expert_ids, gate, up, down):
    return reference.moe_experts(x, expert_ids, _gate_up(gate, up), down)


def _gather(x, expert_ids, gate, up, down):
    return experts_gather.moe_experts(x, expert_ids, _gate_up(gate, up), down)


def _tokamax(x, expert_ids, gate, up, down):
    return experts_tokamax.moe_experts(x, expert_ids, _gate_up(gate, up), down)


def _untiling(route, tiling: Tiling | None, shared: bool = False):
    """``route`` on weights in the tiled order of ``tiling`` (the fused gate_up, down): their
    rows put back first; ``shared``: their last expert is the shared one, and the result the
    pair of the routed rows and its rows. ``route`` itself where ``tiling`` is None."""
    if tiling is None:
        return route

    def untiled(x, expert_ids, gate_up, up, down):
        weights = PreparedExperts(gate_up, down, tiling).untiled()
        if not shared:
            return route(x, expert_ids, weights[0], None, weights[1])
        routed_gate_up, routed_down = jax.tree.map(lambda w: w[:-1], weights)
        shared_gate_up, shared_down = jax.tree.map(lambda w: w[-1], weights)
        return (route(x, expert_ids, routed_gate_up, None, routed_down),
                reference.shared_expert(x, shared_gate_up, shared_down))

    return untiled


def _on_cuda(route, reference_route):
    """``route`` where the computation runs on a CUDA device, ``reference_route`` elsewhere: the
    platform it runs on decides, not only the devices this process has."""

    def experts(x, expert_ids, gate, up, down):
        return lax.platform_dependent(x, expert_ids, gate, up, down, cuda=route, default=reference_route)

    return experts


def _has_gpus() -> bool:
    try:
        return bool(jax.local_devices(backend="gpu"))
    except RuntimeError:  # no GPU backend in this jaxlib, or none initialized
        return False


def _why_no_kernels(shape: checks.ExpertsShape, config: ExpertsConfig | None = None) -> str | None:
    """Why the kernels cannot take a call of ``shape`` (with ``config``, else the default), or
    None: no config of the shape exists (`ExpertsConfig`'s checks say why), or its FP8 operands
    are not those the kernels take."""
    if shape.block_scaled and not shape.fp8_weights:
        return ("the kernels take bf16 x and weights, or every weight a BlockScaled of 128 x 128 blocks (e4m3 "
                "weights) with x bf16 or a BlockScaled of 1 x 128 blocks (e4m3 tokens); this call's BlockScaled "
                "operands are otherwise")
    if config is None:
        try:
            _default_config(shape)
        except ValueError as error:
            return f"the kernels take no call of this shape: {error}"
    return None


def _default_config(shape: checks.ExpertsShape) -> ExpertsConfig:
    """`ExpertsConfig.for_shape`'s config of ``shape`` and its m, reading the tiled order of its
    prepared weights where they are."""
    config = ExpertsConfig.for_shape(hidden=shape.hidden, intermediate=shape.intermediate, experts=shape.experts,
                                     top_k=shape.top_k, fused_gate_up=shape.fused, fp8_weights=shape.fp8_weights,
                                     fp8_tokens=shape.fp8_tokens, shared_expert=shape.prepared_shared, m=shape.m)
    return config if shape.tiling is None else shape.tiling.config_for(config)


def _call_fields(shape: checks.ExpertsShape) -> dict:
    """The `ExpertsConfig` fields that a call of ``shape`` fixes."""
    call = dict(hidden=shape.hidden, intermediate=shape.intermediate, experts=shape.experts, top_k=shape.top_k,
                fused_gate_up=shape.fused, tiled_weights=shape.tiling is not None, fp8_weights=shape.fp8_weights,
                fp8_tokens=shape.fp8_tokens, shared_expert=shape.prepared_shared)
    if shape.tiling is not None:
        call.update(dataclasses.asdict(shape.tiling))
    return call


def _check_config(config, call: dict, expected: str) -> None:
    """``config`` is an `ExpertsConfig` with the fields ``call`` gives (``expected`` says of what)."""
    if not isinstance(config, ExpertsConfig):
        raise TypeError(f"config: expected a jax_moe_publish.ExpertsConfig, got {type(config).__name__}")
    differ = {name: (getattr(config, name), value) for name, value in call.items() if getattr(config, name) != value}
    if differ:
        listed = ", ".join(f"{name}={got!r} (the arrays give {want!r})" for name, (got, want) in differ.items())
        raise ValueError(f"config: {listed}; expected a config of {expected}")


def _in_token_chunks(kernels, max_tokens: int):
    """``kernels`` for a call of any number of tokens: one of more than ``max_tokens`` (the most
    whose pairs a kernel call holds) as consecutive calls of at most that many, their results
    in token order. Each token's rows are the same bits in any call, so in any chunk."""

    def experts(x, expert_ids, gate, up, down):
        m = expert_ids.shape[0]
        if m <= max_tokens:
            return kernels(x, expert_ids, gate, up, down)
        # x may be a BlockScaled: its values and scales split alike.
        chunks = [kernels(jax.tree.map(lambda value: value[start:start + max_tokens], x),
                          expert_ids[start:start + max_tokens], gate, up, down) for start in range(0, m, max_tokens)]
        return jax.tree.map(lambda *parts: jnp.concatenate(parts), *chunks)

    return experts


def _call_kernels(set_id, x, expert_ids, gate, up, down, shared: bool = False):
    """The FFI call of a loaded experts kernel set: the operands of its call record, the
    activations a scratch result that is dropped. ``shared``: the weights' last expert is the
    shared one, and the result ``(rows, shared_rows)``."""
    m, top_k = expert_ids.shape
    # The reference's result type: its varying manual axes too, under shard_map.
    rows_type = jax.eval_shape(lambda: _reference(x, expert_ids, gate, up, down))
    shared_type = [rows_type.update(shape=(m, down.shape[-1]))] if shared else []
    activations_type = rows_type.update(shape=(m, top_k + int(shared), down.shape[1]))
    weights = [gate, down] if up is None else [gate, up, down]
    if isinstance(down, BlockScaled):
        # e4m3 weights: their values, then their scales (`_abi.EXPERTS_OPERANDS`' order).
        weights = [w.values for w in weights] + [w.scales for w in weights]
    # e4m3 tokens: their values first, their scales last.
    tokens, token_scales = (x.values, [x.scales]) if isinstance(x, BlockScaled) else (x, [])
    # Pure: no state outside XLA, so XLA may merge, hoist or drop calls like any computation.
    *results, _ = _launch.ffi_call(set_id, (rows_type, *shared_type, activations_type),
                                   [tokens, expert_ids, *weights, *token_scales], side_effects=False)
    return tuple(results) if shared else results[0]


def _differentiable(experts, reference_route):
    """``experts`` with the derivative of ``reference_route`` (the reference, on the weights as
    they come) at the same inputs."""

    @jax.custom_jvp
    def differentiable(x, expert_ids, gate, up, down):
        return experts(x, expert_ids, gate, up, down)

    @differentiable.defjvp
    def jvp(primals, tangents):
        x, expert_ids, gate, up, down = primals

        def math(x, gate, up, down):
            return reference_route(x, expert_ids, gate, up, down)

        _, tangent = jax.jvp(math, (x, gate, up, down), (tangents[0], tangents[2], tangents[3], tangents[4]))
        return experts(*primals), tangent

    return differentiable
