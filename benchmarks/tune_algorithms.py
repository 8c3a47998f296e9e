"""Write the algorithm table, ``jax_moe_publish/algorithms.json``: one-shot, two-shot or XLA by
(result layout, epilogue, tp) and the size of a call's partial.

    python benchmarks/tune_algorithms.py --model
    python benchmarks/tune_algorithms.py --measure --out benchmarks/results/DATE-tp-sweep.json [--m 1 2 4 ...]

``--model`` (no GPU) rewrites the entries marked ``model`` from `tuning.LinkModel` and the
constants in the file's ``model`` section: for tp > 2, one-shot up to the partial size where
two-shot's fewer NVLink bytes pay for its second exchange (and, with the epilogue, for the
unfused two-shot's two more launches), two-shot beyond.

``--measure`` (on GPUs) times our one-shot and two-shot and XLA's ``psum`` side by side at
every m, for every tp the local GPUs allow (2, 4, 8), without and with the epilogue, the
way ``bench_moe_publish.py`` times its cases (DeepSeek-V3 shape). It writes every figure to
``--out`` and replaces the entries of the measured tp with the fastest path per m, each
range reaching the largest m it won, with a reason that cites ``--out``. ``--cpu`` runs the
same phases on virtual CPU devices (the reference path, times meaningless) and writes the
table to ``--table`` instead of the package's: a plumbing check.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

MEASURED_TPS = (2, 4, 8)
DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", action="store_true", help="rewrite the model entries (no GPU)")
    what.add_argument("--measure", action="store_true", help="time the algorithms on this machine's GPUs")
    parser.add_argument("--out", help="JSON file for every figure of --measure")
    parser.add_argument("--table", default=None, help="the table to rewrite (default: the package's)")
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_MS))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="--measure on 8 virtual CPU devices: plumbing only")
    args = parser.parse_args()
    if args.measure and not args.out:
        parser.error("--measure needs --out")
    if args.cpu and args.table is None:
        parser.error("--cpu needs --table: its times must not reach the package's table")
    return args


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from jax_moe_publish import tuning  # noqa: E402

CASES = {("allreduce", "none"): (1, 1), ("allreduce", "rmsnorm"): (1, 3)}
"""(result, epilogue) -> kernels of a one-shot and of a two-shot call."""


def model_entries(model: tuning.LinkModel, tp: int, oneshot_kernels: int, twoshot_kernels: int) -> list[dict]:
    """The model's entries for one tp: one-shot up to the crossover, two-shot beyond."""
    crossover = model.crossover_bytes(tp, oneshot_kernels, twoshot_kernels)
    if crossover is None:
        return [dict(max_bytes=None, algorithm="oneshot", source="model",
                     reason=f"tp = {tp}: two-shot sends as many NVLink bytes and waits twice")]
    reason = (f"model: one-shot's {tp - 1} copies of the partial cost less than two-shot's second exchange "
              f"({model.exchange_s * 1e6:g} us) and {twoshot_kernels - oneshot_kernels} more launches up to "
              f"{crossover} bytes at {model.p2p_bytes_per_s / 1e9:g} GB/s; not yet measured at tp = {tp}")
    return [dict(max_bytes=crossover, algorithm="oneshot", source="model", reason=reason),
            dict(max_bytes=None, algorithm="twoshot", source="model", reason=reason.replace(
                "cost less than", "cost more than").replace("up to", "beyond"))]


def rewrite_model(data: dict) -> None:
    model = tuning.LinkModel(**{k: data["model"][k] for k in ("p2p_bytes_per_s", "exchange_s", "launch_s")})
    for (result, epilogue), kernels in CASES.items():
        by_tp = data["tables"][f"{result}/{epilogue}"]
        for tp, entries in by_tp.items():
            if int(tp) > 2 and all(entry.get("source") == "model" for entry in entries):
                by_tp[tp] = model_entries(model, int(tp), *kernels)


def measured_entries(timings: list[dict], tp: int, hidden: int, out: str) -> list[dict]:
    """Ranges of m by their fastest path, each reaching the largest m it won (the last: any)."""
    entries = []
    for row in sorted(timings, key=lambda r: r["m"]):
        best = min(row["us"], key=row["us"].get)
        reason = (f"fastest at m = {row['m']} on tp = {tp}: " + ", ".join(
            f"{path} {us:.2f} us" for path, us in sorted(row["us"].items())) + f" ({out})")
        if entries and entries[-1]["algorithm"] == best:
            entries[-1].update(max_bytes=row["m"] * hidden * 2, reason=entries[-1]["reason"] + "; " + reason)
        else:
            entries.append(dict(max_bytes=row["m"] * hidden * 2, algorithm=best, source="measured", reason=reason))
    entries[-1]["max_bytes"] = None
    return entries


def measure(data: dict) -> dict:
    """Time one-shot, two-shot and XLA at every (tp, m, epilogue); rewrite those tp's entries."""
    import jax
    import numpy as np

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import bench_moe_publish as bench
    import jax_moe_publish as jmp

    devices = jax.devices()
    figures = {"environment": bench.machine_environment(), "results": []}
    for tp in [tp for tp in MEASURED_TPS if tp <= len(devices)]:
        mesh = jax.sharding.Mesh(np.array(devices[:tp]), ("tp",))
        for (result, epilogue), _ in CASES.items():
            name = "deepseek-v3" + ("+rmsnorm" if epilogue != "none" else "")
            problem = bench.problem_spec(name)
            timings = []
            for m in ARGS.m:
                key = jax.random.key(m)
                us = {}
                with jmp.Mailbox(mesh, "tp", hidden=problem["hidden"], capacity_m=m) as mailbox:
                    inputs = bench.chain_inputs(mesh, m, problem, key)
                    for algorithm in ("oneshot", "twoshot"):
                        config = bench.case_config(name, tp, algorithm, m)
                        timed = bench.time_ours_and_xla(
                            mailbox, problem, config, inputs, ARGS.reps, f"{name} tp={tp} {algorithm} m={m}",
                            op_impl="reference" if ARGS.cpu else "kernel")
                        us[algorithm] = timed["ours"]["us"]
                        us.setdefault("xla", timed["xla"]["us"])
                timings.append({"tp": tp, "m": m, "case": f"{result}/{epilogue}", "us": us})
                figures["results"].append(timings[-1])
                print(f"tp={tp} {result}/{epilogue} m={m}: " + ", ".join(f"{k} {v:.2f}" for k, v in us.items()),
                      flush=True)
            data["tables"][f"{result}/{epilogue}"][str(tp)] = measured_entries(timings, tp, problem["hidden"],
                                                                              ARGS.out)
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
