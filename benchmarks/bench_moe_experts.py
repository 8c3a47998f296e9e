"""Every route a JAX user has to the routed experts of a decode batch, timed side by side on one
GPU in one run, against the floor that the active experts' weight bytes set.

`jmp.moe_experts` computes one rank's shard of the routed experts (``intermediate = I / tp``):
for each pair ``p = t * top_k + k``, ``y[p] = bf16(bf16(silu(bf16(x[t] @ Wg[e])) *
bf16(x[t] @ Wu[e])) @ Wd[e])``. At decode a call needs only the weights of the experts that the
routing names, and reading them is most of its time. The columns, each its own compiled
program (`COLUMNS`):

* ``ours``: ``jmp.moe_experts(impl="kernel")`` (``--cpu``: ``impl="auto"``, the reference
  path, since the kernels need a CUDA device; the JSON's ``ours_impl`` says which);
* ``ours_prepared``: the same on `jmp.prepare_experts`'s weights (the kernels' tiled order,
  made once per layer before the loop; the layers' weights are then held twice);
* ``ragged_dot``: ``jmp.moe_experts(impl="reference")``, `jax.lax.ragged_dot` in expert
  order as XLA lowers it by default;
* ``ragged_dot_pallas_triton``: the same, traced with JAX's flag
  ``jax_ragged_dot_use_gpu_pallas_triton_lowering`` set (and restored after);
* ``cudnn``: the same, compiled with XLA's ``xla_gpu_experimental_use_ragged_dot_fusion``
  (its cuDNN grouped GEMM; XLA takes it with cuDNN >= 9.22 on Ampere or later);
* ``xla_triton``: the same, compiled with ``xla_gpu_experimental_triton_ragged_dot`` and
  ``xla_gpu_experimental_enable_tiling_propagation`` (XLA's Triton ragged-dot emitter);
* ``tokamax``: ``jmp.moe_experts(impl="tokamax")``: the same two grouped GEMMs as
  ``tokamax.ragged_dot``'s Mosaic GPU kernel (`jax_moe_publish.experts_tokamax`), a route
  ``impl="auto"`` runs where the table has it fastest;
* ``gather``: ``jmp.moe_experts(impl="gather")`` (`jax_moe_publish.experts_gather`: XLA
  gathers the active experts' weights into slots, two batched GEMMs), the route that
  ``impl="auto"`` runs where the table (`experts_tuning`) has it fastest;
* ``ours_fp8``, ``ours_fp8_prepared``, ``gather_fp8``: ``ours``, ``ours_prepared`` and
  ``gather`` on the same weights as DeepSeek-V3 ships them: e4m3 with a float32 scale per
  128 x 128 block (`jmp.BlockScaled.quantize` of each layer's bf16 weights), where the shard
  holds whole blocks. Each is checked against the first column on the same operands, and
  the first of them against ours within `MAX_FP8_DIFFERENCE` (the FP8 weights compute
  another function than the bf16 ones); their ``floor_fraction`` is of ``floor_fp8``: the
  FP8 bytes (values and scales) at the same bandwidth;
* ``ours_fp8_tokens_prepared``: ``ours_fp8_prepared`` with e4m3 tokens, each layer's ``x``
  quantized in the step by `reference.quantize_fp8` (a scale per token and 128 channels, a
  separate XLA fusion: what the epilogue's FP8 out saves), checked against ``ours_fp8``
  within `MAX_FP8_DIFFERENCE`;
* ``ours_shared_prepared``: ``ours_prepared`` on weights that hold the model's shared
  expert after the routed ones (``jmp.prepare_experts(..., shared=...)``): the kernels
  compute its rows with the routed experts' (DeepSeek-V3; a shape without a shared expert,
  or one of another intermediate, records ``why_not``);
* ``ours_prepared_xla_shared``: ``ours_prepared`` with the shared expert through XLA's GEMMs
  (``jmp.moe_experts(..., shared=...)``), what the other columns' users run beside them.
  Both shared columns' shared rows are checked against `reference.shared_expert`; their
  ``floor_fraction`` is of ``floor_shared``: the active experts' and the shared expert's bytes;
* ``ours_bulk_prepared``, ``ours_fp8_bulk_prepared``: ``ours_prepared`` and
  ``ours_fp8_prepared`` with both kernels' loads as bulk copies into a ring of the CTA's
  (``jmp.ExpertsConfig.with_bulk_loads`` of the default config: the same warps and tiled
  order), an experiment beside the default;
* ``ours_prepared:FIELD=VALUE,...`` (``--variants``): ``ours_prepared`` with those changes to
  the op's config (`jmp.ExpertsConfig` launch-shape fields that keep the tiled order, such as
  ``token_tiles=1``): a launch shape measured against the default in the same run;
  ``ours:FIELD=VALUE,...`` (``--variants rows:FIELD=VALUE,...``): ``ours`` so, on the weights'
  rows, where the tiled order's fields may change too (``gate_up_warp_cols=64``);
* ``floor``: the active experts' weight bytes (``3 * hidden * intermediate * 2`` each) at
  the HBM bandwidth measured in the same run (`floors.measure_floors`' copy: bytes read +
  written per second, which a read-only stream moves at about the same rate, the HBM's
  bandwidth being shared between reads and writes).

Every column's output of one pass (rows in pair order) is checked against ours
(or, where ours cannot run, the first column that ran; relative difference at most 1e-2;
the FP8 columns as said above) before its times count. XLA's options are per-program
compile options (as `chains`' ``xla_nccl`` column), not ``XLA_FLAGS``: each column keeps its
own options in this process, so that its runs interleave with ours. A column that cannot run
records ``why_not``: the error, or, where the optimized HLO lacks what the column claims (a
Triton custom call, a cuDNN fusion of the ragged dot), what it had instead (``hlo``: custom
calls and fusion kinds counted in the optimized module). No column is left out silently.

**What is timed.** A decode step reads each layer's weights once, so no timed call may find
its weights in L2 (about 50 MB on an H200) from an earlier call. A program is a ``fori_loop``
over a chain of ``layers`` calls, each layer with its own weights (all ``experts`` of the
model), its own routing and its own ``x``, with enough layers that one pass over the chain
reads ``--min-pass-mb`` (200 MB, 4x L2) of active weights, at least 2, and at most what
``--weight-budget-gb`` of weights allows (the JSON says where the budget cut the layers). The
routing is the model's router (`moe_block.route`: DeepSeek-V3's grouped sigmoid with bias,
Qwen3's softmax top-k) over a random router matrix and random ``x``, the same for a layer
and m at every tp. Each layer's ``x`` and ids are tied to the previous layer's output: plus
``zero * (rows[0, 0] + shared[0, 0])``, ``zero`` a runtime argument, the output ``(rows,
shared)`` (the shared expert's rows, or zeros carried on) behind an ``optimization_barrier`` so
that XLA must compute all of it; so no layer leaves the loop (the sort, the GEMMs:
``tests/cpu/test_bench_moe_experts.py`` reads the optimized HLO on CPU) and the tie costs
one small fusion per layer, the same in every column. XLA may still hoist what reads the
weights alone (on CPU it moved their transposes before the loop): a copy that costs memory,
not time in the loop.

**Timing** follows `timing`: two loop counts per program (the count is a runtime argument
of one compiled program), every column's short and long runs interleaved with ours, the
order reversed every other repetition (`timing.paired_estimates`), a per-call estimate per
repetition from adjacent runs, `timing.summarize` and `timing.paired_ratio` (``over_ours``:
the column's time over ours per repetition). The counts are the column's own: a call here
takes from about a microsecond to tens of milliseconds, so fixed counts would either run for
minutes or leave the difference of the runs within a run's fixed cost, which moves by up to
0.5 ms (`timing`). Each column's long run exceeds its short run by about ``--target-ms``
(measured from its one- and few-iteration runs), the short run being 36/128 of that
difference, as `timing`'s 36 and 164.

Per case the JSON has the shape, tp, hidden, the rank's intermediate, experts, top-k, m,
layers, the distinct active experts of each layer (count and a hex bitmask) and their mean,
the active bytes per call, the floor, and per column ``us``/``p10``/``p90``, ``over_ours``,
``floor_fraction`` (floor over the column's time), its loop counts, compile seconds and
kernels (``hlo``; ours' on a GPU also ``kernel_set``, the key of the set it loads), or
``why_not``. It is written after every case. ``--plot JSON...`` turns runs into a PNG: microseconds against m per shape and tp, one
line per column, the floor dashed, log axes.

**Run time.** Before measuring, the script prints an estimate of the run (``--estimate``
prints it and exits): guessed compile seconds per column and layer (compiling dominates),
the timed runs at the target difference, no shorter than a chain whose calls read every
expert, and drawing the weights (`GUESS`; no H200 run of this script preceded these
guesses, and a column whose module or JAX flag is missing counts a second). Each case
records its elapsed and estimated seconds, to correct the guesses; the JSON written after
every case keeps what a command cut short had measured. By the estimate (without tokamax),
a shape and tp at all nine m would take 9.5 to 10.5 minutes, so a command takes a third of
the m range: about 4 minutes each (4.8 for DeepSeek-V3 at tp = 1, m >= 64, the slowest
calls, and Qwen3-30B-A3B at tp = 8, m <= 4, the most layers), about a minute more where
tokamax is installed. The default selection is the first of them (DeepSeek-V3, tp = 8,
m = 1, 2, 4). A full sweep is 36 commands::

    for shape in deepseek-v3 qwen3-235b-a22b qwen3-30b-a3b; do
      for tp in 1 2 4 8; do
        for ms in "1 2 4" "8 16 32" "64 128 256"; do
          python benchmarks/bench_moe_experts.py --shapes $shape --tp $tp --m $ms
        done
      done
    done
    python benchmarks/bench_moe_experts.py --plot benchmarks/results/*-moe-experts-*.json --png experts.png

Ours needs its kernels: where CuTe DSL is, ``--build-kernels DIR`` builds those of the
selected shapes and tps (no GPU needed); point ``$JAX_MOE_PUBLISH_KERNEL_DIR`` at DIR. A run
on GPUs checks for them before timing anything.

``--cpu`` runs everything on the CPU at tiny dimensions (`CPU_DIMS`): a check of the
plumbing, its times mean nothing.

    python benchmarks/bench_moe_experts.py [--shapes ...] [--tp ...] [--m ...] [--columns ...] [--reps N]
        [--rounds R] [--target-ms T] [--weight-budget-gb G] [--min-pass-mb P] [--out JSON] [--hlo PREFIX]
    python benchmarks/bench_moe_experts.py --estimate --shapes qwen3-30b-a3b --tp 8
    python benchmarks/bench_moe_experts.py --build-kernels kernels/ --shapes deepseek-v3 --tp 1 2 4 8
    python benchmarks/bench_moe_experts.py --plot run1.json run2.json --png experts.png
    python benchmarks/bench_moe_experts.py --cpu --tp 1 2 --m 1 3 --reps 1 --out /tmp/experts.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import itertools
import json
import math
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# examples/ is not a package: its modules import by name (as in bench_moe_block.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import floors
import kernel_builds
import moe_block as mb
import records
import timing

import jax_moe_publish as jmp
from jax_moe_publish import experts_tokamax, reference
from jax_moe_publish.experts_config import FP8_BLOCK
from jax_moe_publish.experts_layout import Tiling
from jax_moe_publish.testing import rank_processes

ROOT = pathlib.Path(__file__).resolve().parent.parent

SHAPES = {
    "deepseek-v3": mb.DEEPSEEK_V3,
    "qwen3-235b-a22b": mb.MoEConfig("qwen3-235b-a22b", hidden=4096, intermediate=1536, experts=128, top_k=8,
                                    router="softmax", model_experts=128),
    "qwen3-30b-a3b": dataclasses.replace(mb.QWEN3_30B_A3B, name="qwen3-30b-a3b"),
}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_MS = (1, 2, 4)
# --cpu: every shape at dimensions that split over tp = 8, and hold whole FP8 blocks at tp = 1 and 2
# (DeepSeek-V3's shared expert of the routed experts' intermediate, as the model's).
CPU_DIMS = {"hidden": 128, "intermediate": 256, "experts": 16, "shared_intermediate": 256}
MAX_DIFFERENCE = 1e-2
MAX_FP8_DIFFERENCE = 0.1
"""e4m3 operands against the unquantized ones: a 3-bit mantissa, about 4 % per value (relative, RMS)."""
MIN_LAYERS = 2  # so that no two consecutive calls share weights or routing
MAX_ITERATIONS = 20_000
# By platform: the long run's excess over the short one (ms), the weights' budget (GB) and the
# active bytes of one pass (MB).
PLATFORM_DEFAULTS = {
    "gpu": {"target_ms": 20.0, "weight_budget_gb": 60.0, "min_pass_mb": 200.0},
    "cpu": {"target_ms": 1.0, "weight_budget_gb": 0.05, "min_pass_mb": 0.5},
}
OURS_IMPLS = {"gpu": "kernel", "cpu": "auto"}
"""Ours' ``impl`` by platform: the kernels, which raise without a CUDA device; on CPU the path
``auto`` takes there (the reference), so that the column's plumbing runs."""
CPU_COPY_SHAPE = (2**10, 2**12)  # bf16, 8 MiB: the --cpu stand-in of the floor's copy
# The run-time estimate's figures: guesses made before this script first ran on an H200.
# `--estimate` and the JSON (``elapsed_s`` beside ``estimate_s`` per case) are there to replace them.
GUESS = {
    "start_s": 60.0,  # JAX and CUDA start, the floors (a 4 GiB copy, the empty-call chain)
    "weights_s_per_gb": 0.1,  # drawing random bf16 weights
    "compile_s": {"ours": 3.0, "ours_prepared": 3.0, "ragged_dot": 8.0, "ragged_dot_pallas_triton": 10.0,
                  "cudnn": 10.0, "xla_triton": 10.0, "tokamax": 20.0, "gather": 8.0, "ours_fp8": 3.0,
                  "ours_fp8_prepared": 3.0, "gather_fp8": 8.0, "ours_fp8_tokens_prepared": 4.0,
                  "ours_shared_prepared": 3.0, "ours_prepared_xla_shared": 4.0, "ours_bulk_prepared": 3.0,
                  "ours_fp8_bulk_prepared": 3.0},
    "compile_s_per_layer": 0.3,
    "unavailable_s": 1.0,  # a column whose module or JAX flag this Python lacks
    "hbm_bytes_per_s": 4.0e12,
    "flops_per_s": 6.0e14,  # bf16 dense GEMMs
}


@dataclasses.dataclass(frozen=True)
class Column:
    """One route to the experts' rows: how its programs are built, and what its optimized HLO
    must hold for the column to be what its name says (``needs_in_hlo``, regexes that must all
    match; ``needs_what`` says it in words)."""

    name: str
    what: str
    route: str  # "ours" (impl="kernel"), or the jmp.moe_experts impl: "reference", "gather", "tokamax"
    prepared: bool = False  # on jmp.prepare_experts's weights (made once, before the timed loop)
    fp8: bool = False  # on the layers' e4m3 weights (BlockScaled of 128 x 128 blocks)
    fp8_tokens: bool = False  # x quantized to e4m3 per token and 128 channels in the step
    shared: str = ""  # the shared expert too: "held" by the prepared weights, or through "xla"
    bulk: bool = False  # ours with ExpertsConfig.with_bulk_loads (prepared weights only)
    changes: tuple = ()  # ours with these (field, value) changes to the default config
    compiler_options: tuple = ()  # XLA options of this column's programs only
    jax_flag: str | None = None  # a JAX config flag set while this column's programs are traced
    needs_in_hlo: tuple = ()
    needs_what: str = ""


_RAGGED_DOT_KEPT = r"\sragged-dot\("  # XLA's default rewrites every ragged dot into dots
COLUMNS = (
    Column("ours", "jmp.moe_experts(impl='kernel'): this package's kernels", "ours"),
    Column("ours_prepared", "jmp.moe_experts(impl='kernel') on jmp.prepare_experts's weights (the kernels' tiled "
           "order, made once before the loop)", "ours", prepared=True),
    Column("ragged_dot", "jmp.moe_experts(impl='reference'): jax.lax.ragged_dot, XLA's default lowering",
           "reference"),
    Column("ragged_dot_pallas_triton", "jmp.moe_experts(impl='reference') traced with "
           "jax_ragged_dot_use_gpu_pallas_triton_lowering: JAX's Pallas Triton ragged dot", "reference",
           jax_flag="jax_ragged_dot_use_gpu_pallas_triton_lowering",
           needs_in_hlo=(r'custom_call_target="[^"]*triton',), needs_what="a Triton custom call"),
    Column("cudnn", "jmp.moe_experts(impl='reference') compiled with xla_gpu_experimental_use_ragged_dot_fusion: "
           "XLA's cuDNN grouped GEMM", "reference",
           compiler_options=(("xla_gpu_experimental_use_ragged_dot_fusion", True),),
           needs_in_hlo=(_RAGGED_DOT_KEPT, r'"kind":\s*"__cudnn\$fusion"'),
           needs_what="a ragged dot in a cuDNN fusion (kind __cudnn$fusion; XLA needs cuDNN >= 9.22 and a CUDA "
                      "GPU of Ampere or later)"),
    Column("xla_triton", "jmp.moe_experts(impl='reference') compiled with xla_gpu_experimental_triton_ragged_dot: "
           "XLA's Triton ragged-dot emitter", "reference",
           compiler_options=(("xla_gpu_experimental_triton_ragged_dot", True),
                             ("xla_gpu_experimental_enable_tiling_propagation", True)),
           needs_in_hlo=(_RAGGED_DOT_KEPT, r'"kind":\s*"__triton_gemm"'),
           needs_what="a ragged dot in a Triton GEMM fusion (kind __triton_gemm)"),
    Column("tokamax", "jmp.moe_experts(impl='tokamax'): the reference's two grouped GEMMs as tokamax.ragged_dot's "
           "Mosaic GPU kernel", "tokamax"),
    Column("gather", "jmp.moe_experts(impl='gather'): the active experts' weights gathered by XLA into slots, "
           "two batched GEMMs", "gather"),
    Column("ours_fp8", "jmp.moe_experts(impl='kernel') on e4m3 weights with 128 x 128 block scales", "ours",
           fp8=True),
    Column("ours_fp8_prepared", "jmp.moe_experts(impl='kernel') on jmp.prepare_experts's order of the e4m3 weights",
           "ours", prepared=True, fp8=True),
    Column("gather_fp8", "jmp.moe_experts(impl='gather') on the e4m3 weights (dequantized after the gather)",
           "gather", fp8=True),
    Column("ours_fp8_tokens_prepared", "jmp.moe_experts(impl='kernel') on e4m3 tokens (quantized in the step by "
           "reference.quantize_fp8) and jmp.prepare_experts's order of the e4m3 weights", "ours", prepared=True,
           fp8=True, fp8_tokens=True),
    Column("ours_shared_prepared", "jmp.moe_experts(impl='kernel') on jmp.prepare_experts's weights holding the "
           "shared expert after the routed ones: the kernels compute its rows too", "ours", prepared=True,
           shared="held"),
    Column("ours_prepared_xla_shared", "ours_prepared, and the shared expert through XLA's GEMMs "
           "(jmp.moe_experts(..., shared=...))", "ours", prepared=True, shared="xla"),
    Column("ours_bulk_prepared", "ours_prepared with both kernels' loads as bulk copies into a ring of the CTA's "
           "(jmp.ExpertsConfig.with_bulk_loads)", "ours", prepared=True, bulk=True),
    Column("ours_fp8_bulk_prepared", "ours_fp8_prepared with both kernels' loads as bulk copies into a ring of the "
           "CTA's (jmp.ExpertsConfig.with_bulk_loads)", "ours", prepared=True, fp8=True, bulk=True),
)
COLUMN_NAMES = tuple(column.name for column in COLUMNS)
COLUMNS_BY_NAME = {column.name: column for column in COLUMNS}
FLOOR_COLUMNS = ("floor", "floor_fp8", "floor_shared")
"""A case's entries beside its columns: the floors (module docstring)."""
VARIANT_PREFIX = "ours_prepared:"
ROWS_VARIANT_PREFIX = "ours:"
ROWS_VARIANT = "rows:"
"""How a ``--variants`` text asks for a column of ``ours`` (the weights' rows)."""
KEPT_BY_VARIANTS = ("hidden", "intermediate", "experts", "top_k", "fused_gate_up", "tiled_weights", "fp8_weights",
                    "fp8_tokens", "shared_expert", "arch", *(f.name for f in dataclasses.fields(Tiling)))
"""`jmp.ExpertsConfig` fields that a ``--variants`` column may not change: the call's operands and
the weights' tiled order (its columns read the same prepared weights as ``ours_prepared``)."""


def parse_changes(text: str) -> dict:
    """``"field=value,field=value"`` -> changes to a `jmp.ExpertsConfig` (ints, or true/false)."""
    changes = {}
    for item in text.split(","):
        field, _, value = (part.strip() for part in item.partition("="))
        changes[field] = value == "true" if value in ("true", "false") else int(value)
    return changes


def variant_column(text: str) -> Column:
    """The ``--variants`` column of ``text`` (`parse_changes`): of ``ours_prepared``, named
    `VARIANT_PREFIX` + ``text``, or after `ROWS_VARIANT` of ``ours``, named `ROWS_VARIANT_PREFIX` +
    the changes; ValueError where a change is not a launch-shape field (that keeps the tiled
    order, on prepared weights)."""
    rows = text.startswith(ROWS_VARIANT)
    changes_text = text.removeprefix(ROWS_VARIANT)
    try:
        changes = parse_changes(changes_text)
    except ValueError:
        raise ValueError(f"--variants {text}: expected [{ROWS_VARIANT}]FIELD=VALUE[,FIELD=VALUE...] with integer or "
                         "true/false values") from None
    fields = {f.name for f in dataclasses.fields(jmp.ExpertsConfig)}
    kept = set(KEPT_BY_VARIANTS) - ({f.name for f in dataclasses.fields(Tiling)} if rows else set())
    for field in changes:
        if field not in fields or field in kept:
            what = "launch-shape field" if rows else "launch-shape field that keeps the weights' tiled order"
            raise ValueError(f"--variants {text}: {field!r} is not a {what}; expected one of {sorted(fields - kept)}")
    if rows:
        return Column(ROWS_VARIANT_PREFIX + changes_text, f"ours with the op's config changed by {changes_text} (the "
                      "weights' rows)", "ours", changes=tuple(sorted(changes.items())))
    return Column(VARIANT_PREFIX + text, f"ours_prepared with the op's config changed by {text} (the same tiled "
                  "order)", "ours", prepared=True, changes=tuple(sorted(changes.items())))


def divides(config, tp: int) -> bool:
    try:
        config.check_tp(tp)
    except ValueError:
        return False
    return True


def selected_columns(args) -> list:
    """The columns of ``--columns`` in `COLUMNS`' order, then those of ``--variants``."""
    return [column for column in COLUMNS if column.name in args.columns] + list(getattr(args, "variant_columns", []))


def column_named(args, name: str) -> Column:
    return next(column for column in selected_columns(args) if column.name == name)


def parse(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shapes", nargs="+", default=["deepseek-v3"], choices=list(SHAPES))
    parser.add_argument("--tp", nargs="+", type=int, default=[8], help="the rank's intermediate is I / tp")
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_MS), help=f"tokens (the sweep: {MS})")
    parser.add_argument("--columns", nargs="+", default=list(COLUMN_NAMES), choices=COLUMN_NAMES)
    parser.add_argument("--variants", nargs="+", default=[], metavar="FIELD=VALUE[,...]",
                        help="more columns: ours_prepared with these changes to the op's config (launch-shape "
                             "fields that keep the tiled order), e.g. token_tiles=1; rows:FIELD=VALUE: ours so (the "
                             "weights' rows), e.g. rows:gate_up_warp_cols=64")
    parser.add_argument("--reps", type=int, default=10, help="paired repetitions per round")
    parser.add_argument("--rounds", type=int, default=1, help="rounds, each with freshly compiled programs")
    parser.add_argument("--target-ms", type=float, help="each column's long run less its short run, in ms "
                                                        "(default 20; --cpu 1)")
    parser.add_argument("--weight-budget-gb", type=float, help="device memory for the layers' weights "
                                                               "(default 60; --cpu 0.05)")
    parser.add_argument("--min-pass-mb", type=float, help="active weight bytes of one pass over the chain "
                                                          "(default 200, 4x an H200's L2; --cpu 0.5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="the JSON (default: benchmarks/results/<date>-<gpu>-moe-experts-...json)")
    parser.add_argument("--hlo", metavar="PREFIX", help="write each column's optimized HLO of the first case to "
                                                        "PREFIX.<column>.txt")
    parser.add_argument("--cpu", action="store_true", help="on the CPU at tiny dimensions: plumbing only")
    parser.add_argument("--estimate", action="store_true", help="print the run-time estimate and exit")
    parser.add_argument("--build-kernels", metavar="DIR", help="compile ours' kernels of the selected shapes "
                                                               "and tps into DIR (CuTe DSL, no GPU), then exit")
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="turn these runs into a PNG (--png), then exit")
    parser.add_argument("--png", help="the --plot PNG (default: the first JSON's name with .png)")
    args = parser.parse_args(argv)
    for name in ("reps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected at least 1")
    if args.png and not args.plot:
        parser.error(f"--png {args.png}: expected --plot with the JSON files to draw")
    if args.estimate and args.cpu:
        parser.error("--estimate --cpu: the estimate is of a run on an H200")
    if min(args.m) < 1 or min(args.tp) < 1:
        parser.error(f"--m {args.m} --tp {args.tp}: expected every value >= 1")
    platform = "cpu" if args.cpu else "gpu"
    for name, value in PLATFORM_DEFAULTS[platform].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive number")
    args.ours_impl = OURS_IMPLS[platform]
    try:
        args.variant_columns = [variant_column(text) for text in dict.fromkeys(args.variants)]
    except ValueError as error:
        parser.error(str(error))
    for name in args.shapes:
        config = shape_config(args, name)
        for tp in args.tp:
            if not args.variant_columns or not divides(config, tp):
                continue  # main refuses a tp that does not divide the shape
            for column, m in itertools.product(args.variant_columns, args.m):
                try:
                    ours_config(config, tp, column, m)  # ExpertsConfig checks each value
                except ValueError as error:
                    text = column.name.removeprefix(VARIANT_PREFIX) if column.prepared else (
                        ROWS_VARIANT + column.name.removeprefix(ROWS_VARIANT_PREFIX))
                    parser.error(f"--variants {text} at {name} tp={tp}: {error}")
    return args


# ---------------------------------------------------------------------------------------
# Shapes, layers, routing, weights


def shape_config(args, name):
    """The model's `moe_block.MoEConfig` (its router and whole dimensions), tiny under --cpu."""
    return mb.scaled(SHAPES[name], **CPU_DIMS) if args.cpu else SHAPES[name]


def layer_weight_bytes(config, tp):
    """Bytes of one layer's expert weights on a rank."""
    return config.experts * config.expert_bytes(tp)


def weight_layouts(args) -> set:
    """The layers' weight arrays that the selected columns read: ``(fp8, prepared, held)``;
    ``held``: prepared with the shared expert. The others are dropped once derived."""
    return {(column.fp8, column.prepared, column.shared == "held") for column in selected_columns(args)}


DRAW_COPIES = 1.5
"""Copies of a layer's bf16 arrays held besides the layers' while the next is drawn: its rows
and their e4m3 quantization, from which the others are derived (`draw_weights`)."""


def weight_copies(args):
    """Bytes of each layer's weights held, in copies of its bf16 arrays (`weight_layouts`; e4m3: half)."""
    return sum(0.5 if fp8 else 1 for fp8, _, _ in weight_layouts(args))


def shared_expert_bytes(config, tp):
    """The shared expert's bf16 weights on a rank (0 without one)."""
    return 3 * config.hidden * (config.shared_intermediate // tp) * 2


def why_no_shared(column, config):
    """Why ``column``'s shared expert cannot run at ``config``, or None."""
    if not config.shared:
        return f"{config.name} has no shared expert"
    if column.shared == "held" and not mb.holds_shared(config):
        return (f"the shared expert's intermediate ({config.shared_intermediate}) is not the routed experts' "
                f"({config.intermediate}): prepare_experts cannot hold it")
    return None


def fp8_expert_bytes(config, tp):
    """One expert's e4m3 weights on a rank: a byte per weight and a float32 per 128 x 128 block."""
    i = config.intermediate // tp
    return 3 * config.hidden * i + 3 * (config.hidden // FP8_BLOCK) * (i // FP8_BLOCK) * 4


def holds_fp8_blocks(config, tp):
    """Whether a rank's shard holds whole 128 x 128 blocks (the FP8 columns' weights)."""
    return config.hidden % FP8_BLOCK == 0 and config.intermediate // tp % FP8_BLOCK == 0


def budget_layers(args, config, tp):
    """The most layers whose weights (`weight_copies` of them) fit ``--weight-budget-gb`` beside
    the arrays of the layer being drawn (`DRAW_COPIES`)."""
    layer_bytes = layer_weight_bytes(config, tp) * weight_copies(args)
    draw_bytes = layer_weight_bytes(config, tp) * DRAW_COPIES
    layers = int((args.weight_budget_gb * 1e9 - draw_bytes) // layer_bytes)
    if layers < 1:
        raise SystemExit(f"--weight-budget-gb {args.weight_budget_gb}: one layer of {config.name} at tp={tp} "
                         f"needs {(layer_bytes + draw_bytes) / 1e9:.2f} GB while drawn; expected a budget of "
                         "at least that")
    return layers


def shape_key(args, name):
    return jax.random.fold_in(jax.random.key(args.seed), list(SHAPES).index(name))


def router_params(key, config):
    """One layer's router (`moe_block.init_layer`'s distributions)."""
    keys = jax.random.split(key)
    params = {"router": mb.router_weight(keys[0], config.hidden, config.experts)}
    if config.router == "sigmoid-grouped":
        params["bias"] = 0.1 * jax.random.normal(keys[1], (config.experts,), jnp.float32)
    return params


@functools.partial(jax.jit, static_argnums=(0, 1))
def draw_routing(config, m, router_key, x_key):
    """One layer's ``x`` (bf16 [m, hidden]) and its experts (int32 [m, top_k]) by the model's router."""
    x = jax.random.normal(x_key, (m, config.hidden), jnp.float32).astype(jnp.bfloat16)
    experts, _ = mb.route(config, router_params(router_key, config), x)
    return x, experts


def case_routing(args, config, tp, m, max_layers):
    """Layers of routing for one case: ``(xs, ids, active)``, ``active`` the sorted distinct experts
    of each layer, as many layers as one pass needs for ``--min-pass-mb`` of active weights (at
    least MIN_LAYERS), at most ``max_layers``. A layer's routing depends on the shape, m and its
    index only, so it is the same at every tp."""
    key = shape_key(args, config.name)
    xs, ids, active, pass_bytes = [], [], [], 0
    while len(xs) < max_layers and (len(xs) < MIN_LAYERS or pass_bytes < args.min_pass_mb * 1e6):
        layer = len(xs)
        router_key = jax.random.fold_in(jax.random.fold_in(key, 0), layer)
        x_key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, 1), m), layer)
        x, experts = draw_routing(config, m, router_key, x_key)
        xs.append(x)
        ids.append(experts)
        active.append(np.unique(np.asarray(experts)))
        pass_bytes += active[-1].size * config.expert_bytes(tp)
    return xs, ids, active


@functools.partial(jax.jit, static_argnums=(1, 2))
def draw_layer_weights(key, config, tp):
    """One layer's weights on one rank, uniform bf16 of variance ``1 / fan_in``
    (`moe_block.init_layer`'s draw): gate_up [experts, hidden, 2 * i] (gate columns, then up)
    and down [experts, i, hidden], ``i = intermediate / tp``."""
    i = config.intermediate // tp
    keys = jax.random.split(key)
    return {"gate_up": uniform_weights(keys[0], (config.experts, config.hidden, 2 * i), config.hidden),
            "down": uniform_weights(keys[1], (config.experts, i, config.hidden), config.intermediate)}


def uniform_weights(key, shape, fan_in):
    """bf16 uniform of variance ``1 / fan_in``."""
    limit = (3 / fan_in) ** 0.5
    return jax.random.uniform(key, shape, jnp.bfloat16, -limit, limit)


@functools.partial(jax.jit, static_argnums=(1, 2))
def draw_shared_weights(key, config, tp):
    """One layer's shared expert on one rank, as `draw_layer_weights` draws an expert:
    ``(gate_up [hidden, 2 * s], down [s, hidden])``, ``s = shared_intermediate / tp``."""
    s = config.shared_intermediate // tp
    keys = jax.random.split(key)
    return (uniform_weights(keys[0], (config.hidden, 2 * s), config.hidden),
            uniform_weights(keys[1], (s, config.hidden), config.shared_intermediate))


def draw_weights(args, config, tp, layers):
    """Each layer's weights that the columns read (`weight_layouts`): ``"gate_up"`` and ``"down"``
    (`draw_layer_weights`); ``"prepared"``, their `jmp.prepare_experts` order; ``"fp8"``, the pair
    ``(gate_up, down)`` quantized (`jmp.BlockScaled.quantize`, where the shard holds whole
    blocks); ``"fp8_prepared"``, its prepared order; with a shared expert, ``"shared"`` (its
    ``(gate_up, down)``) and ``"prepared_shared"``, the prepared order holding it. A layer's
    arrays that no column reads are dropped before the next layer is drawn, so that a tp = 1
    layer's derived copies fit beside it."""
    key = jax.random.fold_in(jax.random.fold_in(shape_key(args, config.name), 2), tp)
    layouts = weight_layouts(args)
    prepare = jax.jit(jmp.prepare_experts)
    # One expert at a time: quantizing a whole tp = 1 layer at once needs float32 copies of it.
    quantize = jax.jit(lambda w: jax.lax.map(jmp.BlockScaled.quantize, w))
    shared_columns = [c for c in selected_columns(args) if c.shared and not why_no_shared(c, config)]
    weights = []
    for layer in range(layers):
        w = draw_layer_weights(jax.random.fold_in(key, layer), config, tp)
        if holds_fp8_blocks(config, tp) and {(True, False, False), (True, True, False)} & layouts:
            fp8 = (quantize(w["gate_up"]), quantize(w["down"]))
            if (True, True, False) in layouts:
                w["fp8_prepared"] = jax.block_until_ready(prepare(*fp8))
            if (True, False, False) in layouts:
                w["fp8"] = fp8
            del fp8
        if (False, True, False) in layouts:
            w["prepared"] = prepare(w["gate_up"], w["down"])
        if shared_columns:
            w["shared"] = draw_shared_weights(jax.random.fold_in(jax.random.fold_in(key, layer), 1), config, tp)
            if (False, True, True) in layouts and mb.holds_shared(config):
                w["prepared_shared"] = prepare(w["gate_up"], w["down"], shared=w["shared"])
        if (False, False, False) not in layouts:
            del w["gate_up"], w["down"]
        weights.append(jax.block_until_ready(w))
    return weights


def active_bitmask(active, experts):
    """The set of active experts as hex, expert e the bit ``1 << e``."""
    return format(sum(1 << int(e) for e in active), f"0{-(-experts // 4)}x")


# ---------------------------------------------------------------------------------------
# The columns' programs


def layer_function(column, args):
    """``(layer weights, x, expert ids) -> rows`` of ``column``."""
    impl = args.ours_impl if column.route == "ours" else column.route
    if column.fp8_tokens:
        return lambda w, x, ids: jmp.moe_experts(jmp.BlockScaled(*reference.quantize_fp8(x)), ids,
                                                 w["fp8_prepared"], impl=impl)
    if column.shared == "held":
        return lambda w, x, ids: jmp.moe_experts(x, ids, w["prepared_shared"], impl=impl)
    if column.shared == "xla":
        return lambda w, x, ids: jmp.moe_experts(x, ids, w["prepared"], shared=w["shared"], impl=impl)
    if column.prepared:
        name = "fp8_prepared" if column.fp8 else "prepared"
        if column.bulk:
            return lambda w, x, ids: jmp.moe_experts(x, ids, w[name], impl=impl,
                                                     config=bulk_config(w[name], ids.shape, column.fp8))
        if column.changes:
            return lambda w, x, ids: jmp.moe_experts(x, ids, w[name], impl=impl,
                                                     config=variant_config(w[name], ids.shape, column))
        return lambda w, x, ids: jmp.moe_experts(x, ids, w[name], impl=impl)
    if column.fp8:
        return lambda w, x, ids: jmp.moe_experts(x, ids, *w["fp8"], impl=impl)
    if column.changes:
        return lambda w, x, ids: jmp.moe_experts(x, ids, w["gate_up"], w["down"], impl=impl,
                                                 config=rows_variant_config(w["gate_up"], ids.shape, column))
    return lambda w, x, ids: jmp.moe_experts(x, ids, w["gate_up"], w["down"], impl=impl)


def rows_variant_config(gate_up, ids_shape, column):
    """A rows ``--variants`` column's config for the weights' rows (the fused ``gate_up``): the
    op's default with the column's changes."""
    return default_config(gate_up, ids_shape).replace(**dict(column.changes))


def default_config(gate_up, ids_shape, fp8: bool = False):
    """The op's default config for fused ``gate_up`` weights (prepared weights' before their
    tiled order) and ids of ``ids_shape`` (m, top_k)."""
    experts, hidden, gate_up_columns = gate_up.shape
    m, top_k = ids_shape
    return jmp.ExpertsConfig.for_shape(hidden=hidden, intermediate=gate_up_columns // 2, experts=experts,
                                       top_k=top_k, fp8_weights=fp8, m=m)


def bulk_config(prepared, ids_shape, fp8: bool):
    """The bulk-copy columns' config for ``prepared`` weights: the default's, with both kernels'
    bulk loads (`jmp.ExpertsConfig.with_bulk_loads`, the same tiled order)."""
    return default_config(prepared.gate_up, ids_shape, fp8).with_bulk_loads()


def variant_config(prepared, ids_shape, column):
    """A ``--variants`` column's config for ``prepared`` weights: the default's in their tiled
    order, with the column's changes."""
    return prepared.tiling.config_for(default_config(prepared.gate_up, ids_shape)).replace(**dict(column.changes))


def chain(layer_fn, layers):
    """``(weights, xs, ids, zero, y, iterations) -> y``: ``iterations`` passes over ``layers``
    calls, each layer's ``x`` and ids plus ``zero * (rows[0, 0] + shared[0, 0])`` of the previous
    layer's output ``y = (rows, shared)`` (``shared`` passed on where a column computes none),
    ``y`` behind an optimization barrier (module docstring)."""

    def program(weights, xs, ids, zero, y, iterations):
        def body(_, y):
            for layer in range(layers):
                rows, shared = lax.optimization_barrier(y)
                tie = zero * (rows[0, 0].astype(jnp.float32) + shared[0, 0].astype(jnp.float32))
                x = (xs[layer].astype(jnp.float32) + tie).astype(jnp.bfloat16)
                out = layer_fn(weights[layer], x, ids[layer] + tie.astype(jnp.int32))
                y = out if isinstance(out, tuple) else (out, shared)
            return y

        return lax.fori_loop(0, iterations, body, y)

    return program


def chain_inputs(config, m, weights, xs, ids):
    """`chain`'s operands but ``iterations`` for one case: the first ``len(xs)`` layers'
    weights, each layer's ``x`` and ids, ``zero``, and the first ``y`` (zero rows and shared rows)."""
    return (weights[:len(xs)], xs, ids, jnp.zeros((), jnp.float32),
            (jnp.zeros((m * config.top_k, config.hidden), jnp.bfloat16), jnp.zeros((m, config.hidden), jnp.bfloat16)))


@contextlib.contextmanager
def jax_flag(name):
    """JAX's config flag ``name`` set while the block runs (None: nothing), restored after."""
    if name is None:
        yield
        return
    if not hasattr(jax.config, name):
        raise ValueError(f"this jax ({jax.__version__}) has no config flag {name!r}")
    before = getattr(jax.config, name)
    jax.config.update(name, True)
    try:
        yield
    finally:
        jax.config.update(name, before)


def compile_column(column, args, layers, inputs):
    """``(compiled program, the call it runs)`` of ``column``; raises where it cannot be built."""
    impl = args.ours_impl if column.route == "ours" else column.route
    return build(column, layer_function(column, args), layers, inputs), f"jmp.moe_experts(impl={impl!r})"


def build(column, layer_fn, layers, inputs):
    """The compiled chain of ``layer_fn`` with ``column``'s XLA options and JAX flag."""
    program = jax.jit(chain(layer_fn, layers), compiler_options=dict(column.compiler_options) or None)
    # The flag is part of JAX's trace context: it counts while tracing; the compiled program keeps it.
    with jax_flag(column.jax_flag):
        lowered = program.lower(*inputs, jnp.int32(1))
    return lowered.compile()


def one_line(error):
    """An exception as one line: its type and the start of its message."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:400]}"


_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":\s*"(__[^"]+)"')


def hlo_kernels(hlo):
    """What an optimized HLO module runs its GEMMs with: custom-call targets and fusion kinds
    (``__cudnn$fusion``, ``__triton_gemm``, ...) counted over the module, and its ragged dots
    (XLA's default lowering rewrites every one into dots)."""

    def counts(pattern):
        found = {}
        for name in pattern.findall(hlo):
            found[name] = found.get(name, 0) + 1
        return found

    return {"custom_calls": counts(_CUSTOM_CALL), "fusion_kinds": counts(_FUSION_KIND),
            "ragged_dots": len(re.findall(_RAGGED_DOT_KEPT, hlo))}


def missing_evidence(column, hlo):
    """Why the optimized HLO does not show ``column``'s implementation, or None where it does."""
    if all(re.search(pattern, hlo) for pattern in column.needs_in_hlo):
        return None
    return (f"the optimized HLO lacks {column.needs_what}; it has {json.dumps(hlo_kernels(hlo))}: "
            "the program runs another implementation")


# ---------------------------------------------------------------------------------------
# Timing


def runner(compiled, iterations):
    """``compiled`` as a function of the inputs alone, at ``iterations`` loop iterations: its rows
    (the shared rows come from the same program, ready with them)."""
    count = jnp.int32(iterations)
    return lambda *inputs: compiled(*inputs, count)[0]


def loop_counts(compiled, inputs, target_s):
    """``(short, long)`` iterations of ``compiled`` whose runs differ by about ``target_s``: the
    time of an iteration from a one-iteration run and a run near the target, the short run
    36/128 of the difference (as `timing`'s counts)."""
    one = float(np.median(timing.time_runs(runner(compiled, 1), inputs, 2)))
    probe = int(min(max(2, math.ceil(target_s / one)), MAX_ITERATIONS))
    probed = float(np.median(timing.time_runs(runner(compiled, probe), inputs, 2)))
    per_iteration = max((probed - one) / (probe - 1), target_s / MAX_ITERATIONS)
    difference = min(max(1, math.ceil(target_s / per_iteration)), MAX_ITERATIONS)
    short = math.ceil(difference * timing.SHORT / (timing.LONG - timing.SHORT))
    return short, short + difference


def per_call_estimates(programs, counts, inputs, reps, layers):
    """`timing.paired_estimates` of every column at its own counts: per-call µs per repetition.
    The columns' runs interleave as `timing` orders them; labels 0 and 1 stand for each
    column's short and long count, and each difference is divided by the column's own calls."""
    sides = {name: {0: runner(compiled, counts[name][0]), 1: runner(compiled, counts[name][1])}
             for name, compiled in programs.items()}
    run_differences = timing.paired_estimates(sides, inputs, reps, layers=1, iterations=(0, 1))
    return {name: run_differences[name] / ((counts[name][1] - counts[name][0]) * layers) for name in programs}


# ---------------------------------------------------------------------------------------
# One case


class NotTimed(Exception):
    """A column that ran but may not be timed as what it claims to be: its ``why_not``."""


def prepare_column(column, args, top_k, layers, inputs, entry, outputs, hlo_prefix):
    """Compile ``column`` and check it before it is timed: its optimized HLO shows what the
    column claims (`missing_evidence`), and its output of one pass (in pair order) agrees with
    that of the first column that ran. Records in ``entry`` the call it ran, its compile seconds,
    its kernels (`hlo_kernels`) and its loop counts (`loop_counts`); returns the program."""
    start = time.perf_counter()
    compiled, entry["ran"] = compile_column(column, args, layers, inputs)
    text = compiled.as_text()
    if hlo_prefix:
        pathlib.Path(f"{hlo_prefix}.{column.name}.txt").write_text(text)
    why_not = missing_evidence(column, text)
    if why_not:
        raise NotTimed(why_not)
    entry["compile_s"] = time.perf_counter() - start
    entry["hlo"] = hlo_kernels(text)
    out, shared = (np.asarray(y, np.float64) for y in compiled(*inputs, jnp.int32(1)))
    outputs[column.name] = out
    if column.shared:
        # The last layer's x is its xs entry (the tie adds zero).
        weights, xs = inputs[0][-1], inputs[1][-1]
        want = np.asarray(reference.shared_expert(xs, *weights["shared"]), np.float64)
        difference = float(np.linalg.norm(shared - want) / np.linalg.norm(want))
        entry["shared_relative_difference"] = difference
        if not difference <= MAX_DIFFERENCE:
            raise NotTimed(f"its shared rows differ from reference.shared_expert's by {difference:.2e} (relative, "
                           f"more than {MAX_DIFFERENCE})")
    # The first column that ran on the same operands (`operand_kind`); the first of a kind
    # against the first of the kind one quantization before (e4m3 weights against bf16, e4m3
    # tokens against e4m3 weights alone), within that quantization's error.
    kind = operand_kind(column)
    against = next(name for name in outputs if operand_kind(column_named(args, name)) == kind)
    bound = MAX_DIFFERENCE
    if column.name == against and kind > 0:
        against = next((name for name in outputs if operand_kind(column_named(args, name)) == kind - 1),
                       column.name)
        bound = MAX_FP8_DIFFERENCE
    if column.name != against:
        difference = float(np.linalg.norm(outputs[column.name] - outputs[against]) / np.linalg.norm(outputs[against]))
        entry.update(relative_difference=difference, checked_against=against)
        if not difference <= bound:
            raise NotTimed(f"its output differs from {against}'s by {difference:.2e} (relative, more than "
                           f"{bound}): it would time another computation")
    entry["iterations"] = list(loop_counts(compiled, inputs, args.target_ms / 1e3))
    return compiled


def operand_kind(column) -> int:
    """0: bf16 operands; 1: e4m3 weights; 2: e4m3 weights and tokens."""
    return int(column.fp8) + int(column.fp8_tokens)


def measure_case(args, config, tp, m, weights, routing, bandwidth, columns, hlo_prefix):
    """Every column of one (shape, tp, m) and its floor."""
    start = time.perf_counter()
    xs, ids, active = routing
    layers = len(xs)
    hidden, top_k = config.hidden, config.top_k
    inputs = chain_inputs(config, m, weights, xs, ids)
    distinct = [int(a.size) for a in active]
    mean_active = float(np.mean(distinct))
    expert_bytes = config.expert_bytes(tp)
    active_bytes = mean_active * expert_bytes
    floor_us = active_bytes / bandwidth * 1e6
    fp8_floor_us = mean_active * fp8_expert_bytes(config, tp) / bandwidth * 1e6
    shared_floor_us = floor_us + shared_expert_bytes(config, tp) / bandwidth * 1e6
    result = {"shape": config.name, "tp": tp, "hidden": hidden, "intermediate": config.intermediate // tp,
              "model_intermediate": config.intermediate, "experts": config.experts, "top_k": top_k, "m": m,
              "router": config.router, "layers": layers, "budget_layers": budget_layers(args, config, tp),
              "active_experts": {"per_layer": distinct, "mean": mean_active,
                                 "bitmask_per_layer": [active_bitmask(a, config.experts) for a in active]},
              "expert_bytes": expert_bytes, "active_bytes_per_call": active_bytes,
              "pass_bytes": sum(distinct) * expert_bytes, "layer_weight_bytes": layer_weight_bytes(config, tp)}
    if not args.cpu:
        result["estimate_s"] = case_estimate_s(args, config, tp, m, layers, columns)
    # case_routing stops short of the pass bytes only at the budget's last layer.
    result["layers_cut_by_budget"] = layers < MIN_LAYERS or result["pass_bytes"] < args.min_pass_mb * 1e6
    figures = {column.name: {"what": column.what} for column in columns}
    timings, outputs = {}, {}
    for round_index in range(args.rounds):
        programs = {}
        for column in columns:
            entry = figures[column.name]
            if column.fp8 and not holds_fp8_blocks(config, tp):
                entry["why_not"] = (f"the rank's shard (hidden {hidden}, intermediate {config.intermediate // tp}) "
                                    f"holds no whole {FP8_BLOCK} x {FP8_BLOCK} blocks")
            if column.shared and why_no_shared(column, config):
                entry["why_not"] = why_no_shared(column, config)
            if "why_not" in entry:
                continue
            try:
                if round_index == 0:
                    if column.route == "ours" and not args.cpu:
                        # The kernel set the op loads here (its launch shapes depend on m).
                        entry["kernel_set"] = ours_config(config, tp, column, m).key
                    programs[column.name] = prepare_column(column, args, top_k, layers, inputs, entry, outputs,
                                                           hlo_prefix)
                else:
                    programs[column.name] = compile_column(column, args, layers, inputs)[0]
            except NotTimed as reason:
                entry["why_not"] = str(reason)
            except Exception as error:  # noqa: BLE001 - JAX, XLA and tokamax raise their own types
                entry["why_not"] = one_line(error)
            if "why_not" in entry:
                timings.pop(column.name, None)
        counts = {name: figures[name]["iterations"] for name in programs}
        for name, estimates in per_call_estimates(programs, counts, inputs, args.reps, layers).items():
            timings.setdefault(name, []).append(estimates)
    for name, column_rounds in timings.items():
        entry = figures[name]
        entry.update(timing.summarize(column_rounds))
        column = column_named(args, name)
        entry["floor_fraction"] = (fp8_floor_us if column.fp8 else shared_floor_us if column.shared
                                   else floor_us) / entry["us"]
        if "ours" in timings and name != "ours":
            entry["over_ours"] = timing.paired_ratio(column_rounds, timings["ours"])
    figures["floor"] = {"us": floor_us, "what": "the active experts' weight bytes at the measured HBM bandwidth",
                        "bytes": active_bytes, "bytes_per_s": bandwidth}
    if any(column.fp8 for column in columns):
        figures["floor_fp8"] = {"us": fp8_floor_us, "bytes": mean_active * fp8_expert_bytes(config, tp),
                                "bytes_per_s": bandwidth,
                                "what": "the active experts' e4m3 weights and scales at the measured HBM bandwidth"}
    if any(column.shared for column in columns) and config.shared:
        figures["floor_shared"] = {"us": shared_floor_us, "bytes": active_bytes + shared_expert_bytes(config, tp),
                                   "bytes_per_s": bandwidth,
                                   "what": "the active experts' and the shared expert's weight bytes at the measured "
                                           "HBM bandwidth"}
    result["columns"] = figures
    result["checked_against"] = next(iter(outputs), None)
    result["elapsed_s"] = time.perf_counter() - start
    return result


# ---------------------------------------------------------------------------------------
# The run-time estimate


def case_estimate_s(args, config, tp, m, layers, columns):
    """Seconds of one case by `GUESS`: per column its compile, then its runs (each repetition a
    short and a long run, together ``1 + 2 * 36/128`` times the target difference, and three
    more for the calibration and warm-up), no shorter than three iterations of a chain whose
    calls read every expert and multiply every row by every expert (as XLA's default lowering
    of a ragged dot does)."""
    rows = m * config.top_k
    expanded_flops = 2 * rows * config.experts * 3 * config.hidden * (config.intermediate // tp)
    call_s = max(layer_weight_bytes(config, tp) / GUESS["hbm_bytes_per_s"], expanded_flops / GUESS["flops_per_s"])
    pair_s = max(args.target_ms / 1e3 * (1 + 2 * timing.SHORT / (timing.LONG - timing.SHORT)), 3 * layers * call_s)
    seconds = 0.0
    for column in columns:
        if known_unavailable(column):
            seconds += GUESS["unavailable_s"]
            continue
        # A --variants column compiles as the column it changes does.
        guess = GUESS["compile_s"][column.name if not column.changes else "ours_prepared" if column.prepared else "ours"]
        compile_s = guess + GUESS["compile_s_per_layer"] * layers
        seconds += args.rounds * (compile_s + (args.reps + 3) * pair_s)
    return seconds


def known_unavailable(column):
    """Whether this Python lacks what ``column`` needs, where that shows without a device (its
    module, its JAX flag); the run records the error itself."""
    if column.route == "tokamax":
        return experts_tokamax.import_error() is not None
    return column.jax_flag is not None and not hasattr(jax.config, column.jax_flag)


def planned_layers(args, config, tp, m):
    """The layers `case_routing` will draw, from the expected distinct experts of uniform routing
    (the estimate does not draw the routing)."""
    expected = config.experts * (1 - (1 - config.top_k / config.experts) ** m)
    needed = math.ceil(args.min_pass_mb * 1e6 / (expected * config.expert_bytes(tp)))
    return min(max(MIN_LAYERS, needed), budget_layers(args, config, tp))


def run_estimate_s(args, columns):
    seconds = GUESS["start_s"]
    for name in args.shapes:
        config = shape_config(args, name)
        for tp in args.tp:
            layers = {m: planned_layers(args, config, tp, m) for m in args.m}
            seconds += max(layers.values()) * layer_weight_bytes(config, tp) / 1e9 * GUESS["weights_s_per_gb"]
            seconds += sum(case_estimate_s(args, config, tp, m, layers[m], columns) for m in args.m)
    return seconds


ESTIMATE_BASIS = ("an estimate, not a measurement: guessed compile seconds per column and layer, the timed runs at "
                  "--target-ms, no shorter than a chain whose calls read every expert at 4 TB/s and multiply every "
                  "row by every expert at 600 TFLOP/s, weights drawn at 10 GB/s, 60 s to start (GUESS in the "
                  "script); compare the cases' elapsed_s")


# ---------------------------------------------------------------------------------------
# Plot


def plot(paths, png):
    """Microseconds against m per (shape, tp), one line per column, the floor dashed, log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(pathlib.Path(path).read_text()) for path in paths]
    results = [r for run in runs for r in run["results"]]
    if not results:
        raise SystemExit(f"--plot {' '.join(paths)}: no results in these files")
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    tps = sorted({r["tp"] for r in results})
    figure, axes = plt.subplots(len(shapes), len(tps), figsize=(max(5 * len(tps), 8), 4 * len(shapes)), squeeze=False)
    for row, shape in enumerate(shapes):
        for col, tp in enumerate(tps):
            axis = axes[row][col]
            cases = sorted((r for r in results if r["shape"] == shape and r["tp"] == tp), key=lambda r: r["m"])
            if not cases:
                axis.set_visible(False)
                continue
            without = []
            # Every column of these runs, --variants ones included, in the runs' order.
            for name in dict.fromkeys(name for r in cases for name in r["columns"] if name not in FLOOR_COLUMNS):
                timed = [r for r in cases if "us" in r["columns"].get(name, {})]
                if timed:
                    axis.plot([r["m"] for r in timed], [r["columns"][name]["us"] for r in timed], "o-",
                              markersize=3, label=name)
                elif any(name in r["columns"] for r in cases):
                    without.append(name)
            axis.plot([r["m"] for r in cases], [r["columns"]["floor"]["us"] for r in cases], "k--", label="floor")
            for floor, style in (("floor_fp8", "k:"), ("floor_shared", "k-.")):
                floor_cases = [r for r in cases if floor in r["columns"]]
                if floor_cases:
                    axis.plot([r["m"] for r in floor_cases], [r["columns"][floor]["us"] for r in floor_cases], style,
                              label=floor)
            axis.set_xscale("log", base=2)
            axis.set_xticks([r["m"] for r in cases], [str(r["m"]) for r in cases])
            axis.set_yscale("log")
            axis.set_xlabel("m (tokens)")
            axis.set_ylabel("µs per call")
            axis.set_title(f"{shape}, tp = {tp} (intermediate {cases[0]['intermediate']})", fontsize=9)
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=7)
            if without:
                axis.text(0.02, 0.02, "no figures: " + ", ".join(without), transform=axis.transAxes, fontsize=6)
    environment = runs[0]["environment"]
    figure.suptitle(f"routed experts of a decode batch: {environment['gpu']}, jax {environment['jax']}"
                    + (": CPU plumbing check, times meaningless" if environment["plumbing_check"] else ""))
    figure.tight_layout()
    figure.savefig(png, dpi=120)


# ---------------------------------------------------------------------------------------
# The run


def default_out(args, gpu):
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower().removeprefix("nvidia")).strip("-") or "device"
    name = (f"{datetime.date.today().isoformat()}-{slug}-moe-experts-{'-'.join(args.shapes)}"
            f"-tp{'-'.join(map(str, args.tp))}-m{args.m[0]}-{args.m[-1]}.json")
    return str(ROOT / "benchmarks" / "results" / name)


def ours_configs(args):
    """The `jmp.ExpertsConfig` of every selected column of ours at every selected shape and tp
    where the column runs: the op's default for the shape, its tiled twin for
    `jmp.prepare_experts`'s weights, e4m3 weights or tokens, the shared expert held."""
    configs = []
    for name in args.shapes:
        config = shape_config(args, name)
        for tp in args.tp:
            for column in selected_columns(args):
                if ours_runs_at(column, config, tp):
                    configs += [ours_config(config, tp, column, m) for m in args.m]
    return list(dict.fromkeys(configs))


def ours_runs_at(column, config, tp) -> bool:
    """Whether ``column`` is one of ours that runs at ``config``'s shard of ``tp``."""
    return (column.route == "ours" and (not column.fp8 or holds_fp8_blocks(config, tp))
            and not (column.shared and why_no_shared(column, config)))


def ours_config(config, tp, column, m):
    """The `jmp.ExpertsConfig` that ours' ``column`` loads at ``config``'s shard of ``tp`` for
    ``m`` tokens."""
    ours = jmp.ExpertsConfig.for_shape(hidden=config.hidden, intermediate=config.intermediate // tp,
                                       experts=config.experts, top_k=config.top_k, fp8_weights=column.fp8,
                                       fp8_tokens=column.fp8_tokens, shared_expert=column.shared == "held", m=m)
    if column.bulk:
        return ours.with_bulk_loads()
    return ours.replace(tiled_weights=column.prepared, **dict(column.changes))


def build_kernels_command(args):
    return (f"python benchmarks/bench_moe_experts.py --build-kernels DIR --shapes {' '.join(args.shapes)} "
            f"--tp {' '.join(map(str, args.tp))} --m {' '.join(map(str, args.m))}")


def read_bandwidth(args, device):
    """``(bytes per second, floors record)``: `floors.measure_floors` on GPUs; with --cpu a jitted
    ``x * 0.5`` of an 8 MiB array (the same kind of figure, meaningless)."""
    if not args.cpu:
        limits = floors.measure_floors([device], args.reps)
        return limits["copy"]["bytes_per_s"], limits
    tiny = jnp.zeros(floors.TINY_SHAPE, jnp.bfloat16)
    big = jnp.ones(CPU_COPY_SHAPE, jnp.bfloat16)
    # At least 3 runs each: the difference of two medians of one run can come out negative.
    rate = 2 * big.nbytes / floors.transfer_seconds(jax.jit(lambda x: x * 0.5), big, tiny, max(args.reps, 3))
    return rate, {"copy": {"bytes_per_s": rate, "array_bytes": big.nbytes,
                           "what": "a jitted x * 0.5 of an 8 MiB bf16 array on the CPU, bytes read + written"}}


def cudnn_version():
    """cuDNN's version as jaxlib loaded it (an int such as 92200; XLA's cuDNN ragged dot needs
    9.22), or None where this jaxlib has none or does not say."""
    try:
        # jaxlib's own record: no public API has it.
        from jax._src.lib import cuda_versions

        return cuda_versions.cudnn_get_version() if cuda_versions is not None else None
    except (ImportError, AttributeError, RuntimeError):
        return None


def print_case(r):
    cells = []
    # The columns in the run's order (--variants ones after the others), then the floors.
    names = [name for name in r["columns"] if name not in FLOOR_COLUMNS] + list(FLOOR_COLUMNS)
    for name in names:
        entry = r["columns"].get(name)
        if entry is not None:
            cells.append(f"{name} {entry['us']:.1f}" if "us" in entry else f"{name} -")
    estimated = f", estimated {r['estimate_s']:.0f} s" if "estimate_s" in r else ""
    print(f"{r['shape']} tp={r['tp']} m={r['m']} layers={r['layers']} active={r['active_experts']['mean']:.1f}: "
          + ", ".join(cells) + f"  ({r['elapsed_s']:.0f} s{estimated})", flush=True)


def main(argv=None):
    started = time.perf_counter()
    args = parse(argv)
    if args.plot:
        png = args.png or str(pathlib.Path(args.plot[0]).with_suffix(".png"))
        plot(args.plot, png)
        print(f"wrote {png}")
        return 0
    for name in args.shapes:
        for tp in args.tp:
            try:
                shape_config(args, name).check_tp(tp)
            except ValueError as error:
                raise SystemExit(f"--tp {tp}: {error}; expected a tp that divides the intermediate size") from None
    if args.build_kernels:
        kernel_builds.build_kernels(ours_configs(args), args.build_kernels)
        return 0
    columns = selected_columns(args)
    estimate = None if args.cpu else {"seconds": run_estimate_s(args, columns), "basis": ESTIMATE_BASIS}
    if estimate:
        print(f"estimated run time: {estimate['seconds'] / 60:.1f} min ({ESTIMATE_BASIS})", flush=True)
    if args.estimate:
        return 0
    rank_processes.refuse_timing("bench_moe_experts.py")
    if args.hlo:
        pathlib.Path(args.hlo).parent.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        jax.config.update("jax_platforms", "cpu")
        print("on the CPU at tiny dimensions, ours through impl='auto' (the reference path): a plumbing check, "
              "its times mean nothing", flush=True)
    elif any(column.route == "ours" for column in columns):
        kernel_builds.check_kernels(ours_configs(args), build_kernels_command(args))
    device = jax.devices()[0]
    bandwidth, floor_limits = read_bandwidth(args, device)
    print(f"read bandwidth for the floor: {bandwidth / 1e9:.0f} GB/s (a copy's bytes read + written per second)",
          flush=True)
    environment = records.machine_environment()
    out = args.out or default_out(args, environment["gpu"])
    results = []
    data = {"environment": {**environment, "platform": "cpu" if args.cpu else "gpu", "plumbing_check": args.cpu,
                            "ours_impl": args.ours_impl, "reps": args.reps, "rounds": args.rounds,
                            "target_ms": args.target_ms, "weight_budget_bytes": args.weight_budget_gb * 1e9,
                            "min_pass_bytes": args.min_pass_mb * 1e6, "min_layers": MIN_LAYERS, "seed": args.seed,
                            "cudnn_version": cudnn_version()},
            "columns": {column.name: {"what": column.what, "compiler_options": dict(column.compiler_options),
                                      "jax_flag": column.jax_flag} for column in columns},
            "floors": floor_limits,
            "floor": {"bytes_per_s": bandwidth,
                      "what": "the active experts' weight bytes over floors.copy.bytes_per_s, which counts a copy's "
                              "bytes read + written: a read-only stream moves its bytes at about that rate"},
            "estimate": estimate,
            "weights": [],
            "results": results}
    for name in args.shapes:
        config = shape_config(args, name)
        for tp in args.tp:
            most = budget_layers(args, config, tp)
            routings = {m: case_routing(args, config, tp, m, most) for m in args.m}
            layers = max(len(routing[0]) for routing in routings.values())
            print(f"{config.name} tp={tp}: {layers} layers of {layer_weight_bytes(config, tp) / 1e9:.3g} GB of weights",
                  flush=True)
            drawing = time.perf_counter()
            weights = jax.block_until_ready(draw_weights(args, config, tp, layers))
            data["weights"].append({"shape": config.name, "tp": tp, "layers": layers,
                                    "bytes": layers * layer_weight_bytes(config, tp) * weight_copies(args),
                                    "draw_s": time.perf_counter() - drawing, "since_start_s": drawing - started})
            for m in args.m:
                r = measure_case(args, config, tp, m, weights, routings[m], bandwidth, columns,
                                 None if results else args.hlo)
                results.append(r)
                print_case(r)
                # After every case, so that a run cut short keeps what it measured.
                records.write_json(data, out)
            del weights
    records.write_json(data, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
