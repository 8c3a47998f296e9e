"""The experts op's shared expert on CPU: given as ``shared=`` (XLA's GEMMs) or held after the
routed experts by `jmp.prepare_experts` (the kernels' one more group), against the float64
model of one expert that every token names, on every pure route, bf16 and e4m3; the kernel path
traced with the kernels stood in for (its config, its FFI call's results), under jit, vmap,
grad and shard_map; its config's call record; and every misuse named."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import fp8_experts
from jaxprs import equations
import numerics
from experts_stand_in import STAND_IN, stood_in  # noqa: F401 - the fixture
from jax_moe_publish import BlockScaled, ExpertsConfig, _abi, experts, prepare_experts, reference
from jax_moe_publish.experts_config import MAX_PAIRS


def _case(rng, *, m=6, hidden=128, intermediate=128, count=5, top_k=3, fused=True, fp8=False):
    """Routed experts and a shared expert: the op's ``(x, ids, gate_up, down, shared)`` (e4m3
    weights of 128 x 128 blocks with ``fp8``), and the model's inputs of both: the values the
    op's operands stand for (`fp8_experts.dequantized`)."""
    routed = numerics.random_experts(rng, m=m, hidden=hidden, intermediate=intermediate, experts=count, top_k=top_k)
    one = numerics.random_experts(rng, m=m, hidden=hidden, intermediate=intermediate, experts=1, top_k=1)

    def operands(inputs):
        """The op's ``(gate_up, down)`` of ``inputs``, and the model's ``(gate, up, down)`` of them."""
        gate_up, down = (inputs.gate_up if fused else (inputs.gate, inputs.up)), inputs.down
        if not fp8:
            return (gate_up, down), (inputs.gate, inputs.up, inputs.down)
        gate_up, down = jax.tree.map(lambda w: BlockScaled.quantize(jnp.asarray(w, jnp.float32)), (gate_up, down))
        gate, up = (np.split(fp8_experts.dequantized(gate_up), 2, axis=-1) if fused else
                    [fp8_experts.dequantized(w) for w in gate_up])
        return (gate_up, down), (gate, up, fp8_experts.dequantized(down))

    (gate_up, down), routed_model = operands(routed)
    shared, (gate, up, one_down) = operands(one)
    shared = jax.tree.map(lambda w: w[0], shared)
    model = numerics.ExpertsInputs(routed.x, routed.expert_ids, *routed_model)
    return ((routed.x, routed.expert_ids, gate_up, down, shared), model,
            numerics.shared_expert_inputs(routed.x, gate[0], up[0], one_down[0]))


def _bits(a):
    return np.asarray(a).view(np.uint16)


@pytest.mark.parametrize("impl", ["reference", "gather", "auto"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_the_shared_expert_matches_the_float64_model(rng, impl, fused, fp8):
    """Given as ``shared=`` and held by `prepare_experts`: the shared rows within the model's
    bound, the routed rows the op's bits without it, the two forms the same bits."""
    (x, ids, gate_up, down, shared), model, shared_model = _case(rng, fused=fused, fp8=fp8)
    rows, shared_rows = jax.jit(lambda x, ids: experts.moe_experts(x, ids, gate_up, down, shared=shared,
                                                                   impl=impl))(x, ids)
    assert shared_rows.shape == (x.shape[0], x.shape[1]) and shared_rows.dtype == jnp.bfloat16
    assert np.array_equal(_bits(rows), _bits(experts.moe_experts(x, ids, gate_up, down, impl=impl)))
    exact, bound = numerics.expected_rows(shared_model)
    assert np.any(exact != 0)
    numerics.assert_close(np.asarray(shared_rows), exact, bound, what=f"{impl} shared rows")
    exact, bound = numerics.expected_rows(model)
    numerics.assert_close(np.asarray(rows), exact, bound, what=f"{impl} rows")
    prepared = prepare_experts(gate_up, down, shared=shared)
    assert prepared.shared and prepared.down.shape[0] == 6
    held = jax.jit(lambda x, ids, p: experts.moe_experts(x, ids, p, impl=impl))(x, ids, prepared)
    assert np.array_equal(_bits(held[0]), _bits(rows)) and np.array_equal(_bits(held[1]), _bits(shared_rows))


def test_the_model_catches_a_wrong_shared_row(rng):
    (x, ids, gate_up, down, shared), _, shared_model = _case(rng)
    _, shared_rows = experts.moe_experts(x, ids, gate_up, down, shared=shared)
    wrong = np.asarray(shared_rows).copy()
    wrong[2] = np.asarray(reference.shared_expert(jnp.asarray(x[[3]]), *shared))[0]
    exact, bound = numerics.expected_rows(shared_model)
    with pytest.raises(AssertionError, match="outside the bound"):
        numerics.assert_close(wrong, exact, bound, what="a token's shared row swapped for another's")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_the_kernel_path_runs_the_held_shared_expert_in_the_kernels(rng, stood_in, fp8):  # noqa: F811
    """Held by `prepare_experts`: the kernels' config has ``shared_expert`` and the FFI call three
    results (rows, shared rows, activations of ``top_k + 1`` pairs a token); on CPU the reference
    branch gives the arrays' bits; vmap folds the batch into one call; the derivative in x is
    the arrays'. Given as ``shared=``: the kernels without it, and XLA's GEMMs for it."""
    (x, ids, gate_up, down, shared), _, _ = _case(rng, fp8=fp8)
    m, top_k = ids.shape
    prepared = prepare_experts(gate_up, down, shared=shared)
    jaxpr = str(jax.make_jaxpr(lambda x, ids, p: experts.moe_experts(x, ids, p, impl="kernel"))(x, ids, prepared))
    call = re.search(rf"ffi_call\[.*?target_name={STAND_IN}", jaxpr, re.S)
    assert call is not None
    for shape in (f"bfloat16[{m * top_k},128]", f"bfloat16[{m},128]", f"bfloat16[{m},{top_k + 1},128]"):
        assert shape in call.group(0), shape
    config, _ = stood_in[-1]
    assert config == ExpertsConfig.for_shape(hidden=128, intermediate=128, experts=5, top_k=top_k, fp8_weights=fp8,
                                             shared_expert=True, m=m).replace(tiled_weights=True)
    want = experts.moe_experts(x, ids, gate_up, down, shared=shared, impl="reference")
    got = jax.jit(lambda x, ids, p: experts.moe_experts(x, ids, p, impl="kernel"))(x, ids, prepared)
    for g, w in zip(got, want):
        assert np.array_equal(_bits(g), _bits(w))
    both = jax.vmap(lambda x, ids: experts.moe_experts(x, ids, prepared, impl="kernel"))(
        np.stack([x, x[::-1]]), np.stack([ids, ids[::-1]]))
    assert both[0].shape == (2, m * top_k, 128) and both[1].shape == (2, m, 128)
    assert np.array_equal(_bits(both[1][1]), _bits(want[1])[::-1])
    grad = jax.grad(lambda x: experts.moe_experts(x, ids, prepared, impl="kernel")[1].astype(jnp.float32).sum())(x)
    grad_want = jax.grad(lambda x: reference.shared_expert(x, *shared).astype(jnp.float32).sum())(x)
    assert np.any(np.asarray(grad, np.float32) != 0) and np.array_equal(_bits(grad), _bits(grad_want))
    experts.moe_experts(x, ids, gate_up, down, shared=shared, impl="kernel")
    config, _ = stood_in[-1]
    assert not config.shared_expert and not config.tiled_weights


def test_each_rank_holds_its_slices_of_the_shared_expert(rng, stood_in):  # noqa: F811
    """Prepared inside ``shard_map`` from each rank's slices of I, routed and shared alike, the
    weights give each rank its partial rows and its partial shared rows."""
    (x, ids, gate_up, down, shared), _, _ = _case(rng, intermediate=64, fused=False)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    specs = ((P(None, None, "tp"), P(None, None, "tp")), P(None, "tp", None), ((P(None, "tp"), P(None, "tp")),
                                                                                P("tp", None)))

    def shard(x, ids, gate_up, down, shared):
        rows, shared_rows = experts.moe_experts(x, ids, prepare_experts(gate_up, down, shared=shared),
                                                impl="kernel")
        return rows[None], shared_rows[None]

    rows, shared_rows = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), *specs), out_specs=P("tp")))(
        x, ids, gate_up, down, shared)
    assert stood_in[-1][0].intermediate == 32 and stood_in[-1][0].shared_expert
    for rank in range(2):
        columns = slice(32 * rank, 32 * (rank + 1))
        (gate, up), one_down = shared
        want = reference.shared_expert(x, (gate[:, columns], up[:, columns]), one_down[columns])
        assert np.any(np.asarray(want, np.float32) != 0)
        assert np.array_equal(_bits(shared_rows[rank]), _bits(want))
        want = reference.moe_experts(x, ids, (gate_up[0][..., columns], gate_up[1][..., columns]),
                                     down[:, columns])
        assert np.array_equal(_bits(rows[rank]), _bits(want))


def test_a_shared_expert_config_s_call_record():
    """The weights hold one more expert, the activations a row more per token, the shared rows
    a result of their own; the down role writes them; m is bounded by ``top_k + 1`` pairs."""
    config = ExpertsConfig.for_shape(hidden=256, intermediate=128, experts=8, top_k=4, shared_expert=True)
    plain = config.replace(shared_expert=False)
    assert config.key != plain.key and config.groups == 9 and config.pairs_per_token == 5
    assert config.max_m == MAX_PAIRS // 5 and plain.max_m == MAX_PAIRS // 4
    assert config.shared_bytes("down") > plain.shared_bytes("down")
    operands = {o["name"]: o for o in _abi.call_operands(config)}
    assert operands["down"]["shape"] == [9, 128, 256] and operands["gate_up"]["shape"] == [9, 256, 256]
    assert operands["activations"]["rows"] == "m" and operands["activations"]["shape"] == [5, 128]
    assert operands["shared"] == {"name": "shared", "io": "ret", "dtype": "bf16", "rows": "m", "shape": [256]}
    assert "shared" not in {o["name"] for o in _abi.call_operands(plain)}
    assert _abi.call_roles(config) == ("expert_gate_up", "expert_down_shared")
    assert _abi.call_roles(config.replace(fp8_weights=True)) == ("expert_gate_up_fp8", "expert_down_fp8_shared")
    assert "shared" in _abi.EXPERTS.roles["expert_down_shared"].params


def test_a_call_past_the_pairs_with_the_shared_expert_is_several_kernel_calls(rng, stood_in):  # noqa: F811
    """``m * (top_k + 1)`` pairs past the kernels' table: kernel calls of ``MAX_PAIRS // 3``
    tokens at top-2, the last of the rest, each with its shared rows."""
    m = MAX_PAIRS // 2
    (x, ids, gate_up, down, shared), _, _ = _case(rng, m=m, hidden=128, intermediate=128, count=3, top_k=2)
    prepared = prepare_experts(gate_up, down, shared=shared)
    jaxpr = jax.make_jaxpr(lambda x, ids, p: experts.moe_experts(x, ids, p, impl="kernel"))(x, ids, prepared).jaxpr
    calls = equations(jaxpr, "ffi_call")
    chunk = MAX_PAIRS // 3
    assert [eqn.invars[0].aval.shape[0] for eqn in calls] == [chunk, m - chunk]
    assert [eqn.outvars[1].aval.shape for eqn in calls] == [(chunk, 128), (m - chunk, 128)]


def test_misuse_is_named(rng):
    (x, ids, gate_up, down, shared), _, _ = _case(rng, fused=False)
    prepared = prepare_experts(gate_up, down, shared=shared)
    (gate, up), one_down = shared
    cases = [
        (dict(shared=(gate,)), r"shared: expected a pair \(gate_up, down\) of the shared expert's weights"),
        (dict(shared=((gate, up[:, :64]), one_down)), r"shared.gate_up\[1\] \(up\).shape=\(128, 64\): expected "
                                                       r"\(128, 128\)"),
        (dict(shared=((gate, up), one_down[:, :64])), r"shared.down.shape=\(128, 64\): expected \[intermediate, "
                                                       r"hidden=128\]"),
        (dict(shared=((gate, up), one_down.astype(np.float32))), r"shared.down"),
    ]
    for options, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            experts.moe_experts(x, ids, gate_up, down, **options)
    with pytest.raises(ValueError, match="shared: expected None with a PreparedExperts that holds the shared expert"):
        experts.moe_experts(x, ids, prepared, shared=shared)
    with pytest.raises(ValueError, match=r"shared: intermediate 64, expected the routed experts' 128 \(the kernels "
                                         r"run the shared expert as one more expert\); pass it to moe_experts as "
                                         r"shared= instead"):
        prepare_experts(gate_up, down, shared=((gate[:, :64], up[:, :64]), one_down[:64]))
    scaled = (BlockScaled.quantize(jnp.asarray(gate, jnp.float32)), BlockScaled.quantize(jnp.asarray(up, jnp.float32)))
    with pytest.raises(ValueError, match=r"prepare_experts: weights of blocks \['bf16', 'bf16', 'bf16', \(128, 128\), "
                                         r"\(128, 128\), 'bf16'\] \(down first, the shared expert's last\)"):
        prepare_experts(gate_up, down, shared=(scaled, one_down))
