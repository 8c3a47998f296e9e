"""Every route a JAX user has to the routed experts of a decode batch, timed side by side on one
GPU in one run, against the floor that the active experts' weight bytes set.

`jmp.moe_experts` computes one rank's shard of the routed experts (``intermediate = I / tp``):
for each pair ``p = t * top_k + k``, ``y[p] = bf16(bf16(silu(bf16(x[t] @ Wg[e])) *
bf16(x[t] @ Wu[e])) @ Wd[e])``. At decode a call needs only the weights of the experts that the
routing names, and reading them is most of its time. The columns, each its own compiled
program (`experts_columns.COLUMNS`):

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
model), its own routing and its own ``x`` (`experts_draws`), with enough layers that one pass
over the chain reads ``--min-pass-mb`` (200 MB, 4x L2) of active weights, at least 2, and at
most what ``--weight-budget-gb`` of weights allows (the JSON says where the budget cut the
layers). The routing is the model's router (`moe_block.route`: DeepSeek-V3's grouped sigmoid
with bias, Qwen3's softmax top-k) over a random router matrix and random ``x``, the same for
a layer and m at every tp. Each layer's ``x`` and ids are tied to the previous layer's output:
plus ``zero * (rows[0, 0] + shared[0, 0])``, ``zero`` a runtime argument, the output ``(rows,
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

``--cpu`` runs everything on the CPU at tiny dimensions (`experts_draws.CPU_DIMS`): a check of
the plumbing, its times mean nothing.

    python benchmarks/bench_moe_experts.py [--shapes ...] [--tp ...] [--m ...] [--columns ...] [--reps N]
        [--rounds R] [--target-ms T] [--weight-budget-gb G] [--min-pass-mb P] [--out JSON] [--hlo PREFIX]
    python benchmarks/bench_moe_experts.py --estimate --shapes qwen3-30b-a3b --tp 8
    python benchmarks/bench_moe_experts.py --build-kernels kernels/ --shapes deepseek-v3 --tp 1 2 4 8
    python benchmarks/bench_moe_experts.py --plot run1.json run2.json --png experts.png
    python benchmarks/bench_moe_experts.py --cpu --tp 1 2 --m 1 3 --reps 1 --out /tmp/experts.json
"""

from __future__ import annotations

import argparse
import datetime
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

import experts_columns
import experts_draws
import floors
import kernel_builds
import records
import timing

from jax_moe_publish import reference
from jax_moe_publish.experts_config import FP8_BLOCK
from jax_moe_publish.testing import rank_processes

ROOT = pathlib.Path(__file__).resolve().parent.parent

MS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_MS = (1, 2, 4)
MAX_DIFFERENCE = 1e-2
MAX_FP8_DIFFERENCE = 0.1
"""e4m3 operands against the unquantized ones: a 3-bit mantissa, about 4 % per value (relative, RMS)."""
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


def divides(config, tp: int) -> bool:
    try:
        config.check_tp(tp)
    except ValueError:
        return False
    return True


def parse(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shapes", nargs="+", default=["deepseek-v3"], choices=list(experts_draws.SHAPES))
    parser.add_argument("--tp", nargs="+", type=int, default=[8], help="the rank's intermediate is I / tp")
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_MS), help=f"tokens (the sweep: {MS})")
    parser.add_argument("--columns", nargs="+", default=list(experts_columns.COLUMN_NAMES),
                        choices=experts_columns.COLUMN_NAMES)
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
        args.variant_columns = [experts_columns.variant_column(text) for text in dict.fromkeys(args.variants)]
    except ValueError as error:
        parser.error(str(error))
    for name in args.shapes:
        config = experts_draws.shape_config(args, name)
        for tp in args.tp:
            if not args.variant_columns or not divides(config, tp):
                continue  # main refuses a tp that does not divide the shape
            for column, m in itertools.product(args.variant_columns, args.m):
                try:
                    experts_columns.ours_config(config, tp, column, m)  # ExpertsConfig checks each value
                except ValueError as error:
                    text = column.name.removeprefix(experts_columns.VARIANT_PREFIX) if column.prepared else (
                        experts_columns.ROWS_VARIANT + column.name.removeprefix(experts_columns.ROWS_VARIANT_PREFIX))
                    parser.error(f"--variants {text} at {name} tp={tp}: {error}")
    return args


# ---------------------------------------------------------------------------------------
# The columns' programs


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


def compile_column(column, args, layers, inputs):
    """``(compiled program, the call it runs)`` of ``column``; raises where it cannot be built."""
    impl = args.ours_impl if column.route == "ours" else column.route
    return (build(column, experts_columns.layer_function(column, args), layers, inputs),
            f"jmp.moe_experts(impl={impl!r})")


def build(column, layer_fn, layers, inputs):
    """The compiled chain of ``layer_fn`` with ``column``'s XLA options and JAX flag."""
    program = jax.jit(chain(layer_fn, layers), compiler_options=dict(column.compiler_options) or None)
    # The flag is part of JAX's trace context: it counts while tracing; the compiled program keeps it.
    with experts_columns.jax_flag(column.jax_flag):
        lowered = program.lower(*inputs, jnp.int32(1))
    return lowered.compile()


def one_line(error):
    """An exception as one line: its type and the start of its message."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:400]}"


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


def prepare_column(column, args, layers, inputs, entry, outputs, hlo_prefix):
    """Compile ``column`` and check it before it is timed: its optimized HLO shows what the
    column claims (`experts_columns.missing_evidence`), and its output of one pass (in pair
    order) agrees with that of the first column that ran. Records in ``entry`` the call it ran,
    its compile seconds, its kernels (`experts_columns.hlo_kernels`) and its loop counts
    (`loop_counts`); returns the program."""
    start = time.perf_counter()
    compiled, entry["ran"] = compile_column(column, args, layers, inputs)
    text = compiled.as_text()
    if hlo_prefix:
        pathlib.Path(f"{hlo_prefix}.{column.name}.txt").write_text(text)
    why_not = experts_columns.missing_evidence(column, text)
    if why_not:
        raise NotTimed(why_not)
    entry["compile_s"] = time.perf_counter() - start
    entry["hlo"] = experts_columns.hlo_kernels(text)
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
    # The first column that ran on the same operands (`experts_columns.operand_kind`); the first
    # of a kind against the first of the kind one quantization before (e4m3 weights against bf16,
    # e4m3 tokens against e4m3 weights alone), within that quantization's error.
    kind = experts_columns.operand_kind(column)
    against = next(name for name in outputs
                   if experts_columns.operand_kind(experts_columns.column_named(args, name)) == kind)
    bound = MAX_DIFFERENCE
    if column.name == against and kind > 0:
        against = next((name for name in outputs
                        if experts_columns.operand_kind(experts_columns.column_named(args, name)) == kind - 1),
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
    fp8_floor_us = mean_active * experts_draws.fp8_expert_bytes(config, tp) / bandwidth * 1e6
    shared_floor_us = floor_us + experts_draws.shared_expert_bytes(config, tp) / bandwidth * 1e6
    result = {"shape": config.name, "tp": tp, "hidden": hidden, "intermediate": config.intermediate // tp,
              "model_intermediate": config.intermediate, "experts": config.experts, "top_k": top_k, "m": m,
              "router": config.router, "layers": layers,
              "budget_layers": experts_draws.budget_layers(args, config, tp),
              "active_experts": {"per_layer": distinct, "mean": mean_active,
                                 "bitmask_per_layer": [experts_draws.active_bitmask(a, config.experts)
                                                       for a in active]},
              "expert_bytes": expert_bytes, "active_bytes_per_call": active_bytes,
              "pass_bytes": sum(distinct) * expert_bytes,
              "layer_weight_bytes": experts_draws.layer_weight_bytes(config, tp)}
    if not args.cpu:
        result["estimate_s"] = case_estimate_s(args, config, tp, m, layers, columns)
    # `experts_draws.case_routing` stops short of the pass bytes only at the budget's last layer.
    result["layers_cut_by_budget"] = layers < experts_draws.MIN_LAYERS or result["pass_bytes"] < args.min_pass_mb * 1e6
    figures = {column.name: {"what": column.what} for column in columns}
    timings, outputs = {}, {}
    for round_index in range(args.rounds):
        programs = {}
        for column in columns:
            entry = figures[column.name]
            if column.fp8 and not experts_draws.holds_fp8_blocks(config, tp):
                entry["why_not"] = (f"the rank's shard (hidden {hidden}, intermediate {config.intermediate // tp}) "
                                    f"holds no whole {FP8_BLOCK} x {FP8_BLOCK} blocks")
            if column.shared and experts_columns.why_no_shared(column, config):
                entry["why_not"] = experts_columns.why_no_shared(column, config)
            if "why_not" in entry:
                continue
            try:
                if round_index == 0:
                    if column.route == "ours" and not args.cpu:
                        # The kernel set the op loads here (its launch shapes depend on m).
                        entry["kernel_set"] = experts_columns.ours_config(config, tp, column, m).key
                    programs[column.name] = prepare_column(column, args, layers, inputs, entry, outputs,
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
        column = experts_columns.column_named(args, name)
        entry["floor_fraction"] = (fp8_floor_us if column.fp8 else shared_floor_us if column.shared
                                   else floor_us) / entry["us"]
        if "ours" in timings and name != "ours":
            entry["over_ours"] = timing.paired_ratio(column_rounds, timings["ours"])
    figures["floor"] = {"us": floor_us, "what": "the active experts' weight bytes at the measured HBM bandwidth",
                        "bytes": active_bytes, "bytes_per_s": bandwidth}
    if any(column.fp8 for column in columns):
        figures["floor_fp8"] = {"us": fp8_floor_us, "bytes": mean_active * experts_draws.fp8_expert_bytes(config, tp),
                                "bytes_per_s": bandwidth,
                                "what": "the active experts' e4m3 weights and scales at the measured HBM bandwidth"}
    if any(column.shared for column in columns) and config.shared:
        figures["floor_shared"] = {"us": shared_floor_us,
                                   "bytes": active_bytes + experts_draws.shared_expert_bytes(config, tp),
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
    call_s = max(experts_draws.layer_weight_bytes(config, tp) / GUESS["hbm_bytes_per_s"],
                 expanded_flops / GUESS["flops_per_s"])
    pair_s = max(args.target_ms / 1e3 * (1 + 2 * timing.SHORT / (timing.LONG - timing.SHORT)), 3 * layers * call_s)
    seconds = 0.0
    for column in columns:
        if experts_columns.known_unavailable(column):
            seconds += GUESS["unavailable_s"]
            continue
        # A --variants column compiles as the column it changes does.
        guess = GUESS["compile_s"][column.name if not column.changes else "ours_prepared" if column.prepared else "ours"]
        compile_s = guess + GUESS["compile_s_per_layer"] * layers
        seconds += args.rounds * (compile_s + (args.reps + 3) * pair_s)
    return seconds


def planned_layers(args, config, tp, m):
    """The layers `experts_draws.case_routing` will draw, from the expected distinct experts of
    uniform routing (the estimate does not draw the routing)."""
    expected = config.experts * (1 - (1 - config.top_k / config.experts) ** m)
    needed = math.ceil(args.min_pass_mb * 1e6 / (expected * config.expert_bytes(tp)))
    return min(max(experts_draws.MIN_LAYERS, needed), experts_draws.budget_layers(args, config, tp))


def run_estimate_s(args, columns):
    seconds = GUESS["start_s"]
    for name in args.shapes:
        config = experts_draws.shape_config(args, name)
        for tp in args.tp:
            layers = {m: planned_layers(args, config, tp, m) for m in args.m}
            seconds += (max(layers.values()) * experts_draws.layer_weight_bytes(config, tp) / 1e9
                        * GUESS["weights_s_per_gb"])
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
            for name in dict.fromkeys(name for r in cases for name in r["columns"]
                                      if name not in experts_columns.FLOOR_COLUMNS):
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
        config = experts_draws.shape_config(args, name)
        for tp in args.tp:
            for column in experts_columns.selected_columns(args):
                if ours_runs_at(column, config, tp):
                    configs += [experts_columns.ours_config(config, tp, column, m) for m in args.m]
    return list(dict.fromkeys(configs))


def ours_runs_at(column, config, tp) -> bool:
    """Whether ``column`` is one of ours that runs at ``config``'s shard of ``tp``."""
    return (column.route == "ours" and (not column.fp8 or experts_draws.holds_fp8_blocks(config, tp))
            and not (column.shared and experts_columns.why_no_shared(column, config)))


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
    names = ([name for name in r["columns"] if name not in experts_columns.FLOOR_COLUMNS]
             + list(experts_columns.FLOOR_COLUMNS))
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
                experts_draws.shape_config(args, name).check_tp(tp)
            except ValueError as error:
                raise SystemExit(f"--tp {tp}: {error}; expected a tp that divides the intermediate size") from None
    if args.build_kernels:
        kernel_builds.build_kernels(ours_configs(args), args.build_kernels)
        return 0
    columns = experts_columns.selected_columns(args)
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
                            "min_pass_bytes": args.min_pass_mb * 1e6, "min_layers": experts_draws.MIN_LAYERS,
                            "seed": args.seed, "cudnn_version": cudnn_version()},
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
        config = experts_draws.shape_config(args, name)
        for tp in args.tp:
            most = experts_draws.budget_layers(args, config, tp)
            routings = {m: experts_draws.case_routing(args, config, tp, m, most) for m in args.m}
            layers = max(len(routing[0]) for routing in routings.values())
            print(f"{config.name} tp={tp}: {layers} layers of "
                  f"{experts_draws.layer_weight_bytes(config, tp) / 1e9:.3g} GB of weights", flush=True)
            drawing = time.perf_counter()
            weights = jax.block_until_ready(experts_draws.draw_weights(args, config, tp, layers))
            data["weights"].append({"shape": config.name, "tp": tp, "layers": layers,
                                    "bytes": (layers * experts_draws.layer_weight_bytes(config, tp)
                                              * experts_draws.weight_copies(args)),
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
