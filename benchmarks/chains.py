"""The programs that the benchmarks time side by side: our op and XLA's finalize + ``psum``,
each a chain of layers in a timed loop, and their inputs.

One ``jit`` + ``shard_map`` runs a ``fori_loop`` whose body is a chain of L = 32 layers
(`make_chain`), each layer with its own inputs (so XLA cannot merge layers) and each layer's
output fed into the next layer's shared-expert input, as in a model. The inputs are the same
in every iteration, so XLA hoists out of the loop whatever reads nothing else: with the ties
of the runs up to ``ac40515`` (the shared input, or without one the weights), the optimized
HLO on CPU ran every layer's gather of routed rows, and with a shared expert its weighted
sum, once before the loop. So each layer of the XLA path takes its indices plus ``zero``
times a part of the previous ``y``, converted to int32, with ``zero`` a runtime argument XLA
cannot fold: every step of the finalize then reads the loop carry. The part is
``y[:, :top_k]``, or at tp = 1 without a shared expert the sum of all of ``y``, where nothing
else reads all of it and XLA would compute only the columns that the tie reads (that sum can
cost XLA one read of ``y`` per layer); otherwise the tie costs ``m * top_k`` multiplies,
conversions and integer adds per layer. ``tests/cpu/test_bench_moe_publish.py`` reads the
optimized HLO on CPU: each layer's gather, weighted sum and ``psum`` in the loop body, none
before it. Our kernels' custom call has side effects, so XLA can neither hoist nor merge nor
slice it and it needs no tie; ours on the reference path (``op_impl="reference"``, where
there are no GPUs) is ``jnp`` and is tied the same way. The sides:

* ``ours``: `moe_finalize_publish` (the kernels);
* ``ours_jnp_quantizer`` (FP8 problems at tp > 1, below): the op's bf16 epilogue
  followed by the ``jnp`` quantizer;
* ``xla``: the same finalize in ``jnp`` followed by ``lax.psum`` (tp > 1), or
  the ``jnp`` finalize alone, which XLA fuses (tp = 1). XLA's default: since
  jaxlib 0.10.1 a small ``psum`` runs XLA's own one-shot or two-shot kernel;
* ``xla_nccl`` (tp > 1): the same program compiled with XLA's collective
  kernels off (``xla_gpu_experimental_use_collective_kernels`` empty), so that
  its ``psum`` runs NCCL. Where the installed XLA does not know that option the
  column cannot run (`probe_xla_columns`).

A problem named ``<problem>+rmsnorm`` (`EPILOGUE_SUFFIX`) has the epilogue: each layer adds
its result to the residual stream and applies RMSNorm, ours fused into the reduce
(``residual=``, ``norm_weight=``), XLA's as ``psum`` then the ``jnp`` add and RMSNorm in the
same ``jit``; each layer's ``out`` feeds the next layer's shared input and its
``residual_out`` the next layer's residual.

A problem named ``<problem>+rmsnorm+fp8`` (``+fp8static``, `FP8_SUFFIXES`) has the epilogue
with its ``out`` in float8_e4m3fn: a scale per token and 128 columns, as DeepSeek-V3's
activations, or one static scale (`FP8_STATIC_SCALE`). ``ours`` passes
``out_dtype=float8_e4m3fn`` (at tp > 1 its kernels quantize); ``ours_jnp_quantizer``
(`OURS_JNP_QUANTIZER`; tp > 1, at tp = 1 it would be ours) and the XLA columns quantize their
bf16 ``out`` with the package's ``jnp`` quantizer (`jmp.reference.quantize_fp8`) in the same
``jit``. In a model the FP8 ``out`` and its scales go to a GEMM that reads them from memory;
`fp8_handoff` stands in for it in every column: an ``optimization_barrier`` (fused into its
consumer, XLA's quantizer would never write its results, as our kernels must), their
dequantization to bf16, the next layer's shared input, and another barrier (so that XLA
computes all of it where only a tie reads it, and cannot fuse it into its next finalize, as
ours cannot). Each column's time per layer thus includes that one small kernel. XLA's GPU
pipeline removes barriers after fusion, its CPU pipeline before it: the CPU tests check that
each layer converts to e4m3 in the loop body, not what reaches memory.

`time_ours_and_xla` times ours against the other columns (`timing.paired_estimates`). Each
column records how its all-reduces ran, read from the optimized HLO (``all_reduce``: the
count per opcode and ``kernel_strategy``; ``default`` where XLA set none, which is NCCL on
GPUs), and the fusion kernels of its loop body per layer (``fusions_per_layer``): below 1,
XLA fused layers together, as it did at tp = 1 on one H200, where no ``psum`` separates them
(``benchmarks/README.md``); a model's GEMMs between the layers would stop that, so such a
figure favours XLA. ``paired_ratio`` has ours over every column, per repetition, with its
spread.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import hlo_text
import jax_moe_publish as jmp
import timing
from jax_moe_publish import tuning

PROBLEMS = {
    "deepseek-v3": dict(hidden=7168, top_k=8, shared=True, scale=2.5),
    "qwen3-moe": dict(hidden=4096, top_k=8, shared=False, scale=1.0),
}
EPILOGUE_SUFFIX = "+rmsnorm"
FP8_SUFFIXES = {"+fp8": "group", "+fp8static": "static"}
"""After `EPILOGUE_SUFFIX`: the epilogue's out in FP8, by `jmp.KernelConfig`'s ``fp8_out`` names."""
FP8_STATIC_SCALE = 16 / 448
"""The static scale of ``+fp8static``: |out| up to 16 fits (RMSNorm's out has about unit RMS)."""
OURS_JNP_QUANTIZER = "ours_jnp_quantizer"
"""The column of our bf16 epilogue followed by the ``jnp`` quantizer (FP8 problems, tp > 1)."""
NORM_EPS = 1e-6
WEIGHT_BYTES = 4  # the chains pass float32 router weights
# The XLA baselines: compile options of each (module docstring).
XLA_COLUMNS = {"xla": {}, "xla_nccl": {"xla_gpu_experimental_use_collective_kernels": ""}}


def problem_spec(name):
    """The problem of a case name: ``PROBLEMS[name]``; for ``<problem>+rmsnorm`` that problem
    with ``epilogue`` set, and for ``<problem>+rmsnorm+fp8`` or ``+fp8static`` also
    ``fp8_out`` (`FP8_SUFFIXES`; "none" otherwise)."""
    problem, fp8_out = name, "none"
    for suffix, mode in FP8_SUFFIXES.items():
        if name.endswith(EPILOGUE_SUFFIX + suffix):
            problem, fp8_out = name.removesuffix(suffix), mode
    base = problem.removesuffix(EPILOGUE_SUFFIX)
    if base not in PROBLEMS:
        raise ValueError(f"problem {name!r}: expected one of {list(PROBLEMS)}, maybe followed by "
                         f"{EPILOGUE_SUFFIX!r} and then one of {list(FP8_SUFFIXES)}")
    return {**PROBLEMS[base], "epilogue": problem != base, "fp8_out": fp8_out}


def case_config(problem, tp, algorithm, m, fuse_reduce=None):
    """The `jmp.KernelConfig` of a case, as the op launches it: the tuning table's for
    ``algorithm`` (``direct`` exactly when tp = 1; there the op runs the epilogue in ``jnp``),
    with the case's FP8 out where the kernels run the epilogue (the op sets ``fp8_out`` from
    ``out_dtype``); ``fuse_reduce`` overrides the table's choice."""
    return spec_config(problem_spec(problem), tp, algorithm, m, fuse_reduce)


def spec_config(spec, tp, algorithm, m, fuse_reduce=None):
    """`case_config` of a problem given by its spec (a `problem_spec` value; without
    ``fp8_out``, bf16)."""
    problem = tuning.Problem(hidden=spec["hidden"], top_k=spec["top_k"], routed_scaling_factor=spec["scale"],
                             include_shared_expert=spec["shared"], fp32_weights=WEIGHT_BYTES == 4)
    epilogue = "rmsnorm" if spec["epilogue"] and tp > 1 else "none"
    config = tuning.kernel_config(problem, tp=tp, m=m, epilogue=epilogue, algorithm=algorithm,
                                  fuse_reduce=fuse_reduce)
    return config if epilogue == "none" else config.replace(fp8_out=spec.get("fp8_out", "none"))


def op_config(config):
    """The ``config`` to pass the op for a case's `case_config`: its bf16 twin (None stays None).
    The op takes ``fp8_out="none"`` and sets it from ``out_dtype``, so ours launches
    ``config`` and `OURS_JNP_QUANTIZER`'s bf16 call this twin."""
    return None if config is None else config.replace(fp8_out="none")


def quantizer_columns(problem, tp):
    """`OURS_JNP_QUANTIZER` where it differs from ours: FP8 problems at tp > 1 (at tp = 1 the op
    itself quantizes its bf16 epilogue with the ``jnp`` quantizer)."""
    return [OURS_JNP_QUANTIZER] if problem.get("fp8_out", "none") != "none" and tp > 1 else []


def xla_columns(tp, columns):
    """The XLA baselines of a case of ``tp`` among ``columns``: tp = 1 has no psum for NCCL to run."""
    return ["xla"] if tp == 1 else list(columns)


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


def fp8_handoff(quantized, out_scale):
    """The next layer's bf16 input from a layer's FP8 out ``[q, scales]`` (or ``[q]`` with the
    static ``out_scale``): q times its scale, rounded to bf16, between two optimization
    barriers, the stand-in for the GEMM that reads them in a model (module docstring)."""
    q, *scales = lax.optimization_barrier(quantized)
    x = q.astype(jnp.float32)
    if scales:
        (scales,) = scales
        x = (x.reshape(*scales.shape, -1) * scales[..., None]).reshape(q.shape)
    else:
        x = x * out_scale
    return lax.optimization_barrier(x.astype(jnp.bfloat16))


def make_chain(impl, mailbox, problem, config, iterations, *, layers=timing.LAYERS, op_impl="kernel"):
    """``iterations`` passes over a chain of ``layers`` calls, in one jitted program.

    ``impl`` is ``ours``, `OURS_JNP_QUANTIZER` or an XLA column (`XLA_COLUMNS`); ``config``
    is the case's (`case_config`). The loop carries ``y`` (the next shared input: with an
    FP8 out, its `fp8_handoff`), and with the epilogue also the residual stream; the
    program returns the final ``y``. Each layer whose finalize is ``jnp`` (XLA's, and ours
    unless ``op_impl`` is ``kernel``) has its indices tied to the previous ``y`` (module
    docstring), so that no part of its finalize can leave the loop; our kernels' custom
    call has side effects and needs no tie. ``op_impl`` is the ``impl`` of ours
    (``reference`` where there are no GPUs, to check the plumbing).
    """
    scale, with_shared, epilogue = problem["scale"], problem["shared"], problem["epilogue"]
    fp8_out = problem.get("fp8_out", "none")
    out_scale = jnp.float32(FP8_STATIC_SCALE) if fp8_out == "static" else None
    fused_fp8 = dict(out_dtype=jnp.float8_e4m3fn, out_scale=out_scale) if impl == "ours" and fp8_out != "none" else {}

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
        if impl in ("ours", OURS_JNP_QUANTIZER):
            if op_impl != "kernel":
                indices = tied(indices, y, zero)
            result = jmp.moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox,
                                              routed_scaling_factor=scale, impl=op_impl, config=op_config(config),
                                              **norm, **fused_fp8)
            if fused_fp8:
                *quantized, residual_out = result
                return fp8_handoff(quantized, out_scale), residual_out
        else:
            result = xla_finalize(routed, weights, tied(indices, y, zero), shared, scale)
            result = lax.psum(result, "tp") if mailbox.tp > 1 else result
            if epilogue:
                # The add and RMSNorm as a JAX user writes them (the reference's rounding points).
                result = jmp.reference.add_rmsnorm(result, residual, norm_weight, eps=NORM_EPS)
        if not epilogue:
            return result, residual
        if fp8_out == "none":
            return result
        out, residual_out = result
        # The package's own jnp quantizer: (q, scales), or q with a static scale.
        quantized = jax.tree.leaves(jmp.reference.quantize_fp8(out, out_scale))
        return fp8_handoff(quantized, out_scale), residual_out

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


def chain_inputs(mesh, m, problem, key, layers=timing.LAYERS):
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


def time_ours_and_xla(mailbox, problem, config, inputs, reps, what, *, layers=timing.LAYERS, op_impl="kernel",
                      hlo=None, rounds=1, iterations=(timing.SHORT, timing.LONG), xla=("xla",)):
    """Per-call time of ours and of the columns it is compared with (`make_chain`) on the same
    inputs: the ``xla`` columns, after `quantizer_columns` where the problem has one. Each
    column gets its all-reduces (`hlo_text.all_reduce_implementations`), its fusion kernels
    per layer in its loop body (`hlo_text.loop_body_fusions` over ``layers``; None where XLA
    left no loop), and the relative difference of its output from ours (this process's
    copy), which must be at most 1e-2.

    Each round builds every side's programs afresh and times them interleaved
    (`timing.paired_estimates`); ``paired_ratio`` holds, per column, the median and spread
    of ours over it per repetition (`timing.paired_ratio`).

    ``what`` names the case in the error; with ``hlo``, each path's optimized HLO goes to
    ``<hlo>.<impl>.txt`` unless that exists.
    """
    result, outputs, hlo_texts = {}, {}, {}
    compared = [*quantizer_columns(problem, mailbox.tp), *xla]
    timings = {impl: [] for impl in ("ours", *compared)}
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
        for impl, estimates in timing.paired_estimates(programs, inputs, reps, layers, iterations).items():
            timings[impl].append(estimates)
    for impl, impl_rounds in timings.items():
        result[impl] = timing.summarize(impl_rounds)
    result["paired_ratio"] = {impl: timing.paired_ratio(timings["ours"], timings[impl]) for impl in compared}
    result["relative_difference"] = {}
    for impl in compared:
        result[impl]["all_reduce"] = hlo_text.all_reduce_implementations(hlo_texts[impl])
        # Below 1, XLA fused layers together: a model's GEMMs between layers would stop that.
        fusions = hlo_text.loop_body_fusions(hlo_texts[impl])
        result[impl]["fusions_per_layer"] = None if fusions is None else fusions / layers
        # Both chains compute the same layers: their outputs must agree before their times count.
        difference = np.linalg.norm(outputs["ours"] - outputs[impl]) / np.linalg.norm(outputs[impl])
        result["relative_difference"][impl] = float(difference)
        if not difference <= 1e-2:
            raise RuntimeError(f"{what}: ours and {impl} differ by {difference:.2e} "
                               "(relative): the timings would compare different computations")
    return result
