"""Faults and misuse on GPUs: every case ends in an error that names the fault, or in
behaviour that is documented here, and never in a hang. The kernel-harness cases run their
ranks on virtual ranks where there are fewer GPUs than ranks (one GPU suffices), except the
mismatched m, whose surviving rank must be read after its peer's trap; the public-API cases
run their ranks as processes that share the GPUs there are (`rank_processes`), at tp = 2,
and for the missing rank also at 4 and 8.

Each case runs one program of `fault_programs` in a child process, because a
trapped kernel loses its device's CUDA context for the rest of the process.
The parent never touches the GPUs: it reads the child's JSON result, and a
child that outlives ``CHILD_TIMEOUT_S`` is killed and reported as a hang.
Run with ``-rP`` to see the time to error of each fault.

What the protocol guarantees, and what it does not:

* A peer that never publishes: the waiting rank traps after ``timeout_s`` and
  its status block names the peer, the stage, the token and the call (also
  where a fused CTA counted the call before it timed out, and across the
  wrap of the call count). In a group of 4 or 8 (oneshot, reduce_scatter)
  every diagnostic recorded names the silent rank alone.
* Ranks that run different m in the same call: the rank with the larger m
  waits for tokens that never come and traps; the rank with the smaller m
  returns the correct sum of the tokens both have, and keeps the other rank's
  extra contributions in its mailbox (harmless only because the group cannot
  go on once a device has trapped).
* A rank that publishes twice without reducing (not reachable through the op,
  which always launches publish and reduce together): NOT detected. The second
  publish overwrites the first in the same stage, since only the reduce
  advances the stage, and both ranks silently return rank 0's call n summed
  with rank 1's call n+1. The test below asserts exactly that, so that a fix
  shows up.
* Under ``on_timeout="flag"`` nothing traps: the timed-out call returns NaN,
  the mailbox halts on that device, and its later calls return NaN without
  waiting. A peer that skipped a call is one call behind: its next call
  returns the halted rank's last partial summed with its own (the mix below),
  and only its call after that times out.
* Through the public API, a rank that skips the op makes the other ranks'
  waits trap; `Mailbox.diagnose` turns XLA's launch failure into
  `MailboxStatusError`, which names that rank. A closed mailbox is refused by the FFI handler; a
  command buffer that XLA recorded before the close never runs the handler
  again, so its kernels find the mailbox halted, trap before touching the
  freed memory, and `diagnose` reports the close.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from jax_moe_publish import protocol
from jax_moe_publish.testing import gpu_matrix, local_processes, rank_processes

pytestmark = pytest.mark.gpus(1)  # virtual ranks or rank processes where there are fewer GPUs than ranks

PROGRAMS = pathlib.Path(__file__).resolve().parents[1] / "programs" / "fault_programs.py"
CHILD_TIMEOUT_S = 300
TIME_TO_ERROR_S = 5.0
"""A fault must be reported within the kernel timeout plus this."""
LAST_CALL = protocol.CALL_COUNT_PERIOD - 1
"""The last call number before the call count wraps to 0."""


def _no_result(program: str, options, code, stdout: str, stderr: str) -> str:
    return (f"{program} {' '.join(options)} exited with {code} and no result\n"
            f"stdout: {stdout[-4000:]}\nstderr: {stderr[-4000:]}")


def run_program(program: str, *options: str, env: dict | None = None) -> dict:
    """Run ``fault_programs.py program options`` in a fresh process; its JSON result."""
    # No preallocation: this process (or an earlier test's JAX) may already hold GPU memory.
    environment = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **(env or {})}
    command = [sys.executable, str(PROGRAMS), program, *options]
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                               env=environment)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{program} {' '.join(options)} hung: killed after {CHILD_TIMEOUT_S} s\n"
                    f"stdout: {error.stdout}\nstderr: {error.stderr}")
    result = local_processes.read_result(child.stdout)
    assert child.returncode == 0 and result is not None, _no_result(
        program, options, child.returncode, child.stdout, child.stderr)
    return result


def run_api_program(program: str, tp: int, *options: str, env: dict | None = None) -> list[dict]:
    """A public-API program of a group of ``tp``: in one process on tp GPUs, or as tp rank
    processes on the GPUs there are; each process's result (each reports its own ranks)."""
    if local_processes.local_gpu_count() >= tp:
        return [run_program(program, *options, env=env)]
    outcomes = rank_processes.launch([sys.executable, str(PROGRAMS), program, *options], tp,
                                     deadline_s=CHILD_TIMEOUT_S, extra_env=env)
    for outcome in outcomes:
        if outcome.killed:
            pytest.fail(f"{program} {' '.join(options)} hung: {outcome.describe()}\n"
                        f"stdout: {outcome.stdout[-4000:]}\nstderr: {outcome.stderr[-4000:]}")
        assert not outcome.failed and outcome.result is not None, _no_result(
            program, options, outcome.returncode, outcome.stdout, outcome.stderr)
    return [outcome.result for outcome in outcomes]


def _assert_timed_out(status: dict, *, missing: list[int], call: int, tokens: range) -> None:
    assert status["code"] == protocol.STATUS_TIMEOUT, f"no timeout recorded: {status}"
    assert status["missing_ranks"] == missing, f"wrong missing ranks: {status}"
    assert status["call"] == call and status["stage"] == call % protocol.STAGES, f"wrong call: {status}"
    assert status["token"] in tokens, f"token outside {tokens}: {status}"


def _assert_faulted_in_time(outcome: dict, timeout_s: float, what: str) -> None:
    assert not outcome["hung"], f"{what}: still running at the host deadline: {outcome}"
    assert not outcome["completed"] and outcome["error"], f"{what}: no error: {outcome}"
    assert 0.9 * timeout_s <= outcome["elapsed_s"] < timeout_s + TIME_TO_ERROR_S, (
        f"{what}: error after {outcome['elapsed_s']:.3f} s with a {timeout_s} s timeout"
    )
    print(f"{what}: time to error {outcome['elapsed_s']:.3f} s (timeout {timeout_s} s): {outcome['error']}")


@pytest.mark.parametrize("algorithm,silent", [("oneshot", 1), ("twoshot", 1), ("reduce_scatter", 1), ("oneshot", 0)])
def test_silent_peer_traps_within_the_timeout(algorithm, silent):
    _check_silent_peer("--algorithm", algorithm, "--silent-rank", str(silent))


# The rank that never calls; at tp > 2 neither first nor last, so that a diagnostic that
# names a fixed rank fails.
SILENT_RANK = {2: 1, 4: 2, 8: 5}


@pytest.mark.gpus(1)  # virtual ranks where there are fewer GPUs than tp
@pytest.mark.parametrize("algorithm", ["oneshot", "reduce_scatter"])
@pytest.mark.parametrize("tp", gpu_matrix.GROUP_TPS, ids=lambda tp: f"tp{tp}")
def test_a_rank_that_never_launches_is_named_by_the_waits(tp, algorithm):
    """Every rank of a group but one runs a call: each wait that times out names exactly the
    silent rank. (Twoshot only at tp = 2: at larger tp a gather, which polls while its reduce
    still waits, may time out first on an owner that is itself stuck, and name that owner.)"""
    _check_silent_peer("--algorithm", algorithm, "--tp", str(tp), "--silent-rank", str(SILENT_RANK[tp]))


@pytest.mark.parametrize("config,first_call,warmup", [
    ("fused", 0, 2), ("rmsnorm-fused", 0, 2), ("rmsnorm-fused-14-ctas", 0, 2),
    # The timed-out call is the last before the count wraps: its fused CTAs may have counted
    # it (wrapping the count to 0) before the diagnostic reads the count.
    ("fused", LAST_CALL, 0), ("rmsnorm-fused", LAST_CALL, 0),
    # ... and the first after the wrap.
    ("fused", LAST_CALL, 1), ("rmsnorm", LAST_CALL, 1),
])
def test_silent_peer_diagnostic_names_the_call(config, first_call, warmup):
    _check_silent_peer("--config", config, "--first-call", str(first_call), "--warmup", str(warmup))


def _check_silent_peer(*options: str) -> None:
    """Every waiting rank errs within the timeout; each diagnostic recorded names the silent
    rank alone, the call and a token. A rank with a GPU to itself must record one; where
    waiting ranks share a GPU, the first trap ends the others' kernels, maybe before theirs
    (which then leave the code 0)."""
    result = run_program("silent-peer", *options)
    waiting, silent, gpu_of_rank = result["waiting"], result["silent"], result["gpu_of_rank"]
    call = (result["first_call"] + result["warmup"]) % protocol.CALL_COUNT_PERIOD
    for rank in waiting:
        what = f"{result['key']}, rank {silent} silent, rank {rank}"
        _assert_faulted_in_time(result["outcomes"][str(rank)], result["timeout_s"], what)
        status = result["status"][rank]
        alone = [gpu_of_rank[r] for r in waiting].count(gpu_of_rank[rank]) == 1
        if alone or status["code"] != protocol.STATUS_OK:
            _assert_timed_out(status, missing=[silent], call=call, tokens=range(result["m"]))
    recorded = [rank for rank in waiting if result["status"][rank]["code"] != protocol.STATUS_OK]
    assert recorded, f"no waiting rank recorded a diagnostic: {result['status']}"
    assert result["status"][silent]["words"] == [0] * protocol.STATUS_WORDS


@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot", "reduce_scatter"])
def test_a_flagged_mailbox_returns_nan_and_halts_instead_of_trapping(algorithm):
    result = run_program("flagged-silent-peer", "--algorithm", algorithm)
    timeout_s = result["timeout_s"]
    healthy, skipped, after = result["calls"]
    assert all(o["completed"] for o in healthy["outcomes"].values()), healthy
    assert healthy["output_failure"] == {"0": None, "1": None} and healthy["halt"] == [0, 0], healthy

    # Rank 0 waits in vain: the kernel ends (no trap) after the timeout, with NaN and the diagnostic.
    waited = skipped["outcomes"]["0"]
    assert waited["completed"], f"a flagged mailbox trapped: {waited}"
    assert 0.9 * timeout_s <= waited["elapsed_s"] < timeout_s + TIME_TO_ERROR_S, waited
    assert skipped["all_nan"]["0"], "a timed-out call returned numbers"
    _assert_timed_out(skipped["status"][0], missing=[1], call=1, tokens=range(result["m"]))
    assert skipped["halt"] == [protocol.HALT_FAILED, protocol.HALT_RUNNING], skipped["halt"]
    print(f"{algorithm}, flagged: time to NaN + flag {waited['elapsed_s']:.3f} s (timeout {timeout_s} s)")

    # Then the halted rank returns NaN at once and publishes nothing. Its peer, which skipped
    # the previous call, reads what rank 0 published then: the documented mix of two calls
    # (rows it owns), or NaN where it waited for rank 0 in vain (twoshot's gather).
    assert all(o["completed"] for o in after["outcomes"].values()), after
    assert after["outcomes"]["0"]["elapsed_s"] < 0.5 * timeout_s, f"a halted rank waited: {after}"
    assert after["all_nan"]["0"], "a halted rank returned numbers"
    assert "other" not in after["rank_1_rows"], after["rank_1_rows"]
    assert after["halt"][0] == protocol.HALT_FAILED, after["halt"]


@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot", "reduce_scatter"])
def test_double_publish_silently_returns_the_later_call(algorithm):
    """Documents a weakness: see the module docstring."""
    result = run_program("double-publish", "--algorithm", algorithm)
    assert result["publishes"]["completed"], result["publishes"]
    assert result["stage_after_publishes"]["next_stage"] == 0, "a publish moved the stage"
    for rank, outcome in result["outcomes"].items():
        assert outcome["completed"], f"rank {rank}: {outcome}"
    assert result["differs_from_mixed"] == [None, None], (
        f"not the sum of rank 0's call n and rank 1's call n+1: {result['differs_from_mixed']}"
    )
    assert all(result["differs_from_call_n"]), "a rank returned the right sum: the protocol changed"
    assert all(s["code"] == protocol.STATUS_OK for s in result["status"]), result["status"]
    assert result["stage"] == [{"next_stage": 1, "arrivals": 0, "call_count": 1}] * 2, result["stage"]
    assert result["stale"] == [[], []], f"lanes left filled: {result['stale']}"
    assert result["next_call_failures"] == [None, None], "the next call is wrong"


def _leftovers(algorithm: str, small_rank: int, large_rank: int, small_m: int, large_m: int) -> list[list]:
    """Contribution slots of the smaller-m rank's mailbox that keep the larger-m rank's extra tokens."""
    if algorithm == "oneshot":
        slots = range(small_m, large_m)
    else:  # owner algorithms: token t goes to rank t % tp, slot t // tp
        slots = [t // 2 for t in range(small_m, large_m) if t % 2 == small_rank]
    return [["contributions", 0, large_rank, slot] for slot in slots]


@pytest.mark.gpus(2)  # the smaller rank is read after the larger one's trap: on one GPU, one context
@pytest.mark.parametrize("ms", [(3, 5), (5, 3)], ids=lambda ms: f"m{ms[0]}-m{ms[1]}")
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot", "reduce_scatter"])
def test_mismatched_m_traps_the_rank_with_more_tokens(algorithm, ms):
    result = run_program("mismatched-m", "--algorithm", algorithm, "--m", *map(str, ms))
    small, large = (0, 1) if ms[0] < ms[1] else (1, 0)
    outcomes = result["outcomes"]
    _assert_faulted_in_time(outcomes[str(large)], result["timeout_s"], f"{algorithm}, m={ms}, rank {large}")
    _assert_timed_out(result["status"][large], missing=[small], call=0, tokens=range(min(ms), max(ms)))
    assert outcomes[str(small)]["completed"], f"rank {small}: {outcomes[str(small)]}"
    assert result["status"][small]["words"] == [0] * protocol.STATUS_WORDS
    assert result["output_failure"][str(small)] is None, result["output_failure"][str(small)]
    assert result["stage"][str(small)] == {"next_stage": 1, "arrivals": 0, "call_count": 1}
    assert sorted(result["stale"][str(small)]) == _leftovers(algorithm, small, large, min(ms), max(ms))


def test_nan_and_inf_propagate_like_the_model():
    result = run_program("nonfinite")
    for algorithm, report in result.items():
        assert report["failures"] == [], f"{algorithm}: {report['failures']}"


def test_negative_zero_partials_never_stall_a_wait():
    result = run_program("negative-zero")
    for algorithm, report in result.items():
        assert report["failures"] == [], f"{algorithm}: {report['failures']}"
        # Far below the 2 s timeout: no wait came near it.
        assert report["elapsed_s"] < 1.0, f"{algorithm}: {report['calls']} calls took {report['elapsed_s']:.3f} s"


def api_on_timeout(tp: int) -> str:
    """The public-API fault's timeout action: "abort" (a trap) where each rank process has its own
    GPU, or where one rank waits; "flag" where several waiting rank processes share a GPU. There
    a trap in one process's context stalled another's kernel: at tp = 4 on one H200
    (2026-12-04), the processes of ranks 0 and 3 got their error and closed, while rank 1's
    call never returned and its 5 s wait never timed out (docs/testing.md)."""
    return "abort" if tp == 2 or local_processes.local_gpu_count() >= tp else "flag"


@pytest.fixture(scope="module", params=[
    pytest.param((tp, silent), id=f"tp{tp}-silent{silent}")
    for tp, silent in ((2, 1), (2, 0), (4, SILENT_RANK[4]), (8, SILENT_RANK[8]))
])
def api_timeout(request):
    """One run of ``api-timeout``: one rank skips the op (a `lax.cond` on the rank) in a call made
    through the public API, on tp GPUs or as tp rank processes (`api_on_timeout`). As one
    result: every rank's status, and the outcome and close of each process that holds a waiting
    rank."""
    tp, silent = request.param
    results = run_api_program("api-timeout", tp, "--tp", str(tp), "--silent-rank", str(silent),
                              "--on-timeout", api_on_timeout(tp))
    merged = dict(results[0])
    for key in ("status", "status_after_close"):
        merged[key] = sorted((s for result in results for s in result[key]), key=lambda s: s["rank"])
    waiting = [result for result in results if any(s["rank"] != silent for s in result["status"])]
    merged["outcomes"] = [result["outcome"] for result in waiting]
    merged["closings"] = [result["close_after_fault"] for result in waiting]
    merged["healthy_failures"] = [result["healthy_failure"] for result in results]
    return merged


def test_api_timeout_raises_the_mailbox_diagnostic(api_timeout):
    """`Mailbox.diagnose` raises `MailboxStatusError`, which names the rank that skipped the op,
    and only that one; every other rank's status block names it too."""
    result = api_timeout
    silent, waiting = result["silent"], [rank for rank in range(result["tp"]) if rank != result["silent"]]
    assert result["healthy_failures"] == [None] * len(result["healthy_failures"]), result["healthy_failures"]
    for outcome in result["outcomes"]:
        _assert_names_the_silent_rank(outcome, result, silent, waiting)
    status = {s["rank"]: s for s in result["status"]}
    assert sorted(status) == list(range(result["tp"])), f"not every rank's status: {result['status']}"
    for rank in waiting:
        _assert_timed_out(status[rank], missing=[silent], call=1, tokens=range(result["m"]))
    assert status[silent]["code"] == protocol.STATUS_OK, status[silent]


def _assert_names_the_silent_rank(outcome: dict, result: dict, silent: int, waiting: list[int]) -> None:
    assert outcome["raised"] == "MailboxStatusError", f"diagnose() did not explain the failure: {outcome}"
    for words in (f"no data from rank(s) [{silent}]", "different order", "process died"):
        assert words in outcome["message"], f"{words!r} missing from: {outcome['message']}"
    named = re.findall(r"no data from rank\(s\) (\[[\d, ]*\])", outcome["message"])
    assert set(named) == {f"[{silent}]"}, f"the diagnostic names other ranks: {outcome['message']}"
    reporting = [int(rank) for rank in re.findall(r"\(rank (\d+)\)", outcome["message"])]
    assert reporting and set(reporting) <= set(waiting), f"wrong reporting ranks: {outcome['message']}"
    if result["on_timeout"] == "abort":
        assert outcome["cause"], "the XLA error is not chained"
    else:  # the call returned: its waiting ranks' rows are NaN, and check() raised
        assert outcome["cause"] is None and "The mailbox is halted" in outcome["message"], outcome
        assert outcome["nan_ranks"] == outcome["waiting_ranks"], f"a flagged wait's rows are not NaN: {outcome}"
    assert outcome["elapsed_s"] < result["timeout_s"] + TIME_TO_ERROR_S, outcome
    print(f"public API, tp = {result['tp']}, rank {silent} skips the op: time to error {outcome['elapsed_s']:.3f} s "
          f"(timeout {result['timeout_s']} s)\n{outcome['message']}\ncaused by: {outcome['cause']}")


def test_close_after_a_fault_does_not_hide_the_diagnostic(api_timeout):
    """``with Mailbox(...)`` closes the mailbox while the diagnostic propagates: an error from
    close() would replace it."""
    for closing in api_timeout["closings"]:
        assert closing["raised"] is None, f"Mailbox.close() after a device fault raised: {closing}"
        # A trap loses the context, and close() warns that the memory stays; a flag loses nothing.
        assert ("lost their CUDA context" in closing["warning"]) == (api_timeout["on_timeout"] == "abort"), closing
    assert api_timeout["status_after_close"] == api_timeout["status"], "close() lost the diagnostic"


@pytest.mark.parametrize("command_buffers", ["off", "on"])
def test_two_mailboxes_alternate_and_a_closed_one_errors(command_buffers):
    env = {}
    if command_buffers == "off":
        env["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    for result in run_api_program("two-mailboxes", 2, env=env):
        _check_two_mailboxes(result, command_buffers)


def _check_two_mailboxes(result: dict, command_buffers: str) -> None:
    assert result["alternate_failures"] == [], result["alternate_failures"]
    closed = result["closed_call"]
    assert closed["raised"] and f"mailbox {result['closed_id']} is closed" in closed["message"], (
        f"calling a compiled function of a closed mailbox (handler executes captured in command "
        f"buffers: {result['captured_calls']}): {closed}"
    )
    if closed["raised"] == "MailboxStatusError":
        # A replayed command buffer ran the kernels, which trapped: the devices are gone.
        assert command_buffers == "on", closed
        return
    after = result["other_mailbox_after"]
    assert after["raised"] is None and after["value"] is None, f"the other mailbox broke: {after}"
    assert all(s["code"] == protocol.STATUS_OK for s in result["status_b"])


def test_closed_mailbox_in_a_replayed_command_buffer_errors():
    """A command buffer recorded before `close` replays the kernels without the handler: they
    must find the mailbox closed, touch none of its freed memory, and fail with the diagnostic.

    The handler's executes show what XLA did: a run that captured the op recorded the command
    buffer, a run with none replayed it. Before the close the chain must have been captured and
    replayed (with right results on every rank), and the call after the close must be a replay:
    a handler execute there would be refused by the handler, and test nothing of the kernels."""
    for result in run_api_program("closed-chain", 2):
        _check_closed_chain(result)


def _check_closed_chain(result: dict) -> None:
    runs = result["runs"]
    assert [run["failure"] for run in runs] == [None] * len(runs), runs
    assert any(run["captured"] > 0 for run in runs), f"XLA never captured the chain: {runs}"
    assert any(run["captured"] == run["direct"] == 0 for run in runs), (
        f"XLA never replayed the chain without the handler: {runs}"
    )
    closed = result["closed_call"]
    assert result["handler_executes_after_close"] == {"captured": 0, "direct": 0}, (
        f"after the close XLA ran the handler instead of replaying: {result['handler_executes_after_close']}; "
        f"{closed}"
    )
    assert closed["raised"] == "MailboxStatusError", closed
    assert f"mailbox {result['closed_id']} is closed" in closed["message"], closed
    assert {s["code"] for s in result["status_after"]} == {protocol.STATUS_CLOSED}, result["status_after"]
