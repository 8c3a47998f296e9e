"""Child-process programs for the GPU fault tests (`test_faults_gpu`) and `tools/sanitize.sh`.

A kernel that traps (a timed-out mailbox wait) loses its device's CUDA
context for the rest of the process, so each fault runs in a process of its
own::

    python tests/programs/fault_programs.py PROGRAM [options]

A program reports one result (`local_processes.report`, read back with
`local_processes.read_result`), the last line of its output. After a fault no
memory is freed (every free would fail): the program reports its result and
leaves with ``os._exit``.

Programs on the kernel harness (`gpu_harness`, one prebuilt ``tests``-preset
config per algorithm, the ranks' kernels launched role by role or one rank at a time):

* ``silent-peer``: a group of ``--tp`` ranks (virtual ranks where there are fewer
  GPUs); one rank never launches, the others run a whole call. Their waits must
  trap within the timeout and record the diagnostic that names the silent rank.
* ``flagged-silent-peer``: ``silent-peer`` on a mailbox that flags instead of
  trapping: a healthy call, a call rank 1 skips, then a call on both.
* ``double-publish``: rank 1 publishes calls n and n+1 with no reduce between,
  then rank 0 runs call n. Shows what rank 0's reduce reads.
* ``mismatched-m``: the ranks run the same call with different m.
* ``nonfinite``: NaN and Inf inputs, every algorithm, against the float64 model.
* ``negative-zero``: inputs whose partials round to -0.0 (the empty sentinel),
  every algorithm, several calls: no wait may stall.
* ``sanitize``: a few healthy calls of every kernel (oneshot, twoshot, both
  fused variants on grids smaller than their tiles, the RMSNorm epilogue
  unfused and fused, both of its outputs poisoned), for ``compute-sanitizer``;
  it ends with a normal exit.

Programs on the public API (jit + shard_map on two GPUs, the FFI handler). Where there are
fewer GPUs than ranks, the test starts one process per rank on the GPUs there are
(`jax_moe_publish.testing.rank_processes`): each process joins first (`_api`), reports its own
ranks, and leaves through a last barrier.

* ``api-timeout``: on ``--tp`` GPUs, ``--silent-rank`` skips the op (a `lax.cond`
  on the rank); with ``--on-timeout abort`` the other ranks' waits trap, and
  `Mailbox.diagnose` must turn XLA's error into `MailboxStatusError`; with
  ``flag`` they return NaN and `Mailbox.check` raises it; then the mailbox is
  closed, as `with Mailbox` would.
* ``two-mailboxes``: two jitted functions on two mailboxes, called
  alternately; then one mailbox is closed and its compiled function called.
* ``closed-chain``: a chain of calls on inputs that differ by rank, which XLA
  captures in a command buffer and replays, then called again after its
  mailbox is closed; the handler's executes of each run show which runs
  were replays.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import time
import traceback
import warnings

import numpy as np
from cuda.bindings import driver

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "support"))  # as tests/conftest.py does for tests
import gpu_harness  # noqa: E402
import numerics  # noqa: E402
from jax_moe_publish import protocol, tuning  # noqa: E402
from jax_moe_publish._abi import PORTABLE_CLUSTER_CTAS  # noqa: E402
from jax_moe_publish.config import GROUP_ALGORITHMS  # noqa: E402
from jax_moe_publish.aot.store import default_store  # noqa: E402
from jax_moe_publish.memory.driver import CudaError, check  # noqa: E402
from jax_moe_publish.testing import gpu_matrix, local_processes, rank_processes  # noqa: E402

ALGORITHMS = GROUP_ALGORITHMS
CAPACITY_M = 16
ROUTED_ROWS = 16
FAULT_TIMEOUT_NS = 200 * 10**6
HEALTHY_TIMEOUT_NS = 2 * 10**9
SANITIZE_TIMEOUT_NS = 120 * 10**9  # instrumented kernels poll slowly
SHARED_GPU_FAULT_TIMEOUT_NS = 5 * 10**9
"""The public-API fault's timeout where rank processes share a GPU: each process's first call of a
compiled function loads its kernels and records its command buffer while the others' contexts hold
the GPU, so calls made after one barrier start far more than 200 ms apart (at tp = 4 a healthy call
timed out on one H200, 2026-12-02)."""
HOST_DEADLINE_S = 20.0  # far past every kernel timeout used here: reaching it is a hang
POLL_S = 50e-6
EPILOGUE_EPS = 1e-6


def finish(result: dict) -> None:
    """Report the result and leave at once: after a fault, no cleanup can succeed (a rank process
    first waits for the others at a last barrier, which needs no GPU)."""
    local_processes.report(result)
    sys.stderr.flush()
    if rank_processes.current() is not None:
        local_processes.leave(0)
    os._exit(0)


# --- kernel harness ----------------------------------------------------------------------------


def config_for(algorithm: str, tp: int = 2):
    """The first ``tests``-preset variant of ``algorithm`` for a group of ``tp`` (prebuilt for the
    GPU machine)."""
    return next(c for c in gpu_matrix.variants(tp) if c.algorithm == algorithm)


@contextlib.contextmanager
def group(algorithm: str, timeout_ns: int, on_timeout: int = protocol.ON_TIMEOUT_ABORT, *, config=None,
          grid_limits=None):
    """A `gpu_harness.GroupLauncher` of ``algorithm`` for two ranks, or of ``config``: rank r on
    GPU r % count, virtual ranks where there are fewer GPUs than ranks."""
    pool = gpu_harness.DevicePool()
    artifact = default_store().get(config or config_for(algorithm))
    with gpu_harness.open_group(artifact, pool, capacity_m=CAPACITY_M, timeout_ns=timeout_ns,
                                on_timeout=on_timeout, grid_limits=grid_limits) as launcher:
        yield launcher
    pool.close()


def random_problem(config, rng, m: int) -> numerics.RankInputs:
    return numerics.random_problem(
        rng, m=m, hidden=config.hidden, top_k=config.top_k, num_rows=ROUTED_ROWS,
        fp32_weights=config.fp32_weights, shared=config.include_shared_expert,
    )


def prepare(rank_buffers, problem) -> None:
    rank_buffers.upload(problem)
    rank_buffers.out.poison()


def prepare_call(buffers, problems, rng, m: int):
    """`prepare` every rank's buffers; with an epilogue also upload residual rows and a norm
    weight for ``m`` tokens, the same on every rank, and return them (else None)."""
    for rank_buffers, problem in zip(buffers, problems):
        prepare(rank_buffers, problem)
    if not buffers[0].epilogue:
        return None
    residual, norm_weight = numerics.epilogue_inputs(rng, m, buffers[0].config.hidden)
    for rank_buffers in buffers:
        rank_buffers.upload_epilogue(residual, norm_weight, EPILOGUE_EPS)
        rank_buffers.residual_out.poison()
    return residual, norm_weight


def launch_ranks(launcher, ranks, buffers, m: int, roles=None) -> None:
    """Enqueue the kernels of a call (all of them, or those of ``roles``) for ``ranks``, rank r
    with ``buffers[r]``, role by role as `GroupLauncher.launch` does, each persistent grid capped
    as there (so that virtual ranks sharing a GPU all run at once)."""
    for index, kernel in enumerate(launcher.kernels):
        if roles is not None and kernel["role"] not in roles:
            continue
        rows = m if kernel["rows"] == "m" else protocol.owned_rows(m, launcher.config.tp)
        for rank in ranks:
            launcher.devices[rank].launch(launcher.functions[rank][index], kernel, rows,
                                          launcher.values(rank, buffers[rank], m), launcher.pdl,
                                          launcher.max_ctas[rank][index])


def launch_rank(launcher, rank: int, rank_buffers, m: int, roles=None) -> None:
    """Enqueue one rank's kernels of a call (all of them, or those of ``roles``) on its device."""
    launch_ranks(launcher, [rank], {rank: rank_buffers}, m, roles)


def _query(device) -> str | None:
    """None while the device's stream runs; "" once it finished; the error text after a fault."""
    try:
        with device.current():
            result = driver.cuStreamQuery(device.stream)
            if result[0] == driver.CUresult.CUDA_ERROR_NOT_READY:
                return None
            check(result, f"cuStreamQuery(device {device.ordinal})")
    except CudaError as error:
        return str(error)
    return ""


def wait_ranks(launcher, ranks, start: float) -> dict:
    """Poll the ranks' devices together until each finishes or faults, or the host deadline.

    Returns, per rank: ``completed``, ``error`` (text or None), ``hung`` and
    ``elapsed_s`` (from ``start`` until the host saw the outcome).
    """
    outcomes = {}
    pending = list(ranks)
    while pending:
        for rank in list(pending):
            text = _query(launcher.devices[rank])
            if text is not None:
                outcomes[rank] = {"completed": text == "", "error": text or None, "hung": False,
                                  "elapsed_s": time.monotonic() - start}
                pending.remove(rank)
        if pending and time.monotonic() - start > HOST_DEADLINE_S:
            for rank in pending:
                outcomes[rank] = {"completed": False, "error": None, "hung": True,
                                  "elapsed_s": time.monotonic() - start}
            break
        time.sleep(POLL_S)
    return {str(rank): outcome for rank, outcome in outcomes.items()}


def status(launcher, rank: int) -> dict:
    """Rank's status block (host memory: readable after a fault), decoded."""
    words = launcher.status(rank)
    mask = words[protocol.STATUS_MISSING_RANKS]
    return {
        "words": words,
        "code": words[protocol.STATUS_CODE],
        "stage": words[protocol.STATUS_STAGE],
        "token": words[protocol.STATUS_TOKEN],
        "missing_ranks": [r for r in range(launcher.config.tp) if mask >> r & 1],
        "call": words[protocol.STATUS_CALL],
    }


def truncated(problem: numerics.RankInputs, m: int) -> numerics.RankInputs:
    """The first m tokens of ``problem``."""
    shared = None if problem.shared is None else problem.shared[:m]
    return numerics.RankInputs(problem.routed, problem.weights[:m], problem.indices[:m], shared)


def output_failure(config, bits: np.ndarray, problems, m: int, rank: int) -> str | None:
    """Why rank's output (raw bf16 bits) is not the float64 model of ``problems``; None if it is."""
    total, bound = numerics.expected_sum(problems, config.routed_scaling_factor)
    scatter = config.algorithm == "reduce_scatter"
    rows = protocol.owned_rows(m, config.tp) if scatter else m
    if not np.all(bits[rows:] == numerics.POISON_BF16):
        return f"rank {rank}: rows past {rows} were written"
    reference = numerics.owned(total, config.tp, rank) if scatter else total
    reference_bound = numerics.owned(bound, config.tp, rank) if scatter else bound
    try:
        numerics.assert_close(bits[:rows].view(numerics.BF16), reference, reference_bound, what=f"rank {rank}")
    except AssertionError as error:
        return str(error)
    return None


def stale_slots(launcher, rank: int) -> list[list]:
    """Mailbox rows of ``rank`` holding any non-empty lane: ``[area, stage, src, slot]`` (gather: src -1)."""
    contributions, gather = launcher.mailbox(rank)
    rows = [["contributions", *map(int, index)]
            for index in np.argwhere(np.any(contributions != protocol.EMPTY_BF16, axis=-1))]
    rows += [["gather", int(stage), -1, int(slot)]
             for stage, slot in np.argwhere(np.any(gather != protocol.EMPTY_BF16, axis=-1))]
    return rows


def stage_words(launcher, rank: int) -> dict:
    state = launcher.stage_state(rank)
    return {"next_stage": int(state[protocol.NEXT_STAGE]), "arrivals": int(state[protocol.ARRIVALS]),
            "call_count": int(state[protocol.CALL_COUNT])}


def silent_peer(args) -> None:
    """``--warmup`` healthy calls of a group of ``--tp``, then a call that every rank but
    ``--silent-rank`` runs; the group's first call is number ``--first-call`` (its stage words
    are set so). ``m`` is at least tp + 1, so that every rank owns a token (reduce_scatter and
    twoshot) and waits for the silent rank."""
    config = sanitize_configs()[args.config] if args.config else config_for(args.algorithm, args.tp)
    tp, silent = config.tp, args.silent_rank
    if tp != args.tp or not 0 <= silent < tp:
        raise ValueError(f"--tp {args.tp} --silent-rank {silent}: {config.key} is a group of {tp}")
    waiting = [rank for rank in range(tp) if rank != silent]
    m = max(5, tp + 1)
    rng = np.random.default_rng(args.seed)
    with group(args.algorithm, FAULT_TIMEOUT_NS, config=config) as launcher:
        launcher.start_at_call(args.first_call)
        buffers = launcher.allocate(CAPACITY_M, ROUTED_ROWS)
        for _ in range(args.warmup):
            prepare_call(buffers, [random_problem(config, rng, m) for _ in buffers], rng, m)
            launcher.run(buffers, m)
        prepare_call([buffers[rank] for rank in waiting], [random_problem(config, rng, m) for _ in waiting], rng, m)
        start = time.monotonic()
        launch_ranks(launcher, waiting, buffers, m)
        outcomes = wait_ranks(launcher, waiting, start)
        finish({
            "key": config.key, "tp": tp, "m": m, "timeout_s": FAULT_TIMEOUT_NS / 1e9, "warmup": args.warmup,
            "first_call": args.first_call, "waiting": waiting, "silent": silent, "outcomes": outcomes,
            "gpu_of_rank": [device.ordinal for device in launcher.devices],
            "status": [status(launcher, rank) for rank in range(config.tp)],
        })


def flagged_silent_peer(args) -> None:
    """Under ON_TIMEOUT_FLAG: a healthy call, a call that rank 1 skips, then a call on both."""
    m = 5
    rng = np.random.default_rng(args.seed)
    with group(args.algorithm, FAULT_TIMEOUT_NS, protocol.ON_TIMEOUT_FLAG) as launcher:
        config = launcher.config
        buffers = launcher.allocate(CAPACITY_M, ROUTED_ROWS)
        calls, history = [], []
        for ranks in ([0, 1], [0], [0, 1]):
            problems = [random_problem(config, rng, m) for _ in range(config.tp)]
            history.append(problems)
            for rank in ranks:
                prepare(buffers[rank], problems[rank])
            start = time.monotonic()
            for rank in ranks:
                launch_rank(launcher, rank, buffers[rank], m)
            outcomes = wait_ranks(launcher, ranks, start)
            calls.append({
                "ranks": ranks, "outcomes": outcomes,
                # None where the output is the model of the call's partials.
                "output_failure": {str(r): output_failure(config, buffers[r].output(), problems, m, r)
                                   for r in ranks if outcomes[str(r)]["completed"]},
                "all_nan": {str(r): bool(np.all(np.isnan(_written(config, buffers[r].output(), m, r))))
                            for r in ranks if outcomes[str(r)]["completed"]},
                "status": [status(launcher, rank) for rank in range(config.tp)],
                "halt": [int(launcher.stage_state(rank)[protocol.HALT]) for rank in range(config.tp)],
            })
        # In the last call rank 1 consumes what halted rank 0 published in the call rank 1
        # skipped: per written row, NaN or that mix; anything else is a protocol change.
        mixed = [history[1][0], history[2][1]]
        total, bound = numerics.expected_sum(mixed, config.routed_scaling_factor)
        if config.algorithm == "reduce_scatter":
            total, bound = numerics.owned(total, config.tp, 1), numerics.owned(bound, config.tp, 1)
        rows = _written(config, buffers[1].output(), m, 1)
        kinds = []
        for row, values in enumerate(rows):
            if np.all(np.isnan(values)):
                kinds.append("nan")
            elif np.all(np.abs(values - total[row]) <= bound[row] + 1e-30):
                kinds.append("mixed")
            else:
                kinds.append("other")
        calls[-1]["rank_1_rows"] = kinds
        finish({"algorithm": config.algorithm, "m": m, "timeout_s": FAULT_TIMEOUT_NS / 1e9, "calls": calls})


def _written(config, bits: np.ndarray, m: int, rank: int) -> np.ndarray:
    """The rows of a rank's output that the call writes with data (as float32)."""
    rows = protocol.owned_rows(m, config.tp) if config.algorithm == "reduce_scatter" else m
    values = bits[:rows].view(numerics.BF16).astype(np.float32)
    if config.algorithm == "reduce_scatter":
        values = values[~numerics.tokenless_rows(rows, config.tp, rank, m)]
    return values


def double_publish(args) -> None:
    """Rank 1 publishes calls n and n+1 back to back with no reduce; then rank 0 runs call n
    and rank 1 the rest of call n; then one healthy call on both."""
    m = 5
    rng = np.random.default_rng(args.seed)
    with group(args.algorithm, FAULT_TIMEOUT_NS) as launcher:
        config = launcher.config
        call_n = launcher.allocate(CAPACITY_M, ROUTED_ROWS)
        call_next = launcher.allocate(CAPACITY_M, ROUTED_ROWS)
        problems_n = [random_problem(config, rng, m) for _ in range(config.tp)]
        problem_next = random_problem(config, rng, m)
        for rank_buffers, problem in zip(call_n, problems_n):
            prepare(rank_buffers, problem)
        prepare(call_next[1], problem_next)

        start = time.monotonic()
        launch_rank(launcher, 1, call_n[1], m, roles=("publish",))
        launch_rank(launcher, 1, call_next[1], m, roles=("publish",))
        publishes = wait_ranks(launcher, [1], start)["1"]
        stage_after_publishes = stage_words(launcher, 1)

        # Rank 0's whole call n, and the rest of rank 1's (its waits), together: in
        # twoshot each rank's gather waits for the other's reduce.
        start = time.monotonic()
        launch_rank(launcher, 0, call_n[0], m)
        launch_rank(launcher, 1, call_n[1], m, roles=launcher.roles[1:])
        outcomes = wait_ranks(launcher, range(config.tp), start)

        outputs = [call_n[rank].output() for rank in range(config.tp)]
        mixed = [problems_n[0], problem_next]
        result = {
            "algorithm": config.algorithm, "publishes": publishes, "outcomes": outcomes,
            "stage_after_publishes": stage_after_publishes,
            # None where the output IS the model of those partials.
            "differs_from_call_n": [output_failure(config, bits, problems_n, m, rank)
                                    for rank, bits in enumerate(outputs)],
            "differs_from_mixed": [output_failure(config, bits, mixed, m, rank)
                                   for rank, bits in enumerate(outputs)],
            "status": [status(launcher, rank) for rank in range(config.tp)],
            "stage": [stage_words(launcher, rank) for rank in range(config.tp)],
            "stale": [stale_slots(launcher, rank) for rank in range(config.tp)],
        }
        problems = [random_problem(config, rng, m) for _ in range(config.tp)]
        for rank_buffers, problem in zip(call_n, problems):
            prepare(rank_buffers, problem)
        launcher.run(call_n, m)
        result["next_call_failures"] = [
            output_failure(config, call_n[rank].output(), problems, m, rank) for rank in range(config.tp)
        ]
        finish(result)


def mismatched_m(args) -> None:
    """Rank r runs one whole call with ``args.m[r]`` tokens."""
    ms = args.m
    rng = np.random.default_rng(args.seed)
    with group(args.algorithm, FAULT_TIMEOUT_NS) as launcher:
        config = launcher.config
        buffers = launcher.allocate(CAPACITY_M, ROUTED_ROWS)
        problems = [random_problem(config, rng, m) for m in ms]
        for rank_buffers, problem in zip(buffers, problems):
            prepare(rank_buffers, problem)
        start = time.monotonic()
        for rank, m in enumerate(ms):
            launch_rank(launcher, rank, buffers[rank], m)
        # The rank with fewer tokens completes at once. Read it before the other rank's
        # trap: after a trap on one GPU, copies from the other failed too (2x H200).
        small = int(np.argmin(ms))
        outcomes = wait_ranks(launcher, [small], start)
        result = {
            "algorithm": config.algorithm, "m": ms, "timeout_s": FAULT_TIMEOUT_NS / 1e9,
            "output_failure": {}, "stale": {}, "stage": {},
        }
        if outcomes[str(small)]["completed"]:
            time.sleep(0.02)  # the other rank's publish of its extra tokens lands meanwhile
            common = [truncated(problem, min(ms)) for problem in problems]
            result["output_failure"][str(small)] = output_failure(
                config, buffers[small].output(), common, ms[small], small
            )
            result["stale"][str(small)] = stale_slots(launcher, small)
            result["stage"][str(small)] = stage_words(launcher, small)
        outcomes.update(wait_ranks(launcher, [1 - small], start))
        result["outcomes"] = outcomes
        result["status"] = [status(launcher, rank) for rank in range(config.tp)]
        finish(result)


def _nonfinite_problems(config, rng, m: int) -> list[numerics.RankInputs]:
    """Two ranks' inputs with NaN and Inf placed so that each token tests one rule.

    Rows 1-3 of ``routed`` hold NaN (columns 0-15), +Inf and -Inf (columns
    16-31); row 0 stays finite (the float64 model reads it for skipped experts).
    token 0: rank 0 reads the NaN row; token 1: rank 0 reads +Inf; token 2:
    rank 0 reads +Inf and -Inf (NaN); token 3: rank 0 +Inf, rank 1 -Inf (NaN
    only in the sum); token 4: a NaN weight on index -1 (skipped: finite);
    token 5: a NaN weight on a valid index; token 6: +Inf and -Inf in the
    shared rows of different columns.
    """
    problems = []
    for rank in range(config.tp):
        problem = random_problem(config, rng, m)
        problem.indices = rng.integers(4, ROUTED_ROWS, problem.indices.shape).astype(np.int32)
        routed = problem.routed.astype(np.float32)
        routed[1, :16] = np.nan
        routed[2, 16:32] = np.inf
        routed[3, 16:32] = -np.inf
        problem.routed = routed.astype(numerics.BF16)
        weights = problem.weights.astype(np.float32)
        if rank == 0:
            problem.indices[0, 0] = 1
            problem.indices[1, 0] = 2
            problem.indices[2, 0] = 2
            problem.indices[2, -1] = 3  # (with top_k 1 token 2 reads only -Inf)
            problem.indices[3, 0] = 2
            weights[5, 0] = np.nan
        else:
            problem.indices[3, 0] = 3
        problem.indices[4, 0] = -1
        weights[4, 0] = np.nan
        problem.weights = weights.astype(problem.weights.dtype)
        if problem.shared is not None:
            shared = problem.shared.astype(np.float32)
            shared[6, 40 + rank] = np.inf if rank == 0 else -np.inf
            problem.shared = shared.astype(numerics.BF16)
        problems.append(problem)
    return problems


def _nonfinite_failure(config, bits: np.ndarray, problems, m: int, rank: int) -> str | None:
    """Why rank's output does not carry NaN and Inf where the float64 model does; None if it does."""
    with np.errstate(invalid="ignore", over="ignore"):
        total, bound = numerics.expected_sum(problems, config.routed_scaling_factor)
    scatter = config.algorithm == "reduce_scatter"
    rows = protocol.owned_rows(m, config.tp) if scatter else m
    if scatter:
        total, bound = numerics.owned(total, config.tp, rank), numerics.owned(bound, config.tp, rank)
    out = bits[:rows].view(numerics.BF16).astype(np.float64)
    nan = np.isnan(total)
    if not np.array_equal(np.isnan(out), nan):
        return f"rank {rank}: NaN at {np.argwhere(np.isnan(out) != nan)[:5].tolist()} differs from the model"
    inf = np.isinf(total)
    if not np.array_equal(out[inf], total[inf]):
        return f"rank {rank}: Inf values differ from the model at {np.argwhere(inf)[:5].tolist()}"
    finite = ~(nan | inf)
    if not np.all(np.isfinite(out[finite])):
        return f"rank {rank}: non-finite output where the model is finite"
    if not np.all(np.abs(out[finite] - total[finite]) <= bound[finite]):
        return f"rank {rank}: finite elements outside the bound"
    if not np.all(bits[rows:] == numerics.POISON_BF16):
        return f"rank {rank}: rows past {rows} were written"
    return None


def _negative_zero_problems(config, rng, m: int) -> list[numerics.RankInputs]:
    """Inputs whose partials round to bf16 -0.0 before the publish turns them into +0.0."""
    return numerics.make_negative_zero([random_problem(config, rng, m) for _ in range(config.tp)], rng)


def _special_values(args, make_problems, failure, calls: int) -> None:
    """``calls`` healthy calls per algorithm on inputs from ``make_problems``, each output checked by ``failure``."""
    m = 7
    rng = np.random.default_rng(args.seed)
    report = {}
    for algorithm in ALGORITHMS:
        with group(algorithm, HEALTHY_TIMEOUT_NS) as launcher:
            config = launcher.config
            buffers = launcher.allocate(CAPACITY_M, ROUTED_ROWS)
            failures = []
            start = time.monotonic()
            for call in range(calls):
                problems = make_problems(config, rng, m)
                for rank_buffers, problem in zip(buffers, problems):
                    prepare(rank_buffers, problem)
                launcher.run(buffers, m)
                outputs = [b.output() for b in buffers]
                failures += [f"call {call}: {text}" for rank, bits in enumerate(outputs)
                             if (text := failure(config, bits, problems, m, rank))]
                if config.algorithm != "reduce_scatter" and not np.array_equal(outputs[0][:m], outputs[1][:m]):
                    failures.append(f"call {call}: the ranks' outputs differ in bits")
            elapsed = time.monotonic() - start
            stale = [stale_slots(launcher, rank) for rank in range(config.tp)]
            if any(stale):
                failures.append(f"lanes not re-armed: {stale}")
            report[algorithm] = {"calls": calls, "elapsed_s": elapsed, "failures": failures}
    finish(report)


def nonfinite(args) -> None:
    _special_values(args, _nonfinite_problems, _nonfinite_failure, calls=2)


def _zero_failure(config, bits: np.ndarray, problems, m: int, rank: int) -> str | None:
    rows = protocol.owned_rows(m, config.tp) if config.algorithm == "reduce_scatter" else m
    if not np.all(bits[:rows] == 0):
        return f"rank {rank}: {np.sum(bits[:rows] != 0)} elements are not +0.0"
    return None


def negative_zero(args) -> None:
    # Four calls: every stage is used, and stage 0 a second time.
    _special_values(args, _negative_zero_problems, _zero_failure, calls=protocol.STAGES + 1)


def sanitize_configs() -> dict:
    """The configs `sanitize` runs, by name: one per unfused algorithm, the fused variants (own
    partials in shared memory, in the mailbox, 8-byte fragments), and the RMSNorm epilogue
    unfused, fused in a portable cluster, and fused in a cluster beyond the portable 8 CTAs."""
    fused = [c for c in gpu_matrix.variants(2) if c.fuse_reduce]
    epilogues = [c for c in gpu_matrix.epilogues(2) if c.algorithm == "oneshot" and c.hidden == 7168]
    return {
        "oneshot": config_for("oneshot"),
        "twoshot": config_for("twoshot"),
        "fused": next(c for c in fused if c.elements_per_thread == 8 and c.keep_own_partial),
        "fused-own-slot": next(c for c in fused if not c.keep_own_partial),
        "fused-4-elements": next(c for c in fused if c.elements_per_thread == 4),
        "rmsnorm": next(c for c in epilogues if not c.fuse_reduce),
        "rmsnorm-fused": next(c for c in epilogues if c.fuse_reduce and c.ctas_per_row <= PORTABLE_CLUSTER_CTAS),
        "rmsnorm-fused-14-ctas": next(c for c in epilogues if c.fuse_reduce and c.ctas_per_row == 14),
    }


# Fused grids capped below their tiles, unequal by rank: every CTA loops.
SANITIZE_GRID_LIMITS = [3, 7]


def sanitize(args) -> dict:
    """A few healthy calls of each of `sanitize_configs` with checked outputs; returns normally
    (no fault)."""
    rng = np.random.default_rng(args.seed)
    report = {}
    for name, config in sanitize_configs().items():
        grid_limits = SANITIZE_GRID_LIMITS if config.fuse_reduce else None
        with group(config.algorithm, SANITIZE_TIMEOUT_NS, config=config, grid_limits=grid_limits) as launcher:
            buffers = launcher.allocate(CAPACITY_M, ROUTED_ROWS)
            failures = []
            for m in (1, 5, CAPACITY_M):
                problems = [random_problem(config, rng, m) for _ in range(config.tp)]
                epilogue_inputs = prepare_call(buffers, problems, rng, m)
                if epilogue_inputs is None:
                    launcher.run(buffers, m)
                    failures += [f"m={m}: {text}" for rank, b in enumerate(buffers)
                                 if (text := output_failure(config, b.output(), problems, m, rank))]
                    continue
                residual, norm_weight = epilogue_inputs
                launcher.run(buffers, m)
                total, bound = numerics.expected_sum(problems, config.routed_scaling_factor)
                for rank, b in enumerate(buffers):
                    out, residual_out = b.output(), b.residual_output()
                    failures += [f"m={m}: rank {rank}'s {name} rows past {m} were written"
                                 for name, bits in (("out", out), ("residual_out", residual_out))
                                 if not np.all(bits[m:] == numerics.POISON_BF16)]
                    try:
                        numerics.assert_epilogue_close(
                            out[:m].view(numerics.BF16), residual_out[:m].view(numerics.BF16),
                            total, bound, residual, norm_weight, EPILOGUE_EPS, what=f"rank {rank}")
                    except AssertionError as error:
                        failures.append(f"m={m}: {error}")
            report[name] = {"key": config.key, "failures": failures}
    return report


# --- public API ---------------------------------------------------------------------------------

API_PROBLEM = gpu_matrix.DEFAULT_PROBLEMS[3]  # the example's problem: its default configs are prebuilt
API_M = 5
CHAIN_LAYERS = 8


def _api(tp: int = 2):
    """(jax, jmp, mesh over GPUs 0 to tp - 1, or over the rank processes' devices), imported only
    by the public-API programs."""
    rank_processes.join()
    import jax

    import jax_moe_publish as jmp

    gpus = [d for d in jax.devices() if d.platform == "gpu"][:tp]
    if len(gpus) < tp:
        raise RuntimeError(f"{tp} GPUs needed, JAX sees {jax.devices()}")
    return jax, jmp, jax.sharding.Mesh(np.array(gpus), ("tp",))


def _api_mailbox(jmp, mesh, timeout_s: float = 5.0, on_timeout: str = "abort"):
    return jmp.Mailbox(mesh, "tp", hidden=API_PROBLEM.hidden, capacity_m=CAPACITY_M, timeout_s=timeout_s,
                       on_timeout=on_timeout)


def _api_config(tp: int = 2):
    return tuning.kernel_config(API_PROBLEM, tp=tp, m=API_M)


def _api_problems(rng, tp: int) -> list[numerics.RankInputs]:
    """Fresh inputs of one call for every rank, different on each."""
    config = _api_config(tp)
    return [random_problem(config, rng, API_M) for _ in range(tp)]


def _api_args(jax, mesh, problems):
    """Per-rank inputs stacked on a leading rank axis and laid out along ``tp``."""
    from jax.sharding import PartitionSpec as P

    fields = ("routed", "weights", "indices", "shared")
    return [rank_processes.place(mesh, P("tp"), np.stack([getattr(p, f) for p in problems])) for f in fields]


def _api_step(jax, jmp, mailbox):
    """jit(shard_map) of one call on ``mailbox``: [tp, ...] stacks in, [tp, m, hidden] out (one row per rank)."""
    from jax.sharding import PartitionSpec as P

    def shard(routed, weights, indices, shared):
        out = jmp.moe_finalize_publish(
            routed[0], weights[0], indices[0], shared[0], mailbox=mailbox,
            routed_scaling_factor=API_PROBLEM.routed_scaling_factor, impl="kernel",
        )
        return out[None]

    return jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=P("tp"), out_specs=P("tp")))


def _api_failure(out: np.ndarray, problems) -> str | None:
    """Why the per-rank outputs ``out`` [tp, m, hidden] are not the group's sum; None if they are."""
    total, bound = numerics.expected_sum(problems, API_PROBLEM.routed_scaling_factor)
    failures = []
    for rank, rank_out in enumerate(out):
        try:
            numerics.assert_close(rank_out, total, bound, what=f"rank {rank}")
        except AssertionError as error:
            failures.append(str(error))
    for rank, rank_out in enumerate(out[1:], 1):
        if not np.array_equal(rank_out.view(np.uint16), out[0].view(np.uint16)):
            failures.append(f"rank {rank}'s output differs in bits from rank 0's")
    return "; ".join(failures) or None


def _outcome(call) -> dict:
    """Run ``call``; how it ended: ``raised`` (exception type or None), ``message``, ``cause``."""
    start = time.monotonic()
    try:
        value = call()
    except Exception as error:
        cause = error.__cause__
        return {"raised": type(error).__name__, "message": str(error), "value": None,
                "cause": None if cause is None else f"{type(cause).__name__}: {cause}",
                "elapsed_s": time.monotonic() - start}
    return {"raised": None, "message": None, "value": value, "cause": None,
            "elapsed_s": time.monotonic() - start}


def api_timeout(args) -> None:
    """On ``--tp`` GPUs: one healthy call, then a call in which ``--silent-rank`` skips the op
    (a `lax.cond` on the rank), under `Mailbox.diagnose` and followed by `Mailbox.check`; then
    the status words once every other rank's wait has timed out (each device's on its own), and
    a close. The outcome names this process's waiting ranks and those whose rows came back NaN
    (with ``--on-timeout flag``)."""
    tp, silent = args.tp, args.silent_rank
    if not 0 <= silent < tp:
        raise ValueError(f"--silent-rank {silent}: a group of {tp} has ranks 0 to {tp - 1}")
    jax, jmp, mesh = _api(tp)
    from jax import lax
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(args.seed)
    shared_gpu = rank_processes.current() is not None and rank_processes.current().gpus < tp
    timeout_s = (SHARED_GPU_FAULT_TIMEOUT_NS if shared_gpu else FAULT_TIMEOUT_NS) / 1e9
    mailbox = _api_mailbox(jmp, mesh, timeout_s=timeout_s, on_timeout=args.on_timeout)
    problems = _api_problems(rng, tp)
    healthy_inputs = _api_args(jax, mesh, problems)
    healthy = _api_step(jax, jmp, mailbox).lower(*healthy_inputs).compile()
    # Rank processes compile at different speeds: with a short timeout, the first to finish
    # would time out waiting for the slowest, not for the silent rank.
    rank_processes.barrier()
    healthy_failure = _api_failure(rank_processes.to_host(healthy(*healthy_inputs)), problems)

    def shard(routed, weights, indices, shared):
        def publish():
            return jmp.moe_finalize_publish(
                routed[0], weights[0], indices[0], shared[0], mailbox=mailbox,
                routed_scaling_factor=API_PROBLEM.routed_scaling_factor, impl="kernel",
            )

        def skip():
            return jax.numpy.zeros((API_M, API_PROBLEM.hidden), jax.numpy.bfloat16)

        return lax.cond(lax.axis_index("tp") != silent, publish, skip)[None]

    # The branches differ per rank by design, so the varying-axes check is off.
    faulty = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    inputs = _api_args(jax, mesh, _api_problems(rng, tp))
    compiled = faulty.lower(*inputs).compile()
    rank_processes.barrier()

    nan_ranks = []

    def step():
        with mailbox.diagnose():
            out = compiled(*inputs).block_until_ready()
        # A flagged wait returns: its rows, then the status words, tell.
        nan_ranks.extend(shard.index[0].start for shard in out.addressable_shards
                         if np.isnan(np.asarray(shard.data, np.float32)).all())
        mailbox.check()

    outcome = _outcome(step)
    outcome.pop("value")
    outcome["nan_ranks"] = sorted(nan_ranks)
    outcome["waiting_ranks"] = sorted(s["rank"] for s in mailbox.status() if s["rank"] != silent)
    # The error came from the first device to fail; the others' waits time out on their own.
    deadline = time.monotonic() + HOST_DEADLINE_S
    while time.monotonic() < deadline and any(
            s["code"] == protocol.STATUS_OK for s in mailbox.status() if s["rank"] != silent):
        time.sleep(0.01)
    status_words = mailbox.status()
    # What `with Mailbox(...)` does next: an error here would replace the diagnostic.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        closing = _outcome(mailbox.close)
    closing.pop("value")
    closing["warning"] = " | ".join(str(w.message) for w in caught)
    finish({"tp": tp, "silent": silent, "on_timeout": args.on_timeout, "m": API_M,
            "healthy_failure": healthy_failure, "mailbox_id": mailbox.id,
            "outcome": outcome, "timeout_s": timeout_s, "status": status_words,
            "close_after_fault": closing, "status_after_close": mailbox.status()})


def two_mailboxes(args) -> None:
    """Calls alternate between two mailboxes' jitted functions; then mailbox a is closed and its
    compiled function called again; then mailbox b must still work."""
    jax, jmp, mesh = _api()
    from jax_moe_publish import _extension

    rng = np.random.default_rng(args.seed)
    mailboxes = {"a": _api_mailbox(jmp, mesh), "b": _api_mailbox(jmp, mesh)}
    steps = {name: _api_step(jax, jmp, mailbox) for name, mailbox in mailboxes.items()}
    captured_before, _ = _extension.execute_counts()
    failures = []
    for call in range(12):
        name = "ab"[call % 2]
        problems = _api_problems(rng, 2)
        if text := _api_failure(rank_processes.to_host(steps[name](*_api_args(jax, mesh, problems))), problems):
            failures.append(f"call {call} on {name}: {text}")
    captured_after, _ = _extension.execute_counts()

    mailboxes["a"].close()

    def call_closed():
        with mailboxes["a"].diagnose():
            return rank_processes.to_host(steps["a"](*_api_args(jax, mesh, _api_problems(rng, 2))))

    closed = _outcome(call_closed)
    closed["value"] = None if closed["value"] is None else "an array"
    problems = _api_problems(rng, 2)
    after = _outcome(lambda: _api_failure(rank_processes.to_host(steps["b"](*_api_args(jax, mesh, problems))),
                                          problems))
    finish({
        "alternate_failures": failures, "captured_calls": captured_after - captured_before,
        "closed_id": mailboxes["a"].id, "closed_call": closed, "other_mailbox_after": after,
        "status_b": mailboxes["b"].status(),
    })


def closed_chain(args) -> None:
    """A chain of CHAIN_LAYERS calls in one jit, on inputs that differ by rank, run three times on
    the same input arrays (XLA records its command buffer, then replays it), then run again after
    its mailbox is closed. Reports the handler's executes of each run: a run with none replayed
    the recorded command buffer, which never runs the handler."""
    jax, jmp, mesh = _api()
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax_moe_publish import _extension

    rng = np.random.default_rng(args.seed)
    mailbox = _api_mailbox(jmp, mesh)
    tp, scale = mailbox.tp, API_PROBLEM.routed_scaling_factor

    def shard(routed, weights, indices, shared):
        y = shared[0]
        outputs = []
        for layer in range(CHAIN_LAYERS):
            y = jmp.moe_finalize_publish(routed[0, layer], weights[0, layer], indices[0, layer], y, mailbox=mailbox,
                                         routed_scaling_factor=scale, impl="kernel")
            outputs.append(y)
        return jnp.stack(outputs)[None]

    # Each rank's own output buffers, so that every rank's result is checked.
    chain = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    config = _api_config(tp)
    # layers[r][l]: rank r's inputs of layer l, different on every rank (the shared input of
    # layer l > 0 is the chain's: layer l - 1's result).
    layers = [[random_problem(config, rng, API_M) for _ in range(CHAIN_LAYERS)] for _ in range(tp)]
    # Placed once, so that every run reads the same input buffers.
    inputs = [rank_processes.place(mesh, P("tp"), np.stack([np.stack([getattr(p, f) for p in rank_layers])
                                                            for rank_layers in layers]))
              for f in ("routed", "weights", "indices")]
    inputs.append(rank_processes.place(mesh, P("tp"), np.stack([rank_layers[0].shared for rank_layers in layers])))

    def per_rank(out) -> np.ndarray:
        """Each rank's outputs, [tp, CHAIN_LAYERS, m, hidden]."""
        return rank_processes.to_host(out)

    def check(out: np.ndarray) -> str | None:
        """Why the ranks' outputs are not the chain's model; None if they are."""
        for rank in range(1, tp):
            if not np.array_equal(out[rank].view(np.uint16), out[0].view(np.uint16)):
                return f"rank {rank}'s outputs differ in bits from rank 0's"
        previous = None
        for layer in range(CHAIN_LAYERS):
            problems = [numerics.RankInputs(layers[r][layer].routed, layers[r][layer].weights, layers[r][layer].indices,
                                         layers[r][0].shared if layer == 0 else previous) for r in range(tp)]
            expected, bound = numerics.expected_sum(problems, scale)
            try:
                numerics.assert_close(out[0, layer], expected, bound, what=f"layer {layer}")
            except AssertionError as error:
                return str(error)
            previous = out[0, layer]
        return None

    def executes_since(before) -> dict:
        return dict(zip(("captured", "direct"), (n - b for n, b in zip(_extension.execute_counts(), before))))

    runs = []
    for _ in range(3):
        before = _extension.execute_counts()
        out = chain(*inputs)
        failure = check(per_rank(out))
        del out  # lets XLA hand the next run the same output buffers
        runs.append({**executes_since(before), "failure": failure})
    mailbox.close()

    def call_closed():
        with mailbox.diagnose():
            return check(per_rank(chain(*inputs)))

    before = _extension.execute_counts()
    closed = _outcome(call_closed)
    finish({
        "runs": runs, "closed_id": mailbox.id, "closed_call": closed, "status_after": mailbox.status(),
        "handler_executes_after_close": executes_since(before),
    })


PROGRAMS = {
    "silent-peer": silent_peer,
    "flagged-silent-peer": flagged_silent_peer,
    "double-publish": double_publish,
    "mismatched-m": mismatched_m,
    "nonfinite": nonfinite,
    "negative-zero": negative_zero,
    "sanitize": sanitize,
    "api-timeout": api_timeout,
    "two-mailboxes": two_mailboxes,
    "closed-chain": closed_chain,
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("program", choices=sorted(PROGRAMS))
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="oneshot")
    parser.add_argument("--tp", type=int, choices=gpu_matrix.GROUP_TPS, default=2,
                        help="group size of silent-peer and api-timeout")
    parser.add_argument("--silent-rank", type=int, default=1, help="the rank that never calls (below --tp)")
    parser.add_argument("--on-timeout", choices=("abort", "flag"), default="abort", help="api-timeout's mailbox's")
    parser.add_argument("--warmup", type=int, default=2, help="healthy calls before the fault")
    parser.add_argument("--first-call", type=int, default=0, help="number of the group's first call")
    parser.add_argument("--config", choices=sorted(sanitize_configs()),
                        help="a config of `sanitize_configs` instead of --algorithm's first")
    parser.add_argument("--m", type=int, nargs=2, default=(3, 5), help="m of rank 0 and rank 1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        result = PROGRAMS[args.program](args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Only `sanitize` returns (the others leave through `finish`): a normal exit, so the
    # sanitizer sees every allocation freed.
    local_processes.report(result)


if __name__ == "__main__":
    main()
