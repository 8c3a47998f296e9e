"""Two processes joined by ``jax.distributed`` on localhost: the mailbox across processes.

Each case runs a program of `process_programs` in two child processes (the
parent never touches the GPUs) with a deadline on each, so a bug fails the
test instead of hanging it. Kernels come from the prebuilt ``tests`` preset.
Each process takes a GPU of its own where there are two; on one GPU both share it (their
kernels take turns, `jax_moe_publish.testing.rank_processes`), except where the case is
about two GPUs: their order, or XLA's collectives, which NCCL refuses on one GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import processes
from jax_moe_publish import protocol
from jax_moe_publish.testing.local_processes import local_gpu_count

# How processes map to GPUs and ranks: process i holds GPU gpus[i]; the mesh lists
# the processes' devices in process order, or reversed (rank 0 in process 1).
LAYOUTS = {
    "straight": dict(gpus=[0, 1], order="straight"),
    "gpus-reversed": dict(gpus=[1, 0], order="straight"),
    "mesh-reversed": dict(gpus=[0, 1], order="mesh-reversed"),
}
EXIT_TIMEOUT_S = 1.0
EXIT_PROCESS_TIMEOUT_S = 5.0
TIME_TO_ERROR_S = 5.0
"""A fault must be reported within the kernel timeout plus this."""


def _seed() -> str:
    return str(np.random.default_rng().integers(2**31))


def _gpus(layout: str) -> list[int]:
    """The layout's GPU of each process, on the GPUs there are (processes share one where there
    are fewer)."""
    return [gpu % local_gpu_count() for gpu in LAYOUTS[layout]["gpus"]]


def _run(program: str, layout: str = "straight", *options: str, **kwargs) -> list[dict]:
    return processes.run(program, "--order", LAYOUTS[layout]["order"], "--seed", _seed(), *options,
                         gpus=_gpus(layout), **kwargs)


def _ranks_follow_the_layout(results: list[dict], layout: str) -> None:
    spec = LAYOUTS[layout]
    for process, result in enumerate(results):
        assert result["ordinal"] == _gpus(layout)[process], result
        expected_rank = 1 - process if spec["order"] == "mesh-reversed" else process
        assert result["rank"] == expected_rank, result


def _check_match(results: list[dict]) -> None:
    """Every call matches float64 in each process; all-reduce outputs agree bitwise across processes."""
    for result in results:
        for call in result["calls"]:
            assert call["failure"] is None, f"process {result['process']}, {call}: {call['failure']}"
        assert result["kernel_executes"] > 0, "the kernels never ran"
        for mailbox in result["mailboxes"]:
            assert len(mailbox["status"]) == 1, f"each process holds one device's mailbox: {mailbox}"
            assert all(s["code"] == protocol.STATUS_OK for s in mailbox["status"]), mailbox
    assert [c["m"] for c in results[0]["calls"]] == [c["m"] for c in results[1]["calls"]]
    for a, b in zip(results[0]["calls"], results[1]["calls"]):
        if a["result"] == "allreduce":
            assert a["sha256"] == b["sha256"], f"{a}: the processes' outputs differ bitwise"


@pytest.mark.gpus(1)
def test_two_processes_match_float64_and_agree_bitwise():
    """Three problems (bf16 and f32 weights, no shared expert, hidden 2048) x both result layouts: six
    mailboxes created and closed collectively, one after the other."""
    results = _run("match", "straight", "--problems", "0", "1", "2")
    _ranks_follow_the_layout(results, "straight")
    _check_match(results)
    assert len(results[0]["calls"]) == 3 * 2 * 4


@pytest.mark.parametrize("layout", [pytest.param("gpus-reversed", marks=pytest.mark.gpus(2)),
                                    pytest.param("mesh-reversed", marks=pytest.mark.gpus(1))])
def test_reversed_device_order_along_the_axis(layout):
    results = _run("match", layout)
    _ranks_follow_the_layout(results, layout)
    _check_match(results)


@pytest.mark.gpus(1)
def test_500_chained_calls_with_varying_m():
    results = _run("chain", "straight", "--calls", "500", "--problems", "1")
    for result in results:
        assert result["calls"] == 500, result
        assert result["failures"] == [], f"process {result['process']}: {result['failures']}"
        assert all(s["code"] == protocol.STATUS_OK for s in result["status"]), result["status"]
    assert len(set(results[0]["ms"])) > 1, f"m never varied: {results[0]['ms']}"
    assert results[0]["sha256"] == results[1]["sha256"], "the processes' outputs differ bitwise"


@pytest.mark.gpus(1)
@pytest.mark.parametrize("layout", ["straight", "mesh-reversed"])
def test_a_process_that_exits_mid_run_fails_the_survivor_within_the_timeout(layout):
    results = _run("exit-mid-run", layout, "--timeout", str(EXIT_TIMEOUT_S),
                   "--process-timeout", str(EXIT_PROCESS_TIMEOUT_S))
    leaver, survivor = results[1], results[0]
    assert leaver["healthy"] == [None] * leaver["left_after"], leaver
    assert survivor["healthy"] == [None] * leaver["left_after"], survivor
    outcome = survivor["outcome"]
    assert outcome["raised"] == "MailboxStatusError", f"diagnose() did not explain the failure: {outcome}"
    missing = leaver["rank"]
    assert f"no data from rank(s) [{missing}]" in outcome["message"], outcome["message"]
    assert f"(rank {survivor['rank']})" in outcome["message"], outcome["message"]
    assert outcome["elapsed_s"] < EXIT_TIMEOUT_S + TIME_TO_ERROR_S, outcome
    closing = survivor["close"]
    assert closing["raised"] == "ProcessGroupError", f"close() with a dead peer: {closing}"
    assert closing["elapsed_s"] < EXIT_PROCESS_TIMEOUT_S + TIME_TO_ERROR_S, closing
    print(f"survivor (rank {survivor['rank']}): time to error {outcome['elapsed_s']:.3f} s "
          f"(timeout {EXIT_TIMEOUT_S} s)\n{outcome['message']}\nclose: {closing}")


@pytest.mark.gpus(2)  # XLA's collectives: NCCL refuses two ranks on one GPU
@pytest.mark.parametrize("result", ["allreduce", "reduce_scatter"])
def test_groups_across_hosts_fall_back_to_xla_collectives(result):
    """Host identities differ (the test-only override): the op runs the reference over NCCL."""
    env = [{"JAX_MOE_PUBLISH_TEST_HOST_ID": f"host-{name}"} for name in "ab"]
    results = _run("cross-host", "straight", "--result", result, env=env)
    for result in results:
        assert result["spans_hosts"] and result["hosts"] == [["host-a", "host-b"]], result
        assert result["allocated_devices"] == 0, "a mailbox across hosts allocated memory"
        for call in result["calls"]:
            assert call["failure"] is None, f"process {result['process']}, m={call['m']}: {call['failure']}"
        assert len(result["warnings"]) == 1, f"expected one warning, got {result['warnings']}"
        assert "rank 0: host-a, rank 1: host-b" in result["warnings"][0], result["warnings"][0]
        assert result["kernel_error"] and "host-a" in result["kernel_error"], result["kernel_error"]
    if result == "allreduce":
        assert [c["sha256"] for c in results[0]["calls"]] == [c["sha256"] for c in results[1]["calls"]]
