"""A CPU model of how the experts kernels spread their work items over a persistent grid.

Each kernel (gate/up, down) gives every active group (the held shared expert, then each routed
expert) ``items_per_expert`` column blocks, and its pairs passes of ``tokens_per_pass``
(`ExpertsConfig.gemm`). With ``pass_items`` (the default) an item is one block of one pass, the
passes of a block side by side in the item order; without, one block of all the group's
passes, one after another. CTA ``c`` of ``G`` takes the items ``c, c + G, ...``
(`kernels.expert_routing`). With one unit of cost per pass over a block's weights, this
counts, from the routing the benchmark draws (`experts_draws.case_routing`, the models'
routers):

- ``reads``: the units over the floor's (each active group's blocks once): the weight bytes
  read if no pass found its block in L2;
- ``cta``: the busiest CTA's units over the ideal (every unit spread evenly over the grid);
- ``sm``: the same per SM, its CTAs' units together (CTA ``c`` and ``c + sms`` on one SM).

Where HBM bandwidth rules, the kernels' time over the floor is about ``sm`` times the share of
``reads`` that comes from memory: all of it without ``pass_items`` (a block's passes are far
apart in time), less with it, where a block's passes run at about the same time. A model, not
a measurement: one CTA alone on an SM may read faster than its share.

    python benchmarks/item_schedule.py --shapes deepseek-v3 --tp 8 --m 1 16 64 256 --variants pass_items=false
"""

import argparse
import math
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_moe_experts as bench  # noqa: E402
import experts_columns  # noqa: E402
import experts_draws  # noqa: E402
from jax_moe_publish.experts_config import ExpertsConfig  # noqa: E402


def item_costs(counts, config: ExpertsConfig, role: str, m: int) -> tuple[list[int], int]:
    """Each work item's passes over its block, in the kernels' item order (module docstring;
    `ExpertRouting.work_item`) for the routed experts' pair ``counts`` (active ones, in expert
    order), and the units of the floor (each active group's blocks once)."""
    shape = config.gemm(role)
    per_pass, blocks = shape.tokens_per_pass, shape.items_per_expert
    groups = ([m] if config.shared_expert else []) + [int(count) for count in counts]
    costs = []
    for count in groups:
        passes = math.ceil(count / per_pass)
        costs += [1] * (passes * blocks) if config.pass_items else [passes] * blocks
    return costs, len(groups) * blocks


def spread(costs: list[int], floor_units: int, sms: int, ctas_per_sm: int) -> dict:
    """``reads``, ``cta`` and ``sm`` (module docstring) of ``costs`` dealt round robin."""
    grid = sms * ctas_per_sm
    per_cta = np.zeros(grid)
    np.add.at(per_cta, np.arange(len(costs)) % grid, costs)
    per_sm = per_cta.reshape(ctas_per_sm, sms).sum(axis=0)
    ideal = sum(costs) / grid
    return {"items": len(costs), "reads": sum(costs) / floor_units, "cta": per_cta.max() / ideal,
            "sm": per_sm.max() / (ideal * ctas_per_sm)}


def parse(argv=None):
    """This model's arguments, and the benchmark's for the same shapes, tps, m, columns and
    variants (it checks the variants and names each column's config,
    `experts_columns.ours_config`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["deepseek-v3"], choices=list(experts_draws.SHAPES))
    parser.add_argument("--tp", nargs="+", type=int, default=[8])
    parser.add_argument("--m", nargs="+", type=int, default=[1, 16, 64, 128, 256])
    parser.add_argument("--columns", nargs="+", default=["ours_prepared"],
                        choices=[column.name for column in experts_columns.COLUMNS if column.route == "ours"],
                        help="the benchmark's columns of ours (ours_shared_prepared: the shared expert held)")
    parser.add_argument("--variants", nargs="+", default=[], metavar="FIELD=VALUE[,...]",
                        help="the benchmark's --variants, e.g. token_tiles=4")
    parser.add_argument("--layers", type=int, default=3, help="routing draws per case (the benchmark's first)")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--ctas-per-sm", type=int, default=2, help="`ExpertsConfig.for_shape`'s 8-warp CTAs: 2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    same = ["--seed", str(args.seed), "--min-pass-mb", "1e12"]
    for name in ("shapes", "tp", "m", "columns", "variants"):
        if getattr(args, name):
            same += [f"--{name}", *map(str, getattr(args, name))]
    bench_args = bench.parse(same)
    return args, bench_args


def main(argv=None):
    args, bench_args = parse(argv)
    print("| shape | tp | m | column | kernel | token tiles | items | reads | cta | sm | reads x sm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes:
        model = experts_draws.SHAPES[name]
        for tp in args.tp:
            columns = [c for c in experts_columns.selected_columns(bench_args) if bench.ours_runs_at(c, model, tp)]
            for m in args.m:
                _, ids, _ = experts_draws.case_routing(bench_args, model, tp, m, args.layers)
                layer_counts = [np.bincount(np.asarray(layer_ids).ravel(), minlength=model.experts) for layer_ids in ids]
                for column in columns:
                    config = experts_columns.ours_config(model, tp, column, m)
                    for role in ("gate_up", "down"):
                        layers = []
                        for counts in layer_counts:
                            costs, floor_units = item_costs(counts[counts > 0], config, role, m)
                            layers.append(spread(costs, floor_units, args.sms, args.ctas_per_sm))
                        mean = {key: np.mean([layer[key] for layer in layers]) for key in layers[0]}
                        print(f"| {name} | {tp} | {m} | {column.name} | {role} | {config.gemm(role).token_tiles} "
                              f"| {mean['items']:.0f} | {mean['reads']:.2f} | {mean['cta']:.2f} | {mean['sm']:.2f} "
                              f"| {mean['reads'] * mean['sm']:.2f} |")


if __name__ == "__main__":
    main()
