"""Which route ``impl="auto"`` runs the experts op on: a measured table, as data.

An entry of ``experts_table.json`` says that for one shard shape (hidden, intermediate,
experts, top_k) and calls of more tokens than the shape's previous entry covers and at most
``max_m``, ``impl`` ("kernel", "gather", "tokamax" or "reference") was the fastest route at
every measured m of that range in the run its ``source`` names (a result file under
``benchmarks/results``), and ``otherwise`` the fastest of the others where ``impl`` is
"tokamax" (an optional dependency: the route where it does not import). A call of more tokens
than a shape's last entry covers takes that entry's route, the fastest at the largest measured
m. A shape without entries takes the kernels up to `UNLISTED_KERNEL_MAX_PAIRS_PER_EXPERT` pairs
per expert, the range the runs measured, and the reference past it (`auto_impl` says why).
The table measures CUDA devices, and ``impl="auto"`` reads it on them only.
``benchmarks/experts_table.py`` rewrites the table from such runs (`measured_entries`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

TABLE_FILE = pathlib.Path(__file__).with_name("experts_table.json")
IMPLS = ("kernel", "gather", "tokamax", "reference")
OUT_OF_MEMORY = "JaxRuntimeError: RESOURCE_EXHAUSTED"
"""How a column's ``why_not`` starts where its program ran out of the GPU's memory (the
benchmark writes the exception's type first)."""
KERNEL_COLUMN = "ours"
"""The benchmark's column of ``impl="kernel"``."""
TOKAMAX_COLUMN = "tokamax"
"""The benchmark's column of ``impl="tokamax"``, where its ``ran`` is `TOKAMAX_RAN`: runs
before that route timed tokamax's GEMMs in a grouping of the benchmark's own, not a route
``auto`` can take."""
TOKAMAX_RAN = "jmp.moe_experts(impl='tokamax')"
GATHER_COLUMN = "gather"
"""The benchmark's column of ``impl="gather"``. The runs of 2026-12-03 timed it as
``examples/moe_block.py``'s decode path before it became the op's route: the same gather and
GEMMs, with the pairs sorted by expert before and the rows left in that order."""
ROUTE_COLUMNS = {"kernel": KERNEL_COLUMN, "gather": GATHER_COLUMN, "tokamax": TOKAMAX_COLUMN}
"""The benchmark's column of each route but the reference."""
REFERENCE_ROUTES = ("ragged_dot", "ragged_dot_pallas_triton", "cudnn", "xla_triton")
"""The benchmark's columns that ``impl="reference"`` can run as (its ragged_dot under a flag or
a compile option); the table's reference is the fastest of them."""


@dataclasses.dataclass(frozen=True)
class ExpertsChoice:
    """``impl`` for calls of one shard shape with at most ``max_m`` tokens and more than the
    shape's previous entry covers, measured in ``source``; ``otherwise``: the route where
    ``impl`` is "tokamax" and tokamax does not import (None for any other ``impl``)."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    max_m: int
    impl: str
    source: str
    reason: str
    otherwise: str | None = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r}: expected one of {IMPLS}")
        others = tuple(impl for impl in IMPLS if impl != "tokamax")
        if (self.impl == "tokamax") != (self.otherwise in others):
            raise ValueError(f"otherwise={self.otherwise!r} with impl={self.impl!r}: expected one of {others} with "
                             "impl='tokamax', else None")
        if not self.source.startswith("benchmarks/results/"):
            raise ValueError(f"source={self.source!r}: expected the result file of the run that measured it")


def load_table(path: pathlib.Path = TABLE_FILE) -> list[ExpertsChoice]:
    """The table's entries, each checked, a shape's in ascending ``max_m`` (`auto_impl` takes
    the first that covers a call)."""
    entries = [ExpertsChoice(**entry) for entry in json.loads(path.read_text())["entries"]]
    last = {}
    for entry in entries:
        shape = (entry.hidden, entry.intermediate, entry.experts, entry.top_k)
        if entry.max_m <= last.get(shape, 0):
            raise ValueError(f"{path}: an entry of shape {shape} with max_m={entry.max_m} after one with "
                             f"max_m={last[shape]}; expected a shape's entries in ascending max_m")
        last[shape] = entry.max_m
    return entries


TABLE = load_table()

UNLISTED_KERNEL_MAX_PAIRS_PER_EXPERT = 16
"""The most pairs per expert (``m * top_k / experts``) at which ``impl="auto"`` runs the kernels
at a shape the table lacks: the most that the table's runs measured (m = 256 at top-8 of 128
experts)."""


def auto_impl(*, hidden: int, intermediate: int, experts: int, top_k: int, m: int) -> tuple[str, str | None]:
    """``impl="auto"``'s route for a call on a CUDA device, and the route where that is tokamax
    and tokamax cannot run: the first entry of the shape that covers ``m``, past them all the
    shape's last (the route measured fastest at its largest m).

    A shape without entries: the kernels up to `UNLISTED_KERNEL_MAX_PAIRS_PER_EXPERT` pairs per
    expert, else the reference. In the committed runs up to 2026-12-07 (213 cases: DeepSeek-V3,
    Qwen3-235B and Qwen3-30B shards at tp 1-8, m 1-256, H100 and H200) the kernels on the
    weights' rows took a median 0.25 of ``ragged_dot``'s time and at most 1.04 of the fastest
    ``ragged_dot`` route's (2 cases above 1.0, Qwen3-30B's tp 1 shard at m 16 and 32); the
    reference was the fastest route in none. Past that many pairs per expert, unmeasured, the
    kernels read an active expert's weights once per 16 or 24 of its pairs (their token tiles)
    where a dense GEMM reads them once."""
    entries = [entry for entry in TABLE
               if (entry.hidden, entry.intermediate, entry.experts, entry.top_k) == (hidden, intermediate, experts, top_k)]
    if not entries:
        within = m * top_k <= UNLISTED_KERNEL_MAX_PAIRS_PER_EXPERT * experts
        return ("kernel" if within else "reference"), None
    entry = next((entry for entry in entries if m <= entry.max_m), entries[-1])
    return entry.impl, entry.otherwise


def measured_entries(paths: list[pathlib.Path]) -> list[ExpertsChoice]:
    """The entries of the ``bench_moe_experts.py`` runs ``paths``: per shard shape, the fastest
    route at each measured m (the kernels' column, the gather column, the tokamax route's, and
    the fastest of `REFERENCE_ROUTES` as the reference; a case needs a reference figure, or a
    reference column that ran out of memory, and one other) and, where that is tokamax, the
    fastest of the others; one entry per range of consecutive measured m with the same two, up
    to the range's last m, the last range's included (`auto_impl` extends it past that m).
    Where several runs measured one shape and m, the later path's figures count. Each entry
    names the run of its last m."""
    cases = {}
    for path in paths:
        for case in json.loads(path.read_text())["results"]:
            routes = _route_figures(case["columns"])
            if "reference" not in routes or len(routes) < 2:
                continue
            shape = (case["hidden"], case["intermediate"], case["experts"], case["top_k"])
            cases.setdefault(shape, {})[case["m"]] = (routes, path.name)
    entries = []
    for (hidden, intermediate, experts, top_k), measured in sorted(cases.items()):
        ranges = []  # [(impl, otherwise), [m, ...]] of consecutive measured m with the same two
        for m in sorted(measured):
            routes, _ = measured[m]
            winner = min(routes, key=lambda route: routes[route][0])
            otherwise = None
            if winner == "tokamax":
                otherwise = min((route for route in routes if route != "tokamax"), key=lambda route: routes[route][0])
            if ranges and ranges[-1][0] == (winner, otherwise):
                ranges[-1][1].append(m)
            else:
                ranges.append([(winner, otherwise), [m]])
        for (impl, otherwise), ms in ranges:
            routes, name = measured[ms[-1]]
            figures = ", ".join((f"{route} {us:.1f} us" if math.isfinite(us) else f"{route} failed")
                                + (f" ({column})" if route == "reference" else "")
                                for route, (us, column) in sorted(routes.items(), key=lambda item: item[1][0]))
            entries.append(ExpertsChoice(
                hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, max_m=ms[-1], impl=impl,
                source=f"benchmarks/results/{name}",
                reason=f"fastest at measured m = {', '.join(map(str, ms))}; at m = {ms[-1]}: {figures}",
                otherwise=otherwise))
    return entries


def _route_figures(columns: dict) -> dict:
    """``{impl: (us, column)}`` of one case's timed columns: kernel, gather, tokamax (where the
    column ran the op's route, `TOKAMAX_RAN`), and reference as the fastest of
    `REFERENCE_ROUTES`; where none of those ran but one ran out of the GPU's memory, the
    reference at infinity: the table must not send a call to a route that cannot run it."""
    timed = {name: figures["us"] for name, figures in columns.items() if "us" in figures}
    routes = {impl: (us, ROUTE_COLUMNS[impl]) for impl in ROUTE_COLUMNS
              if (us := timed_route(columns, impl)) is not None}
    references = [name for name in REFERENCE_ROUTES if name in timed]
    failed = [name for name in REFERENCE_ROUTES
              if columns.get(name, {}).get("why_not", "").startswith(OUT_OF_MEMORY)]
    if references:
        best = min(references, key=timed.get)
        routes["reference"] = (timed[best], best)
    elif failed:
        routes["reference"] = (math.inf, failed[0])
    return routes


def timed_route(columns: dict, impl: str) -> float | None:
    """The µs of route ``impl`` (one of `ROUTE_COLUMNS`) in a case's ``columns``, or None where
    its column has no figure of that route: none, or tokamax's GEMMs timed alone (not
    `TOKAMAX_RAN`)."""
    figures = columns.get(ROUTE_COLUMNS[impl], {})
    if impl == "tokamax" and figures.get("ran") != TOKAMAX_RAN:
        return None
    return figures.get("us")
