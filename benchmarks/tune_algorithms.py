"""Write the algorithm table, ``jax_moe_publish/algorithms.json``: one-shot, two-shot or XLA by
(result layout, epilogue, tp) and the size of a call's partial.

    python benchmarks/tune_algorithms.py --model [--table COPY]
    python benchmarks/tune_algorithms.py --measure --tp 2 --m 1 2 4 --out sweep-tp2-m1-4.json
    python benchmarks/tune_algorithms.py --merge sweep-tp2-m1-4.json sweep-tp2-m8-32.json ... \
        --table jax_moe_publish/algorithms.json
    python benchmarks/tune_algorithms.py --measure --tp 2 --out sweep-tp2.json --table algorithms.json
    python benchmarks/tune_algorithms.py --measure --cpu --tp 2 --m 1 2 --out /tmp/sweep.json \
        --table /tmp/algorithms.json

``--model`` (no GPU) rewrites the entries marked ``model`` from `link_model.LinkModel` and the
constants in the file's ``model`` section, at the DeepSeek-V3 shape: for every tp > 1 whose
entries are all the model's, one-shot up to the largest m at which it is no slower than
two-shot, two-shot beyond.

``--measure`` (on GPUs) times our kernels and XLA's path side by side at ``--tp`` and every
``--m``, without and with the epilogue: at tp = 1 the direct kernel against XLA's ``jnp``
finalize, above it one-shot and two-shot against the finalize and ``psum``, the way
``bench_moe_publish.py`` times its cases (DeepSeek-V3 shape, both XLA columns). It writes
every figure to ``--out``, a part of the sweep, after each m (a run cut short keeps the m it
finished). XLA's default column competes as ``xla`` (the op's ``jnp`` path runs it), for
problems with a shared expert only, as measured; the NCCL column is recorded beside it.
``--cpu`` runs the same phases on virtual CPU devices (the reference path, short chains,
times meaningless): a plumbing check.

``--merge`` (no GPU) turns parts into entries: it replaces the entries of their tp with the
fastest path per m, each range reaching the largest m it won, each m's reason citing its
part as named on the command line. It refuses parts of different tp, device, commit or
problem, an m that two parts hold, and parts that together lack an m of ``--m`` or hold one
outside it: a range would stretch over m that nobody timed. ``--measure`` with ``--table``
merges its own part, the one path from figures to entries.

``--table`` is the table to rewrite; where that file does not exist yet, it starts as the
package's. Without it ``--model`` rewrites the package's table in place; ``--merge`` needs
it, and ``--measure`` writes no table without it: on a GPU machine the package is installed,
not edited, and its copy of the table is not the one committed.
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
    what.add_argument("--measure", action="store_true", help="time the algorithms at --tp on this machine's GPUs")
    what.add_argument("--merge", nargs="+", metavar="PART",
                      help="rewrite one tp's entries from the parts that --measure wrote (no GPU)")
    parser.add_argument("--tp", type=int, choices=MEASURED_TPS, help="the tp that --measure times")
    parser.add_argument("--out", help="--measure's part of the sweep: a JSON file of every figure")
    parser.add_argument("--table", default=None,
                        help="the table to rewrite, the package's where the file does not exist yet (needed by "
                             "--merge; --measure writes one only with it; --model's default: the package's)")
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_MS),
                        help="the m that --measure times, and that the parts of a merge hold together")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help=f"--measure on {CPU_DEVICES} virtual CPU devices: "
                                                           "plumbing only")
    args = parser.parse_args()
    if args.measure and (args.tp is None or args.out is None):
        parser.error("--measure needs --tp and --out: a part holds one tp's figures")
    if not args.measure and (args.tp is not None or args.out is not None):
        parser.error("--tp and --out are --measure's")
    if args.merge and args.table is None:
        parser.error("--merge needs --table: the table to rewrite (the committed one is "
                     "jax_moe_publish/algorithms.json of the checkout)")
    if args.merge and len(set(args.merge)) < len(args.merge):
        parser.error(f"--merge {' '.join(args.merge)}: a part named twice")
    if args.cpu and not args.measure:
        parser.error("--cpu is a plumbing check of --measure")
    return args


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CPU_DEVICES}"

from jax_moe_publish import link_model, tuning  # noqa: E402
from jax_moe_publish.aot.presets import DEEPSEEK_V3  # noqa: E402

CASES = (("allreduce", "none"), ("allreduce", "rmsnorm"))
"""The (result, epilogue) tables with a choice between one-shot and two-shot."""


def measured_cases(tp: int):
    """The (result, epilogue) cases and kernel algorithms a sweep times at ``tp``: at tp = 1 the
    direct kernel, with the epilogue in ``jnp`` after it, where XLA's path fuses the finalize
    into its epilogue (one launch fewer)."""
    return CASES, ("direct",) if tp == 1 else ("oneshot", "twoshot")


def model_entries(model: link_model.LinkModel, problem: tuning.Problem, tp: int, epilogue: str) -> list[dict]:
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
    """Replace every tp > 1 whose entries are all ``model`` by the model's entries (tp = 1 has
    one kernel algorithm: nothing to model); every other entry stays as it is."""
    model = link_model.LinkModel(**{name: data["model"][name] for name in link_model.LinkModel.__dataclass_fields__})
    for result, epilogue in CASES:
        by_tp = data["tables"][f"{result}/{epilogue}"]
        for tp, entries in by_tp.items():
            if int(tp) > 1 and all(entry.get("source") == "model" for entry in entries):
                by_tp[tp] = model_entries(model, DEEPSEEK_V3, int(tp), epilogue)


def measured_entries(timings: list[dict], tp: int, hidden: int, shared_expert: bool) -> list[dict]:
    """Ranges of m by their fastest path, each reaching the largest m it won; the last takes
    any m, and is a kernel (the kernel path's own choice must cover every call): where XLA won
    at the largest m, the faster kernel there follows it. An ``xla`` range holds for problems
    with a shared expert or without, as the sweep's problem (``shared_expert``).

    ``timings``: one row per m, ``{"m": m, "us": {path: us}, "cited": file}``; every path
    competes, and each m's reason cites its row's file."""
    entries = []
    rows = sorted(timings, key=lambda r: r["m"])
    for row in rows:
        best = min(row["us"], key=row["us"].get)
        reason = (f"fastest at m = {row['m']} on tp = {tp}: " + ", ".join(
            f"{path} {us:.2f} us" for path, us in sorted(row["us"].items())) + f" ({row['cited']})")
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
                                   f"largest ({rows[-1]['cited']})"))
    entries[-1]["max_bytes"] = None
    return entries


SWEEP_PROBLEM = "deepseek-v3"
"""The problem a sweep times (`chains.PROBLEMS`); its cases add the epilogue."""


def measure(tp: int, ms: list[int], reps: int, cpu: bool, out: str) -> dict:
    """Time one-shot, two-shot and XLA at ``tp`` and every m of ``ms``, with and without the
    epilogue (`measured_cases`): the sweep's part, written to ``out`` after each m.

    A part holds its ``tp``, the ``m`` it was asked for, the ``problem``, the ``environment``
    (the device, the commit from ``$JMP_COMMIT``, the chains) and one row per (m, case):
    ``{"tp", "m", "case": "result/epilogue", "us": {path: us}, "xla": {column: [figures]}}``."""
    import jax
    import numpy as np

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import chains
    import jax_moe_publish as jmp
    import records
    import timing

    chain_options = CPU_CHAINS if cpu else dict(layers=timing.LAYERS, iterations=(timing.SHORT, timing.LONG))
    devices = jax.devices()
    if tp > len(devices):
        raise SystemExit(f"--tp {tp}: needs {tp} devices, found {len(devices)}")
    mesh = jax.sharding.Mesh(np.array(devices[:tp]), ("tp",))
    refused = chains.probe_xla_columns(mesh, chains.XLA_COLUMNS)
    columns = [column for column in chains.XLA_COLUMNS if column not in refused]
    spec = chains.problem_spec(SWEEP_PROBLEM)
    part = {"tp": tp, "m": list(ms),
            "problem": {"name": SWEEP_PROBLEM, "hidden": spec["hidden"], "shared_expert": spec["shared"]},
            "environment": {**records.machine_environment(), "plumbing_check": cpu, **chain_options, "reps": reps,
                            "xla_columns_refused": refused},
            "results": []}
    cases, algorithms = measured_cases(tp)
    for m in ms:
        for result, epilogue in cases:
            name = SWEEP_PROBLEM + (chains.EPILOGUE_SUFFIX if epilogue != "none" else "")
            problem = chains.problem_spec(name)
            row = {"tp": tp, "m": m, "case": f"{result}/{epilogue}", "us": {}, "xla": {}}
            with jmp.Mailbox(mesh, "tp", hidden=problem["hidden"], capacity_m=m) as mailbox:
                inputs = chains.chain_inputs(mesh, m, problem, jax.random.key(m), chain_options["layers"])
                for algorithm in algorithms:
                    timed = chains.time_ours_and_xla(
                        mailbox, problem, chains.case_config(name, tp, algorithm, m), inputs, reps,
                        f"{name} tp={tp} {algorithm} m={m}", op_impl="reference" if cpu else "kernel",
                        xla=chains.xla_columns(tp, columns), **chain_options)
                    row["us"][algorithm] = timed["ours"]["us"]
                    for column in chains.xla_columns(tp, columns):
                        row["xla"].setdefault(column, []).append(timed[column])
                mailbox.check()
            # The op's jnp path runs XLA's default column: the fastest of its programs (one
            # per kernel algorithm; they differ by up to 3 us at small m) competes.
            row["us"]["xla"] = min(figure["us"] for figure in row["xla"]["xla"])
            part["results"].append(row)
            print(f"tp={tp} {result}/{epilogue} m={m}: " + ", ".join(
                f"{path} {us:.2f}" for path, us in row["us"].items()), flush=True)
        records.write_json(part, out)
    return part


PART_KEYS = ("tp", "m", "problem", "environment", "results")
PART_FACTS = {
    "tp": lambda part: part["tp"],
    "device": lambda part: part["environment"]["gpu"],
    "commit": lambda part: part["environment"]["commit"],
    "problem": lambda part: part["problem"],
}
"""What the parts of one merge share: a merge rewrites one tp's entries, from one device's runs of one tree."""


def merge(data: dict, parts: dict[str, dict], ms: list[int]) -> int:
    """Replace the entries of the parts' tp in ``data`` by `measured_entries` of their rows, every
    case of `measured_cases`; return that tp.

    ``parts``: each part as `measure` wrote it, by the name its reasons cite. Raises
    ValueError, naming the parts and what is wrong, for parts that differ in a fact of
    `PART_FACTS`, an (m, case) that two parts hold, an m outside ``ms``, and an m of ``ms``
    that no part holds for some case."""
    for path, part in parts.items():
        missing = [key for key in PART_KEYS if key not in part]
        if missing:
            raise ValueError(f"{path}: not a part of a sweep (it has no {', '.join(missing)}); "
                             "tune_algorithms.py --measure writes them")
    for fact, value_of in PART_FACTS.items():
        values = {path: value_of(part) for path, part in parts.items()}
        if len({json.dumps(value, sort_keys=True) for value in values.values()}) > 1:
            raise ValueError(f"the parts differ in {fact}: " + ", ".join(
                f"{path} has {value}" for path, value in values.items()) + "; a merge takes the parts of "
                "one tp, from one device, commit and problem")
    first = next(iter(parts.values()))
    tp, problem = first["tp"], first["problem"]
    cases = [f"{result}/{epilogue}" for result, epilogue in measured_cases(tp)[0]]
    held = {case: {} for case in cases}
    for path, part in parts.items():
        for row in part["results"]:
            if row["m"] not in ms:
                raise ValueError(f"{path}: m = {row['m']} is not one of the sweep's m, "
                                 f"{' '.join(map(str, ms))} (--m)")
            if row["m"] in held[row["case"]]:
                raise ValueError(f"tp = {tp}, {row['case']}, m = {row['m']}: in both "
                                 f"{held[row['case']][row['m']]['cited']} and {path}")
            held[row["case"]][row["m"]] = {"m": row["m"], "us": row["us"], "cited": path}
    unmeasured = {}  # the m that no part holds: the cases that lack them
    for case in cases:
        missing = tuple(m for m in ms if m not in held[case])
        if missing:
            unmeasured.setdefault(missing, []).append(case)
    if unmeasured:
        raise ValueError(f"tp = {tp}: no part holds " + "; ".join(
            f"m = {', '.join(map(str, missing))} of {' and '.join(lacking)}" for missing, lacking in unmeasured.items())
            + f" (the sweep's m: {' '.join(map(str, ms))}, --m)")
    for case in cases:
        data["tables"][case][str(tp)] = measured_entries(list(held[case].values()), tp, problem["hidden"],
                                                         problem["shared_expert"])
    return tp


def main() -> int:
    table = pathlib.Path(ARGS.table) if ARGS.table else tuning.TABLE_FILE
    data = json.loads((table if table.exists() else tuning.TABLE_FILE).read_text())
    if ARGS.model:
        rewrite_model(data)
    elif ARGS.measure:
        parts = {ARGS.out: measure(ARGS.tp, ARGS.m, ARGS.reps, ARGS.cpu, ARGS.out)}
        print(f"wrote {ARGS.out}")
        if ARGS.table is None:
            return 0
        merge(data, parts, ARGS.m)
    else:
        parts = {path: json.loads(pathlib.Path(path).read_text()) for path in ARGS.merge}
        try:
            merge(data, parts, ARGS.m)
        except ValueError as error:
            sys.exit(f"--merge: {error}")
    table.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
