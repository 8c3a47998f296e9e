"""How many loop iterations `bench_moe_publish.py` needs: run time against iterations, ours and XLA's.

    python benchmarks/iteration_counts.py --out results.json [--m 16 64] [--counts 4 36 132 260]

For each problem (DeepSeek-V3, with and without the epilogue) and m, at tp = 2,
oneshot, both paths' chains (`chains.make_chain`) run at every
iteration count, each T the median of ``--reps`` runs, in ``--rounds`` rounds
of freshly compiled programs. The JSON keeps every T and, per round, the
least-squares slope and intercept over all counts and the per-call estimate of
each pair of counts. If T were linear in the iterations, every pair would give
the same per-call time; where it is not (a fixed cost per run that varies, a
start-up), the pairs differ and show which counts to time.

It also records how often XLA ran our FFI handler per run (never on XLA's
path), inside a CUDA graph capture and directly
(`jax_moe_publish._extension.execute_counts`): a replayed command buffer runs it
not at all, a recapture once per layer, and a call outside the command buffer
once per call. That tells whether a run's fixed cost comes from capturing the
custom calls again.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for every figure")
    parser.add_argument("--m", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--counts", nargs="+", type=int, default=[4, 36, 132, 260])
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if len(set(args.counts)) < 2 or min(args.counts) < 1:
        parser.error(f"--counts {args.counts}: expected at least two distinct counts >= 1")
    return args


ARGS = _parse() if __name__ == "__main__" else None

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_moe_publish as jmp  # noqa: E402
from jax_moe_publish import _extension  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chains  # noqa: E402
import records  # noqa: E402
import timing  # noqa: E402

TP = 2
PROBLEMS = ("deepseek-v3", "deepseek-v3" + chains.EPILOGUE_SUFFIX)


def time_counts(impl, mailbox, problem, config, inputs, counts, reps):
    """Median run time in ms of ``impl``'s chain at each of ``counts`` iterations, and the fit."""
    programs = {n: chains.make_chain(impl, mailbox, problem, config, n) for n in counts}
    ms, executes = {}, {}
    for n in counts:
        before = _extension.execute_counts()
        ms[n] = float(np.median(timing.time_runs(programs[n], inputs, reps))) * 1e3
        runs = reps + 1  # time_runs' warm-up run, then the timed ones
        executes[str(n)] = {kind: (after - start) / runs for kind, after, start
                            in zip(("captured", "direct"), _extension.execute_counts(), before)}
    calls = np.array(counts) * timing.LAYERS
    slope, intercept = np.polyfit(calls, np.array([ms[n] for n in counts]), 1)
    pairs = {f"{a}-{b}": (ms[b] - ms[a]) / ((b - a) * timing.LAYERS) * 1e3
             for a, b in itertools.combinations(sorted(counts), 2)}
    return {"ms": {str(n): ms[n] for n in counts}, "fit_us_per_call": float(slope * 1e3),
            "fit_intercept_ms": float(intercept), "pair_us_per_call": pairs,
            "handler_executes_per_run": executes}


def main():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < TP:
        raise SystemExit(f"needs {TP} GPUs, found {len(gpus)}")
    mesh = jax.sharding.Mesh(np.array(gpus[:TP]), ("tp",))
    counts = sorted(set(ARGS.counts))
    data = {"environment": {**records.machine_environment(), "layers": timing.LAYERS, "counts": counts,
                            "reps": ARGS.reps, "rounds": ARGS.rounds},
            "results": []}
    for name in PROBLEMS:
        problem = chains.problem_spec(name)
        for m in ARGS.m:
            config = chains.case_config(name, TP, "oneshot", m)
            with jmp.Mailbox(mesh, "tp", hidden=problem["hidden"], capacity_m=m) as mailbox:
                inputs = chains.chain_inputs(mesh, m, problem, jax.random.key(m))
                for impl in ("ours", "xla"):
                    for round_index in range(ARGS.rounds):
                        row = {"problem": name, "m": m, "impl": impl, "round": round_index,
                               **time_counts(impl, mailbox, problem, config, inputs, counts, ARGS.reps)}
                        data["results"].append(row)
                        pairs = " ".join(f"{k} {v:.2f}" for k, v in row["pair_us_per_call"].items())
                        handler = " ".join(f"{n}: {e['captured']:g} captured, {e['direct']:g} direct"
                                           for n, e in row["handler_executes_per_run"].items())
                        print(f"{name} m={m} {impl} round {round_index}: fit {row['fit_us_per_call']:.2f} us/call "
                              f"+ {row['fit_intercept_ms']:.2f} ms; pairs (us/call) {pairs}; "
                              f"handler runs per run: {handler}", flush=True)
                mailbox.check()
    records.write_json(data, ARGS.out)
    print(f"wrote {ARGS.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
