"""A TP group across two processes against the same group in one process: µs per call, in one run.

    python benchmarks/bench_multiprocess.py [--m 1 8 64 256] [--algorithms oneshot twoshot] [--out PATH]
    python benchmarks/bench_multiprocess.py --build-kernels DIR

Two phases, one after the other, each in fresh child processes (this process
never starts JAX, so it holds no GPU memory):

1. two processes, one GPU each, joined by ``jax.distributed`` on localhost
   (`jax_moe_publish.testing.local_processes`, as in ``examples/multiprocess_decode.py``);
2. one process with both GPUs.

Each times, for every algorithm and m, our op (``impl="kernel"``) and XLA's
finalize + ``psum`` on the DeepSeek-V3 problem (hidden 7168, top-k 8, shared
expert, scale 2.5) at tp = 2, with the method and the code of
``bench_moe_publish.py``: a ``fori_loop`` over a chain of ``--layers`` calls,
each layer with its own inputs and its output fed into the next layer's
shared input (XLA's tied to the loop carry); per call = (T(164 iterations) -
T(36 iterations)) / (128 * layers) (``--iterations``), from ``--reps`` timed
runs of each program, ours and XLA's interleaved within each repetition
(`timing.paired_estimates`): ``us`` the median of the per-call
estimates and ``p10``/``p90`` their percentiles (`timing.summarize`),
``paired_ratio`` ours over XLA per repetition, from adjacent runs. The two
processes time their own runs of the same programs; a
call is done when both ranks have its output, so the two-process figure is
the slower process's (the JSON keeps each one's). ``2p/1p`` is the
two-process time over the one-process time.

The run writes one JSON (by default
``benchmarks/results/<date>-<gpu>x2-multiprocess.json``) and prints a
Markdown table. The kernels must be there before it starts: build them where
CuTe DSL is with ``--build-kernels DIR`` (or ``python -m jax_moe_publish.aot
build --preset deepseek-v3 --out DIR``) and point
``$JAX_MOE_PUBLISH_KERNEL_DIR`` at DIR.

Without GPUs (or with ``--cpu``) the same phases run on CPU: two processes
with one CPU device each (gloo) and one process with two virtual CPU devices,
ours on the reference path (the kernels need GPUs). That only checks the
plumbing, its times mean nothing, and its JSON is written only to an explicit
``--out``. A smoke run: ``--cpu --hidden 64 --m 1 --layers 2 --reps 3``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

# benchmarks/ is on sys.path when this file runs as a script.
import chains
import kernel_builds
import records
import timing
from jax_moe_publish.testing import local_processes, rank_processes

TP = 2
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PHASES = {"two_processes": "2 processes, 1 device each", "one_process": "1 process, 2 devices"}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file; default benchmarks/results/<date>-<gpu>x2-multiprocess.json "
                                      "on GPUs, none on CPU")
    parser.add_argument("--m", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--algorithms", nargs="+", default=["oneshot", "twoshot"], choices=["oneshot", "twoshot"])
    parser.add_argument("--problem", default="deepseek-v3", choices=sorted(chains.PROBLEMS))
    parser.add_argument("--hidden", type=int, help="replace the problem's hidden size (a smoke run)")
    parser.add_argument("--layers", type=int, default=timing.LAYERS, help="calls per loop iteration")
    parser.add_argument("--reps", type=int, default=30, help="timed runs of each program")
    parser.add_argument("--iterations", nargs=2, type=int, metavar=("FEW", "MANY"),
                        default=[timing.SHORT, timing.LONG],
                        help="loop iterations of the two timed programs (bench_moe_publish.py's by default)")
    parser.add_argument("--cpu", action="store_true",
                        help="the plumbing check on CPU, also where there are GPUs")
    parser.add_argument("--deadline", type=float, default=1800.0,
                        help="seconds a phase may take before its processes are killed")
    parser.add_argument("--build-kernels", metavar="DIR",
                        help="compile every kernel the cases need into DIR, then exit; needs CuTe DSL, not a GPU")
    parser.add_argument("--role", choices=["worker", "single"], help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    few, many = args.iterations
    if not 1 <= few < many:
        parser.error(f"--iterations {few} {many}: expected 1 <= FEW < MANY")
    return args


def problem_spec(args):
    return {**chains.problem_spec(args.problem), **({"hidden": args.hidden} if args.hidden else {})}


def problem_name(args):
    return args.problem + (f" (hidden {args.hidden})" if args.hidden else "")


def case_flags(args):
    """The flags that choose the cases, for the children and for a build command."""
    flags = ["--problem", args.problem, "--m", *map(str, args.m), "--algorithms", *args.algorithms]
    return flags + (["--hidden", str(args.hidden)] if args.hidden else [])


def needed_configs(args):
    return list(dict.fromkeys(chains.spec_config(problem_spec(args), TP, algorithm, m)
                              for algorithm in args.algorithms for m in args.m))


def measure_cases(args, mesh):
    """Per-call times of ours and XLA's for every algorithm and m, on ``mesh`` (this process's part)."""
    import jax

    import jax_moe_publish as jmp

    spec = problem_spec(args)
    results = []
    key = jax.random.key(0)  # the same inputs in every process and in both phases
    for algorithm in args.algorithms:
        for m in args.m:
            key, sub = jax.random.split(key)
            config = chains.spec_config(spec, TP, algorithm, m)
            with jmp.Mailbox(mesh, "tp", hidden=spec["hidden"], capacity_m=m) as mailbox:
                inputs = chains.chain_inputs(mesh, m, spec, sub, args.layers)
                timed = chains.time_ours_and_xla(mailbox, spec, config, inputs, args.reps, f"{algorithm} m={m}",
                                                 layers=args.layers, op_impl="reference" if args.cpu else "kernel",
                                                 iterations=tuple(args.iterations))
                mailbox.check()
            print(f"{algorithm} m={m}: ours {timed['ours']['us']:.2f} us, xla {timed['xla']['us']:.2f} us per call",
                  flush=True)
            results.append({"algorithm": algorithm, "m": m, **timed})
    return results


def worker(args):
    """One of the two processes: its GPU (or CPU device), the mesh over both processes' devices."""
    local_processes.join(args.port, TP, args.process_id, None if args.cpu else args.process_id)
    import jax
    import numpy as np

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    results = measure_cases(args, jax.sharding.Mesh(np.array(devices), ("tp",)))
    local_processes.report({"process": jax.process_index(), "device": str(jax.local_devices()[0]),
                            "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": results})


def single(args):
    """The one process: the first two local devices."""
    import jax
    import numpy as np

    if args.cpu:
        jax.config.update("jax_platforms", "cpu")
    devices = jax.devices()[:TP]
    if len(devices) < TP:
        raise SystemExit(f"{len(devices)} device(s): the one-process case needs {TP}")
    results = measure_cases(args, jax.sharding.Mesh(np.array(devices), ("tp",)))
    local_processes.report({"environment": records.machine_environment(), "devices": list(map(str, devices)),
                            "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": results})


def run_phase(args, phase):
    """The child results of one phase; exits, naming the failed processes, if any failed."""
    script = [sys.executable, os.path.abspath(__file__), *case_flags(args), "--layers", str(args.layers),
              "--reps", str(args.reps), "--iterations", *map(str, args.iterations)]
    script += ["--cpu"] if args.cpu else []
    if phase == "two_processes":
        port = local_processes.free_port()
        commands = [script + ["--role", "worker", "--process-id", str(i), "--port", str(port)] for i in range(TP)]
        envs = [local_processes.child_environment()] * TP
        names = [f"process {i}" for i in range(TP)]
    else:
        commands = [script + ["--role", "single"]]
        envs = [local_processes.child_environment(cpu_devices=TP if args.cpu else None)]
        names = ["single process"]
    print(f"--- {PHASES[phase]}", flush=True)
    outcomes = local_processes.run(commands, envs=envs, names=names, deadline_s=args.deadline)
    failed = [o.describe() for o in outcomes if o.failed or o.result is None]
    if failed:
        raise SystemExit(f"{PHASES[phase]}: failed: " + "; ".join(failed))
    return [o.result for o in outcomes]


def slower(per_process):
    """The figure of the slower process, with every process's."""
    index = max(range(len(per_process)), key=lambda i: per_process[i]["us"])
    return {**per_process[index], "process": index, "per_process": per_process}


def combine(args, workers, single_result):
    """One row per case: both phases' times and the two-process time over the one-process time."""
    rows = []
    for index, single_case in enumerate(single_result["results"]):
        algorithm, m = single_case["algorithm"], single_case["m"]
        cases = [w["results"][index] for w in workers]
        if any((c["algorithm"], c["m"]) != (algorithm, m) for c in cases):
            raise RuntimeError(f"case {index}: the processes ran {[(c['algorithm'], c['m']) for c in cases]}, "
                               f"the single process {(algorithm, m)}")
        two = {impl: slower([c[impl] for c in cases]) for impl in ("ours", "xla")}
        two["relative_difference"] = max(c["relative_difference"]["xla"] for c in cases)
        one = {key: single_case[key] for key in ("ours", "xla")}
        one["relative_difference"] = single_case["relative_difference"]["xla"]
        rows.append({
            "problem": problem_name(args), "tp": TP, "algorithm": algorithm, "m": m,
            "two_processes": two, "one_process": one,
            # A negative or zero one-process time (noise on CPU) has no ratio.
            "two_over_one": {impl: two[impl]["us"] / one[impl]["us"] if one[impl]["us"] > 0 else None
                             for impl in ("ours", "xla")},
        })
    return rows


def environment(args, workers, single_result):
    machine = single_result["environment"]
    drivers = sorted({line.rsplit(",", 1)[-1].strip() for line in machine["gpus"]})
    return {**machine, "driver": ", ".join(drivers) or None, "platform": "cpu" if args.cpu else "gpu",
            "plumbing_check": args.cpu, "problem": {"name": problem_name(args), **problem_spec(args)},
            "tp": TP, "layers": args.layers, "iterations": args.iterations, "reps": args.reps,
            "xla_flags": {"two_processes": workers[0]["xla_flags"], "one_process": single_result["xla_flags"]},
            "devices": {"two_processes": [w["device"] for w in workers], "one_process": single_result["devices"]}}


def default_out(environment):
    gpu = re.sub(r"[^a-z0-9]+", "-", environment["gpu"].lower().removeprefix("nvidia")).strip("-")
    return os.path.join(RESULTS_DIR, f"{environment['date']}-{gpu}x{TP}-multiprocess.json")


def render_markdown(data):
    def us(figure):
        return f"{figure['us']:.2f}"

    def ratio(value):
        return f"{value:.3f}" if value is not None and math.isfinite(value) else "-"

    lines = ["| problem | tp | algorithm | m | ours 2-proc µs | ours 1-proc µs | ours 2p/1p | "
             "xla 2-proc µs | xla 1-proc µs | xla 2p/1p |", "|" + "---|" * 10]
    for r in data["results"]:
        two, one, ratios = r["two_processes"], r["one_process"], r["two_over_one"]
        lines.append(f"| {r['problem']} | {r['tp']} | {r['algorithm']} | {r['m']} | {us(two['ours'])} | "
                     f"{us(one['ours'])} | {ratio(ratios['ours'])} | {us(two['xla'])} | {us(one['xla'])} | "
                     f"{ratio(ratios['xla'])} |")
    return "\n".join(lines)


def main(argv=None):
    rank_processes.refuse_timing("bench_multiprocess.py")
    args = parse(argv)
    if args.role == "worker":
        local_processes.run_and_leave(worker, args)
    if args.role == "single":
        local_processes.run_and_leave(single, args)
    if args.build_kernels:
        kernel_builds.build_kernels(needed_configs(args), args.build_kernels)
        return 0
    gpus = local_processes.local_gpu_count()
    args.cpu = args.cpu or gpus == 0
    if args.cpu:
        print("PLUMBING CHECK ON CPU: the reference path, gloo between processes; these times mean nothing"
              + ("" if args.out else " and no JSON is written without --out"), flush=True)
    elif gpus < TP:
        raise SystemExit(f"{gpus} GPU(s): this benchmark needs {TP} (--cpu for the plumbing check)")
    else:
        kernel_builds.check_kernels(needed_configs(args), "python benchmarks/bench_multiprocess.py --build-kernels DIR "
                                    + " ".join(case_flags(args)))
    workers = run_phase(args, "two_processes")
    (single_result,) = run_phase(args, "one_process")
    data = {"environment": environment(args, workers, single_result),
            "results": combine(args, workers, single_result)}
    out = args.out or (None if args.cpu else default_out(data["environment"]))
    if out:
        records.write_json(data, out)
        print(f"wrote {out}")
    print()
    if args.cpu:
        print("Plumbing check on CPU (reference path): these times mean nothing.\n")
    print(render_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
