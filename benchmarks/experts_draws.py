"""What `bench_moe_experts` draws for its cases: the shard shapes, each layer's routing by the
model's router, each layer's weights in the layouts the selected columns read, and the bytes
those weights hold and read."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

import experts_columns

# examples/ is not a package: its modules import by name (as in bench_moe_block.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import moe_block as mb

import jax_moe_publish as jmp
from jax_moe_publish.experts_config import FP8_BLOCK

SHAPES = {
    "deepseek-v3": mb.DEEPSEEK_V3,
    "qwen3-235b-a22b": mb.MoEConfig("qwen3-235b-a22b", hidden=4096, intermediate=1536, experts=128, top_k=8,
                                    router="softmax", model_experts=128),
    "qwen3-30b-a3b": dataclasses.replace(mb.QWEN3_30B_A3B, name="qwen3-30b-a3b"),
}
# --cpu: every shape at dimensions that split over tp = 8, and hold whole FP8 blocks at tp = 1 and 2
# (DeepSeek-V3's shared expert of the routed experts' intermediate, as the model's).
CPU_DIMS = {"hidden": 128, "intermediate": 256, "experts": 16, "shared_intermediate": 256}
MIN_LAYERS = 2  # so that no two consecutive calls share weights or routing


def shape_config(args, name):
    """The model's `moe_block.MoEConfig` (its router and whole dimensions), tiny under --cpu."""
    return mb.scaled(SHAPES[name], **CPU_DIMS) if args.cpu else SHAPES[name]


def layer_weight_bytes(config, tp):
    """Bytes of one layer's expert weights on a rank."""
    return config.experts * config.expert_bytes(tp)


def weight_layouts(args) -> set:
    """The layers' weight arrays that the selected columns read: ``(fp8, prepared, held)``;
    ``held``: prepared with the shared expert. The others are dropped once derived."""
    return {(column.fp8, column.prepared, column.shared == "held") for column in experts_columns.selected_columns(args)}


DRAW_COPIES = 1.5
"""Copies of a layer's bf16 arrays held besides the layers' while the next is drawn: its rows
and their e4m3 quantization, from which the others are derived (`draw_weights`)."""


def weight_copies(args):
    """Bytes of each layer's weights held, in copies of its bf16 arrays (`weight_layouts`; e4m3: half)."""
    return sum(0.5 if fp8 else 1 for fp8, _, _ in weight_layouts(args))


def shared_expert_bytes(config, tp):
    """The shared expert's bf16 weights on a rank (0 without one)."""
    return 3 * config.hidden * (config.shared_intermediate // tp) * 2


def fp8_expert_bytes(config, tp):
    """One expert's e4m3 weights on a rank: a byte per weight and a float32 per 128 x 128 block."""
    i = config.intermediate // tp
    return 3 * config.hidden * i + 3 * (config.hidden // FP8_BLOCK) * (i // FP8_BLOCK) * 4


def holds_fp8_blocks(config, tp):
    """Whether a rank's shard holds whole 128 x 128 blocks (the FP8 columns' weights)."""
    return config.hidden % FP8_BLOCK == 0 and config.intermediate // tp % FP8_BLOCK == 0


def budget_layers(args, config, tp):
    """The most layers whose weights (`weight_copies` of them) fit ``--weight-budget-gb`` beside
    the arrays of the layer being drawn (`DRAW_COPIES`)."""
    layer_bytes = layer_weight_bytes(config, tp) * weight_copies(args)
    draw_bytes = layer_weight_bytes(config, tp) * DRAW_COPIES
    layers = int((args.weight_budget_gb * 1e9 - draw_bytes) // layer_bytes)
    if layers < 1:
        raise SystemExit(f"--weight-budget-gb {args.weight_budget_gb}: one layer of {config.name} at tp={tp} "
                         f"needs {(layer_bytes + draw_bytes) / 1e9:.2f} GB while drawn; expected a budget of "
                         "at least that")
    return layers


def shape_key(args, name):
    return jax.random.fold_in(jax.random.key(args.seed), list(SHAPES).index(name))


def router_params(key, config):
    """One layer's router (`moe_block.init_layer`'s distributions)."""
    keys = jax.random.split(key)
    params = {"router": mb.router_weight(keys[0], config.hidden, config.experts)}
    if config.router == "sigmoid-grouped":
        params["bias"] = 0.1 * jax.random.normal(keys[1], (config.experts,), jnp.float32)
    return params


@functools.partial(jax.jit, static_argnums=(0, 1))
def draw_routing(config, m, router_key, x_key):
    """One layer's ``x`` (bf16 [m, hidden]) and its experts (int32 [m, top_k]) by the model's router."""
    x = jax.random.normal(x_key, (m, config.hidden), jnp.float32).astype(jnp.bfloat16)
    experts, _ = mb.route(config, router_params(router_key, config), x)
    return x, experts


def case_routing(args, config, tp, m, max_layers):
    """Layers of routing for one case: ``(xs, ids, active)``, ``active`` the sorted distinct experts
    of each layer, as many layers as one pass needs for ``--min-pass-mb`` of active weights (at
    least MIN_LAYERS), at most ``max_layers``. A layer's routing depends on the shape, m and its
    index only, so it is the same at every tp."""
    key = shape_key(args, config.name)
    xs, ids, active, pass_bytes = [], [], [], 0
    while len(xs) < max_layers and (len(xs) < MIN_LAYERS or pass_bytes < args.min_pass_mb * 1e6):
        layer = len(xs)
        router_key = jax.random.fold_in(jax.random.fold_in(key, 0), layer)
        x_key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, 1), m), layer)
        x, experts = draw_routing(config, m, router_key, x_key)
        xs.append(x)
        ids.append(experts)
        active.append(np.unique(np.asarray(experts)))
        pass_bytes += active[-1].size * config.expert_bytes(tp)
    return xs, ids, active


@functools.partial(jax.jit, static_argnums=(1, 2))
def draw_layer_weights(key, config, tp):
    """One layer's weights on one rank, uniform bf16 of variance ``1 / fan_in``
    (`moe_block.init_layer`'s draw): gate_up [experts, hidden, 2 * i] (gate columns, then up)
    and down [experts, i, hidden], ``i = intermediate / tp``."""
    i = config.intermediate // tp
    keys = jax.random.split(key)
    return {"gate_up": uniform_weights(keys[0], (config.experts, config.hidden, 2 * i), config.hidden),
            "down": uniform_weights(keys[1], (config.experts, i, config.hidden), config.intermediate)}


def uniform_weights(key, shape, fan_in):
    """bf16 uniform of variance ``1 / fan_in``."""
    limit = (3 / fan_in) ** 0.5
    return jax.random.uniform(key, shape, jnp.bfloat16, -limit, limit)


@functools.partial(jax.jit, static_argnums=(1, 2))
def draw_shared_weights(key, config, tp):
    """One layer's shared expert on one rank, as `draw_layer_weights` draws an expert:
    ``(gate_up [hidden, 2 * s], down [s, hidden])``, ``s = shared_intermediate / tp``."""
    s = config.shared_intermediate // tp
    keys = jax.random.split(key)
    return (uniform_weights(keys[0], (config.hidden, 2 * s), config.hidden),
            uniform_weights(keys[1], (s, config.hidden), config.shared_intermediate))


def draw_weights(args, config, tp, layers):
    """Each layer's weights that the columns read (`weight_layouts`): ``"gate_up"`` and ``"down"``
    (`draw_layer_weights`); ``"prepared"``, their `jmp.prepare_experts` order; ``"fp8"``, the pair
    ``(gate_up, down)`` quantized (`jmp.BlockScaled.quantize`, where the shard holds whole
    blocks); ``"fp8_prepared"``, its prepared order; with a shared expert, ``"shared"`` (its
    ``(gate_up, down)``) and ``"prepared_shared"``, the prepared order holding it. A layer's
    arrays that no column reads are dropped before the next layer is drawn, so that a tp = 1
    layer's derived copies fit beside it."""
    key = jax.random.fold_in(jax.random.fold_in(shape_key(args, config.name), 2), tp)
    layouts = weight_layouts(args)
    prepare = jax.jit(jmp.prepare_experts)
    # One expert at a time: quantizing a whole tp = 1 layer at once needs float32 copies of it.
    quantize = jax.jit(lambda w: jax.lax.map(jmp.BlockScaled.quantize, w))
    shared_columns = [c for c in experts_columns.selected_columns(args)
                      if c.shared and not experts_columns.why_no_shared(c, config)]
    weights = []
    for layer in range(layers):
        w = draw_layer_weights(jax.random.fold_in(key, layer), config, tp)
        if holds_fp8_blocks(config, tp) and {(True, False, False), (True, True, False)} & layouts:
            fp8 = (quantize(w["gate_up"]), quantize(w["down"]))
            if (True, True, False) in layouts:
                w["fp8_prepared"] = jax.block_until_ready(prepare(*fp8))
            if (True, False, False) in layouts:
                w["fp8"] = fp8
            del fp8
        if (False, True, False) in layouts:
            w["prepared"] = prepare(w["gate_up"], w["down"])
        if shared_columns:
            w["shared"] = draw_shared_weights(jax.random.fold_in(jax.random.fold_in(key, layer), 1), config, tp)
            if (False, True, True) in layouts and mb.holds_shared(config):
                w["prepared_shared"] = prepare(w["gate_up"], w["down"], shared=w["shared"])
        if (False, False, False) not in layouts:
            del w["gate_up"], w["down"]
        weights.append(jax.block_until_ready(w))
    return weights


def active_bitmask(active, experts):
    """The set of active experts as hex, expert e the bit ``1 << e``."""
    return format(sum(1 << int(e) for e in active), f"0{-(-experts // 4)}x")
