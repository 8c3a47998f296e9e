"""Decode-step time of a stack of MoE blocks (`examples/moe_block.py`), our finalize against
XLA's, with both GEMM paths, side by side on the same GPUs in one run.

For every problem (DeepSeek-V3, Qwen3-30B-A3B at their own dimensions, ``--experts``
scaling the expert count down), m and GEMM path (``ragged``: `jax.lax.ragged_dot`;
``decode``: only the active experts' weights), one ``jit`` + ``shard_map`` over tp = every
local GPU runs a ``fori_loop`` whose body is one decode step through ``--layers`` layers,
each with its own weights, each layer's ``out`` and ``residual_out`` feeding the next.
Two sides:

* ``ours``: the block with `moe_finalize_publish` and its residual + RMSNorm epilogue, through
  our kernels (``impl="kernel"``; on CPU the reference path): never ``impl="auto"``, which
  hands a call to XLA's ``jnp`` path where the algorithm table says ``xla`` (tp = 1, m = 1,
  with a shared expert);
* ``xla``: the same block with the ``jnp`` finalize, ``lax.psum`` and the ``jnp`` add +
  RMSNorm (`jmp.reference.add_rmsnorm`), as a JAX user writes it.

and two more programs per side:

* ``no_gemm``: the same block with the MoE GEMMs (routed and shared, and the decode
  path's weight gather) replaced by stand-ins of their shapes, behind an
  ``optimization_barrier``, so that XLA materializes them as it does a GEMM's output and
  can neither fold them into the finalize nor hoist them (``x`` changes every layer): for
  the ``ragged`` path the token rows of ``x`` sorted by expert (``no_gemm_sorted``), for
  the others, whose rows are in (token, k) order, ``x``'s rows repeated top_k times
  (``no_gemm_pairs``); and ``x`` itself for the shared expert. Its step is the router,
  the ``ragged`` path's sort, the finalize + reduce, the epilogue and the loop's own cost;
* ``op``: the finalize + reduce + epilogue alone at the same m and tp
  (`chains.make_chain`, its 32 chained calls per iteration, both sides'
  finalize kept in the timed loop: XLA's tied to the loop carry, ours our kernels' custom
  call, or on CPU the reference path tied like XLA's): what the op saves by itself.

Time per step = ``(T(MANY iterations) - T(FEW)) / (MANY - FEW)``, one program per count,
so that host dispatch cancels, ours and XLA's programs timed interleaved and paired by run
(`timing.paired_estimates`, ``--reps`` repetitions after a warm-up): each
estimate is one run less the adjacent one. Before timing, a one-layer program of each
side and variant runs on the same inputs: ours and XLA's outputs must agree (relative
difference at most 1e-2). The environment records our side's ``op_impl``. Per (problem,
m, path) the JSON has:

* ``step_us``: each side's full and ``no_gemm`` step (median, p10, p90); ``no_gemm``:
  which stand-in the path's ``no_gemm`` step is;
* ``saved_us_per_layer`` = (xla − ours) / layers, and ``saved_share`` = (xla − ours) / xla;
* ``op``: ours and XLA per call alone, ``op_saved_us``, and ``saved_over_op`` =
  ``saved_us_per_layer / op_saved_us`` (the goal: at least 0.9); ``never_slower``;
* ``no_gemm_share``: each side's ``no_gemm`` step over its full step, the share of the
  step outside the MoE GEMMs (finalize + reduce, router, sort, epilogue, loop);
  ``gemm_us_per_layer``: (full − ``no_gemm``) / layers;
* ``weights``: bytes of expert weights per layer and rank that the path reads (a byte
  model: ``ragged_dot`` about every expert's weights, the decode path's gather three
  times its slots, see `jax_moe_publish.experts_gather`) and the least any path must read
  (the experts a layer's router picks, plus the shared expert): ``active_experts`` is their
  mean over the layers and the steps the estimate times (steps FEW to MANY - 1 of the
  loop, each routing its own input, the previous step's output: `timed_active_experts`);
  on GPUs their time at the copy
  bandwidth measured in the run (``read_us``, ``least_us``) and ``gemm_over_read_us``, the
  GEMMs' time over their reads' (near 1: the weight reads set it); ``dominant``: the larger
  of the GEMMs and the rest. The weights of a layer (``problems``) are stated per rank.

``--cpu`` runs the same on 8 virtual CPU devices (``--tp`` fewer), the finalize on the
reference path, at small dimensions: a check of the plumbing, its times mean nothing.
``--plot`` writes a PNG (matplotlib, imported only then).

    python benchmarks/bench_moe_block.py --out results.json --plot results.png [--problems ...] [--m 1 8 ...]
        [--layers 3] [--experts N] [--iterations FEW MANY] [--reps N] [--paths ragged decode]
    python benchmarks/bench_moe_block.py --build-kernels kernels/   # the op's kernels of these cases (CuTe DSL)
    python benchmarks/bench_moe_block.py --cpu --m 2 --layers 2 --iterations 1 3 --reps 2 --out /tmp/block.json
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CPU_DEVICES = 8
DEFAULT_MS = (1, 8, 32, 64, 128)
# The weights of the default 3 layers fit one H200 at tp = 1 (DeepSeek-V3: 67.9 GB of 141 GB).
DEFAULT_LAYERS = 3
# Loop iterations of the two timed programs: 128 steps apart, as bench_moe_publish's counts
# (benchmarks/README.md: a run's fixed cost moves between runs by up to about 0.5 ms).
FEW, MANY = 36, 164
# --cpu: the plumbing at dimensions that split over 8 ranks.
CPU_DIMS = dict(hidden=64, intermediate=64, experts=16, shared_intermediate=64)
MAX_DIFFERENCE = 1e-2
OP_IMPLS = {"gpu": "kernel", "cpu": "reference"}
"""Our side's ``impl`` by platform: our kernels where they run, never ``auto`` (module docstring)."""
PATHS = ("ragged", "decode", "ours", "prepared")
"""`moe_block.PATHS`, named before the flags are parsed, which is before JAX (and so the
example) may be imported."""


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file of every figure (needed unless --build-kernels)")
    parser.add_argument("--plot", help="PNG of the µs saved per layer and the step times")
    parser.add_argument("--problems", nargs="+", default=["deepseek-v3", "qwen3-moe"],
                        choices=["deepseek-v3", "qwen3-moe"])
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_MS))
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="layers of the stack, each its own weights")
    parser.add_argument("--experts", type=int, help="scale every problem's expert count down to this")
    parser.add_argument("--tp", type=int, help="ranks (default: every local GPU, or the 8 CPU devices; "
                                               "with --build-kernels on a machine without GPUs, required)")
    parser.add_argument("--iterations", nargs=2, type=int, default=[FEW, MANY], metavar=("FEW", "MANY"))
    parser.add_argument("--op-layers", type=int, default=None,
                        help="chained calls per iteration of the op-alone programs (default: bench_moe_publish's 32)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help=f"on {CPU_DEVICES} virtual CPU devices, the reference "
                                                           "path, small dimensions: plumbing only")
    parser.add_argument("--build-kernels", metavar="DIR", help="compile the op's kernels of these cases into DIR "
                                                               "(CuTe DSL, no GPU needed), then exit")
    args = parser.parse_args()
    if not 0 < args.iterations[0] < args.iterations[1]:
        parser.error(f"--iterations {' '.join(map(str, args.iterations))}: expected 0 < FEW < MANY")
    if args.layers < 1 or args.reps < 1 or min(args.m) < 1:
        parser.error("--layers, --reps and every --m must be >= 1")
    if args.out is None and not args.build_kernels:
        parser.error("--out is required to measure")
    return args


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.cpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CPU_DEVICES}"

sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import chains  # noqa: E402
import floors  # noqa: E402
import jax_moe_publish as jmp  # noqa: E402
from jax_moe_publish import experts_gather  # noqa: E402
from jax_moe_publish.testing import rank_processes  # noqa: E402
import kernel_builds  # noqa: E402
import moe_block as mb  # noqa: E402
import records  # noqa: E402
import timing  # noqa: E402


def problem_config(name):
    dims = dict(CPU_DIMS) if ARGS.cpu else {}
    if ARGS.experts:
        dims["experts"] = ARGS.experts
    return mb.scaled(mb.PROBLEMS[name], **dims)


def op_spec(config):
    """The op's problem as a `chains.problem_spec` value, with the epilogue."""
    return dict(hidden=config.hidden, top_k=config.top_k, shared=config.shared,
                scale=config.routed_scaling_factor, epilogue=True)


NO_GEMM = {"ragged": "no_gemm_sorted", "decode": "no_gemm_pairs", "ours": "no_gemm_pairs",
           "prepared": "no_gemm_pairs"}
"""Each GEMM path's ``no_gemm`` stand-in (module docstring)."""


def no_gemm_layer(config, finalize, mailbox, impl, sorted_rows: bool):
    """One layer on one shard with the MoE GEMMs replaced by stand-ins (module docstring):
    the rows sorted by expert, as the ``ragged`` path's, or in (token, k) order."""

    def layer(params, x, residual):
        experts, weights = mb.route(config, params, x)
        if sorted_rows:
            order, permuted_indices, _ = mb.sort_by_expert(experts, config.experts)
            rows = x[order // config.top_k]
        else:
            rows = jnp.repeat(x, config.top_k, axis=0)
            permuted_indices = mb.pair_order_indices(experts)
        # Each rank's stand-in partials, marked as such (the same on every rank).
        stand_ins = (rows, x)
        rows, shared = lax.optimization_barrier(tuple(lax.pcast(a, mb.TP, to="varying") for a in stand_ins))
        parts = (rows, weights, permuted_indices, shared if config.shared else None)
        return mb.finalize_layer(config, params, parts, residual, finalize=finalize, mailbox=mailbox, impl=impl)

    return layer


def layer_fn(config, variant, finalize, mailbox, impl):
    """One layer of ``variant`` (a GEMM path or a `NO_GEMM` stand-in) on one shard; ``impl``: ours' op impl."""
    if variant in NO_GEMM.values():
        return no_gemm_layer(config, finalize, mailbox, impl, sorted_rows=variant == NO_GEMM["ragged"])
    return functools.partial(mb.moe_layer, config, path=variant, finalize=finalize, mailbox=mailbox, impl=impl)


def op_impl():
    """Our side's ``impl`` on this run's platform (`OP_IMPLS`)."""
    return OP_IMPLS["cpu" if ARGS.cpu else "gpu"]


def step_us(config, mesh, mailbox, variant, inputs, layers):
    """`timing.summarize` of one round of per-step estimates of ``variant``'s stack,
    per side, the sides timed interleaved."""
    few, many = ARGS.iterations
    programs = {}
    for side in mb.FINALIZES:
        fn = layer_fn(config, variant, side, mailbox, op_impl())
        # The timing helpers wait for one array: the final out, which the residual stream feeds.
        programs[side] = {n: jax.jit(lambda *a, n=n, fn=fn: mb.make_decode(config, mesh, fn, layers, steps=n)(*a)[0])
                          for n in (few, many)}
    estimates = timing.paired_estimates(programs, inputs, ARGS.reps, 1, (few, many))
    return {side: timing.summarize([estimates[side]]) for side in mb.FINALIZES}


def check_outputs(config, mesh, mailbox, params, x, residual, variants):
    """Relative differences of one layer's ``out``, ours against XLA's, per variant (and
    between the GEMM paths); raises where they exceed MAX_DIFFERENCE."""
    outs = {}
    for variant in variants:
        for finalize in mb.FINALIZES:
            program = mb.make_decode(config, mesh, layer_fn(config, variant, finalize, mailbox, op_impl()), 1)
            out, _ = jax.block_until_ready(program(params[:1], x, residual))
            outs[variant, finalize] = np.asarray(out.addressable_data(0), np.float64)

    def difference(a, b):
        return float(np.linalg.norm(outs[a] - outs[b]) / np.linalg.norm(outs[b]))

    result = {variant: difference((variant, "ours"), (variant, "xla")) for variant in variants}
    paths = [v for v in variants if v in mb.PATHS]
    for path in paths[1:]:
        result[f"{path}_vs_{paths[0]}"] = difference((path, "ours"), (paths[0], "ours"))
    for what, value in result.items():
        if not value <= MAX_DIFFERENCE:
            raise RuntimeError(f"{config.name}: {what}: relative difference {value:.2e}: the sides would time "
                               "different computations")
    return result


def op_programs(mailbox, config, layers, counts, impl):
    """The op-alone chains of both sides (`chains.make_chain`), ``{side: {n: program}}``
    for each ``n`` in ``counts``, ours through ``impl``."""
    spec = op_spec(config)
    return {side: {n: chains.make_chain(side, mailbox, spec, None, n, layers=layers, op_impl=impl) for n in counts}
            for side in mb.FINALIZES}


def op_alone(mailbox, mesh, config, m, key):
    """Per-call time of the op alone, ours and XLA's, in `chains`' chains, timed interleaved."""
    iterations = tuple(ARGS.iterations)
    layers = ARGS.op_layers or timing.LAYERS
    inputs = chains.chain_inputs(mesh, m, op_spec(config), key, layers)
    programs = op_programs(mailbox, config, layers, iterations, op_impl())
    estimates = timing.paired_estimates(programs, inputs, ARGS.reps, layers, iterations)
    result = {"layers": layers, **{side: timing.summarize([estimates[side]]) for side in mb.FINALIZES}}
    result["saved_us"] = result["xla"]["us"] - result["ours"]["us"]
    return result


def timed_active_experts(config, mesh, mailbox, path, inputs):
    """The mean number of distinct experts a layer's router picks in the steps the estimate
    times (`step_us`: MANY less FEW steps from the same inputs, so steps FEW to MANY - 1 of
    one run of MANY), on ``path`` with our finalize."""
    fn = layer_fn(config, path, "ours", mailbox, op_impl())
    few, many = ARGS.iterations

    def shard(params, x, residual):
        def step(index, carry):
            x, residual, picked = carry
            for layer in params:
                layer = mb.local_params(config, layer)
                experts, _ = mb.route(config, layer, x)
                distinct = jnp.zeros((config.experts,), jnp.int32).at[experts.reshape(-1)].set(1).sum()
                picked += jnp.where(index >= few, distinct, 0)
                x, residual = fn(layer, x, residual)
            return x, residual, picked

        return lax.fori_loop(0, many, step, (x, residual, jnp.int32(0)))[2]

    params = inputs[0]
    specs = ([mb.layer_specs(config, layer) for layer in params], P(), P())
    picked = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=specs, out_specs=P()))(*inputs)
    return int(picked) / ((many - few) * len(params))


def weight_bytes(config, tp, m, active, path):
    """(bytes of expert weights a layer reads on each rank by the byte model, the least any path reads)."""
    expert = config.expert_bytes(tp)
    shared = config.shared_bytes(tp)
    least = active * expert + shared
    if path == "ragged":
        return config.experts * expert + shared, least
    if path in ("ours", "prepared"):  # each active expert once (per 16 of its tokens: one pass at decode)
        return least, least
    slots, gathered = experts_gather.gather_slots(m, config.top_k, config.experts)
    return (experts_gather.GATHER_TRAFFIC * slots if gathered else config.experts) * expert + shared, least


def measure_case(config, mesh, mailbox, params, m, key, copy_rate):
    """Every figure of one (problem, m): a list of one result per GEMM path."""
    layers, tp = ARGS.layers, mesh.shape[mb.TP]
    input_key, op_key = jax.random.split(key)
    x, residual = mb.init_inputs(input_key, config, mesh, m)
    inputs = (params, x, residual)
    stand_ins = list(dict.fromkeys(NO_GEMM[path] for path in ARGS.paths))
    differences = check_outputs(config, mesh, mailbox, params, x, residual, [*ARGS.paths, *stand_ins])
    no_gemms = {stand_in: step_us(config, mesh, mailbox, stand_in, inputs, layers) for stand_in in stand_ins}
    op = op_alone(mailbox, mesh, config, m, op_key)
    results = []
    for path in ARGS.paths:
        full = step_us(config, mesh, mailbox, path, inputs, layers)
        no_gemm = no_gemms[NO_GEMM[path]]
        saved = full["xla"]["us"] - full["ours"]["us"]
        gemm = {side: (full[side]["us"] - no_gemm[side]["us"]) / layers for side in mb.FINALIZES}
        active = timed_active_experts(config, mesh, mailbox, path, inputs)
        reads, least = weight_bytes(config, tp, m, active, path)
        weights = {"read_bytes": reads, "least_bytes": least, "active_experts": active, "experts": config.experts}
        if copy_rate:
            weights.update(read_us=reads / copy_rate * 1e6, least_us=least / copy_rate * 1e6)
            # Near 1: the GEMMs run at the speed of their weight reads.
            weights["gemm_over_read_us"] = gemm["ours"] / weights["read_us"]
        rest = no_gemm["ours"]["us"] / layers
        results.append({
            "problem": config.name, "tp": tp, "m": m, "path": path, "layers": layers,
            "step_us": {"ours": full["ours"], "xla": full["xla"],
                        "ours_no_gemm": no_gemm["ours"], "xla_no_gemm": no_gemm["xla"]},
            "no_gemm": NO_GEMM[path],
            "saved_us_per_layer": saved / layers, "saved_share": saved / full["xla"]["us"],
            "never_slower": full["ours"]["us"] <= full["xla"]["us"],
            "op": op, "op_saved_us": op["saved_us"],
            "saved_over_op": (saved / layers) / op["saved_us"] if op["saved_us"] > 0 else None,
            "no_gemm_share": {side: no_gemm[side]["us"] / full[side]["us"] for side in mb.FINALIZES},
            "gemm_us_per_layer": gemm,
            "weights": weights,
            "dominant": "MoE GEMMs" if gemm["ours"] > rest else "router, finalize + reduce, epilogue",
            "relative_difference": differences,
        })
    return results


def experts_config(config, tp: int, m: int, prepared: bool):
    """The experts op's config of the rank's expert shard at ``m`` (prepared weights:
    ``tiled_weights``, and the shared expert held where `moe_block.holds_shared`)."""
    ours = jmp.ExpertsConfig.for_shape(hidden=config.hidden, intermediate=config.intermediate // tp,
                                       experts=config.experts, top_k=config.top_k, m=m,
                                       shared_expert=prepared and mb.holds_shared(config))
    return ours.replace(tiled_weights=prepared)


def kernel_configs(configs, tp):
    """The kernel configs of every case: the finalize op's (the tuning table's choice for the
    kernels) and, for the ``ours`` and ``prepared`` paths, the experts op's own
    (`experts_config`) at each m."""
    finalize = [chains.spec_config(op_spec(config), tp, None, m) for config in configs for m in ARGS.m]
    chosen = [experts_config(config, tp, m, path == "prepared") for path in ("ours", "prepared")
              if path in ARGS.paths for config in configs for m in ARGS.m]
    return list(dict.fromkeys(finalize + chosen))


def print_table(results):
    print(f"{'problem':12} {'tp':>2} {'path':7} {'m':>4} {'ours us':>9} {'xla us':>9} {'saved/layer':>11} "
          f"{'op saved':>8} {'/op':>5} {'saved %':>7} {'no-GEMM % ours/xla':>18}  dominant")
    for r in results:
        ratio = f"{r['saved_over_op']:5.2f}" if r["saved_over_op"] is not None else f"{'-':>5}"
        shares = f"{r['no_gemm_share']['ours']:.0%} / {r['no_gemm_share']['xla']:.0%}"
        print(f"{r['problem']:12} {r['tp']:>2} {r['path']:7} {r['m']:>4} {r['step_us']['ours']['us']:9.1f} "
              f"{r['step_us']['xla']['us']:9.1f} {r['saved_us_per_layer']:11.2f} {r['op_saved_us']:8.2f} {ratio} "
              f"{r['saved_share']:7.1%} {shares:>18}  {r['dominant']}", flush=True)


def plot(results, path, note):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(dict.fromkeys(r["problem"] for r in results))
    figure, axes = plt.subplots(2, len(problems), figsize=(6 * len(problems), 8), squeeze=False)
    for column, problem in enumerate(problems):
        rows = [r for r in results if r["problem"] == problem]
        saved, steps = axes[0][column], axes[1][column]
        for gemm_path in dict.fromkeys(r["path"] for r in rows):
            picked = [r for r in rows if r["path"] == gemm_path]
            ms = [r["m"] for r in picked]
            saved.plot(ms, [r["saved_us_per_layer"] for r in picked], "o-", label=f"block, {gemm_path}")
            for side, style in (("ours", "o-"), ("xla", "s--")):
                steps.plot(ms, [r["step_us"][side]["us"] / r["layers"] for r in picked], style,
                           label=f"{side}, {gemm_path}")
        first = [r for r in rows if r["path"] == rows[0]["path"]]
        ms = [r["m"] for r in first]
        saved.plot(ms, [r["op_saved_us"] for r in first], "k^:", label="op alone, per call")
        saved.plot(ms, [0.9 * r["op_saved_us"] for r in first], "x:", color="grey", label="0.9 x op alone (goal)")
        saved.axhline(0, color="black", linewidth=0.5)
        saved.set_title(f"{problem}, tp = {rows[0]['tp']}: µs saved per layer")
        steps.set_title("µs per layer of the decode step")
        for axis in (saved, steps):
            axis.set_xscale("log", base=2)
            axis.set_xlabel("m (tokens)")
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=8)
    figure.suptitle(note)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    rank_processes.refuse_timing("bench_moe_block.py")
    platform = "cpu" if ARGS.cpu else "gpu"
    devices = [d for d in jax.devices() if d.platform == platform]
    tp = ARGS.tp or len(devices)
    configs = [problem_config(name) for name in ARGS.problems]
    if ARGS.build_kernels:
        if not tp:
            raise SystemExit("--build-kernels without GPUs here: give --tp")
        kernel_builds.build_kernels(kernel_configs(configs, tp), ARGS.build_kernels)
        return 0
    if not 0 < tp <= len(devices):
        raise SystemExit(f"tp={tp}: {len(devices)} {platform.upper()} device(s) here")
    mesh = jax.sharding.Mesh(np.array(devices[:tp]), (mb.TP,))
    if ARGS.cpu:
        print(f"on {tp} virtual CPU devices, the reference path, small dimensions: a plumbing check, its times "
              "mean nothing", flush=True)
        copy, copy_rate = None, None
    else:
        kernel_builds.check_kernels(kernel_configs(configs, tp),
                                    "python benchmarks/bench_moe_block.py --build-kernels DIR "
                                    f"--problems {' '.join(ARGS.problems)} --m {' '.join(map(str, ARGS.m))} "
                                    f"--tp {tp} --paths {' '.join(ARGS.paths)}")
        copy = floors.copy_limit(devices[0], ARGS.reps)
        copy_rate = copy["bytes_per_s"]
        print(f"copy bandwidth {copy_rate / 1e9:.0f} GB/s (read + write; {copy['what']})", flush=True)
    results = []
    data = {"environment": {**records.machine_environment(), "platform": platform, "plumbing_check": ARGS.cpu,
                            "tp": tp, "layers": ARGS.layers, "iterations": list(ARGS.iterations),
                            "reps": ARGS.reps, "paths": ARGS.paths, "op_impl": op_impl()},
            "copy_bytes_per_s": copy_rate, "copy": copy, "problems": {}, "results": results}
    key = jax.random.key(0)
    for config in configs:
        config.check_tp(tp)
        memory = ARGS.layers * config.weight_bytes(tp, prepared="prepared" in ARGS.paths)
        data["problems"][config.name] = {"describe": config.describe(), "experts": config.experts,
                                         "model_experts": config.model_experts, "weight_bytes_per_rank": memory}
        print(f"{config.describe()}\n  {ARGS.layers} layers: {memory / 1e9:.2f} GB of weights per rank, tp = {tp}",
              flush=True)
        key, params_key = jax.random.split(key)
        params = mb.init_params(params_key, config, mesh, ARGS.layers, prepared="prepared" in ARGS.paths)
        with jmp.Mailbox(mesh, mb.TP, hidden=config.hidden, capacity_m=max(ARGS.m)) as mailbox:
            for m in ARGS.m:
                key, case_key = jax.random.split(key)
                case = measure_case(config, mesh, mailbox, params, m, case_key, copy_rate)
                results.extend(case)
                print_table(case)
                # After every case, so that a run cut short keeps what it measured.
                records.write_json(data, ARGS.out)
            mailbox.check()
        del params
    records.write_json(data, ARGS.out)
    print(f"wrote {ARGS.out}")
    if ARGS.plot:
        environment = data["environment"]
        note = (f"{environment['gpu']}, jax {environment['jax']}, {ARGS.layers} layers"
                + (": CPU plumbing check, times meaningless" if ARGS.cpu else ""))
        plot(results, ARGS.plot, note)
        print(f"wrote {ARGS.plot}")
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
