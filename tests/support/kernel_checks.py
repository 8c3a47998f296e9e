"""Fresh data, mailbox groups and protocol checks shared by the kernel-level GPU tests."""

from __future__ import annotations

import zlib

import numpy as np

import gpu_harness
import numerics
from jax_moe_publish import protocol
from jax_moe_publish.aot.store import default_store

CAPACITY_M = 64
TIMEOUT_NS = 10 * 10**9  # a lost contribution traps after 10 s instead of hanging


def seeded_rng(*labels) -> np.random.Generator:
    """A generator seeded from ``labels``: every check draws its own reproducible data."""
    return np.random.default_rng(zlib.crc32(repr(labels).encode()))


def open_test_group(config, devices, capacity_m, grid_limits=None, on_timeout=protocol.ON_TIMEOUT_ABORT):
    """The config's kernels on a group of ``devices`` (the `gpu_harness.DevicePool`), with a mailbox of ``capacity_m`` and the tests' timeout;
    ``grid_limits`` caps each rank's persistent (fused) grid; ``on_timeout`` is the mailbox's
    `protocol.ON_TIMEOUT_ABORT` or `ON_TIMEOUT_FLAG`."""
    return gpu_harness.open_group(
        default_store().get(config), devices, capacity_m=capacity_m, timeout_ns=TIMEOUT_NS,
        on_timeout=on_timeout, grid_limits=grid_limits,
    )


def routed_rows(config, m: int) -> int:
    """Routed rows of a random problem of m tokens (the `numerics.random_problem` default)."""
    return max(1, m * config.top_k // 2)


def random_problems(config, m: int, rng, num_rows: int) -> list[numerics.RankInputs]:
    """Fresh inputs for every rank, with -1 and out-of-range indices."""
    return [
        numerics.random_problem(
            rng, m=m, hidden=config.hidden, top_k=config.top_k, num_rows=num_rows,
            fp32_weights=config.fp32_weights, shared=config.include_shared_expert,
        )
        for _ in range(config.tp)
    ]


def check_protocol_state(launcher, calls: int, first_call: int = 0) -> None:
    """After ``calls`` complete calls on a mailbox, from call number ``first_call`` on: healthy,
    advanced, and every lane empty again."""
    count = (first_call + calls) % protocol.CALL_COUNT_PERIOD
    for rank in range(launcher.config.tp):
        what = f"{launcher.config.key} rank {rank} after {calls} calls from call {first_call}"
        assert launcher.status(rank) == [0] * protocol.STATUS_WORDS, f"{what}: status words set"
        state = launcher.stage_state(rank)
        assert state[protocol.NEXT_STAGE] == count % protocol.STAGES, f"{what}: stage words {state}"
        assert state[protocol.ARRIVALS] == 0, f"{what}: arrival count not reset: {state}"
        assert state[protocol.CALL_COUNT] == count, f"{what}: stage words {state}"
        for name, area in zip(("contributions", "gather area"), launcher.mailbox(rank)):
            stale = np.argwhere(area != protocol.EMPTY_BF16)
            assert stale.size == 0, (
                f"{what}: {len(stale)} {name} lanes not re-armed, first at {stale[0]}"
            )
