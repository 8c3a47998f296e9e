"""`benchmarks/item_schedule.py`: the model's counts on routings whose answer follows by hand."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import item_schedule

from jax_moe_publish.experts_config import ExpertsConfig

SHARD = dict(hidden=7168, intermediate=256, experts=256, top_k=8)


@pytest.mark.parametrize("pass_items", [True, False])
def test_an_expert_of_more_pairs_than_a_pass_is_read_once_per_pass(pass_items):
    config = ExpertsConfig.for_shape(**SHARD, m=64).replace(pass_items=pass_items)
    shape = config.gemm("gate_up")
    per_pass, blocks = shape.tokens_per_pass, shape.items_per_expert
    counts = np.array([1, 2 * per_pass + 1, per_pass])
    costs, floor_units = item_schedule.item_costs(counts, config, "gate_up", m=64)
    if pass_items:
        # An item per block and pass: 1 + 3 + 1 passes.
        assert costs == [1] * (5 * blocks)
    else:
        assert costs == [1] * blocks + [3] * blocks + [1] * blocks
    assert floor_units == 3 * blocks


@pytest.mark.parametrize("pass_items", [True, False])
def test_the_held_shared_expert_is_the_first_group(pass_items):
    m = 40
    config = ExpertsConfig.for_shape(**SHARD, shared_expert=True, m=m).replace(pass_items=pass_items)
    shape = config.gemm("down")
    passes = -(-m // shape.tokens_per_pass)
    assert passes > 1
    costs, floor_units = item_schedule.item_costs(np.array([3]), config, "down", m=m)
    if pass_items:
        assert costs == [1] * (passes + 1) * shape.items_per_expert
    else:
        assert costs == [passes] * shape.items_per_expert + [1] * shape.items_per_expert
    assert floor_units == 2 * shape.items_per_expert


@pytest.mark.parametrize("sms,ctas_per_sm", [(4, 1), (4, 2), (132, 2)])
def test_one_item_more_than_the_grid_holds_doubles_the_busiest_cta(sms, ctas_per_sm):
    grid = sms * ctas_per_sm
    whole = item_schedule.spread([1] * grid, grid, sms, ctas_per_sm)
    assert whole["cta"] == pytest.approx(1.0) and whole["sm"] == pytest.approx(1.0)
    assert whole["reads"] == pytest.approx(1.0)
    one_more = item_schedule.spread([1] * (grid + 1), grid + 1, sms, ctas_per_sm)
    ideal = (grid + 1) / grid
    assert one_more["cta"] == pytest.approx(2 / ideal)
    # CTA 0 holds the extra item; its SM holds CTA sms too: ctas_per_sm + 1 units against the ideal.
    assert one_more["sm"] == pytest.approx((ctas_per_sm + 1) / (ctas_per_sm * ideal))


def test_reads_count_passes_against_each_active_group_once():
    result = item_schedule.spread([2, 2, 1, 1], 4, sms=2, ctas_per_sm=1)
    assert result["reads"] == pytest.approx(6 / 4)
    # CTA 0 takes items 0 and 2 (3 units), CTA 1 items 1 and 3 (3 units).
    assert result["cta"] == pytest.approx(1.0)


def test_the_command_prints_a_row_per_column_and_kernel_with_the_benchmarks_configs():
    run = subprocess.run([sys.executable, str(BENCHMARKS / "item_schedule.py"), "--shapes", "qwen3-30b-a3b",
                          "--tp", "8", "--m", "4", "--layers", "1", "--variants", "token_tiles=4"],
                         capture_output=True, text=True, check=True)
    rows = [[cell.strip() for cell in line.split("|")[4:7]] for line in run.stdout.splitlines()
            if line.startswith("| qwen3-30b-a3b")]
    # Qwen3-30B-A3B's tp 8 shard: the op's token tiles at m = 4.
    default = str(ExpertsConfig.for_shape(hidden=2048, intermediate=96, experts=128, top_k=8, m=4).token_tiles)
    assert rows == [["ours_prepared", "gate_up", default], ["ours_prepared", "down", default],
                    ["ours_prepared:token_tiles=4", "gate_up", "4"], ["ours_prepared:token_tiles=4", "down", "4"]]


def test_a_variant_the_benchmark_refuses_is_refused():
    with pytest.raises(SystemExit):
        item_schedule.parse(["--variants", "hidden=1024"])
