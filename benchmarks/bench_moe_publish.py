"""Side-by-side timing of jax-moe-publish against XLA's finalize + psum, on the same GPUs in one run.

For every case one ``jit`` + ``shard_map`` runs a ``fori_loop`` whose body is a
chain of L = 32 layers, each layer with its own inputs (so XLA cannot merge
layers) and each layer's output fed into the next layer's shared-expert input,
as in a model. The inputs are the same in every iteration, so XLA hoists out
of the loop whatever reads nothing else: with the ties of the runs up to
``ac40515`` (the shared input, or without one the weights), the optimized HLO
on CPU ran every layer's gather of routed rows, and with a shared expert its
weighted sum, once before the loop. So each layer of the XLA path
takes its indices plus ``zero`` times a part of the previous ``y``, converted
to int32, with ``zero`` a runtime argument XLA cannot fold: every step of the
finalize then reads the loop carry. The part is ``y[:, :top_k]``, or at tp = 1
without a shared expert the sum of all of ``y``, where nothing else reads all
of it and XLA would compute only the columns that the tie reads (that sum can
cost XLA one read of ``y`` per layer); otherwise the tie costs ``m * top_k``
multiplies, conversions and integer adds per layer.
``tests/cpu/test_bench_moe_publish.py`` reads the optimized HLO on CPU: each
layer's gather, weighted sum and ``psum`` in the loop body, none before it.
Our kernels' custom call has side effects, so XLA can neither hoist nor merge
nor slice it and it needs no tie; ours on the reference path (``--cpu``) is
``jnp`` and is tied the same way:

* ``ours``: `moe_finalize_publish` (the kernels);
* ``xla``: the same finalize in ``jnp`` followed by ``lax.psum`` (tp > 1), or
  the ``jnp`` finalize alone, which XLA fuses (tp = 1). XLA's default: since
  jaxlib 0.10.1 a small ``psum`` runs XLA's own one-shot or two-shot kernel;
* ``xla_nccl`` (tp > 1): the same program compiled with XLA's collective
  kernels off (``xla_gpu_experimental_use_collective_kernels`` empty), so that
  its ``psum`` runs NCCL. Where the installed XLA does not know that option the
  column is left out and the JSON says why (``environment.xla_columns``).

Each XLA column records how its all-reduces ran, read from the optimized HLO
(``all_reduce``: the count per opcode and ``kernel_strategy``; ``default``
where XLA set none, which is NCCL on GPUs), and the fusion kernels of its loop
body per layer (``fusions_per_layer``): below 1, XLA fused layers together,
as it did at tp = 1 on one H200, where no ``psum`` separates them
(``benchmarks/README.md``); a model's GEMMs between the layers would stop
that, so such a figure favours XLA. ``ratio`` is ours over the faster XLA
column, which ``xla_best`` names: the median of the ratios of one repetition
each (below), ``paired_ratio`` has every column's with its spread.

With ``--epilogue`` every problem also runs as ``<problem>+rmsnorm``: each layer
adds its result to the residual stream and applies RMSNorm, ours fused into the
reduce (``residual=``, ``norm_weight=``), XLA's as ``psum`` then the ``jnp`` add
and RMSNorm in the same ``jit``; each layer's ``out`` feeds the next layer's
shared input and its ``residual_out`` the next layer's residual.

Time per call = ``(T(164 iterations) - T(36 iterations)) / (128 * 32)``: one
dispatch per run, so host dispatch cancels, and the loop's own cost per
iteration is spread over 32 calls. Every program runs once to warm up. Then
each of ``--reps`` repetitions runs ours' two programs and every XLA
column's back to back, the sides in turn, and every other repetition runs the
same sequence backwards (ours 36, ours 164, XLA 36, XLA 164; then XLA 164,
XLA 36, ours 164, ours 36), so that no side always runs first and a drift
linear in time cancels over two repetitions (`paired_estimates`). A side's
per-call estimate of a repetition is its long run less its short run: two
adjacent runs, so a fixed cost that moves between batches of runs cancels.
``us`` is the median of a side's estimates and ``p10``/``p90`` their 10th and
90th percentiles: one estimator, so ``p10 <= us <= p90``. The ratio of ours
over an XLA column is taken per repetition, from estimates of adjacent runs,
and ``ratio`` is the median of these ratios. Every run in
``benchmarks/results/`` predates this pairing: those up to ``ac40515`` took
``us`` from the median T of each program (63 of the 1234 figures of ours and
XLA's then in ``benchmarks/results/`` lie outside their own spread), and the
MoE block runs of 2026-12-01 paired the i-th fastest long run with the i-th
fastest short run, each side's runs timed in a batch of their own; in all of
them ``ratio`` is ours' ``us`` over XLA's. The counts are
128 iterations (4096 calls) apart: on 2x H200 a run of ours has a fixed cost
of 2 to 3 ms that moves between batches of runs, which over fewer calls reads
as a different time per call. In
``benchmarks/results/2026-11-30-h200x2-iteration-counts.json`` the estimate
from 4 and 36 iterations was off the one from 36 and 260 by -0.93 to
+0.58 us, while two rounds of the latter agreed within 0.16 us. The runs of
2026-11-30 before that used 4 and 36 iterations (and earlier 4 and 12); the
JSON records the iterations.

XLA's path still differs between separately compiled programs by up to 3 us
at small m (ours, with these counts, by under 0.25 us). ``--rounds R`` times ours,
XLA and every variant R times in turn, each round with freshly built
programs, and pools the rounds' estimates (and ratios) into each side's ``us``,
``p10`` and ``p90``, with every round's median in ``rounds_us``. The launch
variants of ``--configs`` are timed one after another, each paired by run
within itself.

Each case also gets a *floor* (`jax_moe_publish.traffic` states the byte model):
the slowest of its HBM bytes at the device copy bandwidth, its NVLink bytes at
the peer-to-peer copy bandwidth and one tiny dependent XLA kernel, all three
measured once per run, on the same GPUs. ``ours_over_floor`` is our time as a
multiple of it. At the end the results print as a Markdown table
(``benchmarks/report.py`` renders saved runs, merges them and plots them).

``--configs`` also times `tuning_variants` of our kernels per case and prints
the table it chose from. Every variant needs its cubin: build them where CuTe
DSL is with ``--build-kernels DIR`` (or print one build command per kernel
with ``--list-configs``), given the same ``--problems/--tp/--algorithms``.

``--cpu`` runs the same cases on 8 virtual CPU devices, ours through the
reference path: a check of the plumbing at every tp (its times mean nothing,
and it has no floors). With ``--layers 2 --iterations 2 6 --reps 3`` it takes
seconds per case.

    python benchmarks/bench_moe_publish.py --out results.json [--no-command-buffer] [--configs [M ...]]
    python benchmarks/bench_moe_publish.py --build-kernels kernels/ --tp 1 2
    python benchmarks/bench_moe_publish.py --cpu --tp 4 8 --m 3 --layers 2 --iterations 2 6 --reps 3 --out /tmp/cpu.json
"""

from __future__ import annotations

import argparse
import os
import sys


LAYERS = 32
SHORT, LONG = 36, 164  # loop iterations of the two timed programs (module docstring)
CPU_DEVICES = 8
# The XLA baselines: compile options of each (module docstring).
XLA_COLUMNS = {"xla": {}, "xla_nccl": {"xla_gpu_experimental_use_collective_kernels": ""}}

# Launch shapes that --configs tries; tuning_variants keeps the valid ones per case.
TUNING_GRID = {
    "threads": (128, 256),
    "elements_per_thread": (4, 8),
    "prefetch_group": (4, 8),
    "reduce_threads": (128, 256),
    "enable_pdl": (True, False),
    "fuse_reduce": (False, True),
    "keep_own_partial": (True, False),
    "waves": (1, 2),
}


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file for every figure (needed unless --list-configs or "
                                      "--build-kernels)")
    parser.add_argument("--problems", nargs="+", default=["deepseek-v3", "qwen3-moe"])
    parser.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--algorithms", nargs="+", default=["oneshot", "twoshot"], choices=["oneshot", "twoshot"],
                        help="all-reduce algorithms for tp > 1 (tp = 1 runs 'direct')")
    parser.add_argument("--epilogue", action="store_true",
                        help="also time each problem with the residual add + RMSNorm epilogue, as "
                             "case '<problem>+rmsnorm'")
    parser.add_argument("--xla-columns", nargs="+", default=list(XLA_COLUMNS), choices=list(XLA_COLUMNS),
                        help="the XLA baselines for tp > 1 (tp = 1 has no psum: 'xla' only)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=LAYERS, help="calls per loop iteration")
    parser.add_argument("--iterations", nargs=2, type=int, default=[SHORT, LONG], metavar=("FEW", "MANY"),
                        help="loop iterations of the two timed programs")
    parser.add_argument("--cpu", action="store_true",
                        help="on 8 virtual CPU devices, ours through the reference path: plumbing only")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time ours, XLA and every variant this many times in turn, each round with "
                             "freshly compiled programs; pool the rounds' estimates (and keep every "
                             "round's median)")
    parser.add_argument("--no-command-buffer", action="store_true",
                        help="turn XLA command buffers (CUDA graphs) off for this run")
    parser.add_argument("--hlo", help="write the optimized HLO of the first case's chains and of the "
                                      "empty-call chain to HLO.<name>.txt")
    parser.add_argument("--configs", nargs="*", type=int, metavar="M",
                        help="also time every launch variant of tuning_variants() for ours, at these m "
                             "(no value: at every m); costs GPU time and needs the variants' cubins")
    parser.add_argument("--tune-fields", nargs="+", choices=sorted(TUNING_GRID), default=sorted(TUNING_GRID),
                        help="the TUNING_GRID fields that --configs varies (default: all)")
    parser.add_argument("--list-configs", action="store_true",
                        help="print a build command for every kernel the cases (and their tuning "
                             "variants) need, then exit")
    parser.add_argument("--build-kernels", metavar="DIR",
                        help="compile every kernel the cases (and their tuning variants) need into DIR, "
                             "then exit; needs CuTe DSL, not a GPU")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: expected at least 1")
    if not 0 < args.iterations[0] < args.iterations[1]:
        parser.error(f"--iterations {' '.join(map(str, args.iterations))}: expected 0 < FEW < MANY")
    if args.out is None and not (args.list_configs or args.build_kernels):
        parser.error("--out is required to measure")
    return args


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.no_command_buffer:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
if ARGS is not None and ARGS.cpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CPU_DEVICES}"

import datetime  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_publish as jmp  # noqa: E402
import report  # noqa: E402
from jax_moe_publish import traffic, tuning  # noqa: E402  (benchmarks/ is on sys.path when this file runs as a script)
from jax_moe_publish.testing import rank_processes  # noqa: E402

PROBLEMS = {
    "deepseek-v3": dict(hidden=7168, top_k=8, shared=True, scale=2.5),
    "qwen3-moe": dict(hidden=4096, top_k=8, shared=False, scale=1.0),
}
EPILOGUE_SUFFIX = "+rmsnorm"
NORM_EPS = 1e-6
WEIGHT_BYTES = 4  # the chains pass float32 router weights
COPY_SHAPE = (2**15, 2**16)  # bf16: 4 GiB, far past any cache
P2P_SHAPE = (2**14, 2**15)  # bf16: 1 GiB
TINY_SHAPE = (8,)
EMPTY_CALL = "tiny dependent XLA kernel"


def problem_spec(name):
    """The problem of a case name: ``PROBLEMS[name]``, or for ``<problem>+rmsnorm`` that
    problem with ``epilogue`` set."""
    base = name.removesuffix(EPILOGUE_SUFFIX)
    return {**PROBLEMS[base], "epilogue": name != base}


def case_config(problem, tp, algorithm, m, fuse_reduce=None):
    """The `jmp.KernelConfig` of a case, as the op picks it from the tuning table, for
    ``algorithm`` (``direct`` exactly when tp = 1; there the op runs the epilogue in ``jnp``);
    ``fuse_reduce`` overrides the table's choice."""
    return spec_config(problem_spec(problem), tp, algorithm, m, fuse_reduce)


def spec_config(spec, tp, algorithm, m, fuse_reduce=None):
    """`case_config` of a problem given by its spec (a `problem_spec` value)."""
    problem = tuning.Problem(hidden=spec["hidden"], top_k=spec["top_k"], routed_scaling_factor=spec["scale"],
                             include_shared_expert=spec["shared"], fp32_weights=WEIGHT_BYTES == 4)
    return tuning.kernel_config(problem, tp=tp, m=m, epilogue="rmsnorm" if spec["epilogue"] and tp > 1 else "none",
                                algorithm=algorithm, fuse_reduce=fuse_reduce)


def tuning_variants(problem, tp, algorithm, m):
    """The launch shapes ``--configs`` times for one case: the default first, then the rest of
    TUNING_GRID over the ``--tune-fields``.

    Values a case cannot take are left out (``prefetch_group`` above top-k,
    ``elements_per_thread`` not dividing hidden, shapes a fused epilogue cannot
    have), and ``reduce_threads`` is not varied for ``direct``, which has no
    reduce kernel. ``fuse_reduce`` is not a grid axis: for oneshot it adds the
    default launch shape of the other choice.

    Returns
    -------
    list of `jmp.KernelConfig`, distinct, the default first.
    """
    base = case_config(problem, tp, algorithm, m)
    grid = {
        "threads": TUNING_GRID["threads"],
        "elements_per_thread": tuple(e for e in TUNING_GRID["elements_per_thread"] if base.hidden % e == 0),
        "prefetch_group": tuple(g for g in TUNING_GRID["prefetch_group"] if g <= base.top_k),
        "enable_pdl": TUNING_GRID["enable_pdl"],
    }
    if algorithm != "direct":
        grid["reduce_threads"] = TUNING_GRID["reduce_threads"]
    if base.fuse_reduce:
        grid["keep_own_partial"] = TUNING_GRID["keep_own_partial"]
        grid["waves"] = TUNING_GRID["waves"]
    grid = {field: values for field, values in grid.items() if field in ARGS.tune_fields}
    variants = []
    for values in itertools.product(*grid.values()):
        try:
            variants.append(base.replace(**dict(zip(grid, values))))
        except ValueError:
            continue
    if algorithm == "oneshot" and "fuse_reduce" in ARGS.tune_fields:
        variants.append(case_config(problem, tp, algorithm, m, fuse_reduce=not base.fuse_reduce))
    return list(dict.fromkeys([base, *variants]))


def case_problems():
    """The problem names of this run's cases: ``--problems``, and with ``--epilogue`` their
    ``+rmsnorm`` cases too."""
    return ARGS.problems + ([name + EPILOGUE_SUFFIX for name in ARGS.problems] if ARGS.epilogue else [])


def case_algorithms(tp):
    return ["direct"] if tp == 1 else ARGS.algorithms


def xla_columns(tp, columns=None):
    """The XLA baselines of a case among ``columns`` (default: this run's, less those refused):
    tp = 1 has no psum for NCCL to run."""
    if columns is None:
        columns = [c for c in ARGS.xla_columns if c not in XLA_UNAVAILABLE]
    return ["xla"] if tp == 1 else list(columns)


XLA_UNAVAILABLE: dict[str, str] = {}
"""The XLA columns this run left out, and why (`probe_xla_columns`)."""


def needed_configs(tp_sizes, with_variants):
    """Every kernel config the cases of this run use: the table's, plus their tuning variants if
    ``with_variants``."""
    configs = []
    for tp in tp_sizes:
        for name in case_problems():
            for algorithm in case_algorithms(tp):
                for m in ARGS.m:
                    configs += (tuning_variants(name, tp, algorithm, m) if with_variants
                                else [case_config(name, tp, algorithm, m)])
    return list(dict.fromkeys(configs))


def case_flags():
    """The command-line flags that choose the cases, to repeat in a build command."""
    return (f"--problems {' '.join(ARGS.problems)} --tp {' '.join(map(str, ARGS.tp))} "
            f"--algorithms {' '.join(ARGS.algorithms)}" + (" --epilogue" if ARGS.epilogue else ""))


def list_configs(configs):
    """Print one ``python -m jax_moe_publish.aot build`` command per config: a shell script."""
    from jax_moe_publish.aot.store import build_command

    print(f"# {len(configs)} kernel sets; or in one process: "
          f"python benchmarks/bench_moe_publish.py --build-kernels DIR {case_flags()}")
    for config in configs:
        print(build_command(config))


def build_kernels(configs, directory):
    """Compile ``configs`` into ``directory`` (needs CuTe DSL), skipping those built from these sources."""
    from jax_moe_publish.aot.artifact import KernelArtifact
    from jax_moe_publish.aot.compile import compile_config

    for index, config in enumerate(configs, 1):
        existing = KernelArtifact.load(directory, config.key)
        if existing is not None and existing.is_current:
            print(f"[{index}/{len(configs)}] {config.key}  already built", flush=True)
            continue
        start = time.perf_counter()
        compile_config(config).save(directory)
        print(f"[{index}/{len(configs)}] {config.key}  {time.perf_counter() - start:.1f} s", flush=True)
    print(f"{len(configs)} kernel sets in {directory}; point $JAX_MOE_PUBLISH_KERNEL_DIR at it")


def check_kernels(configs, build_hint):
    """Find every kernel before any timing, so that a missing cubin stops the run at once, not hours in.

    ``build_hint`` is the command that builds them all into a folder DIR."""
    from jax_moe_publish.aot.store import MissingKernelError, default_store

    missing = []
    for config in configs:
        try:
            default_store().get(config)
        except MissingKernelError:
            missing.append(config.key)
    if missing:
        named = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise SystemExit(
            f"{len(missing)} of {len(configs)} kernels missing ({named}). Where CuTe "
            f"DSL is, run: {build_hint}\n"
            f"and point $JAX_MOE_PUBLISH_KERNEL_DIR at DIR here."
        )


def xla_finalize(routed, weights, indices, shared, scale):
    """The finalize a JAX user writes: gather, float32 weighted sum, round to bf16."""
    valid = (indices >= 0) & (indices < routed.shape[0])
    rows = jnp.take(routed, jnp.where(valid, indices, 0), axis=0).astype(jnp.float32)
    w = jnp.where(valid, weights.astype(jnp.float32) * scale, 0.0)
    # HIGHEST: a float32 sum like ours; the default lets XLA use TF32 for the contraction.
    out = jnp.einsum("mk,mkh->mh", w, rows, precision=lax.Precision.HIGHEST)
    if shared is not None:
        out = out + shared.astype(jnp.float32)
    return out.astype(jnp.bfloat16)


def make_chain(impl, mailbox, problem, config, iterations, *, layers=LAYERS, op_impl="kernel"):
    """``iterations`` passes over a chain of ``layers`` calls, in one jitted program.

    ``impl`` is ``ours`` or an XLA column (`XLA_COLUMNS`). The loop carries ``y`` (the
    next shared input), and with the epilogue also the residual stream; the program
    returns the final ``y``. Each layer whose finalize is ``jnp`` (XLA's, and ours unless
    ``op_impl`` is ``kernel``) has its indices tied to the previous ``y`` (module
    docstring), so that no part of its finalize can leave the loop; our kernels' custom
    call has side effects and needs no tie. ``op_impl`` is the ``impl`` of ours
    (``reference`` where there are no GPUs, to check the plumbing).
    """
    scale, with_shared, epilogue = problem["scale"], problem["shared"], problem["epilogue"]

    def tied(indices, y, zero):
        """``indices`` plus ``int32(zero * part of y)`` (module docstring): without it XLA
        hoists the gather and the weighted sum, which read no loop carry, out of the loop (an
        optimization_barrier or a literal 0 * y did not stop it)."""
        if mailbox.tp == 1 and not with_shared:
            # Nothing else reads all of y: XLA would slice a layer down to what the tie reads.
            tie = jnp.sum(y, dtype=jnp.float32) * zero
        else:
            tie = y[:, : indices.shape[1]].astype(jnp.float32) * zero
        return indices + tie.astype(indices.dtype)

    def layer(args, carry, zero):
        routed, weights, indices, norm_weight = args
        y, residual = carry
        shared = y if with_shared else None
        norm = dict(residual=residual, norm_weight=norm_weight, norm_eps=NORM_EPS) if epilogue else {}
        if impl == "ours":
            if op_impl != "kernel":
                indices = tied(indices, y, zero)
            result = jmp.moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox,
                                              routed_scaling_factor=scale, impl=op_impl, config=config,
                                              **norm)
            return result if epilogue else (result, residual)
        out = xla_finalize(routed, weights, tied(indices, y, zero), shared, scale)
        out = lax.psum(out, "tp") if mailbox.tp > 1 else out
        if not epilogue:
            return out, residual
        # The add and RMSNorm as a JAX user writes them (the reference's rounding points).
        return jmp.reference.add_rmsnorm(out, residual, norm_weight, eps=NORM_EPS)

    def shard(routed, weights, indices, norm_weights, shared, residual, zero):
        def body(_, carry):
            for index in range(layers):
                args = (routed[index][0], weights[index][0], indices[index][0], norm_weights[index][0])
                carry = layer(args, carry, zero[0])
            return carry

        return lax.fori_loop(0, iterations, body, (shared[0], residual[0]))[0]

    # Without varying-axes types the loop carry's type need not track psum (and tp = 1,
    # where XLA's path has no psum).
    return jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=P("tp"), out_specs=P(),
                                 check_vma=False), compiler_options=XLA_COLUMNS.get(impl) or None)


def make_tiny_chain(iterations):
    """``iterations`` passes over LAYERS dependent one-op kernels on a tiny array: the cost of any call."""

    def body(_, y):
        for _ in range(LAYERS):
            # The barrier keeps XLA from fusing the chain into one kernel.
            y = lax.optimization_barrier(y + 1.0)
        return y

    return jax.jit(lambda y: lax.fori_loop(0, iterations, body, y))


def chain_inputs(mesh, m, problem, key, layers=LAYERS):
    """Per-layer lists of [tp, ...] arrays (routed, weights, indices, RMSNorm weights), the first
    shared input, the first residual (read only with the epilogue) and a runtime zero per rank
    (see `make_chain`)."""
    tp, hidden, top_k = mesh.shape["tp"], problem["hidden"], problem["top_k"]
    num_rows = m * top_k
    sharding = jax.sharding.NamedSharding(mesh, P("tp"))

    def put(x):
        return jax.device_put(x, sharding)

    routed, weights, indices, norm_weights = [], [], [], []
    for layer_key in jax.random.split(key, layers):
        keys = jax.random.split(layer_key, 4)
        routed.append(put(jax.random.normal(keys[0], (tp, num_rows, hidden), jnp.bfloat16)))
        weights.append(put(jax.random.uniform(keys[1], (tp, m, top_k), jnp.float32, 0.0, 0.25)))
        # Each token's experts are distinct rows, as after a routing permutation.
        order = jax.random.permutation(keys[2], num_rows).reshape(m, top_k).astype(jnp.int32)
        indices.append(put(jnp.broadcast_to(order, (tp, m, top_k))))
        # The same on every rank, as a model's replicated norm weight.
        gamma = 1.0 + 0.1 * jax.random.normal(keys[3], (hidden,), jnp.float32)
        norm_weights.append(put(jnp.broadcast_to(gamma.astype(jnp.bfloat16), (tp, hidden))))
    shared_key, residual_key = jax.random.split(key)
    shared = put(jax.random.normal(shared_key, (tp, m, hidden), jnp.bfloat16) * 0.1)
    # Replicated, as the residual stream of an all-reduce model.
    residual = put(jnp.broadcast_to(jax.random.normal(residual_key, (m, hidden), jnp.bfloat16), (tp, m, hidden)))
    return routed, weights, indices, norm_weights, shared, residual, put(jnp.zeros((tp,), jnp.float32))


_ALL_REDUCE = re.compile(r"\s(all-reduce(?:-start)?)\(")
_STRATEGY = re.compile(r'"kernel_strategy":\s*"(\w+)"')
_OPCODE = re.compile(r"=\s*\S+\s+([\w-]+)\(")


def all_reduce_implementations(hlo_text):
    """How the all-reduces of an optimized HLO module run: a count per ``opcode: strategy``.

    The strategy is the ``kernel_strategy`` of the instruction's collective backend config
    (XLA's one-shot or two-shot kernel), ``default`` where it sets none: the collectives
    library (NCCL on GPUs). Any other instruction that carries a strategy (a fusion) counts
    under its own opcode.
    """
    counts = {}
    for line in hlo_text.splitlines():
        all_reduce, strategy = _ALL_REDUCE.search(line), _STRATEGY.search(line)
        if not all_reduce and not strategy:
            continue
        if all_reduce:
            opcode = all_reduce.group(1)
        else:
            match = _OPCODE.search(line)
            opcode = match.group(1) if match else "?"
        name = strategy.group(1) if strategy and strategy.group(1) != "KERNEL_STRATEGY_DEFAULT" else "default"
        key = f"{opcode}: {name}"
        counts[key] = counts.get(key, 0) + 1
    return counts


# A computation opens on an unindented line ending in "{"; an instruction is "name = shape opcode(...)",
# where a tuple shape holds no "word(" and a "/*index=5*/" comment comes after the first "=".
_COMPUTATION = re.compile(r"^(?!HloModule\b)(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\b([a-z][\w\-]*)\(")
_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


def hlo_computations(hlo_text):
    """The computations of an HLO module's text: ``({name: [(opcode, line), ...]}, entry name)``."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instruction = _INSTRUCTION.match(line)
            if instruction:
                current.append((instruction.group(1), line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _called(line, computations):
    """The computations an instruction calls (fusion, reducer, loop body, branch...): every
    ``%name`` on its line that names a computation (instruction and computation names are
    distinct in a module)."""
    return [name for name in re.findall(r"%([\w.\-]+)", line) if name in computations]


def _instructions(computations, name, *, into_fusions=True, skip=None):
    """``(opcode, line)`` of every instruction of computation ``name`` and, once per call, of
    every computation it calls; with ``into_fusions`` False not those inside a fusion (its fused
    computation is one kernel), and nothing that the instruction line ``skip`` calls."""
    for opcode, line in computations[name]:
        yield opcode, line
        if line is skip or (opcode == "fusion" and not into_fusions):
            continue
        for callee in _called(line, computations):
            yield from _instructions(computations, callee, into_fusions=into_fusions, skip=skip)


def _opcode_counts(instructions):
    counts = {}
    for opcode, _ in instructions:
        counts[opcode] = counts.get(opcode, 0) + 1
    return counts


def _chain_loop(computations, entry):
    """The one ``while`` instruction of a module outside fusions (the chain's ``fori_loop``):
    ``(its line, its body's name)``, or None where there is not exactly one."""
    loops = [line for opcode, line in _instructions(computations, entry, into_fusions=False) if opcode == "while"]
    return (loops[0], _WHILE_BODY.search(loops[0]).group(1)) if len(loops) == 1 else None


def loop_body_opcodes(hlo_text):
    """Opcode counts of an optimized HLO module with one ``while`` loop (the chain's
    ``fori_loop``): ``(in the loop body, outside the loop)``, each with the computations called
    from there once per call, fusions included; the loop's condition counts in neither.
    Raises ValueError without exactly one loop."""
    computations, entry = hlo_computations(hlo_text)
    loop = _chain_loop(computations, entry)
    if loop is None:
        raise ValueError("expected exactly one while loop in the HLO module")
    line, body = loop
    return (_opcode_counts(_instructions(computations, body)),
            _opcode_counts(_instructions(computations, entry, skip=line)))


def loop_body_fusions(hlo_text):
    """The fusion kernels in the loop body of an optimized HLO module (as `loop_body_opcodes`),
    counted through calls (command buffers) but not inside fusions; None without exactly one
    ``while`` loop (XLA may unroll a short one)."""
    computations, entry = hlo_computations(hlo_text)
    loop = _chain_loop(computations, entry)
    if loop is None:
        return None
    return _opcode_counts(_instructions(computations, loop[1], into_fusions=False)).get("fusion", 0)


def probe_xla_columns(mesh, columns):
    """The XLA columns among ``columns`` whose compile options this XLA refuses, and why."""
    def psum(x):
        return lax.psum(x, "tp")

    x = jax.device_put(jnp.ones((mesh.shape["tp"], 8), jnp.bfloat16), jax.sharding.NamedSharding(mesh, P("tp")))
    refused = {}
    for column in columns:
        program = jax.jit(jax.shard_map(psum, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")),
                          compiler_options=XLA_COLUMNS[column] or None)
        try:
            program.lower(x).compile()
        except Exception as error:  # noqa: BLE001 - XLA raises its own types for an unknown option
            refused[column] = f"{type(error).__name__}: {error}".splitlines()[0]
            print(f"leaving out the {column} column: {refused[column]}", flush=True)
    return refused


def time_run(fn, args, clock=time.perf_counter):
    """Seconds of one run of ``fn(*args)``, to its result's readiness."""
    start = clock()
    fn(*args).block_until_ready()
    return clock() - start


def time_runs(fn, args, reps):
    """Seconds of each of ``reps`` runs of ``fn(*args)`` after a warm-up run."""
    fn(*args).block_until_ready()
    return np.array([time_run(fn, args) for _ in range(reps)])


def paired_estimates(sides, inputs, reps, layers=LAYERS, iterations=(SHORT, LONG), clock=time.perf_counter):
    """Per-call estimates in us of every side, paired by run (module docstring).

    ``sides[name][n]`` is a side's program of ``n`` loop iterations over ``layers`` calls, for
    the two counts of ``iterations``. Each program runs once to warm up. Then each of ``reps``
    repetitions runs every side's short and long program, the sides in turn, the whole
    sequence reversed in every other repetition (so that no side always runs first, and a
    drift linear in time cancels over two repetitions). A side's estimate of a repetition
    is its long run less its short run, over the calls between them: two adjacent runs, and
    the sides' estimates of one repetition come from adjacent runs too.

    Returns
    -------
    dict of name: float array of ``reps`` estimates, in repetition order.
    """
    few, many = iterations
    runs = [(name, n) for name in sides for n in (few, many)]
    for name, n in runs:
        sides[name][n](*inputs).block_until_ready()
    seconds = {run: np.empty(reps) for run in runs}
    for rep in range(reps):
        for name, n in (runs if rep % 2 == 0 else runs[::-1]):
            seconds[name, n][rep] = time_run(sides[name][n], inputs, clock)
    calls = (many - few) * layers
    return {name: (seconds[name, many] - seconds[name, few]) / calls * 1e6 for name in sides}


def call_estimates(programs, inputs, reps, layers=LAYERS, iterations=(SHORT, LONG)):
    """`paired_estimates` of one side, ``programs[n]``."""
    return paired_estimates({"programs": programs}, inputs, reps, layers, iterations)["programs"]


def summarize(rounds):
    """One side's figures from its rounds (`paired_estimates` results, each from its own
    programs), all of one estimator over the rounds' estimates pooled: ``us`` their
    median, ``p10`` and ``p90`` their 10th and 90th percentiles (so p10 <= us <= p90), and
    with several rounds each round's median (``rounds_us``)."""
    estimates = np.concatenate(rounds)
    result = {"us": float(np.median(estimates)), "p10": float(np.percentile(estimates, 10)),
              "p90": float(np.percentile(estimates, 90))}
    if len(rounds) > 1:
        result["rounds_us"] = [float(np.median(round_estimates)) for round_estimates in rounds]
    return result


def paired_ratio(ours_rounds, other_rounds):
    """Ours over another side, one ratio per repetition of the same round (their estimates
    from adjacent runs), pooled over the rounds: ``ratio`` the median, ``p10`` and ``p90``."""
    ratios = np.concatenate([ours / other for ours, other in zip(ours_rounds, other_rounds, strict=True)])
    return {"ratio": float(np.median(ratios)), "p10": float(np.percentile(ratios, 10)),
            "p90": float(np.percentile(ratios, 90))}


def per_call_us(programs, inputs, reps, layers=LAYERS):
    """`summarize` of one round of ``programs``."""
    return summarize([call_estimates(programs, inputs, reps, layers)])


def transfer_seconds(op, big, tiny, reps):
    """Median time of ``op(big)`` less that of ``op(tiny)``: the transfer without host dispatch and wait."""
    return float(np.median(time_runs(op, (big,), reps)) - np.median(time_runs(op, (tiny,), reps)))


def driver_copy_bytes_per_s(ordinal, nbytes, reps):
    """Device-to-device ``cuMemcpyDtoDAsync`` of ``nbytes`` on one GPU, timed with CUDA events;
    bytes read + written per second (the median)."""
    from cuda.bindings import driver

    from jax_moe_publish.memory.driver import check, primary_context

    with primary_context(ordinal):
        source = check(driver.cuMemAlloc(nbytes), "cuMemAlloc")
        target = check(driver.cuMemAlloc(nbytes), "cuMemAlloc")
        stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
        start = check(driver.cuEventCreate(0), "cuEventCreate")
        stop = check(driver.cuEventCreate(0), "cuEventCreate")
        try:
            elapsed = []
            for _ in range(reps + 1):  # the first copy warms up
                check(driver.cuEventRecord(start, stream), "cuEventRecord")
                check(driver.cuMemcpyDtoDAsync(target, source, nbytes, stream), "cuMemcpyDtoDAsync")
                check(driver.cuEventRecord(stop, stream), "cuEventRecord")
                check(driver.cuEventSynchronize(stop), "cuEventSynchronize")
                elapsed.append(check(driver.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / 1e3)
        finally:
            for event in (start, stop):
                check(driver.cuEventDestroy(event), "cuEventDestroy")
            check(driver.cuStreamDestroy(stream), "cuStreamDestroy")
            for address in (source, target):
                check(driver.cuMemFree(address), "cuMemFree")
    return 2 * nbytes / float(np.median(elapsed[1:]))


def xla_copy_bytes_per_s(device, reps):
    """Bytes read + written per second by a jitted ``x * 0.5`` of a 4 GiB bf16 array on
    ``device`` (a real multiply, so XLA must read and write every byte)."""
    tiny = jnp.zeros(TINY_SHAPE, jnp.bfloat16, device=device)
    big = jnp.ones(COPY_SHAPE, jnp.bfloat16, device=device)
    return 2 * big.nbytes / transfer_seconds(jax.jit(lambda x: x * 0.5), big, tiny, reps)


def measure_floors(gpus, reps):
    """The three limits every case's floor is made of, measured once on this run's GPUs.

    * ``copy``: a jitted ``x * 0.5`` of a 4 GiB bf16 array on GPU 0 (a real
      multiply, so XLA must read and write every byte), bytes read + written
      per second;
    * ``p2p``: ``jax.device_put`` of a 1 GiB array from GPU 0 to GPU 1 and
      back, bytes one way per second, the faster direction (None with one GPU);
    * ``empty_call``: per-call time of a chain of tiny dependent XLA kernels,
      timed like the cases.
    """
    first = gpus[0]
    tiny = jnp.zeros(TINY_SHAPE, jnp.bfloat16, device=first)
    xla_copy = xla_copy_bytes_per_s(first, reps)
    copy_bytes = int(np.prod(COPY_SHAPE)) * 2
    memcpy = driver_copy_bytes_per_s(first.local_hardware_id, copy_bytes, reps)
    # The floor takes the faster of the two: a memory-bound kernel can reach either.
    floors = {"copy": {"bytes_per_s": max(xla_copy, memcpy), "xla_kernel_bytes_per_s": xla_copy,
                       "memcpy_bytes_per_s": memcpy, "array_bytes": copy_bytes,
                       "what": "faster of a jitted x * 0.5 and cuMemcpyDtoDAsync on GPU 0, "
                               "bytes read + written"},
              "p2p": None}
    if len(gpus) > 1:
        second = gpus[1]
        forward_big = jnp.ones(P2P_SHAPE, jnp.bfloat16, device=first)
        backward_big = jnp.ones(P2P_SHAPE, jnp.bfloat16, device=second)
        forward = transfer_seconds(lambda x: jax.device_put(x, second), forward_big, tiny, reps)
        backward = transfer_seconds(lambda x: jax.device_put(x, first), backward_big,
                                    jax.device_put(tiny, second), reps)
        size = forward_big.nbytes
        floors["p2p"] = {"bytes_per_s": size / min(forward, backward), "forward_bytes_per_s": size / forward,
                         "backward_bytes_per_s": size / backward, "array_bytes": size,
                         "what": "jax.device_put GPU 0 -> GPU 1 and back, bytes one way, the faster"}
        del forward_big, backward_big
    programs = {n: make_tiny_chain(n) for n in (SHORT, LONG)}
    carry = jnp.zeros(TINY_SHAPE, jnp.float32, device=first)
    floors["empty_call"] = {**per_call_us(programs, (carry,), reps), "what": EMPTY_CALL}
    if ARGS.hlo:
        # To confirm that the chain stayed LAYERS separate kernels per iteration.
        with open(f"{ARGS.hlo}.empty_call.txt", "w") as f:
            f.write(programs[SHORT].lower(carry).compile().as_text())
    return floors


def time_variants(mailbox, problem, configs, inputs, reps, rounds=1):
    """Per-call time of ours under each config; ``configs[0]`` is the default, whose bits all must match."""
    timings = [[] for _ in configs]
    bits = []
    for round_index in range(rounds):
        for config, config_rounds in zip(configs, timings):
            programs = {n: make_chain("ours", mailbox, problem, config, n) for n in (SHORT, LONG)}
            if round_index == 0:
                bits.append(np.asarray(programs[SHORT](*inputs)).view(np.uint16))
            config_rounds.append(call_estimates(programs, inputs, reps))
    variants = []
    for config, config_rounds, config_bits in zip(configs, timings, bits):
        # Direct mode has no reduce kernel: its reduce_threads is not a choice.
        launch = {f: getattr(config, f) for f in TUNING_GRID
                  if f != "reduce_threads" or config.algorithm != "direct"}
        variants.append({"key": config.key, "launch": launch, **summarize(config_rounds),
                         "same_bits_as_default": bool(np.array_equal(config_bits, bits[0]))})
    return {"variants": variants, "best": min(range(len(variants)), key=lambda i: variants[i]["us"])}


def time_ours_and_xla(mailbox, problem, config, inputs, reps, what, *, layers=LAYERS, op_impl="kernel",
                      hlo=None, rounds=1, iterations=(SHORT, LONG), xla=("xla",)):
    """Per-call time of ours and of the ``xla`` columns (`make_chain`) on the same inputs, each
    XLA column's all-reduces (`all_reduce_implementations`) and fusion kernels per layer in its
    loop body (`loop_body_fusions` over ``layers``; None where XLA left no loop), and the
    relative difference of each column's output from ours (this process's copy), which must be
    at most 1e-2.

    Each round builds every side's programs afresh and times them interleaved
    (`paired_estimates`); ``paired_ratio`` holds, per XLA column, the median and spread of
    ours over it per repetition (`paired_ratio`).

    ``what`` names the case in the error; with ``hlo``, each path's optimized HLO goes to
    ``<hlo>.<impl>.txt`` unless that exists.
    """
    result, outputs, hlo_texts = {}, {}, {}
    timings = {impl: [] for impl in ("ours", *xla)}
    for round_index in range(rounds):
        programs = {}
        for impl in timings:
            counts = (1, *iterations) if round_index == 0 else iterations
            programs[impl] = {n: make_chain(impl, mailbox, problem, config, n, layers=layers, op_impl=op_impl)
                              for n in counts}
            if round_index == 0:
                outputs[impl] = np.asarray(programs[impl][1](*inputs).addressable_data(0), np.float64)
                hlo_texts[impl] = programs[impl][iterations[0]].lower(*inputs).compile().as_text()
                if hlo and not os.path.exists(f"{hlo}.{impl}.txt"):
                    with open(f"{hlo}.{impl}.txt", "w") as f:
                        f.write(hlo_texts[impl])
        for impl, estimates in paired_estimates(programs, inputs, reps, layers, iterations).items():
            timings[impl].append(estimates)
    for impl, impl_rounds in timings.items():
        result[impl] = summarize(impl_rounds)
    result["paired_ratio"] = {impl: paired_ratio(timings["ours"], timings[impl]) for impl in xla}
    result["relative_difference"] = {}
    for impl in xla:
        result[impl]["all_reduce"] = all_reduce_implementations(hlo_texts[impl])
        # Below 1, XLA fused layers together: a model's GEMMs between layers would stop that.
        fusions = loop_body_fusions(hlo_texts[impl])
        result[impl]["fusions_per_layer"] = None if fusions is None else fusions / layers
        # Both chains compute the same layers: their outputs must agree before their times count.
        difference = np.linalg.norm(outputs["ours"] - outputs[impl]) / np.linalg.norm(outputs[impl])
        result["relative_difference"][impl] = float(difference)
        if not difference <= 1e-2:
            raise RuntimeError(f"{what}: ours and {impl} differ by {difference:.2e} "
                               "(relative): the timings would compare different computations")
    return result


def measure_case(mesh, name, m, algorithm, reps, key, floors, tune):
    """One case: ours against every XLA column of its tp, its floor (None without ``floors``)."""
    problem = problem_spec(name)
    tp = mesh.shape["tp"]
    config = case_config(name, tp, algorithm, m)
    result = {"problem": name, "m": m, "tp": tp, "algorithm": algorithm}
    layers, iterations = ARGS.layers, tuple(ARGS.iterations)
    with jmp.Mailbox(mesh, "tp", hidden=problem["hidden"], capacity_m=m) as mailbox:
        inputs = chain_inputs(mesh, m, problem, key, layers)
        result.update(time_ours_and_xla(mailbox, problem, config, inputs, reps, f"{name} tp={tp} {algorithm} m={m}",
                                        layers=layers, op_impl="reference" if ARGS.cpu else "kernel",
                                        hlo=ARGS.hlo, rounds=ARGS.rounds, iterations=iterations,
                                        xla=xla_columns(tp)))
        if tune:
            result["tuning"] = time_variants(mailbox, problem, tuning_variants(name, tp, algorithm, m), inputs, reps,
                                             ARGS.rounds)
        mailbox.check()
    result["xla_best"] = min(xla_columns(tp), key=lambda column: result[column]["us"])
    result["ratio"] = result["paired_ratio"][result["xla_best"]]["ratio"]
    if floors is None:
        return result
    # The op's own traffic only.
    moved = traffic.bytes_per_rank(algorithm=algorithm, tp=tp, m=m, hidden=problem["hidden"],
                                   top_k=problem["top_k"], shared_expert=problem["shared"],
                                   weight_bytes=WEIGHT_BYTES, residual_norm=problem["epilogue"],
                                   own_slot=not config.keep_own_partial)
    result["floor"] = report.case_floor(moved, floors)
    result["ours_over_floor"] = result["ours"]["us"] / result["floor"]["us"]
    return result


def machine_environment():
    """Date, device kind, ``nvidia-smi``'s name and driver of each GPU (none without it), jax
    version and commit (``$JMP_COMMIT``, else git's HEAD)."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
    except FileNotFoundError:
        smi = []
    git = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    # The device machines get a copy of the tree without git history: pass JMP_COMMIT there.
    commit = os.environ.get("JMP_COMMIT") or (git.stdout.strip() if git.returncode == 0 else "")
    return {"date": datetime.date.today().isoformat(), "gpu": jax.devices()[0].device_kind, "gpus": smi,
            "jax": jax.__version__, "commit": commit or "unknown"}


def environment():
    return {**machine_environment(), "platform": "cpu" if ARGS.cpu else "gpu", "plumbing_check": ARGS.cpu,
            "command_buffer": not ARGS.no_command_buffer, "layers": ARGS.layers,
            "iterations": list(ARGS.iterations), "reps": ARGS.reps, "rounds": ARGS.rounds,
            "configs": ARGS.configs, "tune_fields": ARGS.tune_fields,
            "xla_columns": {column: XLA_UNAVAILABLE.get(column, "timed") for column in ARGS.xla_columns}}


def write_json(data, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".partial", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".partial", path)


def print_tuning(tuning):
    print(f"    {'launch variant of ours':72} {'us':>9}")
    for index, variant in enumerate(tuning["variants"]):
        notes = ["default"] if index == 0 else []
        notes += ["best"] if index == tuning["best"] else []
        notes += [] if variant.get("same_bits_as_default", True) else ["BITS DIFFER FROM DEFAULT"]
        print(f"    {report.format_launch(variant['launch']):72} {variant['us']:9.2f}  {' '.join(notes)}")


def main():
    rank_processes.refuse_timing("bench_moe_publish.py")
    if ARGS.list_configs or ARGS.build_kernels:
        configs = needed_configs(ARGS.tp, with_variants=True)
        if ARGS.list_configs:
            list_configs(configs)
        if ARGS.build_kernels:
            build_kernels(configs, ARGS.build_kernels)
        return 0
    platform = "cpu" if ARGS.cpu else "gpu"
    devices = [d for d in jax.devices() if d.platform == platform]
    tp_sizes = [tp for tp in ARGS.tp if tp <= len(devices)]
    for tp in sorted(set(ARGS.tp) - set(tp_sizes)):
        print(f"skipping tp={tp}: {len(devices)} {platform.upper()} device(s)")
    if not tp_sizes:
        raise SystemExit(f"no case can run: {len(devices)} {platform.upper()} device(s) for "
                         f"--tp {' '.join(map(str, ARGS.tp))}")
    if ARGS.cpu:
        floors = None
        print("on virtual CPU devices, ours through the reference path: a plumbing check, its times mean "
              "nothing", flush=True)
    else:
        check_kernels(needed_configs(tp_sizes, with_variants=ARGS.configs is not None),
                      f"python benchmarks/bench_moe_publish.py --build-kernels DIR {case_flags()}")
        floors = measure_floors(devices, ARGS.reps)
        p2p = floors["p2p"]
        print(f"floors: copy {floors['copy']['bytes_per_s'] / 1e9:.0f} GB/s (read + write), "
              + (f"peer copy {p2p['bytes_per_s'] / 1e9:.0f} GB/s (one way), " if p2p else "")
              + f"{EMPTY_CALL} {floors['empty_call']['us']:.2f} us", flush=True)
    if max(tp_sizes) > 1:
        XLA_UNAVAILABLE.update(probe_xla_columns(jax.sharding.Mesh(np.array(devices[:max(tp_sizes)]), ("tp",)),
                                                 ARGS.xla_columns))
    results = []
    data = {"environment": environment(), "floors": floors, "results": results}
    key = jax.random.key(0)
    print(f"{'problem':12} {'tp':>2} {'algorithm':9} {'m':>5} {'ours us':>9} {'xla us':>9} {'nccl us':>9} "
          f"{'ratio':>6} {'floor us':>9} {'bound':10} {'/floor':>6}")
    for tp in tp_sizes:
        mesh = jax.sharding.Mesh(np.array(devices[:tp]), ("tp",))
        for name in case_problems():
            for algorithm in case_algorithms(tp):
                for m in ARGS.m:
                    key, sub = jax.random.split(key)
                    tune = ARGS.configs is not None and (not ARGS.configs or m in ARGS.configs)
                    r = measure_case(mesh, name, m, algorithm, ARGS.reps, sub, floors, tune)
                    results.append(r)
                    nccl = f"{r['xla_nccl']['us']:9.2f}" if "xla_nccl" in r else f"{'-':>9}"
                    floor = (f"{r['floor']['us']:9.2f} {r['floor']['bound']:10} {r['ours_over_floor']:6.2f}"
                             if "floor" in r else f"{'-':>9} {'':10} {'-':>6}")
                    print(f"{name:12} {tp:>2} {algorithm:9} {m:>5} {r['ours']['us']:9.2f} {r['xla']['us']:9.2f} "
                          f"{nccl} {r['ratio']:6.3f} {floor}", flush=True)
                    if tune:
                        print_tuning(r["tuning"])
                    # After every case, so that a run cut short keeps what it measured.
                    write_json(data, ARGS.out)
    write_json(data, ARGS.out)
    print(f"wrote {ARGS.out}\n")
    print(report.render_markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
