"""The one tuning table: the algorithm and launch shape of a call, as data.

A call is a `Problem` on a group of ``tp`` ranks, with ``m`` tokens, the mailbox's
result layout and, or not, the residual + RMSNorm epilogue. `kernel_config` maps it to
the `KernelConfig` that the op compiles and launches, in two steps:

1. the algorithm, by result layout, epilogue, tp and the partial's size (`CHOICES`,
   data in ``algorithms.json``), which may be ``xla``: the op then runs the ``jnp`` path;
2. whether the call is one persistent kernel (`FUSED`), and the launch shape of its
   kernels for ``m`` (`SHAPES`), by ranges of m.

Every entry gives a one-line reason, measured at hidden 7168, top-k 8, tp = 2 on 2x H200
unless it says otherwise (an algorithm entry's ``source`` says whether it was measured at
all, `SOURCES`); the measurements, with their result files, are in
``docs/tuning.md``. The op, the benchmarks and the presets all ask
this module, so a choice is made in one place.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from jax_moe_publish import _abi, protocol
from jax_moe_publish.config import ALGORITHMS as KERNEL_ALGORITHMS
from jax_moe_publish.config import KernelConfig

RESULTS = _abi.RESULTS
"""The result layouts of a mailbox: the group's sum on every rank, or each owner's tokens."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """What the kernels are specialized on, apart from tp and the launch shape."""

    hidden: int
    top_k: int
    routed_scaling_factor: float = 1.0
    include_shared_expert: bool = True
    fp32_weights: bool = False


SOURCES = {
    "measured": "a benchmark run timed the choice: the reason cites its result file and rows",
    "model": "`link_model.LinkModel`'s at algorithms.json's constants (tune_algorithms.py --model writes those of "
             "tp > 1)",
    "argument": "the reason's argument (the only algorithm, or a cost nobody timed); no run or model chose it",
}
"""Where an algorithm entry comes from. A label may qualify its kind in parentheses, as
``measured (unfused two-shot, before the fused kernel)``: the run timed something else
than what the op now launches, or a part of the entry's range."""


@dataclasses.dataclass(frozen=True)
class AlgorithmChoice:
    """``algorithm`` for calls whose partial, ``m * hidden * 2`` bytes, is at most ``max_bytes``
    (None: any size), for problems with (True) or without (False) a shared expert, or any
    (None). ``xla``: the op runs the ``jnp`` path, which XLA fuses with its neighbours.
    ``source``: one of `SOURCES`, maybe qualified."""

    max_bytes: int | None
    algorithm: str
    reason: str
    source: str
    shared_expert: bool | None = None

    def __post_init__(self):
        kind, _, qualifier = self.source.partition(" (")
        if kind not in SOURCES or (qualifier and not qualifier.endswith(")")):
            raise ValueError(f"source={self.source!r}: expected one of {tuple(SOURCES)}, "
                             "maybe followed by a qualifier in parentheses")


TABLE_FILE = pathlib.Path(__file__).with_name("algorithms.json")
"""The algorithm entries as data, which ``benchmarks/tune_algorithms.py`` writes."""


def _load_table(path: pathlib.Path):
    data = json.loads(path.read_text())
    return {
        tuple(case.split("/")): {int(tp): tuple(AlgorithmChoice(**entry) for entry in entries)
                                 for tp, entries in by_tp.items()}
        for case, by_tp in data["tables"].items()
    }


CHOICES = _load_table(TABLE_FILE)
"""`CHOICES[(result, epilogue)][tp]`: the entries of a call, the first that covers it applies.
A tp without entries takes those of the largest listed tp below it."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """The launch shape of calls of up to ``m_max`` tokens (None: any larger m).

    ``elements_per_thread``, ``prefetch_group`` (capped at top-k) and, unfused without
    the epilogue, ``reduce_threads`` are `KernelConfig`'s (a fused kernel's threads publish
    and reduce). ``waves`` is the fused grid's passes.
    ``cluster_ctas`` (fused epilogue only) is the most CTAs over which a row spreads:
    its thread count follows from hidden (`_fused_norm_threads`).
    """

    m_max: int | None
    elements_per_thread: int
    prefetch_group: int
    reason: str
    reduce_threads: int = 128
    waves: int = 1
    cluster_ctas: int = 0


SMALL_M = 64
"""Up to this many tokens a call is latency-bound."""
ONE_PASS_M = SMALL_M // 2
"""Up to this many tokens a fused call covers its rows in one pass of the grid."""

_LATENCY_BOUND = ("latency-bound: 8-byte fragments (twice the threads in flight) and a group of 8 routed rows "
                  "loaded before use were fastest in the sweep at m = 8 and 64")
_BANDWIDTH_BOUND = "bandwidth-bound: 16-byte fragments"

# By kernel kind and epilogue: the first shape whose m_max covers m. The unfused kinds
# (the finalize alone, or publish then reduce) also give the direct finalize's shape.
SHAPES: dict[tuple[str, str], tuple[Shape, ...]] = {
    ("unfused", "none"): (
        Shape(SMALL_M, 4, 8, _LATENCY_BOUND + ", 256-thread reduce CTAs", reduce_threads=256),
        Shape(None, 8, 4, _BANDWIDTH_BOUND),
    ),
    # The reduce CTA holds a row: its threads follow from hidden (`_row_reduce_threads`).
    ("unfused", "rmsnorm"): (
        Shape(SMALL_M, 4, 8, _LATENCY_BOUND),
        Shape(None, 8, 4, _BANDWIDTH_BOUND),
    ),
    ("fused", "none"): (
        Shape(ONE_PASS_M, 4, 8, _LATENCY_BOUND + ", in one pass of the grid"),
        Shape(SMALL_M, 4, 8, "two passes: the first tiles' NVLink stores overlap the next tiles' loads "
                             "(0.31-0.96 us faster than one pass at m = 64 in four runs)", waves=2),
        Shape(None, 8, 4, _BANDWIDTH_BOUND + ", one pass (two were slower at m = 128)"),
    ),
    ("fused", "rmsnorm"): (
        Shape(ONE_PASS_M, 4, 8, "8-byte fragments over up to 16 CTAs per row (a cluster beyond the portable "
                                "8): 3.93 against 4.31 us at m = 1 for 16-byte ones over 7 (hidden 7168)",
              cluster_ctas=_abi.MAX_CLUSTER_CTAS),
        Shape(SMALL_M, 8, 8, "16-byte fragments over up to 8 CTAs, two passes: 7.65 against 7.81 and 7.71 "
                             "against 7.95 us for 8-byte ones at m = 64", waves=2,
              cluster_ctas=_abi.PORTABLE_CLUSTER_CTAS),
        Shape(None, 8, 4, _BANDWIDTH_BOUND + " over up to 8 CTAs per row, one pass (two were within 1 us "
                                             "either way at m = 128 and 256)", cluster_ctas=_abi.PORTABLE_CLUSTER_CTAS),
    ),
}

TUNING_GRID: dict[str, tuple] = {
    "threads": (128, 256),
    "elements_per_thread": (4, 8),
    "prefetch_group": (4, 8),
    "reduce_threads": (128, 256),
    "enable_pdl": (True, False),
    "fuse_reduce": (False, True),
    "keep_own_partial": (True, False),
    "waves": (1, 2),
}
"""The launch shapes that ``benchmarks/bench_moe_publish.py --configs`` tries around the table's
(its ``tuning_variants`` keeps the valid ones per case): the search space of `SHAPES`."""

FUSED: dict[tuple[str, str], str] = {
    ("oneshot", "none"): "one persistent kernel at every m: 0.70-0.81 of two kernels' time at m = 256 to 1024, "
                         "within the noise at m = 8 and 64",
    ("oneshot", "rmsnorm"): "one persistent kernel with a cluster per row: 4.26 against 5.40 us for two kernels "
                            "at m = 1, 0.81 and 0.88 of their time at m = 256 and 1024",
    ("twoshot", "none"): "one persistent kernel instead of three launches, by the oneshot figures; not yet "
                         "measured against the three (it takes the fused oneshot's shapes)",
}
"""The (algorithm, epilogue) whose calls are one persistent kernel (``fuse_reduce``), and why."""


def algorithm_for(problem: Problem, tp: int, m: int | None, result: str, epilogue: str = "none", *,
                  kernels_only: bool = False) -> AlgorithmChoice:
    """The algorithm entry of a call (`CHOICES`); ``m`` None means larger than every range.
    ``kernels_only`` skips ``xla`` entries: the kernel path's own choice."""
    if result not in RESULTS:
        raise ValueError(f"result={result!r}: expected one of {RESULTS}")
    by_tp = CHOICES[result, epilogue]
    entries = by_tp[max(t for t in by_tp if t <= tp)]
    nbytes = None if m is None else m * problem.hidden * 2
    for entry in entries:
        if kernels_only and entry.algorithm == "xla":
            continue
        if entry.shared_expert not in (None, problem.include_shared_expert):
            continue
        if entry.max_bytes is None or (nbytes is not None and nbytes <= entry.max_bytes):
            return entry
    raise AssertionError(f"no entry covers tp={tp}, m={m}: the last entry of a table must take any size")


def shape_for(fused: bool, epilogue: str, m: int | None) -> Shape:
    """The launch shape of a call (`SHAPES`); ``m`` None means larger than every range."""
    return _covering(SHAPES["fused" if fused else "unfused", epilogue], m)


def _covering(entries, m: int | None):
    """The first of ``entries`` (ordered by m_max, the last open) whose range holds ``m``."""
    for entry in entries:
        if entry.m_max is None or (m is not None and m <= entry.m_max):
            return entry
    raise AssertionError(f"no entry covers m={m}: the last entry of a table must have m_max=None")


def _prefetch_group(most: int, top_k: int) -> int:
    """Routed rows loaded together: at most ``most``, in groups as even as ``top_k`` allows
    (6 as 3 + 3, not 4 + 2: the uneven tail made ptxas spill a fused two-shot kernel at
    hidden 2048, top-k 6)."""
    groups = max(1, -(-top_k // most))  # top_k < 1 is KernelConfig's to refuse
    return -(-top_k // groups)


def _row_reduce_threads(hidden: int) -> int:
    """Threads of an unfused epilogue's reduce CTA, which holds a whole row: one 16-byte
    fragment per thread up to 1024 threads; wider rows get at most 512 threads, so that each
    may use 128 registers for its several fragments (1024 threads leave 64, and ptxas spilled
    at hidden 16384, tp = 8)."""
    fragments = -(-hidden // protocol.REDUCE_ELEMENTS)
    per_thread = 1 if fragments <= _abi.MAX_THREADS else -(-fragments // (_abi.MAX_THREADS // 2))
    return -(-fragments // per_thread // 32) * 32


def _fused_norm_threads(hidden: int, shape: Shape) -> int:
    """Threads per CTA of a fused epilogue row over at most ``shape.cluster_ctas`` CTAs, one
    fragment each: 128, or more where that many CTAs would not hold the row."""
    fragments = hidden // shape.elements_per_thread
    return max(128, -(-fragments // shape.cluster_ctas // 32) * 32)


def kernel_config(problem: Problem, *, tp: int, m: int | None, result: str = "allreduce",
                  epilogue: str = "none", algorithm: str | None = None, fuse_reduce: bool | None = None,
                  arch: str = "sm_90a") -> KernelConfig:
    """The `KernelConfig` of a call, as the op picks it.

    ``m`` None means larger than every range. ``algorithm`` and ``fuse_reduce``, when
    given, override the table's choice (benchmarks and tests compare the others). Where the
    table chooses ``xla``, this is the kernels' config for the call (``impl="kernel"``).
    """
    if algorithm is None:
        algorithm = algorithm_for(problem, tp, m, result, epilogue, kernels_only=True).algorithm
    elif algorithm not in KERNEL_ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: expected one of {KERNEL_ALGORITHMS}")
    fused = (algorithm, epilogue) in FUSED if fuse_reduce is None else fuse_reduce
    shape = shape_for(fused, epilogue, m)
    threads = _fused_norm_threads(problem.hidden, shape) if fused and epilogue != "none" else 128
    if fused:
        reduce_threads = threads
    elif epilogue != "none":
        reduce_threads = _row_reduce_threads(problem.hidden)
    else:
        reduce_threads = shape.reduce_threads
    elements = shape.elements_per_thread if problem.hidden % 8 == 0 else 4
    return KernelConfig(
        hidden=problem.hidden, top_k=problem.top_k, tp=tp, algorithm=algorithm,
        routed_scaling_factor=problem.routed_scaling_factor,
        include_shared_expert=problem.include_shared_expert, fp32_weights=problem.fp32_weights,
        elements_per_thread=elements, threads=threads, prefetch_group=_prefetch_group(shape.prefetch_group, problem.top_k),
        reduce_threads=reduce_threads, fuse_reduce=fused, waves=shape.waves if fused else 1, epilogue=epilogue,
        arch=arch,
    )


def range_ms() -> tuple[int, ...]:
    """One m in every range of `SHAPES`: each bound, and one past the largest. Calls of these m,
    with every algorithm, get every config the table can choose for a problem (the presets
    build them)."""
    bounds = {entry.m_max for table in SHAPES.values() for entry in table if entry.m_max}
    return (*sorted(bounds), max(bounds) + 1)
