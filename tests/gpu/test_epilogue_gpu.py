"""GPU tests of the fused residual add + RMSNorm epilogue: its kernels through `gpu_harness` (with
virtual ranks on one GPU), and the op through jit + shard_map (tp = 2 on two GPUs, and tp = 1
where jnp runs it).

Every check draws fresh data with residuals far larger than the reduced sum (so
that the bf16 rounding of ``y + residual`` matters) and, from m = 37 on, a
token whose inputs are all zero. ``residual_out`` is compared with the float64
sum plus residual, and ``out`` with the float64 RMSNorm of that
``residual_out`` (`numerics.assert_epilogue_close`); across ranks both must
agree bit for bit, and after each call the mailbox must be healthy, advanced
and re-armed. Through the harness both outputs are poisoned before every call:
rows past the result's (``m``, or ``ceil(m / tp)`` for reduce_scatter) must keep
the poison, and reduce_scatter rows of no token must come out +0.0 in both.
Through JAX, a group of tp ranks runs on tp GPUs, or as tp rank processes on fewer
(``rank_processes``, tests/support/rank_runs.py).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp
import numerics
from jax_moe_publish import protocol, reference
from jax_moe_publish import tuning
from jax_moe_publish.testing import gpu_matrix, rank_processes
from jax_moe_publish._abi import PORTABLE_CLUSTER_CTAS
from kernel_checks import (
    CAPACITY_M,
    check_protocol_state,
    open_test_group,
    random_problems,
    routed_rows,
    seeded_rng,
)

M_VALUES = (1, 37, CAPACITY_M)
EPS_VALUES = (1e-5, 1e-6)
SILENT_TOKEN = 5  # from m = 37 on: zero partials on every rank and a zero residual row
GARBAGE = 7.0  # in residual rows of no token (reduce_scatter): they must not be read
CONFIGS = [c for tp in gpu_matrix.GROUP_TPS for c in gpu_matrix.epilogues(tp)]


def _m_id(m):
    return f"m{m}"


def _epilogue_problem(config, m, rng):
    """Every rank's finalize inputs, the full residual [m, hidden] and the weight."""
    problems = random_problems(config, m, rng, routed_rows(config, m))
    residual, norm_weight = numerics.epilogue_inputs(rng, m, config.hidden)
    if m > SILENT_TOKEN:
        numerics.silence_token(problems, SILENT_TOKEN)
        residual[SILENT_TOKEN] = 0
    return problems, residual, norm_weight


def _rank_rows(algorithm, x, tp, rank):
    """Rank's rows of an [m, ...] array in the layout of the op's result; rows of no token
    (reduce_scatter) are filled with `GARBAGE`."""
    if algorithm != "reduce_scatter":
        return x
    rows = numerics.owned(x, tp, rank)
    rows[numerics.tokenless_rows(len(rows), tp, rank, len(x))] = GARBAGE
    return rows


def _check_rank(algorithm, tp, rank, out, residual_out, problems, scale, residual, norm_weight, eps, what):
    """One rank's two outputs (bf16 arrays in the result's layout) against the float64 model."""
    total, bound = numerics.expected_sum(problems, scale)
    m = len(total)
    if algorithm == "reduce_scatter":
        total, bound = numerics.owned(total, tp, rank), numerics.owned(bound, tp, rank)
        unused = numerics.tokenless_rows(len(total), tp, rank, m)
        assert np.all(out.view(np.uint16)[unused] == 0), f"{what}: out rows of no token are not +0.0"
        assert np.all(residual_out.view(np.uint16)[unused] == 0), f"{what}: residual_out rows of no token"
        residual = numerics.owned(residual, tp, rank)
        silent = SILENT_TOKEN // tp if SILENT_TOKEN % tp == rank else None
    else:
        silent = SILENT_TOKEN
    numerics.assert_epilogue_close(out, residual_out, total, bound, residual, norm_weight, eps, what=what)
    if silent is not None and m > SILENT_TOKEN:
        # eps keeps the zero row finite and zero: 0 * rsqrt(eps) * weight.
        assert np.all(out[silent].astype(np.float64) == 0), f"{what}: the zero row's out"
        assert np.all(residual_out[silent].astype(np.float64) == 0), f"{what}: the zero row's residual_out"


def _prepared_buffers(launcher, config, m, problems, residual, norm_weight, eps):
    """Every rank's buffers for one call of m tokens: its inputs uploaded (residual rows in the
    layout of its result) and both outputs poisoned."""
    buffers = launcher.allocate(CAPACITY_M, routed_rows(config, m))
    for rank, (rank_buffers, problem) in enumerate(zip(buffers, problems)):
        rank_buffers.upload(problem)
        rank_buffers.upload_epilogue(_rank_rows(config.algorithm, residual, config.tp, rank), norm_weight, eps)
        rank_buffers.out.poison()
        rank_buffers.residual_out.poison()
    return buffers


# Through the harness: the kernels alone, with poisoned outputs.


# Every eps at tp = 2; one at larger tp, where the row's arithmetic is the same.
KERNEL_CASES = [pytest.param(config, m, eps, id=f"{config.key}-m{m}-eps{eps:g}")
                for config in CONFIGS for m in M_VALUES for eps in (EPS_VALUES if config.tp == 2 else EPS_VALUES[:1])]


@pytest.mark.gpus(1)
@pytest.mark.parametrize("config, m, eps", KERNEL_CASES)
def test_epilogue_kernel_matches_model(config, m, eps, devices):  # noqa: F811
    _check_epilogue_call(config, m, eps, devices)


@pytest.mark.gpus(1)
# CTAs, rounded down to whole clusters (at least one): one cluster against several.
@pytest.mark.parametrize("grid_limits", ((1,), (8, 24)), ids=lambda g: "grid" + "-".join(map(str, g)))
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.fuse_reduce], ids=lambda c: c.key)
def test_fused_epilogue_persistent_grid(config, grid_limits, devices):  # noqa: F811
    """A fused grid of fewer clusters than rows: each cluster publishes its rows, then reduces
    and normalizes them one after another (its shared memory reused), with ranks' grids unequal."""
    _check_epilogue_call(config, CAPACITY_M, 1e-6, devices,
                         [grid_limits[rank % len(grid_limits)] for rank in range(config.tp)])


def _check_epilogue_call(config, m, eps, devices, grid_limits=None) -> None:
    """One call of the epilogue kernels on fresh data: both outputs of every rank, bits across
    ranks and the protocol state after it."""
    rng = seeded_rng(config.key, m, eps, grid_limits, "epilogue")
    problems, residual, norm_weight = _epilogue_problem(config, m, rng)
    with open_test_group(config, devices, CAPACITY_M, grid_limits) as launcher:
        buffers = _prepared_buffers(launcher, config, m, problems, residual, norm_weight, eps)
        launcher.run(buffers, m)
        _check_call(config, m, buffers, problems, residual, norm_weight, eps, f"{config.key} m={m} eps={eps}")
        check_protocol_state(launcher, calls=1)


def _check_call(config, m, buffers, problems, residual, norm_weight, eps, what) -> None:
    """Both outputs of every rank of one call, poisoned before it: the rows of the result
    against the model (`_check_rank`), rows past them untouched (still poison), and for an
    all-reduce the same bits on every rank."""
    tp = config.tp
    rows = protocol.owned_rows(m, tp) if config.algorithm == "reduce_scatter" else m
    outputs = [(b.output(), b.residual_output()) for b in buffers]
    for rank, (out, residual_out) in enumerate(outputs):
        for name, bits in (("out", out), ("residual_out", residual_out)):
            assert np.all(bits[rows:] == numerics.POISON_BF16), f"{what} rank {rank}: {name} rows past {rows} written"
        _check_rank(config.algorithm, tp, rank, out[:rows].view(numerics.BF16),
                    residual_out[:rows].view(numerics.BF16), problems, config.routed_scaling_factor,
                    residual, norm_weight, eps, f"{what} rank {rank}")
    if config.algorithm != "reduce_scatter":
        for rank in range(1, tp):
            for index, name in enumerate(("out", "residual_out")):
                assert np.array_equal(outputs[rank][index][:rows], outputs[0][index][:rows]), (
                    f"{what}: rank {rank}'s {name} differs in bits from rank 0's"
                )


@pytest.mark.gpus(1)
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.hidden == 7168], ids=lambda c: c.key)
def test_epilogue_kernel_consecutive_calls(config, devices):  # noqa: F811
    """Calls of random m enqueued back to back, each into its own poisoned buffers: stages
    cycle, every slot is re-armed, and no call writes past its rows."""
    rng = seeded_rng(config.key, "epilogue rounds")
    calls = []
    with open_test_group(config, devices, CAPACITY_M) as launcher:
        for _ in range(9):
            m = int(rng.integers(1, CAPACITY_M, endpoint=True))
            problems, residual, norm_weight = _epilogue_problem(config, m, rng)
            buffers = _prepared_buffers(launcher, config, m, problems, residual, norm_weight, 1e-6)
            calls.append((m, problems, residual, norm_weight, buffers))
        for m, _, _, _, buffers in calls:
            launcher.launch(buffers, m)
        launcher.synchronize()
        for index, (m, problems, residual, norm_weight, buffers) in enumerate(calls):
            _check_call(config, m, buffers, problems, residual, norm_weight, 1e-6, f"{config.key} call {index} m={m}")
        check_protocol_state(launcher, calls=len(calls))


@pytest.mark.gpus(1)
@pytest.mark.parametrize("halt", (protocol.HALT_FAILED, protocol.HALT_CLOSED), ids=("failed", "closed"))
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.hidden == 7168], ids=lambda c: c.key)
def test_epilogue_on_a_halted_mailbox(config, halt, devices):  # noqa: F811
    """A call on a halted mailbox, under on_timeout="flag" (under "abort" a closed one traps):
    NaN in both outputs of every token's row, the mailbox untouched, and a closed mailbox
    recorded in the status words."""
    m = 37
    rng = seeded_rng(config.key, halt, "halted epilogue")
    problems, residual, norm_weight = _epilogue_problem(config, m, rng)
    scatter = config.algorithm == "reduce_scatter"
    rows = protocol.owned_rows(m, config.tp) if scatter else m
    with open_test_group(config, devices, CAPACITY_M, on_timeout=protocol.ON_TIMEOUT_FLAG) as launcher:
        launcher.set_stage_words({protocol.HALT: halt})
        buffers = _prepared_buffers(launcher, config, m, problems, residual, norm_weight, 1e-6)
        launcher.run(buffers, m)
        for rank, rank_buffers in enumerate(buffers):
            what = f"{config.key} halt={halt} rank {rank}"
            # Rows of the rank's tokens (in reduce_scatter the last row may have none).
            token_rows = ~numerics.tokenless_rows(rows, config.tp, rank, m) if scatter else np.ones(rows, bool)
            for name, bits in (("out", rank_buffers.output()), ("residual_out", rank_buffers.residual_output())):
                values = bits[:rows].view(numerics.BF16).astype(np.float32)
                assert np.all(np.isnan(values[token_rows])), f"{what}: {name} holds numbers"
                assert np.all(bits[:rows][~token_rows] == 0), f"{what}: {name} rows of no token are not +0.0"
                assert np.all(bits[rows:] == numerics.POISON_BF16), f"{what}: {name} rows past {rows} written"
            code = protocol.STATUS_CLOSED if halt == protocol.HALT_CLOSED else protocol.STATUS_OK
            assert launcher.status(rank)[protocol.STATUS_CODE] == code, f"{what}: {launcher.status(rank)}"
            state = launcher.stage_state(rank)
            assert state[protocol.HALT] == halt and state[protocol.ARRIVALS] == 0, f"{what}: stage words {state}"
            for name, area in zip(("contributions", "gather area"), launcher.mailbox(rank)):
                assert np.all(area == protocol.EMPTY_BF16), f"{what}: the {name} was written"


# An FP8 out (`KernelConfig.fp8_out`): each FP8 config against its bf16 twin on the same inputs.


FP8_CASES = [pytest.param(config, m, id=f"{config.key}-m{m}")
             for tp in gpu_matrix.GROUP_TPS for config in gpu_matrix.fp8_outs(tp)
             for m in (M_VALUES if tp == 2 else M_VALUES[1:2])]


@pytest.mark.gpus(1)
@pytest.mark.parametrize("config, m", FP8_CASES)
def test_fp8_out_is_the_bf16_out_quantized(config, m, devices):  # noqa: F811
    """The FP8 kernels' out and scales are the bf16 twin's out quantized by
    `reference.quantize_fp8` (computed on the CPU), bit for bit, on every rank; residual_out is
    the twin's; rows past the result keep their poison; and the out is within half an e4m3
    ulp of the float64 model's quantization of that bf16 out (`numerics.assert_fp8_close`)."""
    rng = seeded_rng(config.key, m, "fp8 out")
    problems, residual, norm_weight = _epilogue_problem(config, m, rng)
    static = np.float32(rng.uniform(0.005, 0.05)) if config.fp8_out == "static" else None
    twin = config.replace(fp8_out="none")
    rows = protocol.owned_rows(m, config.tp) if config.algorithm == "reduce_scatter" else m
    with open_test_group(twin, devices, CAPACITY_M) as launcher:
        buffers = _prepared_buffers(launcher, twin, m, problems, residual, norm_weight, 1e-6)
        launcher.run(buffers, m)
        bf16 = [(b.output()[:rows].view(numerics.BF16), b.residual_output()[:rows]) for b in buffers]
    with open_test_group(config, devices, CAPACITY_M) as launcher:
        buffers = _prepared_buffers(launcher, config, m, problems, residual, norm_weight, 1e-6)
        for rank_buffers in buffers:
            if static is None:
                rank_buffers.out_scales.poison()
            else:
                rank_buffers.upload_out_scale(static)
        launcher.run(buffers, m)
        check_protocol_state(launcher, calls=1)
        fp8 = [(b.fp8_output(), b.scales_output() if static is None else None, b.residual_output())
               for b in buffers]
    cpu = jax.devices("cpu")[0]
    for rank, ((out, residual_out), (q_bits, scales, got_residual_out)) in enumerate(zip(bf16, fp8)):
        what = f"{config.key} m={m} rank {rank}"
        want = reference.quantize_fp8(jax.device_put(out, cpu), None if static is None else jax.device_put(static, cpu))
        want_q, want_scales = (want, None) if static is not None else want
        q = q_bits[:rows].view(jnp.float8_e4m3fn)
        differ = np.argwhere(q_bits[:rows] != np.asarray(want_q).view(np.uint8))
        assert not len(differ), (
            f"{what}: {len(differ)} FP8 values differ from the bf16 out quantized, e.g. at {differ[:3].tolist()}: "
            f"x {[float(out[r, c]) for r, c in differ[:3]]}, kernel {[int(q_bits[r, c]) for r, c in differ[:3]]}, "
            f"reference {[int(np.asarray(want_q).view(np.uint8)[r, c]) for r, c in differ[:3]]}")
        assert np.all(q_bits[rows:].view(np.uint16) == numerics.POISON_BF16), f"{what}: out rows past {rows} written"
        assert np.array_equal(got_residual_out[:rows], residual_out), f"{what}: residual_out is not the twin's"
        if static is None:
            assert np.array_equal(scales[:rows].view(np.uint32), np.asarray(want_scales).view(np.uint32)), (
                f"{what}: scales differ from the bf16 out's")
            assert np.all(scales[rows:].view(np.uint16) == numerics.POISON_BF16), f"{what}: scale rows past {rows}"
        numerics.assert_fp8_close(q, scales[:rows] if static is None else None, out, static_scale=static, what=what)
    if config.algorithm != "reduce_scatter":
        for rank in range(1, config.tp):
            assert np.array_equal(fp8[rank][0][:rows], fp8[0][0][:rows]), f"rank {rank}'s FP8 out differs from rank 0's"


@pytest.mark.gpus(1)
@pytest.mark.parametrize("config", [c for tp in gpu_matrix.GROUP_TPS for c in gpu_matrix.fp8_outs(tp)
                                    if c.hidden == 7168 and c.tp == 2], ids=lambda c: c.key)
def test_fp8_out_on_a_halted_mailbox(config, devices):  # noqa: F811
    """A flagged halted mailbox: the FP8 out of every token's row is NaN (its scales too), like
    the bf16 out's, and residual_out NaN."""
    m = 37
    problems, residual, norm_weight = _epilogue_problem(config, m, seeded_rng(config.key, "halted fp8"))
    scatter = config.algorithm == "reduce_scatter"
    rows = protocol.owned_rows(m, config.tp) if scatter else m
    with open_test_group(config, devices, CAPACITY_M, on_timeout=protocol.ON_TIMEOUT_FLAG) as launcher:
        launcher.set_stage_words({protocol.HALT: protocol.HALT_FAILED})
        buffers = _prepared_buffers(launcher, config, m, problems, residual, norm_weight, 1e-6)
        for rank_buffers in buffers:
            if config.fp8_out == "static":
                rank_buffers.upload_out_scale(np.float32(0.01))
        launcher.run(buffers, m)
        for rank, rank_buffers in enumerate(buffers):
            what = f"{config.key} rank {rank}"
            tokens = ~numerics.tokenless_rows(rows, config.tp, rank, m) if scatter else np.ones(rows, bool)
            q = rank_buffers.fp8_output()[:rows].view(jnp.float8_e4m3fn).astype(np.float32)
            assert np.all(np.isnan(q[tokens])), f"{what}: the FP8 out holds numbers"
            if config.fp8_out == "group":
                assert np.all(np.isnan(rank_buffers.scales_output()[:rows][tokens])), f"{what}: scales hold numbers"
            residual_out = rank_buffers.residual_output()[:rows].view(numerics.BF16).astype(np.float32)
            assert np.all(np.isnan(residual_out[tokens])), f"{what}: residual_out holds numbers"


# Through JAX: the FFI target, the Mailbox and the kernels together.


def _mesh(count):
    return jax.sharding.Mesh(np.array([d for d in jax.devices() if d.platform == "gpu"][:count]), ("tp",))


def _op_outputs(mailbox, problems, residual, norm_weight, eps, scale, config=None, **fp8):
    """Each rank's (out, residual_out) as NumPy, in rank order, from one jitted call (with
    ``config``'s kernels, or the default's); with ``fp8`` (``out_dtype``, ``out_scale``) the
    op's FP8 results instead."""
    mesh, tp = mailbox.mesh, mailbox.tp
    stacks = [np.stack([getattr(p, f) for p in problems]) for f in ("routed", "weights", "indices")]
    shared = None if problems[0].shared is None else np.stack([p.shared for p in problems])
    rank_residual = np.stack([_rank_rows(mailbox.result, residual, tp, r) for r in range(tp)])

    def shard(routed, weights, indices, residual_rows, weight, *rest):
        result = jmp.moe_finalize_publish(
            routed[0], weights[0], indices[0], rest[0][0] if rest else None, mailbox=mailbox,
            routed_scaling_factor=scale, impl="kernel", residual=residual_rows[0], norm_weight=weight,
            norm_eps=eps, config=config, **fp8,
        )
        return jax.tree.map(lambda x: x[None], result)

    args = [rank_processes.place(mesh, P("tp"), x) for x in stacks + [rank_residual]]
    args.append(rank_processes.place(mesh, P(), norm_weight))
    args += [rank_processes.place(mesh, P("tp"), shared)] if shared is not None else []
    in_specs = (P("tp"),) * 4 + (P(),) + ((P("tp"),) if shared is not None else ())
    # The per-rank buffers themselves, so that bitwise agreement is checked on the devices' copies.
    step = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=P("tp"), check_vma=False))
    outputs = step(*args)
    return list(zip(*(rank_processes.to_host(x) for x in outputs)))


@pytest.mark.parametrize("tp", [pytest.param(tp, marks=pytest.mark.gpus(tp)) for tp in gpu_matrix.GROUP_TPS])
@pytest.mark.parametrize("result", tuning.RESULTS)
@pytest.mark.parametrize("problem", gpu_matrix.EPILOGUE_PROBLEMS, ids=lambda p: f"h{p.hidden}-k{p.top_k}")
@pytest.mark.rank_processes
def test_epilogue_op_matches_model(problem, result, tp, rng):
    config = tuning.kernel_config(problem, tp=tp, m=None, result=result, epilogue="rmsnorm")
    with jmp.Mailbox(_mesh(tp), "tp", hidden=config.hidden, capacity_m=CAPACITY_M, result=result) as mailbox:
        for m in M_VALUES:
            for eps in EPS_VALUES:
                problems, residual, norm_weight = _epilogue_problem(config, m, rng)
                outputs = _op_outputs(mailbox, problems, residual, norm_weight, eps, config.routed_scaling_factor)
                for rank, (out, residual_out) in enumerate(outputs):
                    _check_rank(config.algorithm, tp, rank, out, residual_out, problems,
                                config.routed_scaling_factor, residual, norm_weight, eps, f"{result} m={m} rank {rank}")
                if result == "allreduce":
                    for rank, index in itertools.product(range(1, tp), range(2)):
                        assert np.array_equal(outputs[rank][index].view(np.uint16), outputs[0][index].view(np.uint16))
        mailbox.check()


@pytest.mark.parametrize("tp", [pytest.param(tp, marks=pytest.mark.gpus(tp)) for tp in gpu_matrix.GROUP_TPS])
@pytest.mark.parametrize("static", [False, True], ids=["group", "static"])
@pytest.mark.parametrize("result", tuning.RESULTS)
@pytest.mark.rank_processes
def test_fp8_op_is_the_bf16_op_quantized(result, static, tp, rng):
    """``out_dtype=jnp.float8_e4m3fn`` through the FFI target (the FP8 kernel sets, their
    operands and result order): every rank's FP8 results are its bf16 call's out quantized by
    `reference.quantize_fp8` on the CPU, bit for bit, and the same residual_out. At m of the
    first m range, whose FP8 launch shapes the harness tests cover (`gpu_matrix.fp8_outs`)."""
    problem = gpu_matrix.EPILOGUE_PROBLEMS[0]
    config = tuning.kernel_config(problem, tp=tp, m=None, result=result, epilogue="rmsnorm")
    scale = np.float32(0.02)
    fp8 = dict(out_dtype=jnp.float8_e4m3fn, out_scale=jnp.float32(scale) if static else None)
    # This process's CPU: with rank processes, jax.devices lists every process's devices.
    cpu = jax.local_devices(backend="cpu")[0]
    with jmp.Mailbox(_mesh(tp), "tp", hidden=config.hidden, capacity_m=CAPACITY_M, result=result) as mailbox:
        for m in (1, tuning.range_ms()[0] - 3):
            problems, residual, norm_weight = _epilogue_problem(config, m, rng)
            args = (mailbox, problems, residual, norm_weight, 1e-6, config.routed_scaling_factor)
            for rank, (bf16, quantized) in enumerate(zip(_op_outputs(*args), _op_outputs(*args, **fp8))):
                what = f"{result} m={m} rank {rank}"
                static_scale = jax.device_put(scale, cpu) if static else None
                want = reference.quantize_fp8(jax.device_put(bf16[0], cpu), static_scale)
                want = (want,) if static else want
                for got, expected in zip(quantized[:-1], want):
                    assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(expected).view(np.uint8)), what
                assert np.array_equal(quantized[-1].view(np.uint16), bf16[1].view(np.uint16)), what
        mailbox.check()


@pytest.mark.gpus(2)
@pytest.mark.rank_processes
def test_epilogue_op_with_a_cluster_beyond_the_portable_size(rng):
    """The launcher's opt-in for a cluster of more than 8 CTAs: 8-byte fragments at 128
    threads, 14 CTAs per row of hidden 7168, through the FFI target."""
    config = next(c for c in CONFIGS if c.fuse_reduce and c.ctas_per_row > PORTABLE_CLUSTER_CTAS)
    with jmp.Mailbox(_mesh(2), "tp", hidden=config.hidden, capacity_m=CAPACITY_M) as mailbox:
        for m in M_VALUES:
            problems, residual, norm_weight = _epilogue_problem(config, m, rng)
            outputs = _op_outputs(mailbox, problems, residual, norm_weight, 1e-6, config.routed_scaling_factor,
                                  config=config)
            for rank, (out, residual_out) in enumerate(outputs):
                _check_rank("oneshot", 2, rank, out, residual_out, problems, config.routed_scaling_factor, residual,
                            norm_weight, 1e-6, f"m={m} rank {rank}")
            for index in range(2):
                assert np.array_equal(outputs[1][index].view(np.uint16), outputs[0][index].view(np.uint16))
        mailbox.check()


@pytest.mark.gpus(1)
@pytest.mark.parametrize("problem", gpu_matrix.EPILOGUE_PROBLEMS, ids=lambda p: f"h{p.hidden}-k{p.top_k}")
def test_epilogue_op_on_one_gpu(problem, rng):
    """tp = 1: the direct kernel, then the epilogue in jnp with the same rounding points."""
    config = tuning.kernel_config(problem, tp=1, m=None)
    with jmp.Mailbox(_mesh(1), "tp", hidden=config.hidden, capacity_m=CAPACITY_M) as mailbox:
        for m in M_VALUES:
            for eps in EPS_VALUES:
                problems, residual, norm_weight = _epilogue_problem(config, m, rng)
                [(out, residual_out)] = _op_outputs(mailbox, problems, residual, norm_weight, eps,
                                                    config.routed_scaling_factor)
                _check_rank("direct", 1, 0, out, residual_out, problems, config.routed_scaling_factor, residual,
                            norm_weight, eps, f"m={m}")


@pytest.mark.gpus(2)
@pytest.mark.rank_processes
def test_epilogue_chain_feeds_residual_out_forward(rng):
    """16 layers in one jit under XLA's default command buffers: each layer's residual input
    is the previous layer's residual_out, written by the previous reduce_norm, which the
    next reduce_norm reads before its mailbox wait; out feeds the next shared input. Every
    rank has its own finalize inputs (and first shared input); the residual stream is the
    same on every rank, as an all-reduce's is."""
    tp, hidden, top_k, scale, layers, m, eps = 2, 7168, 8, 2.5, 16, 8, 1e-6
    num_rows = m * top_k
    routed = rng.standard_normal((tp, layers, num_rows, hidden), dtype=np.float32).astype(numerics.BF16)
    weights = rng.uniform(0.05, 0.3, (tp, layers, m, top_k)).astype(numerics.BF16)  # the tests preset's kernels
    indices = rng.integers(-1, num_rows, (tp, layers, m, top_k)).astype(np.int32)
    shared = rng.standard_normal((tp, m, hidden), dtype=np.float32).astype(numerics.BF16)
    residual, norm_weight = numerics.epilogue_inputs(rng, m, hidden)
    with jmp.Mailbox(_mesh(tp), "tp", hidden=hidden, capacity_m=CAPACITY_M) as mailbox:

        def shard(routed, weights, indices, shared, residual, norm_weight):
            outs, residuals = [], []
            x, r = shared[0], residual
            for layer in range(layers):
                x, r = jmp.moe_finalize_publish(routed[0, layer], weights[0, layer], indices[0, layer], x,
                                                mailbox=mailbox, routed_scaling_factor=scale, residual=r,
                                                norm_weight=norm_weight, norm_eps=eps)
                outs.append(x)
                residuals.append(r)
            return jnp.stack(outs)[None], jnp.stack(residuals)[None]

        # Each rank's own output buffers, so that every rank's result is checked.
        chain = jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=(P("tp"),) * 4 + (P(), P()),
                                      out_specs=P("tp"), check_vma=False))
        args = ([rank_processes.place(mailbox.mesh, P("tp"), x) for x in (routed, weights, indices, shared)]
                + [rank_processes.place(mailbox.mesh, P(), x) for x in (residual, norm_weight)])
        for _ in range(3):  # the first runs record the graph, later ones replay it
            outs, residuals = (rank_processes.to_host(x) for x in chain(*args))
            for rank in range(1, tp):
                for name, x in (("out", outs), ("residual_out", residuals)):
                    assert np.array_equal(x[rank].view(np.uint16), x[0].view(np.uint16)), (
                        f"rank {rank}'s {name} differs in bits from rank 0's")
            previous_out, previous_residual = None, residual
            for layer in range(layers):
                problems = [numerics.RankInputs(routed[r, layer], weights[r, layer], indices[r, layer],
                                             shared[r] if layer == 0 else previous_out) for r in range(tp)]
                total, bound = numerics.expected_sum(problems, scale)
                numerics.assert_epilogue_close(outs[0, layer], residuals[0, layer], total, bound, previous_residual,
                                               norm_weight, eps, what=f"layer {layer}")
                previous_out, previous_residual = outs[0, layer], residuals[0, layer]
        mailbox.check()
