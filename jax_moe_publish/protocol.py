"""Constants of the Lamport mailbox protocol, shared by kernels, mailbox and tests.

Every layer that touches the mailbox reads its layout from here, so the device
code and the host allocation cannot drift apart.
"""

STAGES = 3
"""Mailbox stages. A peer can reuse a stage only three calls later."""

EMPTY_BF16 = 0x8000
"""bf16 -0.0: the *empty* sentinel of a mailbox lane. Published data never holds it."""

EMPTY_U32 = 0x80008000
"""Two empty bf16 lanes in one 32-bit word."""

# int32 words of the per-device stage state.
NEXT_STAGE = 0
"""Stage of the current call, read by every kernel of it; the last kernel of the call
advances it once all of its CTAs have read it."""
ARRIVALS = 1
"""CTAs of the call's last kernel that have read the stage; reset to 0 by the last one."""
CALL_COUNT = 2
"""Completed calls on this device, modulo `CALL_COUNT_PERIOD`."""
DIAGNOSTIC_CLAIM = 3
"""Set once by the first thread that records a diagnostic, so one thread writes it."""
HALT = 4
"""HALT_RUNNING, or why the kernels must no longer touch the mailbox (read at every kernel start)."""
ON_TIMEOUT = 5
"""ON_TIMEOUT_ABORT or ON_TIMEOUT_FLAG, set by the Mailbox; read only on the failure paths."""
STAGE_STATE_WORDS = 8

CALL_COUNT_PERIOD = STAGES * (2**31 // STAGES)
"""Where ``CALL_COUNT`` wraps to 0: a multiple of STAGES, so that a call's stage is always its
count modulo STAGES, and below 2**31, so that the count stays a nonnegative int32. A device
that runs 10**4 calls a second wraps after about 2.5 days."""

HALT_RUNNING = 0
HALT_CLOSED = 1
"""`Mailbox.close` freed the mailbox; a kernel that still runs (a replayed XLA command buffer)
must not touch it."""
HALT_FAILED = 2
"""A wait timed out under ON_TIMEOUT_FLAG: later calls return NaN instead of waiting."""

ON_TIMEOUT_ABORT = 0
"""A timed-out wait (or a call on a closed mailbox) records the diagnostic and traps."""
ON_TIMEOUT_FLAG = 1
"""It records the diagnostic, halts the mailbox and returns NaN; `Mailbox.check` raises."""

# int32 words of the per-device status block (host-mapped where possible).
STATUS_CODE = 0
"""STATUS_OK, STATUS_TIMEOUT or STATUS_CLOSED: the first failure seen on this device."""
STATUS_STAGE = 1
STATUS_TOKEN = 2
STATUS_MISSING_RANKS = 3
"""Bit r is set when rank r's contribution never arrived."""
STATUS_CALL = 4
STATUS_WORDS = 8

STATUS_OK = 0
STATUS_TIMEOUT = 1
"""A reduce wait ran past its timeout."""
STATUS_CLOSED = 2
"""A kernel ran on a closed mailbox (its call was recorded in a command buffer before the close)."""

REDUCE_ELEMENTS = 8
"""bf16 lanes per reduce fragment: one 16-byte volatile load."""

MAX_TP = 8


def contribution_elements(tp: int, capacity_m: int, hidden: int) -> int:
    """bf16 elements of the contribution area: ``[STAGES][tp][capacity_m][hidden]``."""
    return STAGES * tp * capacity_m * hidden


GATHER_AREAS = 2
"""Two-shot gather areas: the owner's sum (``out``), then, with the epilogue, its
``residual_out``."""


def gather_elements(capacity_m: int, hidden: int) -> int:
    """bf16 elements of the two-shot gather areas: ``[GATHER_AREAS][STAGES][capacity_m][hidden]``."""
    return GATHER_AREAS * STAGES * capacity_m * hidden


def mailbox_elements(tp: int, capacity_m: int, hidden: int) -> int:
    """bf16 elements of one device's mailbox: contributions, then the gather areas."""
    return contribution_elements(tp, capacity_m, hidden) + gather_elements(capacity_m, hidden)


def owned_rows(m: int, tp: int) -> int:
    """Rows of the reduce-scatter output: ``ceil(m / tp)``."""
    return -(-m // tp)
