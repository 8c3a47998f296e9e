"""One decode step of the MoE block (`examples/moe_block.py`) on one GPU, for Nsight Compute:
which kernels the step launches and what each costs, against the step's own time.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python benchmarks/profile_block.py --problem qwen3-moe --m 1 --path prepared --finalize ours

The step (``--layers`` layers, each its own weights, tp = 1) is compiled and run until warm;
then one step runs between ``cuProfilerStart`` and ``cuProfilerStop``, so that ncu profiles
that step's kernels alone (ncu flushes the caches before each kernel: every layer's weights
come from HBM, as in a decode step). Without ncu the script prints the step's time from a
``fori_loop`` of ``--steps`` steps, timed with the host's clock (the difference of two step
counts, so that dispatch cancels): the figure the kernels' sum is read against.
``--build-kernels DIR`` compiles the op's kernels of the case (CuTe DSL, no GPU needed).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_moe_block  # noqa: E402
import chains  # noqa: E402
import jax_moe_publish as jmp  # noqa: E402
import kernel_builds  # noqa: E402
import moe_block as mb  # noqa: E402


def profiler(name: str):
    """The CUDA driver's ``cuProfilerStart`` or ``cuProfilerStop``: where ncu's
    ``--profile-from-start off`` starts and stops."""
    call = getattr(ctypes.CDLL("libcuda.so.1"), name)
    return lambda: _check(call(), name)


def _check(result: int, name: str) -> None:
    if result != 0:
        raise RuntimeError(f"{name} returned CUDA error {result}")


def step_us(decode, inputs, steps: int) -> float:
    """µs per step: ``decode[steps]`` less ``decode[1]``, each the fastest of three runs."""
    def best(program):
        program(*inputs)[0].block_until_ready()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            program(*inputs)[0].block_until_ready()
            times.append(time.perf_counter() - start)
        return min(times)

    return (best(decode[steps]) - best(decode[1])) / (steps - 1) * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problem", default="qwen3-moe", choices=list(mb.PROBLEMS))
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--path", default="prepared", choices=list(mb.PATHS))
    parser.add_argument("--finalize", default="ours", choices=list(mb.FINALIZES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64, help="steps of the timed loop")
    parser.add_argument("--build-kernels", metavar="DIR", help="compile the op's kernels of the case into DIR, "
                                                               "then exit")
    args = parser.parse_args(argv)
    config = mb.PROBLEMS[args.problem]
    kernels = []
    if args.finalize == "ours":
        kernels.append(chains.spec_config(bench_moe_block.op_spec(config), 1, None, args.m))
    if args.path in ("ours", "prepared"):
        kernels.append(bench_moe_block.experts_config(config, 1, args.m, args.path == "prepared"))
    if args.build_kernels:
        kernel_builds.build_kernels(kernels, args.build_kernels)
        return 0
    kernel_builds.check_kernels(kernels, f"python benchmarks/profile_block.py --build-kernels DIR --problem "
                                         f"{args.problem} --m {args.m} --path {args.path} --finalize {args.finalize}")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), (mb.TP,))
    key = jax.random.key(0)
    params = mb.init_params(key, config, mesh, args.layers, prepared=args.path == "prepared")
    x, residual = mb.init_inputs(jax.random.fold_in(key, 1), config, mesh, args.m)
    with jmp.Mailbox(mesh, mb.TP, hidden=config.hidden, capacity_m=args.m) as mailbox:
        layer = functools.partial(mb.moe_layer, config, path=args.path, finalize=args.finalize, mailbox=mailbox,
                                  impl="kernel")
        decode = {n: mb.make_decode(config, mesh, layer, args.layers, steps=n) for n in (1, args.steps)}
        inputs = (params, x, residual)
        us = step_us(decode, inputs, args.steps)
        print(f"{args.problem} m={args.m} path={args.path} finalize={args.finalize}, {args.layers} layers: "
              f"{us:.1f} us per step ({us / args.layers:.1f} per layer), host-timed over {args.steps} steps")
        profiler("cuProfilerStart")()
        decode[1](*inputs)[0].block_until_ready()
        profiler("cuProfilerStop")()
        mailbox.check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
