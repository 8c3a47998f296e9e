"""Reliability tests that run in CI without a GPU.

* A property test draws valid problems (shapes, weight dtypes, shared expert,
  scale, tp, result) and index patterns (all -1, duplicates, out of range on
  either side, mixed), runs them through the public API on the virtual CPU
  devices (the reference path) and checks the result against the NumPy
  float64 model of `numerics`.
* The mailbox's timeout diagnostic: `Mailbox.check` and `Mailbox.diagnose`
  build one message from the status words, naming the rank that never arrived
  and the likely causes.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_moe_publish as jmp
import numerics
from jax_moe_publish import protocol

@st.composite
def problems(draw):
    """A valid call of the public API: (tp, result, scale, per-rank `numerics.RankInputs`s)."""
    tp = draw(st.sampled_from((1, 2, 4)))
    result = draw(st.sampled_from(("allreduce", "reduce_scatter"))) if tp > 1 else "allreduce"
    m = draw(st.integers(1, 40))
    hidden = 8 * draw(st.integers(1, 64))
    top_k = draw(st.integers(1, 10))
    num_rows = draw(st.integers(0, 64))
    fp32_weights = draw(st.booleans())
    shared = draw(st.booleans())
    scale = draw(st.sampled_from((1.0, 2.5, 0.5, -1.0)))
    patterns = [draw(st.sampled_from(numerics.INDEX_PATTERNS)) for _ in range(tp)]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ranks = []
    for pattern in patterns:
        ranks.append(numerics.RankInputs(
            routed=rng.standard_normal((num_rows, hidden), dtype=np.float32).astype(numerics.BF16),
            weights=rng.uniform(-1.0, 1.0, (m, top_k)).astype(np.float32 if fp32_weights else numerics.BF16),
            indices=numerics.pattern_indices(rng, pattern, m, top_k, num_rows),
            shared=rng.standard_normal((m, hidden), dtype=np.float32).astype(numerics.BF16) if shared else None,
        ))
    return tp, result, scale, ranks


def _stack(ranks, field):
    values = [getattr(p, field) for p in ranks]
    return None if values[0] is None else jnp.asarray(np.stack(values))


@settings(max_examples=40, deadline=None)
@given(problems())
def test_public_api_matches_float64_model(drawn):
    tp, result, scale, ranks = drawn
    m, hidden = ranks[0].weights.shape[0], ranks[0].routed.shape[1]
    mesh = jax.make_mesh((tp,), ("tp",))
    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=m, result=result) as mailbox:
        # Under jit: an eager shard_map runs op by op, about 20 times slower here.
        call = jax.jit(lambda *args: jmp.sharded_moe_finalize_publish(
            mailbox, *args, routed_scaling_factor=scale))
        out = np.asarray(call(_stack(ranks, "routed"), _stack(ranks, "weights"),
                              _stack(ranks, "indices"), _stack(ranks, "shared")))
    expected, bound = numerics.expected_sum(ranks, scale)
    numerics.assert_group_close(out, expected, bound, result=result, tp=tp)


# --- the timeout diagnostic --------------------------------------------------------------------


def _words(code=protocol.STATUS_OK, stage=0, token=0, missing=0, call=0) -> list[int]:
    words = [0] * protocol.STATUS_WORDS
    words[protocol.STATUS_CODE] = code
    words[protocol.STATUS_STAGE] = stage
    words[protocol.STATUS_TOKEN] = token
    words[protocol.STATUS_MISSING_RANKS] = missing
    words[protocol.STATUS_CALL] = call
    return words


class _FakeGroupMemory:
    """The status words of a group's ranks, read the way `GroupMemory.status` reads them."""

    def __init__(self, ordinals: list[int], words: list[list[int]]) -> None:
        self.ranks = [types.SimpleNamespace(ordinal=o, rank=r) for r, o in enumerate(ordinals)]
        self._words = words

    def status(self, rank: int) -> list[int]:
        return list(self._words[rank])


@pytest.fixture
def mailbox():
    with jmp.Mailbox(jax.make_mesh((4,), ("tp",)), "tp", hidden=64, capacity_m=8) as mailbox:
        yield mailbox


# Rank 0 (device 3) waited in vain for ranks 1 and 3; the others are healthy.
TIMED_OUT = _words(protocol.STATUS_TIMEOUT, stage=2, token=5, missing=0b1010, call=7)
HEALTHY = _words()


@pytest.fixture
def timed_out(mailbox, monkeypatch):
    """``mailbox`` whose status blocks report rank 0's timeout."""
    records = [
        {"device": 3, "rank": 0, "code": protocol.STATUS_TIMEOUT, "stage": 2, "token": 5,
         "missing_ranks": [1, 3], "call": 7},
    ] + [
        {"device": 4 + r, "rank": r, "code": protocol.STATUS_OK, "stage": 0, "token": 0,
         "missing_ranks": [], "call": 0}
        for r in range(1, 4)
    ]
    monkeypatch.setattr(type(mailbox), "status", lambda self: records)
    return mailbox


def _assert_names_the_fault(message: str) -> None:
    for words in ("device 3 (rank 0)", "after 7 completed call(s)", "stage 2", "token 5",
                  "no data from rank(s) [1, 3]", "different order", "process died"):
        assert words in message, f"{words!r} missing from: {message}"
    assert "rank 1)" not in message and "rank 2)" not in message, "healthy ranks are reported"


def test_status_decodes_the_words(mailbox):
    mailbox._memories = [_FakeGroupMemory([3, 4, 5, 6], [TIMED_OUT, HEALTHY, HEALTHY, HEALTHY])]
    try:
        status = mailbox.status()
    finally:
        mailbox._memories = []
    assert status[0] == {"device": 3, "rank": 0, "code": protocol.STATUS_TIMEOUT, "stage": 2,
                         "token": 5, "missing_ranks": [1, 3], "call": 7}
    assert [s["code"] for s in status[1:]] == [protocol.STATUS_OK] * 3


def test_check_names_the_missing_ranks_and_the_causes(timed_out):
    with pytest.raises(jmp.MailboxStatusError) as raised:
        timed_out.check()
    _assert_names_the_fault(str(raised.value))


def test_diagnose_turns_a_launch_failure_into_the_diagnostic(timed_out):
    failure = RuntimeError("INTERNAL: CUDA error: unspecified launch failure")
    with pytest.raises(jmp.MailboxStatusError) as raised, timed_out.diagnose():
        raise failure
    assert raised.value.__cause__ is failure
    with pytest.raises(jmp.MailboxStatusError) as checked:
        timed_out.check()
    assert str(raised.value) == str(checked.value), "diagnose and check build different messages"
    _assert_names_the_fault(str(raised.value))


def test_diagnose_passes_other_errors_through(mailbox):
    failure = ValueError("not a mailbox problem")
    with pytest.raises(ValueError) as raised, mailbox.diagnose():
        raise failure
    assert raised.value is failure
    mailbox.check()


def test_diagnose_is_silent_without_an_error(timed_out):
    with timed_out.diagnose() as entered:
        assert entered is timed_out


def test_a_call_after_close_is_reported_as_the_close(mailbox, monkeypatch):
    records = [{"device": 3 + r, "rank": r, "code": protocol.STATUS_CLOSED, "stage": 1, "token": 0,
                "missing_ranks": [], "call": 4} for r in range(4)]
    monkeypatch.setattr(type(mailbox), "status", lambda self: records)
    with pytest.raises(jmp.MailboxStatusError) as raised, mailbox.diagnose():
        raise RuntimeError("INTERNAL: CUDA error: unspecified launch failure")
    message = str(raised.value)
    for words in (f"mailbox {mailbox.id} is closed", "device(s) [3, 4, 5, 6]", "command buffers",
                  "new Mailbox"):
        assert words in message, f"{words!r} missing from: {message}"
    assert "timed out" not in message


def test_a_flagged_mailbox_says_it_is_halted(monkeypatch):
    with jmp.Mailbox(jax.make_mesh((4,), ("tp",)), "tp", hidden=64, capacity_m=8,
                     on_timeout="flag") as flagged:
        records = [{"device": 3, "rank": 0, "code": protocol.STATUS_TIMEOUT, "stage": 2, "token": 5,
                    "missing_ranks": [1, 3], "call": 7}]
        monkeypatch.setattr(type(flagged), "status", lambda self: records)
        with pytest.raises(jmp.MailboxStatusError) as raised:
            flagged.check()
    _assert_names_the_fault(str(raised.value))
    assert "halted" in str(raised.value) and "NaN" in str(raised.value)
