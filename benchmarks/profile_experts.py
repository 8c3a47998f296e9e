"""The experts op's kernels for Nsight Compute, and launch-shape variants side by side: one
shard shape, nothing else on the GPU between the calls.

    ncu --clock-control none -k regex:expert --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats \\
        python benchmarks/profile_experts.py --shape deepseek-v3 --tp 8 --m 1
    python benchmarks/profile_experts.py --shape deepseek-v3 --tp 8 --m 1 --time \\
        --variant gate_up_warp_cols=64 --variant gate_up_warps_k=4,gate_up_warps_n=2
    python benchmarks/profile_experts.py --build-kernels DIR --shape deepseek-v3 --tp 8 --variant ...

The first call loads the kernels; ncu flushes the caches before each profiled kernel, so one
layer's weights read from HBM as a decode step's would. Routing is the model's router on
random tokens (`experts_draws.draw_routing`). Prints each kernel's weight bytes, against
which ncu's ``dram__bytes_read`` is read.

``--time`` times the launch shapes (`ExpertsConfig.for_shape`'s, then each ``--variant``'s
changes to it) over a chain of layers with their own weights (a pass reads >= 200 MB, beyond
L2): a quick comparison while exploring, timed with the host's clock around many calls; the
benchmark of record is ``bench_moe_experts.py``, and only its figures are a reason to change a
launch shape (at Qwen3-30B tp 1, m = 1, ``--time`` put a variant at 0.70 of the default's time
where the benchmark found the two equal: benchmarks/EXPERIMENTS.md, 2026-12-06). Each
variant's rows of the first layer are checked against the default's (relative difference at
most `bench_moe_experts.MAX_DIFFERENCE`: another K split sums in another order); the script
fails if one is not.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import bench_moe_experts as bench
import experts_columns
import experts_draws
import kernel_builds

import jax_moe_publish as jmp

MIN_PASS_BYTES = 200e6


def configs(args, config):
    """The default launch shapes of the shard at ``args.m``, then each variant's."""
    base = jmp.ExpertsConfig.for_shape(hidden=config.hidden, intermediate=config.intermediate // args.tp,
                                       experts=config.experts, top_k=config.top_k, fp8_weights=args.fp8, m=args.m)
    return [base] + [base.replace(**experts_columns.parse_changes(variant)) for variant in args.variant]


def weights_for(config, layers):
    """Each layer's weights as ``config`` reads them: e4m3 with 128 x 128 block scales
    (`jmp.BlockScaled.quantize`) for a config with ``fp8_weights``; `jmp.prepare_experts`'s
    tiled order for one with ``tiled_weights`` (``down`` then None), else the arrays as drawn."""
    weights = [(layer["gate_up"], layer["down"]) for layer in layers]
    if config is not None and config.fp8_weights:
        quantize = jax.jit(jmp.BlockScaled.quantize)
        weights = [(quantize(gate_up), quantize(down)) for gate_up, down in weights]
    if config is None or not config.tiled_weights:
        return weights
    prepare = jax.jit(lambda gate_up, down: jmp.prepare_experts(gate_up, down, config=config))
    return [(prepare(gate_up, down), None) for gate_up, down in weights]


def time_call(op, weights, xs, ids, calls: int) -> float:
    """µs per call of ``op`` over the layers in turn, ``calls`` calls after one pass of warm-up."""
    def one_pass():
        for layer in range(len(weights)):
            rows = op(xs[layer], ids[layer], *weights[layer])
        return rows

    one_pass().block_until_ready()
    passes = max(1, calls // len(weights))
    start = time.perf_counter()
    for _ in range(passes):
        rows = one_pass()
    rows.block_until_ready()
    return (time.perf_counter() - start) / (passes * len(weights)) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="deepseek-v3", choices=list(experts_draws.SHAPES))
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--calls", type=int, default=4, help="calls per config (with --time: timed calls)")
    parser.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE[,...]",
                        help="an ExpertsConfig change to the default launch shapes (repeatable)")
    parser.add_argument("--time", action="store_true", help="time each config over a chain of layers")
    parser.add_argument("--impl", default="kernel", choices=["kernel", "reference"],
                        help="reference: the plumbing on a machine without a GPU")
    parser.add_argument("--fp8", action="store_true", help="e4m3 weights with 128 x 128 block scales (the default "
                                                           "config's fp8_weights)")
    parser.add_argument("--build-kernels", metavar="DIR", help="compile the configs into DIR (CuTe DSL), then exit")
    args = parser.parse_args(argv)
    config = experts_draws.SHAPES[args.shape]
    chosen = configs(args, config)
    if args.build_kernels:
        kernel_builds.build_kernels(chosen, args.build_kernels)
        return 0
    intermediate = config.intermediate // args.tp
    key = jax.random.key(0)

    def routing(layer):
        return experts_draws.draw_routing(config, args.m, jax.random.fold_in(key, 0),
                                          jax.random.fold_in(key, 1 + layer))

    active = np.unique(np.asarray(routing(0)[1]))
    weight_bytes = 1 if args.fp8 else 2
    gate_up_bytes = active.size * config.hidden * 2 * intermediate * weight_bytes
    down_bytes = active.size * intermediate * config.hidden * weight_bytes
    print(f"{args.shape} tp={args.tp} (intermediate {intermediate}) m={args.m}: {active.size} active experts; "
          f"weight bytes gate/up {gate_up_bytes / 1e6:.2f} MB, down {down_bytes / 1e6:.2f} MB (the first layer)")
    count = int(np.ceil(MIN_PASS_BYTES / (gate_up_bytes + down_bytes))) if args.time else 1
    layers = [experts_draws.draw_layer_weights(jax.random.fold_in(key, 1000 + layer), config, args.tp)
              for layer in range(count)]
    xs, ids = zip(*(routing(layer) for layer in range(count)))
    default_rows, disagree = None, []
    for index, chosen_config in enumerate(chosen):
        # The reference path takes each config too (it checks it against the weights, then
        # ignores it): the plumbing of every variant on a machine without a GPU.
        op = jax.jit(lambda x, ids, gate_up, down, c=chosen_config: jmp.moe_experts(x, ids, gate_up, down,
                                                                                    impl=args.impl, config=c))
        label = "default" if index == 0 else args.variant[index - 1]
        weights = weights_for(chosen_config, layers)
        rows = np.asarray(op(xs[0], ids[0], *weights[0]), np.float64)
        if default_rows is None:
            default_rows = rows
        difference = float(np.linalg.norm(rows - default_rows) / np.linalg.norm(default_rows))
        if not difference <= bench.MAX_DIFFERENCE:
            disagree.append(label)
        against = f"rows vs default {difference:.1e}"
        if args.time:
            us = time_call(op, weights, xs, ids, args.calls)
            print(f"  {label}: {us:.1f} us per call over {count} layers, {against} ({chosen_config.key})")
        else:
            for _ in range(args.calls):
                last = op(xs[0], ids[0], *weights[0])
            last.block_until_ready()
            print(f"  {label}: {args.calls} calls, {against}")
    if disagree:
        print(f"rows differ from the default's by more than {bench.MAX_DIFFERENCE} (relative): {disagree}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
