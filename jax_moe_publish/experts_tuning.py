"""Where ``impl="auto"`` runs the experts op's kernels: a measured table, as data.

An entry of ``experts_table.json`` says that for one shard shape (hidden, intermediate,
experts, top_k) and calls of at most ``max_m`` tokens, ``impl`` ("kernel" or "reference") was
the faster route in the run its ``source`` names (a result file under ``benchmarks/results``).
A call that no entry covers runs the reference: the kernels are chosen only where a run on a
GPU measured them faster than every ragged_dot route.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

TABLE_FILE = pathlib.Path(__file__).with_name("experts_table.json")
IMPLS = ("kernel", "reference")


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
