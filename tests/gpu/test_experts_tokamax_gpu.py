"""The experts op's tokamax route (impl="tokamax", `experts_tokamax`) on one NVIDIA GPU, against
the float64 model (`numerics`): DeepSeek-V3's and Qwen3's shard shapes at decode and past it,
with skipped ids, hot experts and every id skipped; the same bits twice, under vmap; and
impl="auto" taking it from a table entry, or that entry's other route where tokamax cannot run.
Skips where tokamax does not import (the ``tokamax`` extra).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import jax_moe_publish as jmp
import numerics
from jax_moe_publish import experts_tokamax, experts_tuning

pytestmark = [pytest.mark.gpus(1),
              pytest.mark.skipif(experts_tokamax.import_error() is not None,
                                 reason=f"tokamax does not import: {experts_tokamax.import_error()}")]

SHAPES = ((7168, 256, 32, 8, True),  # DeepSeek-V3's tp = 8 shard, with fewer experts
          (2048, 192, 128, 8, False),  # Qwen3-30B's tp = 4 shard, gate and up apart
          (512, 64, 16, 4, True))


def _weights(inputs, fused):
    return inputs.gate_up if fused else (inputs.gate, inputs.up)


def _route(impl):
    """A jit of the op of its own: its trace reads the table and whether tokamax imports."""
    return jax.jit(lambda x, ids, gate_up, down: jmp.moe_experts(x, ids, gate_up, down, impl=impl))


TOKAMAX = _route("tokamax")
"""The model checks' one jit: tokamax compiles once per shape and m, not per case."""


@pytest.mark.parametrize("case", ["random", "hot experts", "every id skipped"])
@pytest.mark.parametrize("m", (1, 7, 64, 256))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "-".join(map(str, shape)))
def test_the_tokamax_route_matches_the_model(rng, shape, m, case):
    hidden, intermediate, count, top_k, fused = shape
    options = {"hot experts": dict(hot_experts=3), "every id skipped": dict(skipped_fraction=1.0)}.get(case, {})
    inputs = numerics.random_experts(rng, m=m, hidden=hidden, intermediate=intermediate, experts=count, top_k=top_k,
                                     **options)
    args = (inputs.x, inputs.expert_ids, _weights(inputs, fused), inputs.down)
    out = np.asarray(TOKAMAX(*args))
    exact, bound = numerics.expected_rows(inputs)
    numerics.assert_close(out, exact, bound, what=f"tokamax m={m} {case}")
    numerics.assert_rows_zero(out, inputs, what=f"tokamax m={m} {case}")
    again = np.asarray(TOKAMAX(*args))
    assert np.array_equal(again.view(np.uint16), out.view(np.uint16)), "the same inputs gave other bits"


def test_the_tokamax_route_under_vmap(rng):
    hidden, intermediate, count, top_k, fused = SHAPES[1]
    batch = [numerics.random_experts(rng, m=5, hidden=hidden, intermediate=intermediate, experts=count, top_k=top_k)
             for _ in range(3)]
    w = batch[0]
    op = jax.jit(jax.vmap(lambda x, ids: jmp.moe_experts(x, ids, _weights(w, fused), w.down, impl="tokamax")))
    got = np.asarray(op(np.stack([b.x for b in batch]), np.stack([b.expert_ids for b in batch])))
    for b, element in enumerate(batch):
        exact, bound = numerics.expected_rows(dataclasses.replace(w, x=element.x, expert_ids=element.expert_ids))
        numerics.assert_close(got[b], exact, bound, what=f"vmap's element {b}")


def test_auto_takes_tokamax_where_the_table_says_and_its_other_route_where_tokamax_cannot_run(rng, monkeypatch):
    hidden, intermediate, count, top_k, fused = SHAPES[0]
    inputs = numerics.random_experts(rng, m=16, hidden=hidden, intermediate=intermediate, experts=count, top_k=top_k)
    gate_up = _weights(inputs, fused)
    entry = experts_tuning.ExpertsChoice(hidden=hidden, intermediate=intermediate, experts=count, top_k=top_k,
                                         max_m=64, impl="tokamax", otherwise="gather",
                                         source="benchmarks/results/test.json", reason="the test's entry")
    monkeypatch.setattr(experts_tuning, "TABLE", [entry])
    args = (inputs.x, inputs.expert_ids, gate_up, inputs.down)
    bits = {impl: np.asarray(_route(impl)(*args)).view(np.uint16) for impl in ("auto", "tokamax", "gather")}
    assert np.array_equal(bits["auto"], bits["tokamax"])
    monkeypatch.setattr(experts_tokamax, "import_error", lambda: "ImportError: the test's")
    fallen_back = np.asarray(_route("auto")(*args)).view(np.uint16)
    assert np.array_equal(fallen_back, bits["gather"])
    with pytest.raises(ValueError, match=r"impl='tokamax': tokamax does not import \(ImportError: the test's\)"):
        jmp.moe_experts(inputs.x, inputs.expert_ids, gate_up, inputs.down, impl="tokamax")


def test_shapes_off_its_tiles_are_refused_before_tokamax(rng):
    """Qwen3-30B's tp = 8 shard (intermediate 96), which tokamax's kernel cannot tile."""
    inputs = numerics.random_experts(rng, m=4, hidden=2048, intermediate=96, experts=8, top_k=8)
    with pytest.raises(ValueError, match=r"impl='tokamax': intermediate=96: the tokamax route takes hidden and "
                                         r"intermediate multiples of 64"):
        jmp.moe_experts(inputs.x, inputs.expert_ids, inputs.gate_up, inputs.down, impl="tokamax")
