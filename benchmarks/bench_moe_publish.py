"""Side-by-side timing of jax-moe-publish against XLA's finalize + psum, on the same GPUs in one run.

Every case (problem, tp, algorithm, m) times ours against the XLA columns of its tp
(``xla``; at tp > 1 also ``xla_nccl``) in chains of ``--layers`` calls per loop iteration:
`chains` says what each side runs and how XLA is kept from hoisting it out of the loop,
`timing` how a call is timed (``--iterations``, ``--reps``). Where the installed XLA does not
know a column's compile option, the column is left out and the JSON says why
(``environment.xla_columns``). ``ratio`` is ours over the faster XLA column, which
``xla_best`` names: the median of the ratios of one repetition each
(`timing.paired_ratio`); ``paired_ratio`` has every column's with its spread.

With ``--epilogue`` every problem also runs as ``<problem>+rmsnorm``: each layer adds its
result to the residual stream and applies RMSNorm (`chains`). With ``--fp8 group`` (or
``static``) every problem also runs as ``<problem>+rmsnorm+fp8`` (``+fp8static``), the
epilogue's out in FP8: ours quantizes in its kernels, and at tp > 1 the column
``ours_jnp_quantizer`` times our bf16 epilogue followed by the ``jnp`` quantizer (`chains`);
``ratio`` stays ours over the faster XLA column, ``paired_ratio`` has that column's too.
FP8 cases have no floor (`jax_moe_publish.traffic` counts a bf16 out).

``--rounds R`` times ours, XLA and every variant R times in turn, each round with freshly
built programs, and pools the rounds' estimates (and ratios) into each side's ``us``,
``p10`` and ``p90``, with every round's median in ``rounds_us`` (`timing` says why). The
launch variants of ``--configs`` are timed one after another, each paired by run within
itself.

Each case also gets a *floor* (`floors`), measured once per run on the same GPUs:
``ours_over_floor`` is our time as a multiple of it. At the end the results print as a
Markdown table (``benchmarks/report.py`` renders saved runs, merges them and plots them).

``--configs`` also times `tuning_variants` of our kernels per case and prints
the table it chose from. Every variant needs its cubin: build them where CuTe
DSL is with ``--build-kernels DIR`` (or print one build command per kernel
with ``--list-configs``), given the same ``--problems/--tp/--algorithms``.

``--cpu`` runs the same cases on 8 virtual CPU devices, ours through the
reference path: a check of the plumbing at every tp (its times mean nothing,
and it has no floors). With ``--layers 2 --iterations 2 6 --reps 3`` it takes
seconds per case.

    python benchmarks/bench_moe_publish.py --out results.json [--no-command-buffer] [--configs [M ...]]
    python benchmarks/bench_moe_publish.py --build-kernels kernels/ --tp 1 2
    python benchmarks/bench_moe_publish.py --cpu --tp 4 8 --m 3 --layers 2 --iterations 2 6 --reps 3 --out /tmp/cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import numpy as np

import chains
import floors
import jax_moe_publish as jmp
import kernel_builds
import records
import report
import timing
from jax_moe_publish import traffic, tuning
from jax_moe_publish.testing import rank_processes

CPU_DEVICES = 8



def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file for every figure (needed unless --list-configs or "
                                      "--build-kernels)")
    parser.add_argument("--problems", nargs="+", default=["deepseek-v3", "qwen3-moe"])
    parser.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--algorithms", nargs="+", default=["oneshot", "twoshot"], choices=["oneshot", "twoshot"],
                        help="all-reduce algorithms for tp > 1 (tp = 1 runs 'direct')")
    parser.add_argument("--epilogue", action="store_true",
                        help="also time each problem with the residual add + RMSNorm epilogue, as "
                             "case '<problem>+rmsnorm'")
    parser.add_argument("--fp8", nargs="+", default=[], choices=list(chains.FP8_SUFFIXES.values()),
                        help="also time each problem with the epilogue's out in FP8, with a scale per "
                             "128 columns ('group': case '<problem>+rmsnorm+fp8') or a static one "
                             "('static': '<problem>+rmsnorm+fp8static')")
    parser.add_argument("--xla-columns", nargs="+", default=list(chains.XLA_COLUMNS),
                        choices=list(chains.XLA_COLUMNS),
                        help="the XLA baselines for tp > 1 (tp = 1 has no psum: 'xla' only)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=timing.LAYERS, help="calls per loop iteration")
    parser.add_argument("--iterations", nargs=2, type=int, default=[timing.SHORT, timing.LONG],
                        metavar=("FEW", "MANY"), help="loop iterations of the two timed programs")
    parser.add_argument("--cpu", action="store_true",
                        help="on 8 virtual CPU devices, ours through the reference path: plumbing only")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time ours, XLA and every variant this many times in turn, each round with "
                             "freshly compiled programs; pool the rounds' estimates (and keep every "
                             "round's median)")
    parser.add_argument("--no-command-buffer", action="store_true",
                        help="turn XLA command buffers (CUDA graphs) off for this run")
    parser.add_argument("--hlo", help="write the optimized HLO of the first case's chains and of the "
                                      "empty-call chain to HLO.<name>.txt")
    parser.add_argument("--configs", nargs="*", type=int, metavar="M",
                        help="also time every launch variant of tuning_variants() for ours, at these m "
                             "(no value: at every m); costs GPU time and needs the variants' cubins")
    parser.add_argument("--tune-fields", nargs="+", choices=sorted(tuning.TUNING_GRID), default=sorted(tuning.TUNING_GRID),
                        help="the tuning.TUNING_GRID fields that --configs varies (default: all)")
    parser.add_argument("--list-configs", action="store_true",
                        help="print a build command for every kernel the cases (and their tuning "
                             "variants) need, then exit")
    parser.add_argument("--build-kernels", metavar="DIR",
                        help="compile every kernel the cases (and their tuning variants) need into DIR, "
                             "then exit; needs CuTe DSL, not a GPU")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    if not 0 < args.iterations[0] < args.iterations[1]:
        parser.error(f"--iterations {' '.join(map(str, args.iterations))}: expected 0 < FEW < MANY")
    if args.out is None and not (args.list_configs or args.build_kernels):
        parser.error("--out is required to measure")
    return args


def configure_xla(args):
    """XLA's settings of this run, before JAX starts a backend: command buffers off with
    ``--no-command-buffer``, and with ``--cpu`` the CPU platform of CPU_DEVICES devices."""
    if args.no_command_buffer:
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
    if args.cpu:
        jax.config.update("jax_platforms", "cpu")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={CPU_DEVICES}")


def tuning_variants(problem, tp, algorithm, m, fields):
    """The launch shapes ``--configs`` times for one case: the default first, then the rest of
    tuning.TUNING_GRID over ``fields`` (``--tune-fields``).

    Values a case cannot take are left out (``prefetch_group`` above top-k,
    ``elements_per_thread`` not dividing hidden, shapes a fused epilogue cannot
    have), and ``reduce_threads`` is not varied for ``direct``, which has no
    reduce kernel. ``fuse_reduce`` is not a grid axis: for oneshot it adds the
    default launch shape of the other choice.

    Returns
    -------
    list of `jmp.KernelConfig`, distinct, the default first.
    """
    base = chains.case_config(problem, tp, algorithm, m)
    grid = {
        "threads": tuning.TUNING_GRID["threads"],
        "elements_per_thread": tuple(e for e in tuning.TUNING_GRID["elements_per_thread"] if base.hidden % e == 0),
        "prefetch_group": tuple(g for g in tuning.TUNING_GRID["prefetch_group"] if g <= base.top_k),
        "enable_pdl": tuning.TUNING_GRID["enable_pdl"],
    }
    if algorithm != "direct":
        grid["reduce_threads"] = tuning.TUNING_GRID["reduce_threads"]
    if base.fuse_reduce:
        grid["keep_own_partial"] = tuning.TUNING_GRID["keep_own_partial"]
        grid["waves"] = tuning.TUNING_GRID["waves"]
    grid = {field: values for field, values in grid.items() if field in fields}
    variants = []
    for values in itertools.product(*grid.values()):
        try:
            variants.append(base.replace(**dict(zip(grid, values))))
        except ValueError:
            continue
    if algorithm == "oneshot" and "fuse_reduce" in fields:
        variants.append(chains.case_config(problem, tp, algorithm, m, fuse_reduce=not base.fuse_reduce))
    return list(dict.fromkeys([base, *variants]))


def case_problems(args):
    """The problem names of this run's cases: ``--problems``, with ``--epilogue`` their
    ``+rmsnorm`` cases too, and with ``--fp8`` their FP8 cases (`chains.FP8_SUFFIXES`)."""
    suffixes = [chains.EPILOGUE_SUFFIX] if args.epilogue else []
    suffixes += [chains.EPILOGUE_SUFFIX + suffix for suffix, mode in chains.FP8_SUFFIXES.items() if mode in args.fp8]
    return args.problems + [name + suffix for suffix in suffixes for name in args.problems]


def case_algorithms(args, tp):
    return ["direct"] if tp == 1 else args.algorithms


def needed_configs(args, tp_sizes, with_variants):
    """Every kernel config the cases of this run use: the table's (with an FP8 out also its bf16
    twin, which `chains.OURS_JNP_QUANTIZER` launches), plus their tuning variants if
    ``with_variants``."""
    configs = []
    for tp in tp_sizes:
        for name in case_problems(args):
            for algorithm in case_algorithms(args, tp):
                for m in args.m:
                    config = chains.case_config(name, tp, algorithm, m)
                    configs += (tuning_variants(name, tp, algorithm, m, args.tune_fields) if with_variants
                                else [config])
                    configs.append(chains.op_config(config))
    return list(dict.fromkeys(configs))


def build_kernels_command(args):
    """The command that builds every kernel of this run's cases into a folder DIR."""
    flags = (f"--problems {' '.join(args.problems)} --tp {' '.join(map(str, args.tp))} "
             f"--algorithms {' '.join(args.algorithms)}" + (" --epilogue" if args.epilogue else "")
             + (f" --fp8 {' '.join(args.fp8)}" if args.fp8 else ""))
    return f"python benchmarks/bench_moe_publish.py --build-kernels DIR {flags}"


def time_variants(mailbox, problem, configs, inputs, reps, rounds=1):
    """Per-call time of ours under each config; ``configs[0]`` is the default, whose bits all must match."""
    timings = [[] for _ in configs]
    bits = []
    for round_index in range(rounds):
        for config, config_rounds in zip(configs, timings):
            programs = {n: chains.make_chain("ours", mailbox, problem, config, n)
                        for n in (timing.SHORT, timing.LONG)}
            if round_index == 0:
                bits.append(np.asarray(programs[timing.SHORT](*inputs)).view(np.uint16))
            config_rounds.append(timing.call_estimates(programs, inputs, reps))
    variants = []
    for config, config_rounds, config_bits in zip(configs, timings, bits):
        # Direct mode has no reduce kernel: its reduce_threads is not a choice.
        launch = {f: getattr(config, f) for f in tuning.TUNING_GRID
                  if f != "reduce_threads" or config.algorithm != "direct"}
        variants.append({"key": config.key, "launch": launch, **timing.summarize(config_rounds),
                         "same_bits_as_default": bool(np.array_equal(config_bits, bits[0]))})
    return {"variants": variants, "best": min(range(len(variants)), key=lambda i: variants[i]["us"])}


def measure_case(args, mesh, name, m, algorithm, key, floor_limits, tune, columns):
    """One case: ours against every XLA column of its tp among ``columns``, its floor (None
    without ``floor_limits``)."""
    problem = chains.problem_spec(name)
    tp = mesh.shape["tp"]
    config = chains.case_config(name, tp, algorithm, m)
    result = {"problem": name, "m": m, "tp": tp, "algorithm": algorithm}
    xla = chains.xla_columns(tp, columns)
    with jmp.Mailbox(mesh, "tp", hidden=problem["hidden"], capacity_m=m) as mailbox:
        inputs = chains.chain_inputs(mesh, m, problem, key, args.layers)
        result.update(chains.time_ours_and_xla(
            mailbox, problem, config, inputs, args.reps, f"{name} tp={tp} {algorithm} m={m}", layers=args.layers,
            op_impl="reference" if args.cpu else "kernel", hlo=args.hlo, rounds=args.rounds,
            iterations=tuple(args.iterations), xla=xla))
        if tune:
            variants = tuning_variants(name, tp, algorithm, m, args.tune_fields)
            result["tuning"] = time_variants(mailbox, problem, variants, inputs, args.reps, args.rounds)
        mailbox.check()
    result["xla_best"] = min(xla, key=lambda column: result[column]["us"])
    result["ratio"] = result["paired_ratio"][result["xla_best"]]["ratio"]
    if floor_limits is None:
        return result
    if problem["fp8_out"] != "none":
        # Not a floor: traffic.bytes_per_rank counts out as bf16, twice its FP8 bytes.
        result["no_floor"] = "jax_moe_publish.traffic has no FP8 out"
        return result
    # The op's own traffic only.
    moved = traffic.bytes_per_rank(algorithm=algorithm, tp=tp, m=m, hidden=problem["hidden"],
                                   top_k=problem["top_k"], shared_expert=problem["shared"],
                                   weight_bytes=chains.WEIGHT_BYTES, epilogue="rmsnorm" if problem["epilogue"] else "none",
                                   own_slot=not config.keep_own_partial)
    result["floor"] = report.case_floor(moved, floor_limits)
    result["ours_over_floor"] = result["ours"]["us"] / result["floor"]["us"]
    return result


def environment(args, refused):
    """The machine and this run's options; per XLA column ``timed``, or why XLA refused it
    (``refused``, `chains.probe_xla_columns`)."""
    return {**records.machine_environment(), "platform": "cpu" if args.cpu else "gpu", "plumbing_check": args.cpu,
            "command_buffer": not args.no_command_buffer, "layers": args.layers,
            "iterations": list(args.iterations), "reps": args.reps, "rounds": args.rounds,
            "configs": args.configs, "tune_fields": args.tune_fields,
            "xla_columns": {column: refused.get(column, "timed") for column in args.xla_columns}}


def print_tuning(tuning):
    print(f"    {'launch variant of ours':72} {'us':>9}")
    for index, variant in enumerate(tuning["variants"]):
        notes = ["default"] if index == 0 else []
        notes += ["best"] if index == tuning["best"] else []
        notes += [] if variant.get("same_bits_as_default", True) else ["BITS DIFFER FROM DEFAULT"]
        print(f"    {report.format_launch(variant['launch']):72} {variant['us']:9.2f}  {' '.join(notes)}")


def main(argv=None):
    args = parse(argv)
    rank_processes.refuse_timing("bench_moe_publish.py")
    configure_xla(args)
    if args.list_configs or args.build_kernels:
        configs = needed_configs(args, args.tp, with_variants=True)
        if args.list_configs:
            kernel_builds.print_build_commands(configs, build_kernels_command(args))
        if args.build_kernels:
            kernel_builds.build_kernels(configs, args.build_kernels)
        return 0
    platform = "cpu" if args.cpu else "gpu"
    devices = [d for d in jax.devices() if d.platform == platform]
    tp_sizes = [tp for tp in args.tp if tp <= len(devices)]
    for tp in sorted(set(args.tp) - set(tp_sizes)):
        print(f"skipping tp={tp}: {len(devices)} {platform.upper()} device(s)")
    if not tp_sizes:
        raise SystemExit(f"no case can run: {len(devices)} {platform.upper()} device(s) for "
                         f"--tp {' '.join(map(str, args.tp))}")
    if args.cpu:
        floor_limits = None
        print("on virtual CPU devices, ours through the reference path: a plumbing check, its times mean "
              "nothing", flush=True)
    else:
        kernel_builds.check_kernels(needed_configs(args, tp_sizes, with_variants=args.configs is not None),
                                    build_kernels_command(args))
        floor_limits = floors.measure_floors(devices, args.reps, args.hlo)
        p2p = floor_limits["p2p"]
        print(f"floors: copy {floor_limits['copy']['bytes_per_s'] / 1e9:.0f} GB/s (read + write), "
              + (f"peer copy {p2p['bytes_per_s'] / 1e9:.0f} GB/s (one way), " if p2p else "")
              + f"{floors.EMPTY_CALL} {floor_limits['empty_call']['us']:.2f} us", flush=True)
    refused = {}
    if max(tp_sizes) > 1:
        refused = chains.probe_xla_columns(jax.sharding.Mesh(np.array(devices[:max(tp_sizes)]), ("tp",)),
                                           args.xla_columns)
    columns = [column for column in args.xla_columns if column not in refused]
    results = []
    data = {"environment": environment(args, refused), "floors": floor_limits, "results": results}
    key = jax.random.key(0)
    print(f"{'problem':12} {'tp':>2} {'algorithm':9} {'m':>5} {'ours us':>9} {'xla us':>9} {'nccl us':>9} "
          f"{'ratio':>6} {'floor us':>9} {'bound':10} {'/floor':>6} {'bf16+q us':>9}")
    for tp in tp_sizes:
        mesh = jax.sharding.Mesh(np.array(devices[:tp]), ("tp",))
        for name in case_problems(args):
            for algorithm in case_algorithms(args, tp):
                for m in args.m:
                    key, sub = jax.random.split(key)
                    tune = args.configs is not None and (not args.configs or m in args.configs)
                    r = measure_case(args, mesh, name, m, algorithm, sub, floor_limits, tune, columns)
                    results.append(r)
                    nccl, quantizer = (f"{r[column]['us']:9.2f}" if column in r else f"{'-':>9}"
                                       for column in ("xla_nccl", chains.OURS_JNP_QUANTIZER))
                    floor = (f"{r['floor']['us']:9.2f} {r['floor']['bound']:10} {r['ours_over_floor']:6.2f}"
                             if "floor" in r else f"{'-':>9} {'':10} {'-':>6}")
                    print(f"{name:12} {tp:>2} {algorithm:9} {m:>5} {r['ours']['us']:9.2f} {r['xla']['us']:9.2f} "
                          f"{nccl} {r['ratio']:6.3f} {floor} {quantizer}", flush=True)
                    if tune:
                        print_tuning(r["tuning"])
                    # After every case, so that a run cut short keeps what it measured.
                    records.write_json(data, args.out)
    records.write_json(data, args.out)
    print(f"wrote {args.out}\n")
    print(report.render_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
