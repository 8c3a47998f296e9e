"""GPU tests of the device kernels, run through `gpu_harness`: a group's ranks on as many GPUs as
there are, with virtual ranks sharing them where there are fewer (one GPU suffices).

Every config comes from `gpu_matrix.variants`, the set prebuilt for the GPU
machine. A call's outputs are compared with the float64 model of `numerics`;
the all-reduce algorithms must also agree bit for bit across ranks. After every
call the protocol state is checked too: the status block is zero (healthy),
the stage words have advanced once per call, and every mailbox lane is back
to the empty sentinel (every consumed slot re-armed, nothing stale).
"""

from __future__ import annotations


import numpy as np
import pytest

import numerics
from kernel_checks import (
    CAPACITY_M,
    check_protocol_state,
    open_test_group,
    random_problems,
    routed_rows,
    seeded_rng,
)
from jax_moe_publish import protocol
from jax_moe_publish.config import GROUP_ALGORITHMS
from jax_moe_publish.config import FUSED_ALGORITHMS
from jax_moe_publish.testing import gpu_matrix

pytestmark = pytest.mark.gpu

M_VALUES = (1, 3, 37, CAPACITY_M)

# Consecutive calls on one mailbox: a small capacity and few routed rows keep
# fresh data for every call cheap.
ROUNDS = 200
"""Calls at tp = 2; larger groups make fewer (each call runs tp ranks), over as many stages."""
ROUNDS_CAPACITY_M = 16
ROUNDS_ROUTED_ROWS = 16
CHAINED_CALLS = 12

TP1_CONFIGS = gpu_matrix.variants(1)
GROUP_CONFIGS = [c for tp in gpu_matrix.GROUP_TPS for c in gpu_matrix.variants(tp)]
# One config of each group algorithm, unfused and fused, per group size: for the tests of
# consecutive calls.
ALGORITHM_CONFIGS = [
    next(c for c in GROUP_CONFIGS if c.tp == tp and c.algorithm == algorithm and c.fuse_reduce == fused)
    for tp in gpu_matrix.GROUP_TPS for algorithm in GROUP_ALGORITHMS for fused in (False, True)
    if not fused or algorithm in FUSED_ALGORITHMS
]
ONESHOT_CONFIGS = [c for c in GROUP_CONFIGS if c.algorithm == "oneshot"]
FUSED_CONFIGS = [c for c in GROUP_CONFIGS if c.fuse_reduce]
# Per-rank caps of a fused (persistent) grid, repeated over the ranks: CTAs then take several
# tiles, different numbers of them, and the ranks' grids may differ.
GRID_LIMITS = ((1,), (3, 7), (64, 5, 2))


def _grid_limits(pattern, tp: int) -> list[int]:
    return [pattern[rank % len(pattern)] for rank in range(tp)]


def _key(config) -> str:
    return config.key


def _prepare(buffers, problems) -> None:
    for rank_buffers, problem in zip(buffers, problems):
        rank_buffers.upload(problem)
        rank_buffers.out.poison()


def _output_rows(config, m: int) -> int:
    return protocol.owned_rows(m, config.tp) if config.algorithm == "reduce_scatter" else m


def _check_outputs(config, outputs: list[np.ndarray], problems, m: int) -> None:
    """Every rank's output (raw bf16 bits) against the float64 model of the call."""
    total, bound = numerics.expected_sum(problems, config.routed_scaling_factor)
    rows = _output_rows(config, m)
    for rank, bits in enumerate(outputs):
        what = f"{config.key} m={m} rank {rank}"
        assert np.all(bits[rows:] == numerics.POISON_BF16), f"{what}: rows past {rows} were written"
        out = bits[:rows].view(numerics.BF16)
        if config.algorithm == "reduce_scatter":
            reference = numerics.owned(total, config.tp, rank)
            numerics.assert_close(out, reference, numerics.owned(bound, config.tp, rank), what=what)
            unused = numerics.tokenless_rows(rows, config.tp, rank, m)
            assert np.all(bits[:rows][unused] == 0), f"{what}: rows of no token are not +0.0"
        else:
            numerics.assert_close(out, total, bound, what=what)
    if config.algorithm in ("oneshot", "twoshot"):
        for rank, bits in enumerate(outputs[1:], 1):
            assert np.array_equal(bits[:rows], outputs[0][:rows]), (
                f"{config.key} m={m}: rank {rank}'s output differs in bits from rank 0's"
            )


def _negative_zero_problems(config, m: int, rng) -> list[numerics.RankInputs]:
    """Inputs whose partials are bf16 -0.0 (or zero) before the publish sanitizes them."""
    return numerics.make_negative_zero(random_problems(config, m, rng, routed_rows(config, m)), rng)


def _check_one_call(config, m, devices, grid_limits=None) -> None:
    """One call on fresh data: every rank's output, and for a group the protocol state after it."""
    rng = seeded_rng(config.key, m, grid_limits)
    problems = random_problems(config, m, rng, routed_rows(config, m))
    with open_test_group(config, devices, CAPACITY_M, grid_limits) as launcher:
        buffers = launcher.allocate(CAPACITY_M, routed_rows(config, m))
        _prepare(buffers, problems)
        launcher.run(buffers, m)
        _check_outputs(config, [b.output() for b in buffers], problems, m)
        if config.tp > 1:
            check_protocol_state(launcher, calls=1)


@pytest.mark.gpus(1)
@pytest.mark.parametrize("m", M_VALUES, ids=lambda m: f"m{m}")
@pytest.mark.parametrize("config", TP1_CONFIGS, ids=_key)
def test_direct_finalize_matches_model(config, m, devices):
    _check_one_call(config, m, devices)


@pytest.mark.gpus(1)
@pytest.mark.parametrize("m", M_VALUES, ids=lambda m: f"m{m}")
@pytest.mark.parametrize("config", GROUP_CONFIGS, ids=_key)
def test_group_call_matches_model(config, m, devices):
    _check_one_call(config, m, devices)


@pytest.mark.gpus(1)
@pytest.mark.parametrize("grid_limits", GRID_LIMITS, ids=lambda g: "grid" + "-".join(map(str, g)))
@pytest.mark.parametrize("m", (3, CAPACITY_M), ids=lambda m: f"m{m}")
@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=_key)
def test_persistent_grid_matches_model(config, m, grid_limits, devices):
    """A fused grid smaller than the tiles of m: each CTA publishes all of its tiles, then
    reduces them; the result and the protocol state are those of a full grid."""
    _check_one_call(config, m, devices, _grid_limits(grid_limits, config.tp))


@pytest.mark.gpus(1)
@pytest.mark.parametrize("config", ONESHOT_CONFIGS, ids=_key)
def test_negative_zero_is_never_published(config, devices):
    m = 37
    problems = _negative_zero_problems(config, m, seeded_rng(config.key, "negative zero"))
    with open_test_group(config, devices, CAPACITY_M) as launcher:
        buffers = launcher.allocate(CAPACITY_M, routed_rows(config, m))
        _prepare(buffers, problems)
        if config.fuse_reduce:
            # Its publish cannot be watched alone; a published -0.0 would stall its own wait
            # until the timeout traps.
            launcher.run(buffers, m)
        else:
            launcher.launch(buffers, m, roles=("publish",))
            launcher.synchronize()
            for rank in range(config.tp):
                what = f"rank {rank}'s mailbox after the publishes"
                contributions, gather = launcher.mailbox(rank)
                published = contributions[0, :, :m]
                assert not np.any(published == protocol.EMPTY_BF16), f"{what}: a lane holds the sentinel"
                assert np.all(published == 0), f"{what}: published lanes are not +0.0"
                assert np.all(contributions[0, :, m:] == protocol.EMPTY_BF16), f"{what}: slots past m"
                assert np.all(contributions[1:] == protocol.EMPTY_BF16), f"{what}: other stages written"
                assert np.all(gather == protocol.EMPTY_BF16), f"{what}: gather area written"
                assert launcher.stage_state(rank)[protocol.NEXT_STAGE] == 0, f"{what}: stage advanced early"
            # The rest of the call: it must find every slot filled, so it cannot hang.
            launcher.launch(buffers, m, roles=launcher.roles[1:])
            launcher.synchronize()
        outputs = [b.output() for b in buffers]
        _check_outputs(config, outputs, problems, m)
        for rank, bits in enumerate(outputs):
            assert np.all(bits[:m] == 0), f"rank {rank}: a zero result is not +0.0"
        check_protocol_state(launcher, calls=1)


@pytest.mark.gpus(1)
@pytest.mark.parametrize("config", ALGORITHM_CONFIGS, ids=_key)
def test_consecutive_rounds_cycle_the_stages(config, devices):
    rng = seeded_rng(config.key, "rounds")
    with open_test_group(config, devices, ROUNDS_CAPACITY_M) as launcher:
        buffers = launcher.allocate(ROUNDS_CAPACITY_M, ROUNDS_ROUTED_ROWS)
        for round_ in range(ROUNDS * 2 // config.tp):
            m = int(rng.integers(1, ROUNDS_CAPACITY_M, endpoint=True))
            problems = random_problems(config, m, rng, ROUNDS_ROUTED_ROWS)
            _prepare(buffers, problems)
            launcher.run(buffers, m)
            _check_outputs(config, [b.output() for b in buffers], problems, m)
            check_protocol_state(launcher, calls=round_ + 1)


@pytest.mark.gpus(1)
@pytest.mark.parametrize("config", ALGORITHM_CONFIGS, ids=_key)
def test_calls_across_the_call_count_wrap(config, devices):
    """The count wraps to 0 after `protocol.CALL_COUNT_PERIOD` calls, and the stages go on
    cycling through the wrap: call c always has stage c % STAGES."""
    rng = seeded_rng(config.key, "wrap")
    first_call = protocol.CALL_COUNT_PERIOD - 2
    with open_test_group(config, devices, ROUNDS_CAPACITY_M) as launcher:
        launcher.start_at_call(first_call)
        buffers = launcher.allocate(ROUNDS_CAPACITY_M, ROUNDS_ROUTED_ROWS)
        for call in range(protocol.STAGES + 1):
            m = int(rng.integers(1, ROUNDS_CAPACITY_M, endpoint=True))
            problems = random_problems(config, m, rng, ROUNDS_ROUTED_ROWS)
            _prepare(buffers, problems)
            launcher.run(buffers, m)
            _check_outputs(config, [b.output() for b in buffers], problems, m)
            check_protocol_state(launcher, calls=call + 1, first_call=first_call)


@pytest.mark.gpus(1)
@pytest.mark.parametrize("config", ALGORITHM_CONFIGS, ids=_key)
def test_chained_calls_without_host_waits(config, devices):
    """Calls enqueued back to back, as XLA issues them: ranks drift apart by up to a call
    and PDL overlaps each call with the previous one; each call has its own buffers."""
    rng = seeded_rng(config.key, "chained")
    with open_test_group(config, devices, ROUNDS_CAPACITY_M) as launcher:
        calls = []
        for _ in range(CHAINED_CALLS):
            m = int(rng.integers(1, ROUNDS_CAPACITY_M, endpoint=True))
            problems = random_problems(config, m, rng, ROUNDS_ROUTED_ROWS)
            buffers = launcher.allocate(ROUNDS_CAPACITY_M, ROUNDS_ROUTED_ROWS)
            _prepare(buffers, problems)
            calls.append((m, problems, buffers))
        for m, _, buffers in calls:
            launcher.launch(buffers, m)
        launcher.synchronize()
        for m, problems, buffers in calls:
            _check_outputs(config, [b.output() for b in buffers], problems, m)
        check_protocol_state(launcher, calls=CHAINED_CALLS)
