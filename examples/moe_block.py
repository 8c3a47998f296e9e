"""A model-shaped tensor-parallel MoE block for decode, one TP shard inside ``shard_map``.

Each MoE layer runs what a JAX model runs:

1. the router, with the published semantics of DeepSeek-V3 (sigmoid scores plus the
   score-correction bias, group-limited: groups scored by their top-2 biased scores, the
   best ``kept_groups`` kept, top-k experts among them by biased score, weights the
   unbiased scores normalized to sum 1, then scaled by 2.5, the finalize's
   ``routed_scaling_factor``) or of Qwen3-MoE (softmax over the experts, top-k,
   renormalized);
2. the (token, expert) pairs sorted by expert into contiguous rows;
3. the routed experts, ``down(silu(gate(x)) * up(x))``, as grouped GEMMs. Each rank holds
   1/tp of every expert's intermediate dimension (gate/up column-parallel, fused as one
   ``[hidden, 2 * intermediate / tp]`` weight; down row-parallel), so its rows are partial
   sums. Four interchangeable paths: ``ragged`` (`jax.lax.ragged_dot`, what JAX models
   use), ``decode`` (``jmp.moe_experts(impl="gather")``: XLA gathers only the active
   experts' weights), ``ours`` (`jmp.moe_experts`: its kernels on GPUs, its reference
   elsewhere) and ``prepared`` (the same on `jmp.prepare_experts`'s weights, prepared once
   with the parameters: ``init_params(..., prepared=True)``);
4. the shared expert (DeepSeek-V3), sliced the same way: through ``jnp`` GEMMs, but on the
   ``prepared`` path held with the routed experts where its intermediate is theirs (as
   DeepSeek-V3's is), so that `jmp.moe_experts` computes it with them;
5. the finalize, the sum over the group and the residual add + RMSNorm, whose outputs
   ``(out, residual_out)`` are the next layer's input and residual stream:
   ``finalize="ours"`` is one `jmp.moe_finalize_publish` call; ``finalize="xla"`` is the
   same in ``jnp`` as a JAX user writes it (gather, float32 weighted sum rounded to bf16,
   ``lax.psum``, `jmp.reference.add_rmsnorm`).

Every GEMM takes bf16 operands and accumulates in float32
(``preferred_element_type=float32``), then rounds to bf16; the SwiGLU is evaluated in
float32 and rounded to bf16. The router runs in float32 (``Precision.HIGHEST``): DeepSeek-V3's
published gate does; Qwen3's is a bf16 linear, here in float32 as well. The router
weights go to the finalize in float32.

`moe_block_model.py` is a float64 NumPy model of one layer that shares no code with this
file.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp
from jax_moe_publish.testing import rank_processes

TP = "tp"
PATHS = ("ragged", "decode", "ours", "prepared")
FINALIZES = ("ours", "xla")
ROUTERS = ("sigmoid-grouped", "softmax")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's shape and router; ``intermediate`` and ``shared_intermediate`` are
    whole (before the TP split), ``shared_intermediate = 0`` means no shared expert, and
    ``model_experts`` is the published model's expert count."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    router: str
    groups: int = 1
    kept_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate: int = 0
    norm_eps: float = 1e-6
    model_experts: int = 0

    def __post_init__(self):
        def need(ok, field, expected):
            if not ok:
                raise ValueError(f"{self.name}: {field}={getattr(self, field)!r}: expected {expected}")

        need(self.router in ROUTERS, "router", f"one of {ROUTERS}")
        # The mailbox moves rows in 16-byte fragments.
        need(self.hidden > 0 and self.hidden % 8 == 0, "hidden", "a positive multiple of 8")
        need(self.intermediate > 0, "intermediate", "> 0")
        need(self.shared_intermediate >= 0, "shared_intermediate", ">= 0")
        need(1 <= self.top_k <= self.experts, "top_k", f"in [1, experts={self.experts}]")
        need(self.groups >= 1 and self.experts % self.groups == 0, "groups", f"a divisor of experts={self.experts}")
        need(1 <= self.kept_groups <= self.groups, "kept_groups", f"in [1, groups={self.groups}]")
        if self.router == "softmax":
            need(self.groups == 1 and self.kept_groups == 1, "groups", "1 for the softmax router")
        else:
            # A group's score is the sum of its top-2 biased scores.
            need(self.experts // self.groups >= 2, "experts", f"at least 2 per group ({self.groups} groups)")
            need(self.kept_groups * (self.experts // self.groups) >= self.top_k, "kept_groups",
                 f"enough groups to hold top_k={self.top_k} experts")
        need(self.norm_eps > 0, "norm_eps", "> 0")

    @property
    def shared(self) -> bool:
        return self.shared_intermediate > 0

    def check_tp(self, tp: int) -> None:
        """Every rank gets an equal slice of each expert's (and the shared expert's) intermediate dim."""
        for field in ("intermediate", "shared_intermediate"):
            if getattr(self, field) % tp:
                raise ValueError(f"{self.name}: {field}={getattr(self, field)} does not split over tp={tp}")

    def weight_bytes(self, tp: int, prepared: bool = False) -> int:
        """Bytes of one layer's parameters on each rank (``prepared``: with the experts' weights
        held twice, `init_params`'s prepared copy, the shared expert's too where it holds it)."""
        router = self.hidden * self.experts * 4 + (self.experts * 4 if self.router == "sigmoid-grouped" else 0)
        experts = self.experts * self.expert_bytes(tp) * (2 if prepared else 1)
        shared = self.shared_bytes(tp) * (2 if prepared and holds_shared(self) else 1)
        return experts + shared + router + self.hidden * 2

    def expert_bytes(self, tp: int) -> int:
        """Bytes of one routed expert's gate, up and down slices on each rank."""
        return 3 * self.hidden * (self.intermediate // tp) * 2

    def shared_bytes(self, tp: int) -> int:
        """Bytes of the shared expert's slices on each rank (0 without one)."""
        return 3 * self.hidden * (self.shared_intermediate // tp) * 2

    def describe(self) -> str:
        experts = f"{self.experts} experts"
        if self.model_experts and self.model_experts != self.experts:
            experts += f" (scaled down from {self.model_experts})"
        if self.router == "sigmoid-grouped":
            router = (f"sigmoid + bias router, {self.groups} groups with the top {self.kept_groups} kept, "
                      f"top-{self.top_k}, scale {self.routed_scaling_factor:g}")
        else:
            router = f"softmax router, top-{self.top_k}, renormalized"
        shared = f", shared expert {self.shared_intermediate}" if self.shared else ", no shared expert"
        return (f"{self.name}: hidden {self.hidden}, expert intermediate {self.intermediate}, {experts}, "
                f"{router}{shared}")


DEEPSEEK_V3 = MoEConfig("deepseek-v3", hidden=7168, intermediate=2048, experts=256, top_k=8,
                        router="sigmoid-grouped", groups=8, kept_groups=4, routed_scaling_factor=2.5,
                        shared_intermediate=2048, model_experts=256)
QWEN3_30B_A3B = MoEConfig("qwen3-moe", hidden=2048, intermediate=768, experts=128, top_k=8, router="softmax",
                          model_experts=128)
PROBLEMS = {config.name: config for config in (DEEPSEEK_V3, QWEN3_30B_A3B)}


def expert_groups(experts: int, top_k: int, groups: int, kept_groups: int) -> tuple[int, int]:
    """(groups, kept groups) of a grouped router with ``experts`` experts: the most groups, at
    most ``groups``, of at least 2 experts each, keeping the same share of the groups (rounded
    up), or more where that share could not hold ``top_k`` experts."""
    for g in range(min(groups, experts // 2), 0, -1):
        if experts % g:
            continue
        keep = max(-(-g * kept_groups // groups), -(-top_k // (experts // g)))
        if keep <= g:
            return g, keep
    raise ValueError(f"experts={experts}: a grouped router needs at least 2 experts and top_k={top_k} <= experts")


def scaled(config: MoEConfig, *, experts=None, hidden=None, intermediate=None, shared_intermediate=None,
           top_k=None) -> MoEConfig:
    """``config`` with the dimensions given changed (the rest kept; ``shared_intermediate``
    applies where the config has a shared expert); a grouped router keeps as many of its
    groups as the expert count allows (`expert_groups`)."""
    experts = config.experts if experts is None else experts
    top_k = config.top_k if top_k is None else top_k
    groups, kept = config.groups, config.kept_groups
    if config.router == "sigmoid-grouped":
        groups, kept = expert_groups(experts, top_k, config.groups, config.kept_groups)
    shared = config.shared_intermediate if shared_intermediate is None or not config.shared else shared_intermediate
    return dataclasses.replace(config, experts=experts, top_k=top_k, groups=groups, kept_groups=kept,
                               hidden=hidden or config.hidden, intermediate=intermediate or config.intermediate,
                               shared_intermediate=shared)


def max_experts(config: MoEConfig, tp: int, layers: int, available_bytes: int, prepared: bool = False) -> int:
    """The most experts, a multiple of the router's groups, whose ``layers`` layers (with their
    prepared copy) fit in ``available_bytes`` per rank (0 if none do)."""
    # Each expert adds its weights (twice, prepared), a router column and (grouped router) a bias.
    per_expert = (config.expert_bytes(tp) * (2 if prepared else 1) + config.hidden * 4
                  + (4 if config.router == "sigmoid-grouped" else 0))
    fixed = config.weight_bytes(tp, prepared) - config.experts * per_expert
    most = (available_bytes // layers - fixed) // per_expert
    return max(0, int(most) // config.groups * config.groups)


# ---------------------------------------------------------------------------------------
# Parameters and inputs


def param_specs(config: MoEConfig, prepared: bool = False) -> dict:
    """The layout of one layer's parameters: replicated (``P()``) or one slice per rank
    along a leading axis of size tp (``P("tp")``). Shapes, with ``i = intermediate / tp``::

        router         float32 [experts, hidden]            (replicated; a Linear's weight, as published)
        bias           float32 [experts]                    (replicated; grouped router only)
        gate_up        bf16 [tp, experts, hidden, 2 * i]    (rank r: gate and up columns r*i..(r+1)*i)
        down           bf16 [tp, experts, i, hidden]        (rank r: rows r*i..(r+1)*i)
        shared_gate_up bf16 [tp, hidden, 2 * s], shared_down bf16 [tp, s, hidden]  (shared expert)
        norm           bf16 [hidden]                        (the RMSNorm after the layer)
        prepared       jmp.PreparedExperts of [tp, ...]     (gate_up and down prepared, with the shared
                                                            expert where s = i; ``prepared``)
    """
    specs = {"router": P(), "gate_up": P(TP), "down": P(TP), "norm": P()}
    if prepared:
        specs["prepared"] = P(TP)
    if config.router == "sigmoid-grouped":
        specs["bias"] = P()
    if config.shared:
        specs["shared_gate_up"] = P(TP)
        specs["shared_down"] = P(TP)
    return specs


def router_weight(key, hidden: int, experts: int):
    """A router weight float32 [experts, hidden] of unit-scale logits, drawn [hidden, experts]
    and transposed: the draw of the runs before the weight's rows were experts."""
    return (jax.random.normal(key, (hidden, experts), jnp.float32) * hidden**-0.5).T


def init_layer(key, config: MoEConfig, tp: int) -> dict:
    """One layer's parameters (global arrays, `param_specs`), random with unit-scale activations.

    The expert weights are drawn uniform in bf16 (variance ``1 / fan_in``): 16 random bits per
    element, so that drawing DeepSeek-V3's 22.5 GB of a layer's experts needs no float32 copy.
    """
    config.check_tp(tp)
    hidden, experts = config.hidden, config.experts
    i, s = config.intermediate // tp, config.shared_intermediate // tp
    keys = jax.random.split(key, 6)

    def weight(k, shape, fan_in):
        limit = (3 / fan_in) ** 0.5
        return jax.random.uniform(k, shape, jnp.bfloat16, -limit, limit)

    params = {
        "router": router_weight(keys[0], hidden, experts),
        "gate_up": weight(keys[1], (tp, experts, hidden, 2 * i), hidden),
        "down": weight(keys[2], (tp, experts, i, hidden), config.intermediate),
        "norm": (1.0 + 0.1 * jax.random.normal(keys[3], (hidden,), jnp.float32)).astype(jnp.bfloat16),
    }
    if config.router == "sigmoid-grouped":
        params["bias"] = 0.1 * jax.random.normal(keys[4], (experts,), jnp.float32)
    if config.shared:
        shared = jax.random.split(keys[5])
        params["shared_gate_up"] = weight(shared[0], (tp, hidden, 2 * s), hidden)
        params["shared_down"] = weight(shared[1], (tp, s, hidden), config.shared_intermediate)
    return params


def init_params(key, config: MoEConfig, mesh, layers: int, *, prepared: bool = False) -> list[dict]:
    """``layers`` layers of distinct parameters, each generated on the devices in its layout;
    with ``prepared``, each layer's expert weights also as each rank's `jmp.prepare_experts`
    (held twice: the other paths read the arrays), the shared expert with them where it has
    their intermediate (`holds_shared`)."""
    shardings = {name: NamedSharding(mesh, spec) for name, spec in param_specs(config).items()}
    make = jax.jit(functools.partial(init_layer, config=config, tp=mesh.shape[TP]), out_shardings=shardings)
    params = [make(layer_key) for layer_key in jax.random.split(key, layers)]
    if prepared:
        shared_names = ("shared_gate_up", "shared_down") if holds_shared(config) else ()

        def prepare(gate_up, down, *shared):  # on each rank, its slices
            shared = tuple(a[0] for a in shared) or None
            return jax.tree.map(lambda a: a[None], jmp.prepare_experts(gate_up[0], down[0], shared=shared))

        prepare = jax.jit(jax.shard_map(prepare, mesh=mesh, in_specs=P(TP), out_specs=P(TP)))
        params = [{**layer, "prepared": prepare(layer["gate_up"], layer["down"],
                                                *(layer[name] for name in shared_names))} for layer in params]
    return params


def holds_shared(config: MoEConfig) -> bool:
    """Whether the prepared weights hold the shared expert: it has the routed experts'
    intermediate, so the kernels run it as one more of them."""
    return config.shared and config.shared_intermediate == config.intermediate


def init_inputs(key, config: MoEConfig, mesh, m: int):
    """(x, residual): bf16 [m, hidden] each, replicated: the first layer's input and residual stream,
    generated on the devices (as `init_params`, also where the mesh spans processes)."""

    def make(key):
        keys = jax.random.split(key)
        return tuple(jax.random.normal(k, (m, config.hidden), jnp.float32).astype(jnp.bfloat16) for k in keys)

    replicated = NamedSharding(mesh, P())
    return jax.jit(make, out_shardings=(replicated, replicated))(key)


def layer_specs(config: MoEConfig, layer: dict) -> dict:
    """`param_specs` of the parameters ``layer`` holds (with or without prepared weights)."""
    return param_specs(config, prepared="prepared" in layer)


def local_params(config: MoEConfig, layer: dict) -> dict:
    """A layer's parameters inside ``shard_map``: each rank's slice without its leading axis."""
    specs = layer_specs(config, layer)
    return {name: jax.tree.map(lambda a: a[0], value) if specs[name] == P(TP) else value
            for name, value in layer.items()}


# ---------------------------------------------------------------------------------------
# One layer on one shard


def route_logits(config: MoEConfig, logits, bias=None):
    """(experts int32 [m, top_k], weights float32 [m, top_k]) from float32 router logits [m, experts].

    ``sigmoid-grouped`` (DeepSeek-V3): ``s = sigmoid(logits)``, ``c = s + bias`` for the
    choice only; a group scores the sum of its two largest ``c``; the ``kept_groups`` best
    groups are kept; the top-k experts of the kept groups by ``c``; weights ``s`` of the
    chosen experts over their sum. ``softmax`` (Qwen3-MoE): ``p = softmax(logits)``, the
    top-k ``p``, over their sum, computed as the softmax of the top-k logits (the same
    function: softmax is monotonic and its normalization cancels), so that only the k chosen
    go through ``exp``. Ties go to the lower index (`jax.lax.top_k`).
    """
    if config.router == "softmax":
        top_logits, experts = lax.top_k(logits, config.top_k)
        return experts.astype(jnp.int32), jax.nn.softmax(top_logits, axis=-1)
    m = logits.shape[0]
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    group_scores = jnp.sum(lax.top_k(choice.reshape(m, config.groups, -1), 2)[0], axis=-1)
    kept = lax.top_k(group_scores, config.kept_groups)[1]
    kept_mask = jnp.any(kept[:, :, None] == jnp.arange(config.groups), axis=1)
    expert_mask = jnp.repeat(kept_mask, config.experts // config.groups, axis=1)
    experts = lax.top_k(jnp.where(expert_mask, choice, -jnp.inf), config.top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights


def route(config: MoEConfig, layer: dict, x):
    """`route_logits` of ``x`` (bf16 [m, hidden]): logits in float32. The weight's rows are
    experts, so that each logit is a reduction along contiguous memory."""
    logits = jnp.einsum("mh,eh->me", x.astype(jnp.float32), layer["router"], precision=lax.Precision.HIGHEST)
    return route_logits(config, logits, layer.get("bias"))


def sort_by_expert(experts, num_experts: int):
    """The pairs (t, k) in expert order, stable.

    Returns ``order`` int32 [m * top_k] (sorted position -> pair ``t * top_k + k``),
    ``permuted_indices`` int32 [m, top_k] (pair -> sorted position, the finalize's
    indices into the sorted rows) and ``group_sizes`` int32 [num_experts].
    """
    m, top_k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    positions = jnp.zeros_like(order).at[order].set(jnp.arange(m * top_k, dtype=jnp.int32))
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, positions.reshape(m, top_k), sizes


def pair_order_indices(experts):
    """The finalize's indices int32 [m, top_k] of rows in pair order: pair ``t * top_k + k`` is
    its own row (`jmp.moe_experts`' output)."""
    return jnp.arange(experts.size, dtype=jnp.int32).reshape(experts.shape)


def _gemm(spec, a, b):
    """bf16 operands, float32 accumulation, rounded to bf16."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def swiglu(h):
    """``bf16(silu(gate) * up)`` of a fused gate/up output ``[..., 2 * i]``, in float32."""
    gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(jnp.bfloat16)


def routed_rows_ragged(layer: dict, x, order, sizes, top_k: int):
    """The sorted rows through their experts with `jax.lax.ragged_dot`: bf16 [m * top_k, hidden]."""
    rows = x[order // top_k]
    h = lax.ragged_dot(rows, layer["gate_up"], sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return lax.ragged_dot(swiglu(h), layer["down"], sizes, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def shared_partial(layer: dict, x):
    """This rank's slice of the shared expert: bf16 [m, hidden]."""
    return _gemm("mi,ih->mh", swiglu(_gemm("mh,hi->mi", x, layer["shared_gate_up"])), layer["shared_down"])


def finalize_inputs(config: MoEConfig, layer: dict, x, *, path: str):
    """This rank's finalize arguments for ``x`` (bf16 [m, hidden]): ``(routed_output bf16
    [m * top_k, hidden], expert_weights float32 [m, top_k], permuted_indices int32 [m, top_k],
    shared_output bf16 [m, hidden] or None)``."""
    if path not in PATHS:
        raise ValueError(f"path={path!r}: expected one of {PATHS}")
    experts, weights = route(config, layer, x)
    shared = None
    if path == "ragged":
        order, permuted_indices, sizes = sort_by_expert(experts, config.experts)
        rows = routed_rows_ragged(layer, x, order, sizes, config.top_k)
    else:
        ours = "kernel" if jax.default_backend() == "gpu" else "reference"
        if path == "prepared":
            if "prepared" not in layer:
                raise ValueError("path='prepared': the layer holds no prepared weights; expected parameters of "
                                 "init_params(..., prepared=True)")
            rows = jmp.moe_experts(x, experts, layer["prepared"], impl=ours)
            if layer["prepared"].shared:
                rows, shared = rows  # the shared expert's rows, computed with the routed ones
        else:
            rows = jmp.moe_experts(x, experts, layer["gate_up"], layer["down"],
                                   impl="gather" if path == "decode" else ours)
        permuted_indices = pair_order_indices(experts)
    if shared is None and config.shared:
        shared = shared_partial(layer, x)
    return rows, weights, permuted_indices, shared


def jnp_finalize(routed, weights, permuted_indices, shared, scale: float):
    """The finalize as a JAX user writes it: each token's rows gathered, their float32
    weighted sum times ``scale`` plus the shared partial, rounded to bf16."""
    rows = routed[permuted_indices].astype(jnp.float32)
    out = jnp.einsum("mk,mkh->mh", weights * scale, rows, precision=lax.Precision.HIGHEST)
    if shared is not None:
        out = out + shared.astype(jnp.float32)
    return out.astype(jnp.bfloat16)


def finalize_layer(config: MoEConfig, layer: dict, parts, residual, *, finalize: str, mailbox=None,
                   impl: str = "auto"):
    """``(out, residual_out)`` of a layer from its finalize arguments ``parts``: ``ours`` is
    `jmp.moe_finalize_publish` with the epilogue (needs ``mailbox``); ``xla`` is
    `jnp_finalize`, ``lax.psum`` over ``tp`` and `jmp.reference.add_rmsnorm`."""
    routed, weights, indices, shared = parts
    scale = config.routed_scaling_factor
    if finalize == "ours":
        return jmp.moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox, routed_scaling_factor=scale,
                                        residual=residual, norm_weight=layer["norm"], norm_eps=config.norm_eps,
                                        impl=impl)
    if finalize != "xla":
        raise ValueError(f"finalize={finalize!r}: expected one of {FINALIZES}")
    y = lax.psum(jnp_finalize(routed, weights, indices, shared, scale), TP)
    return jmp.reference.add_rmsnorm(y, residual, layer["norm"], eps=config.norm_eps)


def moe_layer(config: MoEConfig, layer: dict, x, residual, *, path: str, finalize: str, mailbox=None,
              impl: str = "auto"):
    """One MoE layer on one shard: ``(out, residual_out)``, bf16 [m, hidden] each, the same on
    every rank: the next layer's input and residual stream."""
    parts = finalize_inputs(config, layer, x, path=path)
    return finalize_layer(config, layer, parts, residual, finalize=finalize, mailbox=mailbox, impl=impl)


def make_decode(config: MoEConfig, mesh, layer_fn, layers: int, *, steps: int = 1):
    """``jit(shard_map)`` of ``steps`` decode steps through a stack of ``layers`` layers:
    ``(params, x, residual) -> (x, residual)``.

    ``layer_fn(layer, x, residual) -> (out, residual_out)`` is one layer on one shard
    (`moe_layer` with its options bound) and gets each rank's parameter slices. Each
    layer's ``out`` is the next layer's input, its ``residual_out`` the next residual.
    """
    def shard(params, x, residual):
        def step(_, carry):
            for layer in params:
                carry = layer_fn(local_params(config, layer), *carry)
            return carry

        return lax.fori_loop(0, steps, step, (x, residual))

    def decode(params, x, residual):
        if len(params) != layers:
            raise ValueError(f"params: {len(params)} layers, expected {layers}")
        specs = ([layer_specs(config, layer) for layer in params], P(), P())
        return jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=(P(), P()))(params, x, residual)

    return jax.jit(decode)


def make_parts(config: MoEConfig, mesh, path: str):
    """``jit(shard_map)`` of one layer's finalize arguments on every rank: ``(layer, x) ->
    (parts, experts)``, ``parts`` the `finalize_inputs` as ``[tp, ...]`` stacks (rank r at
    index r) and ``experts`` int32 [m, top_k] the router's choice."""

    def shard(layer, x):
        layer = local_params(config, layer)
        parts = finalize_inputs(config, layer, x, path=path)
        return jax.tree.map(lambda a: a[None], parts), route(config, layer, x)[0]

    def parts(layer, x):
        return jax.shard_map(shard, mesh=mesh, in_specs=(layer_specs(config, layer), P()),
                             out_specs=(P(TP), P()))(layer, x)

    return jax.jit(parts)


def rank_copies(out) -> list[np.ndarray]:
    """Each device's copy of a replicated result, as raw bf16 bits (uint16), in mesh order (every
    device's, also where the mesh spans processes)."""
    copies = rank_processes.gather(out)
    return [copies[device].view(np.uint16) for device in out.sharding.mesh.devices.flat]
