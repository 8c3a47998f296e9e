"""The experts op's kernels for Nsight Compute: one shard shape, a few calls, nothing else on
the GPU between them.

    ncu --clock-control none -k regex:expert --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section LaunchStats --section WarpStateStats \\
        python benchmarks/profile_experts.py --shape deepseek-v3 --tp 8 --m 1

The first call loads the kernels; ncu flushes the caches before each profiled kernel, so one
layer's weights read from HBM as a decode step's would. Routing is the model's router on
random tokens (`bench_moe_experts.draw_routing`). Prints the shape, the active experts and
each kernel's weight bytes, against which ncu's ``dram__bytes_read`` is read.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

import bench_moe_experts as bench

import jax_moe_publish as jmp


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="deepseek-v3", choices=list(bench.SHAPES))
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--impl", default="kernel", choices=["kernel", "reference"],
                        help="reference: the plumbing on a machine without a GPU")
    args = parser.parse_args(argv)
    config = bench.SHAPES[args.shape]
    key = jax.random.key(0)
    x, ids = bench.draw_routing(config, args.m, jax.random.fold_in(key, 0), jax.random.fold_in(key, 1))
    weights = bench.draw_layer_weights(jax.random.fold_in(key, 2), config, args.tp)
    op = jax.jit(lambda x, ids, gate_up, down: jmp.moe_experts(x, ids, gate_up, down, impl=args.impl))
    for _ in range(args.calls):
        rows = op(x, ids, weights["gate_up"], weights["down"])
    rows.block_until_ready()
    active = np.unique(np.asarray(ids))
    intermediate = config.intermediate // args.tp
    gate_up_bytes = active.size * config.hidden * 2 * intermediate * 2
    down_bytes = active.size * intermediate * config.hidden * 2
    print(f"{args.shape} tp={args.tp} (intermediate {intermediate}) m={args.m}: {active.size} active experts; "
          f"weight bytes gate/up {gate_up_bytes / 1e6:.2f} MB, down {down_bytes / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
