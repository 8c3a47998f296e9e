"""The launch contract between the kernels, the compile step and the launchers: written once.

Every value a kernel of the op can receive is in `VALUES`, with its PTX parameter type,
in the order `kernels.program.MoePublishProgram.__call__` takes them (the compile step
builds its fake arguments from this table). Each kernel role (`ROLES`) takes some of them,
in the order of its ``.entry`` parameters, and is or is not persistent, and does or does
not group a row's CTAs into one thread block cluster.

The compile step writes each kernel's parameter names and launch plan into the sidecar
(`aot.artifact`); the C++ launcher (``ffi/launch_values.h`` lists the same values, a CPU
test keeps the lists equal) and the kernel harness of the tests fill the parameters by
name from it.
"""

from __future__ import annotations

import dataclasses

VALUES: dict[str, str] = {
    "routed": "u64",  # bf16 [num_rows, hidden]: this rank's routed expert rows
    "weights": "u64",  # bf16 or f32 [m, top_k]
    "indices": "u64",  # int32 [m, top_k]
    "shared": "u64",  # bf16 [m, hidden], read only with the shared expert
    "mailbox": "u64",  # this device's mailbox (`protocol` layout)
    "peer_table": "u64",  # u64 [tp]: every rank's mailbox base, by rank
    "stage_state": "u64",  # int32 [protocol.STAGE_STATE_WORDS]
    "status": "u64",  # int32 [protocol.STATUS_WORDS], host-mapped diagnostics
    "out": "u64",  # bf16, the result
    "residual": "u64",  # bf16, the shape of out (the epilogue's)
    "norm_weight": "u64",  # bf16 [hidden] (the epilogue's)
    "residual_out": "u64",  # bf16, the shape of out (the epilogue's)
    "timeout_ns": "u64",  # how long a mailbox wait may take; 0 waits forever
    "num_rows": "u32",  # rows of routed
    "m": "u32",  # tokens of the call
    "capacity_m": "u32",  # tokens a mailbox slot area holds
    "rank": "u32",  # position along the TP axis
    "eps": "f32",  # RMSNorm epsilon (the epilogue's)
}
"""Name -> PTX ``.param`` type of every value a kernel can receive. Without a mailbox
(tp = 1) the mailbox values are 0."""

_PUBLISH_INPUTS = ("routed", "weights", "indices", "shared")
_WAIT = ("mailbox", "peer_table", "stage_state", "status", "out", "timeout_ns", "m", "capacity_m", "rank")
_EPILOGUE = ("residual", "norm_weight", "residual_out", "eps")
_FUSED = (*_PUBLISH_INPUTS, "mailbox", "peer_table", "stage_state", "status", "out", "timeout_ns", "num_rows",
          "m", "capacity_m", "rank")


@dataclasses.dataclass(frozen=True)
class Role:
    """One kernel role: its parameters in ``.entry`` order, whether its grid is persistent (its
    CTAs wait on each other's peers, so the launcher caps the grid at the CTAs the GPU holds
    at once) and whether a row's CTAs form one thread block cluster."""

    params: tuple[str, ...]
    persistent: bool = False
    cluster: bool = False


ROLES: dict[str, Role] = {
    # tp = 1: the finalize writes the output rows (the stage words are not read).
    "finalize": Role((*_PUBLISH_INPUTS, "stage_state", "out", "num_rows", "m", "capacity_m", "rank")),
    # Stores each token's partial into the peers' mailboxes.
    "publish": Role((*_PUBLISH_INPUTS, "stage_state", "peer_table", "num_rows", "m", "capacity_m", "rank")),
    "reduce": Role(_WAIT),
    "reduce_norm": Role(_WAIT + _EPILOGUE),
    "gather": Role(_WAIT),
    "gather_norm": Role(_WAIT + _EPILOGUE),
    "publish_reduce": Role(_FUSED, persistent=True),
    "publish_reduce_gather": Role(_FUSED, persistent=True),
    "publish_reduce_norm": Role(_FUSED + _EPILOGUE, persistent=True, cluster=True),
}

MAX_THREADS = 1024
"""Threads of a CTA."""
PORTABLE_CLUSTER_CTAS = 8
"""CTAs of a thread block cluster that every launch may have; beyond it the launcher opts the
kernel in (``NON_PORTABLE_CLUSTER_SIZE_ALLOWED``)."""
MAX_CLUSTER_CTAS = 16
"""The largest cluster Hopper launches."""
DEFAULT_SMEM_BYTES = 48 * 1024
"""Dynamic shared memory a kernel may use without opting in (``MAX_DYNAMIC_SHARED_SIZE_BYTES``)."""


def call_roles(config) -> tuple[str, ...]:
    """The kernels of one call of ``config`` (a `KernelConfig`), in launch order: with an
    epilogue reduce_norm and gather_norm take the reduce's and the gather's places; fused, one
    kernel is the call."""
    if config.fuse_reduce and config.algorithm == "twoshot":
        return ("publish_reduce_gather",)
    if config.fuse_reduce:
        return ("publish_reduce" if config.epilogue == "none" else "publish_reduce_norm",)
    reduce, gather = ("reduce", "gather") if config.epilogue == "none" else ("reduce_norm", "gather_norm")
    return {
        "direct": ("finalize",),
        "oneshot": ("publish", reduce),
        "reduce_scatter": ("publish", reduce),
        "twoshot": ("publish", reduce, gather),
    }[config.algorithm]
