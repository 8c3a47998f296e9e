"""The experts' weights in the kernels' tiled order (`jmp.prepare_experts`) on CPU: the order is
what `GemmShape.tiled_offset` says each lane loads, undoing it gives the arrays back bit for
bit, the op on prepared weights is the op on the arrays on every route (and the kernel path
traces a tiled config), and every misuse is named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import numerics
from experts_stand_in import stood_in  # noqa: F401 - the fixture
from jax_moe_publish import BlockScaled, ExpertsConfig, PreparedExperts, experts, prepare_experts, reference
from jax_moe_publish.experts_config import LANE_ROWS
from jax_moe_publish.experts_layout import Tiling

LAYOUTS = [
    # (hidden, intermediate, experts, config changes): for_shape's launch shapes, then warps side
    # by side with 64-column gate/up warps and 32-column down warps.
    (256, 64, 3, {}),
    (128, 128, 2, dict(gate_up_warps_n=2, gate_up_warp_cols=64, gate_up_warps_k=4, gate_up_unroll=2,
                       down_warps_n=4, down_warp_cols=32, down_warps_k=2, down_unroll=1)),
]


def _config(hidden, intermediate, count, changes, top_k=2):
    return ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate, experts=count,
                                   top_k=top_k).replace(**changes)


def _lane_columns(shape, item, w_n, lane, intermediate):
    """The weight columns lane ``lane`` of warp ``w_n`` reads in item ``item`` (the kernels'
    ``lane_column``), in the arrays' rows: up's after gate's where gated."""
    group = lane // 4
    if shape.gated:
        first = (item * shape.item_columns + w_n * (shape.warp_cols // 2) + (group % 4) * (shape.warp_cols // 8)
                 + (intermediate if group >= 4 else 0))
    else:
        first = item * shape.item_columns + w_n * shape.warp_cols + group * (shape.warp_cols // 8)
    return slice(first, first + shape.warp_cols // 8)


@pytest.mark.parametrize("as_jax", [False, True], ids=["numpy", "jax"])
@pytest.mark.parametrize("hidden, intermediate, count, changes", LAYOUTS)
def test_the_tiled_order_is_where_each_lane_loads(rng, hidden, intermediate, count, changes, as_jax):
    """Every lane's load of every K step of every item, at `GemmShape.tiled_offset`, holds the
    weights it multiplies: rows ``16 step + 2q + LANE_ROWS[r]`` of its columns. NumPy's arrays
    are tiled whole, JAX's an expert at a time."""
    config = _config(hidden, intermediate, count, changes)
    w = numerics.random_experts(rng, m=1, hidden=hidden, intermediate=intermediate, experts=count, top_k=1)
    arrays = (jnp.asarray(w.gate_up), jnp.asarray(w.down)) if as_jax else (w.gate_up, w.down)
    prepared = prepare_experts(*arrays, config=config)
    for role, rows, tiled in (("gate_up", w.gate_up, prepared.gate_up), ("down", w.down, prepared.down)):
        shape = config.gemm(role)
        for expert in range(count):
            flat = np.asarray(tiled[expert]).reshape(-1)
            for item in range(shape.items_per_expert):
                for step in range(shape.k // 16):
                    for w_n in range(shape.warps_n):
                        for r, lane in np.ndindex(4, 32):
                            at = shape.tiled_offset(item, step, w_n, r, lane) // 2
                            row = 16 * step + 2 * (lane % 4) + LANE_ROWS[r]
                            want = rows[expert, row, _lane_columns(shape, item, w_n, lane, intermediate)]
                            got = flat[at:at + shape.warp_cols // 8]
                            assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (
                                f"{role} expert {expert} item {item} step {step} warp {w_n} row {r} lane {lane}")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("hidden, intermediate, count, changes", LAYOUTS)
def test_untiling_gives_the_arrays_back(rng, fused, hidden, intermediate, count, changes):
    config = _config(hidden, intermediate, count, changes)
    w = numerics.random_experts(rng, m=1, hidden=hidden, intermediate=intermediate, experts=count, top_k=1)
    prepared = jax.jit(lambda gate_up, down: prepare_experts(gate_up, down, config=config))(
        w.gate_up if fused else (w.gate, w.up), w.down)
    assert prepared.tiling == Tiling.of(config)
    assert prepared.gate_up.shape == w.gate_up.shape and prepared.down.shape == w.down.shape
    assert not np.array_equal(np.asarray(prepared.gate_up).view(np.uint16), w.gate_up.view(np.uint16))
    gate_up, down = prepared.untiled()
    assert np.array_equal(np.asarray(gate_up).view(np.uint16), w.gate_up.view(np.uint16))
    assert np.array_equal(np.asarray(down).view(np.uint16), w.down.view(np.uint16))


@pytest.mark.parametrize("impl", ["auto", "reference", "gather"])
def test_the_op_on_prepared_weights_is_the_op_on_the_arrays(rng, impl):
    """Each route on prepared weights gives its own bits on the arrays (the routes differ from
    each other in their sums' order), within the model's bound."""
    w = numerics.random_experts(rng, m=6, hidden=256, intermediate=64, experts=5, top_k=3)
    prepared = prepare_experts(w.gate_up, w.down)
    got = jax.jit(lambda x, ids, p: experts.moe_experts(x, ids, p, impl=impl))(w.x, w.expert_ids, prepared)
    want = jax.jit(lambda x, ids: experts.moe_experts(x, ids, w.gate_up, w.down, impl=impl))(w.x, w.expert_ids)
    assert np.any(np.asarray(want).astype(np.float32) != 0)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    exact, bound = numerics.expected_rows(w)
    numerics.assert_close(np.asarray(got), exact, bound, what=impl)


def test_the_kernel_path_on_prepared_weights_loads_the_tiled_config(rng, stood_in):  # noqa: F811
    """``impl="kernel"`` and ``auto`` (on CUDA the kernels, wherever they take the shape) load
    `for_shape`'s config with ``tiled_weights``; on CPU the reference branch untiles; under
    vmap and grad as on the arrays."""
    w = numerics.random_experts(rng, m=4, hidden=128, intermediate=32, experts=6, top_k=2)
    prepared = prepare_experts(w.gate_up, w.down)
    want = reference.moe_experts(w.x, w.expert_ids, w.gate_up, w.down)
    for impl in ("kernel", "auto"):
        got = jax.jit(lambda x, ids, p, impl=impl: experts.moe_experts(x, ids, p, impl=impl))(w.x, w.expert_ids,
                                                                                            prepared)
        assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
        config, _ = stood_in[-1]
        assert config == ExpertsConfig.for_shape(hidden=128, intermediate=32, experts=6, top_k=2, m=4).replace(
            tiled_weights=True)
    second = numerics.random_experts(rng, m=4, hidden=128, intermediate=32, experts=6, top_k=2)
    both = jax.vmap(lambda x, ids: experts.moe_experts(x, ids, prepared, impl="kernel"))(
        np.stack([w.x, second.x]), np.stack([w.expert_ids, second.expert_ids]))
    assert np.array_equal(np.asarray(both[0]).view(np.uint16), np.asarray(want).view(np.uint16))

    def loss(x, weights):
        return experts.moe_experts(x, w.expert_ids, weights, impl="kernel").astype(jnp.float32).sum()

    def loss_on_arrays(x, gate_up, down):
        return reference.moe_experts(x, w.expert_ids, gate_up, down).astype(jnp.float32).sum()

    grad_x, grad_prepared = jax.grad(loss, argnums=(0, 1))(w.x, prepared)
    want_x, want_gate_up, want_down = jax.grad(loss_on_arrays, argnums=(0, 1, 2))(w.x, w.gate_up, w.down)
    assert np.array_equal(np.asarray(grad_x).view(np.uint16), np.asarray(want_x).view(np.uint16))
    gate_up, down = grad_prepared.untiled()
    assert np.array_equal(np.asarray(gate_up).view(np.uint16), np.asarray(want_gate_up).view(np.uint16))
    assert np.array_equal(np.asarray(down).view(np.uint16), np.asarray(want_down).view(np.uint16))


def test_each_rank_prepares_its_slices_inside_shard_map(rng, stood_in):  # noqa: F811
    """Prepared inside ``shard_map`` from each rank's slices of I and kept sharded as the arrays
    are, the weights give each rank the partial rows of its slices."""
    w = numerics.random_experts(rng, m=4, hidden=128, intermediate=64, experts=3, top_k=2)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    weight_specs = (P(None, None, "tp"), P(None, None, "tp"), P(None, "tp", None))
    # A rank's tiling is that of its slices' config (intermediate 32).
    tiling = Tiling.of(ExpertsConfig.for_shape(hidden=128, intermediate=32, experts=3, top_k=1))
    prepared_spec = PreparedExperts(P(None, None, "tp"), P(None, "tp", None), tiling)

    def prepare(gate, up, down):
        return prepare_experts((gate, up), down)

    prepared = jax.jit(jax.shard_map(prepare, mesh=mesh, in_specs=weight_specs, out_specs=prepared_spec))(
        w.gate, w.up, w.down)

    def shard(x, ids, weights):
        return experts.moe_experts(x, ids, weights, impl="kernel")[None]

    out = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), prepared_spec), out_specs=P("tp")))(
        w.x, w.expert_ids, prepared)
    assert stood_in[-1][0].intermediate == 32 and stood_in[-1][0].tiled_weights
    for rank in range(2):
        columns = slice(32 * rank, 32 * (rank + 1))
        want = reference.moe_experts(w.x, w.expert_ids, (w.gate[..., columns], w.up[..., columns]),
                                     w.down[:, columns])
        assert np.any(np.asarray(want).astype(np.float32) != 0)
        assert np.array_equal(np.asarray(out[rank]).view(np.uint16), np.asarray(want).view(np.uint16))


def test_misuse_is_named(rng):
    w = numerics.random_experts(rng, m=2, hidden=128, intermediate=32, experts=4, top_k=2)
    prepared = prepare_experts(w.gate_up, w.down)
    base = ExpertsConfig.for_shape(hidden=128, intermediate=32, experts=4, top_k=2)
    with pytest.raises(ValueError, match="down: expected None with a PreparedExperts"):
        experts.moe_experts(w.x, w.expert_ids, prepared, w.down)
    with pytest.raises(ValueError, match=r"down: expected bf16 \[experts, intermediate, hidden\], got None"):
        experts.moe_experts(w.x, w.expert_ids, w.gate_up)
    with pytest.raises(ValueError, match=r"config: tiled_weights=False \(the arrays give True\)"):
        experts.moe_experts(w.x, w.expert_ids, prepared, config=base)
    with pytest.raises(ValueError, match=r"config: tiled_weights=True \(the arrays give False\)"):
        experts.moe_experts(w.x, w.expert_ids, w.gate_up, w.down, config=base.replace(tiled_weights=True))
    other = base.replace(tiled_weights=True, gate_up_warp_cols=64 if base.gate_up_warp_cols == 32 else 32)
    with pytest.raises(ValueError, match=r"gate_up_warp_cols=.*and of the tiled order they were prepared in"):
        experts.moe_experts(w.x, w.expert_ids, prepared, config=other)
    with pytest.raises(ValueError, match=r"fused_gate_up=False: expected True with tiled_weights"):
        base.replace(fused_gate_up=False, tiled_weights=True)
    with pytest.raises(ValueError, match=r"prepare_experts: weights of blocks \['bf16', \(32, 32\)\] \(down "
                                         r"first, the shared expert's last\); expected every weight bf16, or every "
                                         r"weight a BlockScaled of 128 x 128 blocks"):
        prepare_experts(BlockScaled.quantize(jnp.asarray(w.gate_up, jnp.float32), (32, 32)), w.down)
    with pytest.raises(ValueError, match=r"config: hidden=256 \(the arrays give 128\); expected a config of the "
                                         r"arrays' shape$"):
        prepare_experts(w.gate_up, w.down, config=base.replace(hidden=256))
    with pytest.raises(TypeError, match="config: expected a jax_moe_publish.ExpertsConfig, got dict"):
        prepare_experts(w.gate_up, w.down, config={})
    with pytest.raises(ValueError, match=r"gate_up: a PreparedExperts whose gate_up alone is a BlockScaled; "
                                         r"expected both weights bf16 or both BlockScaled"):
        experts.moe_experts(w.x, w.expert_ids, PreparedExperts(BlockScaled.quantize(
            jnp.asarray(w.gate_up, jnp.float32), (32, 32)), prepared.down, prepared.tiling))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
def test_e4m3_weights_tile_their_values_and_keep_their_scales(rng, fused):
    """`prepare_experts` of `BlockScaled` weights (128 x 128 blocks): the values in the bf16
    order's permutation (byte for byte what the bf16 weights of the same values get), the scales
    as they were (split gate and up: joined as the fused array's), and untiling is exact."""
    config = _config(256, 256, 2, dict(gate_up_warps_n=2, gate_up_warp_cols=64, gate_up_warps_k=4, gate_up_unroll=2))
    w = numerics.random_experts(rng, m=1, hidden=256, intermediate=256, experts=2, top_k=1)
    fp8 = {name: BlockScaled.quantize(jnp.asarray(getattr(w, name), jnp.float32))
           for name in ("gate_up", "gate", "up", "down")}
    gate_up = fp8["gate_up"] if fused else (fp8["gate"], fp8["up"])
    prepared = jax.jit(lambda gate_up, down: prepare_experts(gate_up, down, config=config))(gate_up, fp8["down"])
    fused_values = (fp8["gate_up"].values if fused else
                    jnp.concatenate([fp8["gate"].values, fp8["up"].values], axis=-1))
    fused_scales = (fp8["gate_up"].scales if fused else
                    jnp.concatenate([fp8["gate"].scales, fp8["up"].scales], axis=-1))
    # The same permutation as bf16 weights: tile the values' bytes widened to bf16 (exact).
    as_bf16 = prepare_experts(fused_values.astype(jnp.bfloat16), fp8["down"].values.astype(jnp.bfloat16),
                              config=config)
    for got, want, scales in ((prepared.gate_up, as_bf16.gate_up, fused_scales),
                              (prepared.down, as_bf16.down, fp8["down"].scales)):
        assert got.values.dtype == jnp.float8_e4m3fn
        assert np.array_equal(np.asarray(got.values.astype(jnp.bfloat16)).view(np.uint16),
                              np.asarray(want).view(np.uint16))
        assert np.array_equal(np.asarray(got.scales), np.asarray(scales))
    gate_up_back, down_back = prepared.untiled()
    assert np.array_equal(np.asarray(gate_up_back.values).view(np.uint8), np.asarray(fused_values).view(np.uint8))
    assert np.array_equal(np.asarray(down_back.values).view(np.uint8), np.asarray(fp8["down"].values).view(np.uint8))


def test_the_op_on_prepared_e4m3_weights_is_the_op_on_them(rng, stood_in):  # noqa: F811
    """On CPU every route on prepared e4m3 weights gives the bits of the op on the `BlockScaled`
    arrays; the kernel path (and ``auto``, on CUDA) loads `for_shape`'s e4m3 config with
    ``tiled_weights``."""
    w = numerics.random_experts(rng, m=5, hidden=256, intermediate=128, experts=4, top_k=2)
    gate_up, down = (BlockScaled.quantize(jnp.asarray(a, jnp.float32)) for a in (w.gate_up, w.down))
    prepared = prepare_experts(gate_up, down)
    for impl in ("kernel", "auto", "reference", "gather"):
        got = jax.jit(lambda x, ids, p, impl=impl: experts.moe_experts(x, ids, p, impl=impl))(w.x, w.expert_ids,
                                                                                            prepared)
        want = experts.moe_experts(w.x, w.expert_ids, gate_up, down, impl="gather" if impl == "gather" else
                                   "reference")
        assert np.any(np.asarray(want).astype(np.float32) != 0)
        assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)), impl
    config, _ = stood_in[-1]
    assert config == ExpertsConfig.for_shape(hidden=256, intermediate=128, experts=4, top_k=2,
                                             fp8_weights=True, m=5).replace(tiled_weights=True)

