"""Write the algorithm table, ``jax_moe_publish/algorithms.json``: one-shot, two-shot or XLA by
(result layout, epilogue, tp) and the size of a call's partial.

    python benchmarks/tune_algorithms.py --model
    python benchmarks/tune_algorithms.py --measure --out benchmarks/results/DATE-tp-sweep.json [--m 1 2 4 ...]
    python benchmarks/tune_algorithms.py --measure --cpu --out /tmp/sweep.json --table /tmp/algorithms.json

``--model`` (no GPU) rewrites the entries marked ``model`` from `tuning.LinkModel` and the
constants in the file's ``model`` section, at the DeepSeek-V3 shape: for tp > 2, one-shot up
to the largest m at which it is no slower than two-shot, two-shot beyond.

``--measure`` (on GPUs) times our kernels and XLA's path side by side at every m, for every
tp the local GPUs allow (1, 2, 4, 8): at tp = 1 the direct kernel against XLA's ``jnp``
finalize, above it one-shot and two-shot against the finalize and ``psum``, without and with
the epilogue, the way ``bench_moe_publish.py`` times its cases (DeepSeek-V3 shape, both XLA
columns). It writes every figure to ``--out`` and replaces the entries of the measured tp
with the fastest path per m, each range reaching the largest m it won, with a reason that
cites ``--out``. XLA's default column competes as ``xla`` (the op's ``jnp`` path runs it),
for problems with a shared expert only, as measured; the NCCL column is recorded beside it. ``--cpu`` runs the same phases on virtual CPU devices
(the reference path, short chains, times meaningless) and writes the table to ``--table``
instead of the package's: a plumbing check.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

MEASURED_TPS = (1, 2, 4, 8)
DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
CPU_CHAINS = dict(layers=2, iterations=(2, 6))  # --cpu: the plumbing, not the times
CPU_DEVICES = 8


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", action="store_true", help="rewrite the model entries (no GPU)")
    what.add_argument("--measure", action="store_true", help="time the algorithms on this machine's GPUs")
    parser.add_argument("--out", help="JSON file for every figure of --measure")
    parser.add_argument("--table", default=None, help="the table to rewrite (default: the package's)")
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_MS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help=f"--measure on {CPU_DEVICES} virtual CPU devices: "
                                                           "plumbing only")
    args = parser.parse_args()
    if args.measure and not args.out:
        parser.error("--measure needs --out")
    if args.cpu and args.table is None:
        parser.error("--cpu needs --table: its times must not reach the package's table")
    return args


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CPU_DEVICES}"

from jax_moe_publish import tuning  # noqa: E402
from jax_moe_publish.aot.presets import DEEPSEEK_V3  # noqa: E402

CASES = (("allreduce", "none"), ("allreduce", "rmsnorm"))
"""The (result, epilogue) tables with a choice between one-shot and two-shot."""


def measured_cases(tp: int):
    """The (result, epilogue) cases and kernel algorithms a sweep times at ``tp``: at tp = 1 the
    direct kernel, whose epilogue runs in ``jnp`` either way, so only without it."""
    if tp == 1:
        return (("allreduce", "none"),), ("direct",)
    return CASES, ("oneshot", "twoshot")


def model_entries(model: tuning.LinkModel, problem: tuning.Problem, tp: int, epilogue: str) -> list[dict]:
    """The model's entries for one tp: one-shot up to the crossover, two-shot beyond."""
    crossover = model.crossover_m(problem, tp, epilogue)
    where = (f"at hidden {problem.hidden}, top-k {problem.top_k}, with {model.p2p_bytes_per_s / 1e9:g} GB/s "
             f"NVLink, {model.hbm_bytes_per_s / 1e12:g} TB/s HBM, {model.exchange_s * 1e6:g} us per exchange "
             f"and {model.launch_s * 1e6:g} us per launch; not yet measured at tp = {tp}")
    if crossover is None:
        return [dict(max_bytes=None, algorithm="oneshot", source="model",
                     reason=f"model: one-shot no slower than two-shot up to m = {model.MAX_M}, {where}")]
    twoshot = dict(max_bytes=None, algorithm="twoshot", source="model",
                   reason=f"model: two-shot faster from m = {crossover + 1}, {where}")
    if crossover == 0:
        return [twoshot]
    return [dict(max_bytes=crossover * problem.hidden * 2, algorithm="oneshot", source="model",
                 reason=f"model: one-shot no slower than two-shot up to m = {crossover}, {where}"), twoshot]


def rewrite_model(data: dict) -> None:
    """Replace every tp > 2 whose entries are all ``model`` by the model's entries."""
    model = tuning.LinkModel(**{name: data["model"][name] for name in tuning.LinkModel.__dataclass_fields__})
    for result, epilogue in CASES:
        by_tp = data["tables"][f"{result}/{epilogue}"]
        for tp, entries in by_tp.items():
            if int(tp) > 2 and all(entry.get("source") == "model" for entry in entries):
                by_tp[tp] = model_entries(model, DEEPSEEK_V3, int(tp), epilogue)


def measured_entries(timings: list[dict], tp: int, hidden: int, out: str, shared_expert: bool) -> list[dict]:
    """Ranges of m by their fastest path, each reaching the largest m it won; the last takes
    any m, and is a kernel (the kernel path's own choice must cover every call): where XLA won
    at the largest m, the faster kernel there follows it. An ``xla`` range holds for problems
    with a shared expert or without, as the sweep's problem (``shared_expert``).

    ``timings``: one row per m, ``{"m": m, "us": {path: us}}``; every path competes."""
    entries = []
    rows = sorted(timings, key=lambda r: r["m"])
    for row in rows:
        best = min(row["us"], key=row["us"].get)
        reason = (f"fastest at m = {row['m']} on tp = {tp}: " + ", ".join(
            f"{path} {us:.2f} us" for path, us in sorted(row["us"].items())) + f" ({out})")
        if entries and entries[-1]["algorithm"] == best:
            entries[-1].update(max_bytes=row["m"] * hidden * 2, reason=entries[-1]["reason"] + "; " + reason)
        else:
            entries.append(dict(max_bytes=row["m"] * hidden * 2, algorithm=best, source="measured", reason=reason))
            if best == "xla":
                entries[-1]["shared_expert"] = shared_expert
    if entries[-1]["algorithm"] == "xla":
        kernels = {path: us for path, us in rows[-1]["us"].items() if path != "xla"}
        entries.append(dict(max_bytes=None, algorithm=min(kernels, key=kernels.get), source="measured",
                            reason=f"the faster kernel at m = {rows[-1]['m']} on tp = {tp}, the sweep's "
                                   f"largest ({out})"))
    entries[-1]["max_bytes"] = None
    return entries


def measure(data: dict) -> dict:
    """Time one-shot, two-shot and XLA at every (tp, m, epilogue); rewrite those tp's entries."""
    import jax
    import numpy as np

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import bench_moe_publish as bench
    import jax_moe_publish as jmp

    chains = CPU_CHAINS if ARGS.cpu else dict(layers=bench.LAYERS, iterations=(bench.SHORT, bench.LONG))
    devices = jax.devices()
    tps = [tp for tp in MEASURED_TPS if tp <= len(devices)]
    refused = bench.probe_xla_columns(jax.sharding.Mesh(np.array(devices[:max(tps)]), ("tp",)), bench.XLA_COLUMNS)
    columns = [column for column in bench.XLA_COLUMNS if column not in refused]
    figures = {"environment": {**bench.machine_environment(), "plumbing_check": ARGS.cpu, **chains,
                               "reps": ARGS.reps, "xla_columns_refused": refused},
               "results": []}
    for tp in tps:
        mesh = jax.sharding.Mesh(np.array(devices[:tp]), ("tp",))
        cases, algorithms = measured_cases(tp)
        for result, epilogue in cases:
            name = "deepseek-v3" + (bench.EPILOGUE_SUFFIX if epilogue != "none" else "")
            problem = bench.problem_spec(name)
            timings = []
            for m in ARGS.m:
                row = {"tp": tp, "m": m, "case": f"{result}/{epilogue}", "us": {}, "xla": {}}
                with jmp.Mailbox(mesh, "tp", hidden=problem["hidden"], capacity_m=m) as mailbox:
                    inputs = bench.chain_inputs(mesh, m, problem, jax.random.key(m), chains["layers"])
                    for algorithm in algorithms:
                        timed = bench.time_ours_and_xla(
                            mailbox, problem, bench.case_config(name, tp, algorithm, m), inputs, ARGS.reps,
                            f"{name} tp={tp} {algorithm} m={m}", op_impl="reference" if ARGS.cpu else "kernel",
                            xla=bench.xla_columns(tp, columns), **chains)
                        row["us"][algorithm] = timed["ours"]["us"]
                        for column in bench.xla_columns(tp, columns):
                            row["xla"].setdefault(column, []).append(timed[column])
                    mailbox.check()
                # The op's jnp path runs XLA's default column: the fastest of its programs (one
                # per kernel algorithm; they differ by up to 3 us at small m) competes.
                row["us"]["xla"] = min(figure["us"] for figure in row["xla"]["xla"])
                timings.append(row)
                figures["results"].append(row)
                print(f"tp={tp} {result}/{epilogue} m={m}: " + ", ".join(
                    f"{path} {us:.2f}" for path, us in row["us"].items()), flush=True)
            data["tables"][f"{result}/{epilogue}"][str(tp)] = measured_entries(
                timings, tp, problem["hidden"], ARGS.out, problem["shared"])
    return figures


def main() -> int:
    table = pathlib.Path(ARGS.table) if ARGS.table else tuning.TABLE_FILE
    data = json.loads(tuning.TABLE_FILE.read_text())
    if ARGS.model:
        rewrite_model(data)
    else:
        figures = measure(data)
        pathlib.Path(ARGS.out).write_text(json.dumps(figures, indent=1))
        print(f"wrote {ARGS.out}")
    table.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
