"""Where ``impl="auto"`` runs the experts op's kernels: a measured table, as data.

An entry of ``experts_table.json`` says that for one shard shape (hidden, intermediate,
experts, top_k) and calls of at most ``max_m`` tokens, ``impl`` ("kernel" or "reference") was
the faster route in the run its ``source`` names (a result file under ``benchmarks/results``).
A call that no entry covers runs the reference: the kernels are chosen only where a run on a
GPU measured them faster than every ragged_dot route.
``benchmarks/experts_table.py`` rewrites the table from such runs (`measured_entries`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

TABLE_FILE = pathlib.Path(__file__).with_name("experts_table.json")
IMPLS = ("kernel", "reference")
REFERENCE_ROUTES = ("ragged_dot", "ragged_dot_pallas_triton", "cudnn", "xla_triton", "tokamax")
"""The benchmark's columns that ``impl="reference"`` can run as (its ragged_dot under a flag or
a compile option); the block's gather path is not a route of this op."""


@dataclasses.dataclass(frozen=True)
class ExpertsChoice:
    """``impl`` for calls of one shard shape with at most ``max_m`` tokens, measured in ``source``."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    max_m: int
    impl: str
    source: str
    reason: str

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r}: expected one of {IMPLS}")
        if not self.source.startswith("benchmarks/results/"):
            raise ValueError(f"source={self.source!r}: expected the result file of the run that measured it")


def load_table(path: pathlib.Path = TABLE_FILE) -> list[ExpertsChoice]:
    """The table's entries, each checked."""
    return [ExpertsChoice(**entry) for entry in json.loads(path.read_text())["entries"]]


TABLE = load_table()


def auto_impl(*, hidden: int, intermediate: int, experts: int, top_k: int, m: int) -> str:
    """``impl="auto"``'s route for a call: the first entry of the shape that covers ``m``, else
    ``"reference"``."""
    for entry in TABLE:
        if (entry.hidden, entry.intermediate, entry.experts, entry.top_k) == (hidden, intermediate, experts, top_k) \
                and m <= entry.max_m:
            return entry.impl
    return "reference"


def measured_entries(paths: list[pathlib.Path]) -> list[ExpertsChoice]:
    """One "kernel" entry per shard shape measured in the ``bench_moe_experts.py`` runs ``paths``:
    up to the largest m below which the kernels beat every measured reference route at every
    measured m (none where they lose at the smallest). Each entry names the run of its last m."""
    cases = {}
    for path in paths:
        for case in json.loads(path.read_text())["results"]:
            columns = case["columns"]
            routes = {name: columns[name]["us"] for name in REFERENCE_ROUTES if "us" in columns.get(name, {})}
            if "us" not in columns.get("ours", {}) or not routes:
                continue
            best = min(routes, key=routes.get)
            shape = (case["hidden"], case["intermediate"], case["experts"], case["top_k"])
            cases.setdefault(shape, []).append((case["m"], columns["ours"]["us"], best, routes[best], path.name))
    entries = []
    for (hidden, intermediate, experts, top_k), measured in sorted(cases.items()):
        won = None
        for m, ours, best, best_us, name in sorted(measured):
            if ours >= best_us:
                break
            won = (m, ours, best, best_us, name)
        if won is not None:
            m, ours, best, best_us, name = won
            entries.append(ExpertsChoice(
                hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, max_m=m, impl="kernel",
                source=f"benchmarks/results/{name}",
                reason=f"faster than every reference route at every measured m up to {m}; "
                       f"at m = {m}: {ours:.1f} us against {best} {best_us:.1f} us"))
    return entries
