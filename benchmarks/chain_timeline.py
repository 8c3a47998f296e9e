"""The kernels of `bench_moe_experts`' timed chain as the GPU ran them: what each kernel costs per
call inside the chain, and how much of the call is no kernel at all.

    python benchmarks/chain_timeline.py --shapes deepseek-v3 --tp 8 --m 256 --columns ours_prepared

Takes `bench_moe_experts`' case arguments and builds the same program (its layers, weights,
routing and chain), runs it once to warm up, then ``--iterations`` passes over the layers under
JAX's profiler, and reads the GPU's kernel events from the trace (CUPTI's start and duration
of each kernel). Per case and column: the span from the first kernel's start to the last one's
end per call, each kernel name's µs and launches per call, and the span less the kernels' sum
(the GPU idle between kernels). ncu replays each kernel alone with its caches flushed; this is
the figure to read against the benchmark's per-call time, where the kernels run back to back
on whatever the previous layer left in L2. The profiler's own cost is in the span, not in a
kernel's duration.
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
import sys
import tempfile

import jax
from jax.profiler import ProfileData

import bench_moe_experts as bench
import experts_columns
import experts_draws
import kernel_builds
import records

NAME_CHARS = 80
"""Kernel names are cut to this many characters (XLA's fusions carry long suffixes)."""


def parse(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()), add_help=False)
    parser.add_argument("--iterations", type=int, default=4, help="passes over the layers under the profiler")
    parser.add_argument("--out", help="the JSON (default: print only)")
    own, rest = parser.parse_known_args(argv)
    if own.iterations < 1:
        parser.error(f"--iterations {own.iterations}: expected at least 1")
    args = bench.parse(rest)
    if args.cpu:
        parser.error("--cpu: a timeline is the GPU's kernels; the chain's plumbing on the CPU is "
                     "bench_moe_experts.py --cpu")
    args.iterations, args.timeline_out = own.iterations, own.out
    return args


def kernel_events(xspace_path):
    """``(start_ns, duration_ns, name)`` of every kernel on the GPU planes' streams, by start."""
    events, seen = [], []
    for plane in ProfileData.from_file(xspace_path).planes:
        seen.append(f"{plane.name}: {[line.name for line in plane.lines]}")
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "Stream" in line.name:
                events.extend((event.start_ns, event.duration_ns, event.name) for event in line.events)
    if not events:
        raise ValueError("no kernel events on a /device:GPU plane's Stream line; the trace holds " + "; ".join(seen))
    return sorted(events)


def summarize(events, calls: int) -> dict:
    """Per call of ``calls``: the span of ``events`` (first start to last end), each kernel name's
    µs and launches, their sum, and the span less that sum (kernels that overlap count twice
    in the sum, so ``idle_us`` is at most the GPU's idle time)."""
    if not events:
        raise ValueError("no kernel events: the trace holds no GPU stream (a run without a GPU, or without CUPTI)")
    start = events[0][0]
    end = max(event_start + duration for event_start, duration, _ in events)
    per_name = collections.defaultdict(lambda: [0.0, 0])
    for _, duration, name in events:
        per_name[name[:NAME_CHARS]][0] += duration
        per_name[name[:NAME_CHARS]][1] += 1
    span_us = (end - start) / 1e3 / calls
    kernels = {name: {"us": total / 1e3 / calls, "launches": count / calls}
               for name, (total, count) in sorted(per_name.items(), key=lambda item: -item[1][0])}
    busy_us = sum(kernel["us"] for kernel in kernels.values())
    return {"span_us": span_us, "kernels_us": busy_us, "idle_us": span_us - busy_us, "kernels": kernels}


def cases(args):
    """``(shape config, tp, m, routing, layer count, inputs)`` of every selected case, as
    `bench_moe_experts.main` draws them."""
    for name, tp in itertools.product(args.shapes, args.tp):
        config = experts_draws.shape_config(args, name)
        most = experts_draws.budget_layers(args, config, tp)
        routings = {m: experts_draws.case_routing(args, config, tp, m, most) for m in args.m}
        weights = experts_draws.draw_weights(args, config, tp, max(len(routing[0]) for routing in routings.values()))
        for m, (xs, ids, active) in routings.items():
            yield config, tp, m, active, len(xs), bench.chain_inputs(config, m, weights, xs, ids)
        del weights


def timeline(compiled, inputs, iterations: int, calls: int) -> dict:
    """`summarize` of one run of ``compiled`` at ``iterations`` under JAX's profiler."""
    run = bench.runner(compiled, iterations)
    run(*inputs).block_until_ready()
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            run(*inputs).block_until_ready()
        (path,) = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
        return summarize(kernel_events(path), calls)


def main(argv=None) -> int:
    args = parse(argv)
    columns = experts_columns.selected_columns(args)
    if any(column.route == "ours" for column in columns):
        kernel_builds.check_kernels(bench.ours_configs(args), bench.build_kernels_command(args))
    results = []
    for config, tp, m, active, layers, inputs in cases(args):
        for column in columns:
            case = {"shape": config.name, "tp": tp, "m": m, "column": column.name, "layers": layers,
                    "active_experts": [int(a.size) for a in active]}
            try:
                compiled, _ = bench.compile_column(column, args, layers, inputs)
            except Exception as error:  # noqa: BLE001 - as the benchmark, a column that cannot build is recorded
                results.append({**case, "why_not": bench.one_line(error)})
                print(f"{config.name} tp={tp} m={m} {column.name}: not built: {results[-1]['why_not']}")
                continue
            summary = timeline(compiled, inputs, args.iterations, args.iterations * layers)
            results.append({**case, **summary})
            print(f"{config.name} tp={tp} m={m} {column.name}: span {summary['span_us']:.1f} us per call, "
                  f"kernels {summary['kernels_us']:.1f}, idle {summary['idle_us']:.1f}")
            for name, kernel in summary["kernels"].items():
                print(f"  {kernel['us']:9.1f} us  x{kernel['launches']:.2f}  {name}")
    if args.timeline_out:
        records.write_json({"environment": {**records.machine_environment(), "iterations": args.iterations},
                            "results": results}, args.timeline_out)
        print(f"wrote {args.timeline_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
