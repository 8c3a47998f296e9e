"""Tables and plots of ``bench_moe_publish.py`` results, and the traffic model behind their floors.

    python benchmarks/report.py RESULT.json [MORE.json ...] [--markdown OUT.md] [--plot OUT.png]

Several files (for example one run with XLA command buffers on and one with
them off) are merged into one table with a "command buffers" column.

Each case's *floor* is the slowest of three limits measured in the same run:
the HBM bytes one rank must move at the device copy bandwidth, the NVLink bytes
it must send at the peer-to-peer copy bandwidth, and one tiny dependent XLA
kernel (the cost of any call at all). `bytes_per_rank` states the byte model.

This module uses the standard library only; the plot imports matplotlib when
it is asked for, so the package never depends on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

BF16_BYTES = 2
INDEX_BYTES = 4  # int32 permuted indices
LAUNCH_FIELDS = ("threads", "elements_per_thread", "prefetch_group", "reduce_threads", "enable_pdl", "fuse_reduce",
                 "keep_own_partial", "waves")


def bytes_per_rank(*, mode: str, tp: int, m: int, hidden: int, top_k: int, shared_expert: bool,
                   weight_bytes: int = 4, residual_norm: bool = False, own_slot: bool = True) -> dict[str, float]:
    """HBM and NVLink bytes that one rank moves in one call of the op: the traffic model of the floor.

    With ``row = m * hidden * 2`` (one bf16 [m, hidden] array), every mode
    first reads its inputs once::

        inputs = m * top_k * hidden * 2            (routed rows, all indices valid)
               + row                               (shared expert, if any)
               + m * top_k * (4 + weight_bytes)    (int32 indices, weights)

    A write into a peer's mailbox is counted in the peer's HBM. The ranks are
    symmetric, so each rank's HBM receives as much as it sends.

    * ``direct`` (tp = 1): ``hbm = inputs + row`` (the output); no NVLink.
    * ``oneshot``: each rank's mailbox receives ``tp * row`` (its own slot
      locally, the peers' over NVLink); the reduce reads ``tp * row``, writes
      the ``row`` output and re-arms ``tp * row``::

          hbm = inputs + 3 * tp * row + row,    nvlink = (tp - 1) * row

      Without ``own_slot`` (a fused kernel that keeps its own partial in
      shared memory) the own slot's write, read and re-arm drop out:
      ``3 * (tp - 1) * row`` instead of ``3 * tp * row``. A CTA keeps only
      its first tiles there, so this is a lower bound at large ``m``.

    * ``twoshot``: token ``t`` is reduced by rank ``t % tp``. Per rank, as the
      mean over the group (a lower bound on the slowest rank when ``tp`` does
      not divide ``m``): the owner's slots receive ``row`` of contributions,
      which it reads and re-arms, and writes its ``row / tp`` of output; its
      gather area receives ``(tp - 1) / tp * row`` of fanned-out sums, which
      the gather reads, copies to the output and re-arms::

          hbm = inputs + 3 * row + row / tp + 4 * (tp - 1) / tp * row
          nvlink = 2 * (tp - 1) / tp * row     (publish, then fan-out)

    * ``residual_norm`` (the residual add + RMSNorm epilogue) adds reading the
      residual and the norm weight and writing ``residual_out``::

          hbm += 2 * row + hidden * 2

    Parameters
    ----------
    mode : {"direct", "oneshot", "twoshot"}
    tp, m, hidden, top_k : int
    shared_expert : bool
    weight_bytes : int
        Bytes per router weight: 4 (float32) or 2 (bf16).
    residual_norm : bool
        The call has the epilogue (in any mode).
    own_slot : bool
        Oneshot: this rank's own contribution goes through its mailbox slot.

    Returns
    -------
    dict with ``hbm`` and ``nvlink`` (bytes, one way for NVLink).
    """
    if mode not in ("direct", "oneshot", "twoshot"):
        raise ValueError(f"mode={mode!r}: expected 'direct', 'oneshot' or 'twoshot'")
    if (tp == 1) != (mode == "direct"):
        raise ValueError(f"mode={mode!r} with tp={tp}: expected 'direct' exactly when tp == 1")
    if weight_bytes not in (2, 4):
        raise ValueError(f"weight_bytes={weight_bytes!r}: expected 2 (bf16) or 4 (float32)")
    row = m * hidden * BF16_BYTES
    inputs = m * top_k * hidden * BF16_BYTES + m * top_k * (INDEX_BYTES + weight_bytes)
    if shared_expert:
        inputs += row
    if residual_norm:
        inputs += 2 * row + hidden * BF16_BYTES
    if mode == "direct":
        return {"hbm": float(inputs + row), "nvlink": 0.0}
    if mode == "oneshot":
        slots = tp if own_slot else tp - 1
        return {"hbm": float(inputs + 3 * slots * row + row), "nvlink": float((tp - 1) * row)}
    others = (tp - 1) / tp * row
    return {"hbm": inputs + 3 * row + row / tp + 4 * others, "nvlink": 2 * others}


def case_floor(traffic: dict, floors: dict) -> dict:
    """The floor of one case: the slowest of its three limits.

    ``us = max(hbm / copy_bandwidth, nvlink / p2p_bandwidth, empty_call_us)``

    Parameters
    ----------
    traffic : dict
        `bytes_per_rank` of the case.
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


def merge_files(paths) -> dict:
    """One result set from several benchmark runs (for example command buffers on and off).

    Every case keeps its run's ``command_buffer`` setting, so the table shows
    a "command buffers" column.
    """
    runs, results = [], []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        environment = data["environment"]
        runs.append({"path": str(path), "environment": environment, "floors": data.get("floors")})
        results += [{**case, "command_buffer": environment["command_buffer"]} for case in data["results"]]
    return {"runs": runs, "results": results}


def load(paths) -> dict:
    """The result set of one file as written, or several merged by `merge_files`."""
    if len(paths) == 1:
        with open(paths[0], encoding="utf-8") as f:
            return json.load(f)
    return merge_files(paths)


def format_launch(launch: dict) -> str:
    """``threads=128, elements_per_thread=8, ...`` for the launch fields a variant has."""
    return ", ".join(f"{name}={launch[name]}" for name in LAUNCH_FIELDS if name in launch)


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _ordered(results: list[dict]) -> list[dict]:
    """Cases by problem (first seen first), tp, mode (first seen first), m, then command buffers on first."""
    problems = {r["problem"]: None for r in results}
    modes = {r["mode"]: None for r in results}
    problem_rank = {p: i for i, p in enumerate(problems)}
    mode_rank = {mode: i for i, mode in enumerate(modes)}
    return sorted(results, key=lambda r: (problem_rank[r["problem"]], r["tp"], mode_rank[r["mode"]],
                                          r["m"], not r.get("command_buffer", True)))


def _timing(t: dict) -> str:
    return f"{t['us']:.2f} ({t['p10']:.2f}–{t['p90']:.2f})"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_table(data: dict) -> str:
    """One row per case: ours (p10–p90), XLA, their ratio, the floor and ours as a multiple of it.

    The floor cell names its binding term: ``hbm``, ``nvlink`` or ``empty call``.
    Results of older runs without floors show ``–`` there.
    """
    results = _ordered(data["results"])
    merged = any("command_buffer" in r for r in results)
    header = ["problem", "tp", "mode", "m"] + (["command buffers"] if merged else [])
    header += ["ours µs (p10–p90)", "xla µs", "ratio", "floor µs", "ours/floor"]
    rows = []
    for r in results:
        row = [r["problem"], str(r["tp"]), r["mode"], str(r["m"])]
        if merged:
            row.append(_on_off(r["command_buffer"]))
        floor = r.get("floor")
        row += [
            _timing(r["ours"]), f"{r['xla']['us']:.2f}", f"{r['ratio']:.3f}",
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
                rows.append([r["problem"], str(r["tp"]), r["mode"], str(r["m"]), launch, "refused", "", ""])
                continue
            same_bits = "yes" if variant["same_bits_as_default"] else "NO"
            rows.append([r["problem"], str(r["tp"]), r["mode"], str(r["m"]), launch, _timing(variant),
                         f"{variant['us'] / default_us:.3f}", same_bits])
    if not rows:
        return ""
    header = ["problem", "tp", "mode", "m", "launch", "ours µs (p10–p90)", "vs default", "same bits"]
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


def render_markdown(data: dict) -> str:
    """The runs, the results table and (when present) the tuning table, as one Markdown text."""
    parts = ["\n".join(describe_runs(data)), markdown_table(data)]
    tuning = tuning_table(data)
    if tuning:
        parts += ["Launch variants of ours (`--configs`):", tuning]
    return "\n\n".join(parts) + "\n"


def _suffix(command_buffer) -> str:
    return "" if command_buffer is None else f", cb {_on_off(command_buffer)}"


def _draw_panel(ax, results: list[dict], colors: dict) -> None:
    """Ours per mode with its p10–p90 band, XLA, and the floor per mode, for one (problem, tp)."""
    ours, xla, floor = {}, {}, {}
    for r in results:
        line = (r["mode"], r.get("command_buffer"))
        ours.setdefault(line, {})[r["m"]] = r["ours"]
        # XLA's program does not depend on our mode: pool its runs into one line.
        xla.setdefault(r.get("command_buffer"), {}).setdefault(r["m"], []).append(r["xla"]["us"])
        if r.get("floor"):
            floor.setdefault(line, {})[r["m"]] = r["floor"]["us"]

    def marker(command_buffer):
        return {"marker": "s" if command_buffer is False else "o", "markersize": 3}

    for (mode, cb), points in ours.items():
        ms = sorted(points)
        ax.plot(ms, [points[m]["us"] for m in ms], color=colors[mode], linestyle="-",
                label=f"ours {mode}{_suffix(cb)}", **marker(cb))
        ax.fill_between(ms, [points[m]["p10"] for m in ms], [points[m]["p90"] for m in ms],
                        color=colors[mode], alpha=0.15, linewidth=0)
    for cb, points in xla.items():
        ms = sorted(points)
        ax.plot(ms, [statistics.median(points[m]) for m in ms], color="black", linestyle="--",
                label=f"xla{_suffix(cb)}", **marker(cb))
    for (mode, cb), points in floor.items():
        ms = sorted(points)
        ax.plot(ms, [points[m] for m in ms], color=colors[mode], linestyle=":",
                label=f"floor {mode}{_suffix(cb)}", **marker(cb))


def plot(data: dict, path: str) -> None:
    """µs per call against m (log-log): one line per implementation, one panel per (problem, tp).

    Ours is drawn per mode (solid, with its p10–p90 band), XLA as one dashed
    line, and the floor per mode, dotted. Merged runs draw command buffers off
    with square markers.
    """
    # Lazy: the package does not depend on matplotlib.
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter

    results = _ordered(data["results"])
    problems = list(dict.fromkeys(r["problem"] for r in results))
    tps = sorted({r["tp"] for r in results})
    colors = {mode: f"C{i}" for i, mode in enumerate(dict.fromkeys(r["mode"] for r in results))}
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
