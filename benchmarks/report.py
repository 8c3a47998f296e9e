"""Tables and plots of ``bench_moe_publish.py`` results, and their floors.

    python benchmarks/report.py RESULT.json [MORE.json ...] [--markdown OUT.md] [--plot OUT.png]

Several files (for example one run with XLA command buffers on and one with
them off) are merged into one table with a "command buffers" column.

Each case's *floor* is the slowest of three limits measured in the same run:
the HBM bytes one rank must move at the device copy bandwidth, the NVLink bytes
it must send at the peer-to-peer copy bandwidth, and one tiny dependent XLA
kernel (the cost of any call at all). `jax_moe_publish.traffic` states the byte
model.

The plot imports matplotlib when it is asked for, so the package never depends on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

LAUNCH_FIELDS = ("threads", "elements_per_thread", "prefetch_group", "reduce_threads", "enable_pdl", "fuse_reduce",
                 "keep_own_partial", "waves")


def case_floor(traffic: dict, floors: dict) -> dict:
    """The floor of one case: the slowest of its three limits.

    ``us = max(hbm / copy_bandwidth, nvlink / p2p_bandwidth, empty_call_us)``

    Parameters
    ----------
    traffic : dict
        `jax_moe_publish.traffic.bytes_per_rank` of the case.
    floors : dict
        The run's measured limits, as the benchmark records them:
        ``copy.bytes_per_s``, ``p2p.bytes_per_s`` (``p2p`` is None with one
        GPU) and ``empty_call.us``.

    Returns
    -------
    dict with the bytes, every term in µs, ``us`` (their maximum) and
    ``bound`` (the name of the largest term).
    """
    terms = {
        "hbm": traffic["hbm"] / floors["copy"]["bytes_per_s"] * 1e6,
        "nvlink": 0.0,
        "empty call": floors["empty_call"]["us"],
    }
    if traffic["nvlink"]:
        if floors.get("p2p") is None:
            raise ValueError("traffic['nvlink'] > 0 but floors['p2p'] is None: "
                             "the peer bandwidth was not measured")
        terms["nvlink"] = traffic["nvlink"] / floors["p2p"]["bytes_per_s"] * 1e6
    bound = max(terms, key=terms.get)
    return {
        "hbm_bytes": traffic["hbm"], "nvlink_bytes": traffic["nvlink"],
        "hbm_us": terms["hbm"], "nvlink_us": terms["nvlink"], "empty_call_us": terms["empty call"],
        "us": terms[bound], "bound": bound,
    }


def read(path) -> dict:
    """One benchmark run as this version writes it: runs before 2026-12-01 named a case's
    algorithm ``mode``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for case in data["results"]:
        if "algorithm" not in case:
            case["algorithm"] = case.pop("mode")
    return data


def merge_files(paths) -> dict:
    """One result set from several benchmark runs (for example command buffers on and off).

    Every case keeps its run's ``command_buffer`` setting, so the table shows
    a "command buffers" column.
    """
    runs, results = [], []
    for path in paths:
        data = read(path)
        environment = data["environment"]
        runs.append({"path": str(path), "environment": environment, "floors": data.get("floors")})
        results += [{**case, "command_buffer": environment["command_buffer"]} for case in data["results"]]
    return {"runs": runs, "results": results}


def load(paths) -> dict:
    """The result set of one file as written, or several merged by `merge_files`."""
    return read(paths[0]) if len(paths) == 1 else merge_files(paths)


def format_launch(launch: dict) -> str:
    """``threads=128, elements_per_thread=8, ...`` for the launch fields a variant has."""
    return ", ".join(f"{name}={launch[name]}" for name in LAUNCH_FIELDS if name in launch)


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _ordered(results: list[dict]) -> list[dict]:
    """Cases by problem (first seen first), tp, algorithm (first seen first), m, then command
    buffers on first."""
    problems = {r["problem"]: None for r in results}
    algorithms = {r["algorithm"]: None for r in results}
    problem_rank = {p: i for i, p in enumerate(problems)}
    algorithm_rank = {algorithm: i for i, algorithm in enumerate(algorithms)}
    return sorted(results, key=lambda r: (problem_rank[r["problem"]], r["tp"], algorithm_rank[r["algorithm"]],
                                          r["m"], not r.get("command_buffer", True)))


def _timing(t: dict) -> str:
    return f"{t['us']:.2f} ({t['p10']:.2f}–{t['p90']:.2f})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_table(data: dict) -> str:
    """One row per case: ours (p10–p90), XLA, their ratio, the floor and ours as a multiple of it.

    With an ``xla_nccl`` column in any case, the table shows it beside XLA's default, and the
    ratio is ours over the faster of the two (``xla_best``), as the run recorded it: the
    median of the ratios of one repetition each, whose estimates come from adjacent runs
    (``bench_moe_publish.paired_estimates``); in runs before that pairing, ours' ``us`` over
    XLA's. The floor cell names its binding term: ``hbm``, ``nvlink`` or ``empty call``.
    Cases without a floor or a column show ``–`` there.
    """
    results = _ordered(data["results"])
    merged = any("command_buffer" in r for r in results)
    nccl = any("xla_nccl" in r for r in results)
    header = ["problem", "tp", "algorithm", "m"] + (["command buffers"] if merged else [])
    header += ["ours µs (p10–p90)", "xla µs"] + (["xla nccl µs"] if nccl else [])
    header += ["ratio", "floor µs", "ours/floor"]
    rows = []
    for r in results:
        row = [r["problem"], str(r["tp"]), r["algorithm"], str(r["m"])]
        if merged:
            row.append(_on_off(r["command_buffer"]))
        row += [_timing(r["ours"]), f"{r['xla']['us']:.2f}"]
        if nccl:
            row.append(f"{r['xla_nccl']['us']:.2f}" if "xla_nccl" in r else "–")
        floor = r.get("floor")
        row += [
            f"{r['ratio']:.3f}",
            f"{floor['us']:.2f} ({floor['bound']})" if floor else "–",
            f"{r['ours_over_floor']:.2f}" if floor else "–",
        ]
        rows.append(row)
    return _table(header, rows)


def tuning_table(data: dict) -> str:
    """Every launch variant timed with ``--configs``, the winner of each case in bold; "" if none."""
    rows = []
    for r in _ordered(data["results"]):
        tuning = r.get("tuning")
        if not tuning:
            continue
        default_us = tuning["variants"][0]["us"]  # the first variant is the default config
        for index, variant in enumerate(tuning["variants"]):
            launch = format_launch(variant["launch"])
            if index == tuning["best"]:
                launch = f"**{launch}**"
            if variant["us"] is None:  # runs before fused grids were persistent: refused
                rows.append([r["problem"], str(r["tp"]), r["algorithm"], str(r["m"]), launch, "refused", "", ""])
                continue
            same_bits = "yes" if variant["same_bits_as_default"] else "NO"
            rows.append([r["problem"], str(r["tp"]), r["algorithm"], str(r["m"]), launch, _timing(variant),
                         f"{variant['us'] / default_us:.3f}", same_bits])
    if not rows:
        return ""
    header = ["problem", "tp", "algorithm", "m", "launch", "ours µs (p10–p90)", "vs default", "same bits"]
    return _table(header, rows)


def _runs(data: dict) -> list[dict]:
    if "runs" in data:
        return data["runs"]
    return [{"environment": data.get("environment", {}), "floors": data.get("floors")}]


def describe_runs(data: dict) -> list[str]:
    """One line per run: where it ran and the limits its floors come from."""
    lines = []
    for run in _runs(data):
        env, floors = run["environment"], run["floors"]
        text = (f"{env.get('gpu', '?')} ×{len(env.get('gpus', [])) or '?'}, jax {env.get('jax', '?')}, "
                f"commit {str(env.get('commit', '?'))[:10]}, {env.get('date', '?')}, "
                f"command buffers {_on_off(env.get('command_buffer', True))}")
        if floors:
            p2p = floors.get("p2p")
            text += (f"; copy {floors['copy']['bytes_per_s'] / 1e9:.0f} GB/s, "
                     + (f"peer copy {p2p['bytes_per_s'] / 1e9:.0f} GB/s, " if p2p else "")
                     + f"{floors['empty_call']['what']} {floors['empty_call']['us']:.2f} µs")
        lines.append(f"- {text}")
    return lines


def fused_layers_note(data: dict) -> str:
    """A line naming the cases whose XLA chain fused layers together (``fusions_per_layer`` below
    1: fewer fusion kernels in its loop body than layers), which a model's GEMMs between layers
    would stop, so their XLA figures favour XLA; "" if none (runs before the field have none)."""
    fused = []
    for r in _ordered(data["results"]):
        for column in ("xla", "xla_nccl"):
            per_layer = r.get(column, {}).get("fusions_per_layer")
            if per_layer is not None and per_layer < 1:
                fused.append(f"{r['problem']} tp={r['tp']} m={r['m']} {column} ({per_layer:.2f})")
    if not fused:
        return ""
    return ("XLA fused layers together (fusion kernels per layer in its loop body below 1), which a model's "
            "GEMMs between layers would stop, so these XLA figures favour XLA: " + ", ".join(fused) + ".")


def render_markdown(data: dict) -> str:
    """The runs, the results table, the cases where XLA fused layers together (when any) and the
    tuning table (when present), as one Markdown text."""
    parts = ["\n".join(describe_runs(data)), markdown_table(data)]
    note = fused_layers_note(data)
    if note:
        parts.append(note)
    tuning = tuning_table(data)
    if tuning:
        parts += ["Launch variants of ours (`--configs`):", tuning]
    return "\n\n".join(parts) + "\n"


def _suffix(command_buffer) -> str:
    return "" if command_buffer is None else f", cb {_on_off(command_buffer)}"


def _draw_panel(ax, results: list[dict], colors: dict) -> None:
    """Ours per algorithm with its p10–p90 band, each XLA column, and the floor per algorithm,
    for one (problem, tp)."""
    ours, xla, floor = {}, {}, {}
    for r in results:
        line = (r["algorithm"], r.get("command_buffer"))
        ours.setdefault(line, {})[r["m"]] = r["ours"]
        # XLA's programs do not depend on our algorithm: pool their runs into one line each.
        for column in ("xla", "xla_nccl"):
            if column in r:
                xla.setdefault((column, r.get("command_buffer")), {}).setdefault(r["m"], []).append(r[column]["us"])
        if r.get("floor"):
            floor.setdefault(line, {})[r["m"]] = r["floor"]["us"]

    def marker(command_buffer):
        return {"marker": "s" if command_buffer is False else "o", "markersize": 3}

    for (algorithm, cb), points in ours.items():
        ms = sorted(points)
        ax.plot(ms, [points[m]["us"] for m in ms], color=colors[algorithm], linestyle="-",
                label=f"ours {algorithm}{_suffix(cb)}", **marker(cb))
        ax.fill_between(ms, [points[m]["p10"] for m in ms], [points[m]["p90"] for m in ms],
                        color=colors[algorithm], alpha=0.15, linewidth=0)
    for (column, cb), points in xla.items():
        ms = sorted(points)
        ax.plot(ms, [statistics.median(points[m]) for m in ms], color="black" if column == "xla" else "gray",
                linestyle="--", label=f"{column.replace('_', ' ')}{_suffix(cb)}", **marker(cb))
    for (algorithm, cb), points in floor.items():
        ms = sorted(points)
        ax.plot(ms, [points[m] for m in ms], color=colors[algorithm], linestyle=":",
                label=f"floor {algorithm}{_suffix(cb)}", **marker(cb))


def plot(data: dict, path: str) -> None:
    """µs per call against m (log-log): one line per implementation, one panel per (problem, tp).

    Ours is drawn per algorithm (solid, with its p10–p90 band), each XLA column as one
    dashed line, and the floor per algorithm, dotted. Merged runs draw command buffers off
    with square markers.
    """
    # Lazy: the package does not depend on matplotlib.
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter

    results = _ordered(data["results"])
    problems = list(dict.fromkeys(r["problem"] for r in results))
    tps = sorted({r["tp"] for r in results})
    colors = {algorithm: f"C{i}" for i, algorithm in enumerate(dict.fromkeys(r["algorithm"] for r in results))}
    figure = Figure(figsize=(5.5 * len(tps), 4.2 * len(problems)))
    axes = figure.subplots(len(problems), len(tps), squeeze=False)
    for row, problem in enumerate(problems):
        for column, tp in enumerate(tps):
            ax = axes[row][column]
            panel = [r for r in results if r["problem"] == problem and r["tp"] == tp]
            if not panel:
                ax.set_axis_off()
                continue
            _draw_panel(ax, panel, colors)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ms = sorted({r["m"] for r in panel})
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.set_xticks([], minor=True)
            # Plain numbers (20, 30), not 2 x 10^1.
            ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
            ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
            ax.set_title(f"{problem}, tp={tp}")
            ax.set_xlabel("m (tokens)")
            ax.set_ylabel("µs per call")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="x-small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files written by bench_moe_publish.py --out")
    parser.add_argument("--markdown", help="write the Markdown tables here")
    parser.add_argument("--plot", help="write the PNG plot here (needs matplotlib)")
    args = parser.parse_args(argv)
    data = load(args.results)
    text = render_markdown(data)
    print(text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(text)
    if args.plot:
        plot(data, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
