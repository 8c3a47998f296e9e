"""The launch contract between the kernels, the compile step and the launchers: written once.

Every value a kernel of the op can receive is in `VALUES`, with its PTX parameter type,
in the order `kernels.program.MoePublishProgram.__call__` takes them (the compile step
builds its fake arguments from this table). Each kernel role (`ROLES`) takes some of them,
in the order of its ``.entry`` parameters, and is or is not persistent, and does or does
not group a row's CTAs into one thread block cluster.

Every algorithm is a row of `ALGORITHMS`: the facts derived from it (its result layout,
the rows it reduces and returns, whether its owners fan out, its NVLink exchanges, its
kernels) are read from there, never from its name. Every array of a call is a row of
`OPERANDS`, with the rules for its dtype and rows; `call_operands` resolves them for one
config into the sidecar's call record, which the C++ handler checks the call against.

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
    clustered: bool = False


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
    "publish_reduce_norm": Role(_FUSED + _EPILOGUE, persistent=True, clustered=True),
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


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One way to compute a call's result.

    ``reduce_rows`` are the rows the reduce covers and ``out_rows`` the rows of the result:
    ``"m"`` (every token) or ``"owned"`` (the ceil(m / tp) tokens this rank owns, token
    ``t`` owned by rank ``t % tp``). ``fans_out``: an owner stores its rows' sums into every
    peer's gather area, which a gather kernel (or the fused kernel's gather phase) copies
    out. ``exchanges``: one-way NVLink hops before the result is known (the link model's).
    ``own_partial``: its fused kernel may keep this rank's own partial in shared memory
    (every rank reduces every row, so its own contribution never leaves the CTA).
    ``roles``: the kernels of a call by ``(fused, epilogue)``; its keys are the combinations
    that exist."""

    result: str
    group: bool
    reduce_rows: str
    out_rows: str
    fans_out: bool
    exchanges: int
    roles: dict[tuple[bool, str], tuple[str, ...]]
    own_partial: bool = False

    @property
    def owned_rows(self) -> bool:
        """The reduce covers only the rows this rank owns."""
        return self.reduce_rows == "owned"

    @property
    def out_owned(self) -> bool:
        """The result holds only the rows this rank owns."""
        return self.out_rows == "owned"

    @property
    def fuses(self) -> bool:
        """Has a one-kernel form."""
        return any(fused for fused, _ in self.roles)

    def has_epilogue(self, epilogue: str, fused: bool | None = None) -> bool:
        """Has a form with ``epilogue`` (fused, unfused, or either with None)."""
        return any(e == epilogue and fused in (None, f) for f, e in self.roles)


ALGORITHMS: dict[str, Algorithm] = {
    # tp = 1: the finalize writes the output rows.
    "direct": Algorithm("allreduce", group=False, reduce_rows="m", out_rows="m", fans_out=False, exchanges=0,
                        roles={(False, "none"): ("finalize",)}),
    # Every rank publishes every token to every peer and reduces all of them.
    "oneshot": Algorithm("allreduce", group=True, reduce_rows="m", out_rows="m", fans_out=False, exchanges=1,
                         roles={(False, "none"): ("publish", "reduce"),
                                (False, "rmsnorm"): ("publish", "reduce_norm"),
                                (True, "none"): ("publish_reduce",),
                                (True, "rmsnorm"): ("publish_reduce_norm",)},
                         own_partial=True),
    # Token t's owner, rank t % tp, reduces it and fans the sum out to every rank.
    "twoshot": Algorithm("allreduce", group=True, reduce_rows="owned", out_rows="m", fans_out=True, exchanges=2,
                         roles={(False, "none"): ("publish", "reduce", "gather"),
                                (False, "rmsnorm"): ("publish", "reduce_norm", "gather_norm"),
                                (True, "none"): ("publish_reduce_gather",)}),
    # The owners keep their sums.
    "reduce_scatter": Algorithm("reduce_scatter", group=True, reduce_rows="owned", out_rows="owned",
                                fans_out=False, exchanges=1,
                                roles={(False, "none"): ("publish", "reduce"),
                                       (False, "rmsnorm"): ("publish", "reduce_norm")}),
}
"""Every algorithm of the op, by name."""

RESULTS = tuple(dict.fromkeys(algorithm.result for algorithm in ALGORITHMS.values()))
"""The layouts of the group's sum that a call can return."""

EPILOGUES = ("none", "rmsnorm")


def call_roles(config) -> tuple[str, ...]:
    """The kernels of one call of ``config`` (a `KernelConfig`), in launch order."""
    return ALGORITHMS[config.algorithm].roles[config.fuse_reduce, config.epilogue]


@dataclasses.dataclass(frozen=True)
class Operand:
    """One array of a call, in the FFI target's order: an input (``io="arg"``) or a result
    (``"ret"``), named like the `VALUES` entry that carries its address.

    ``dtype``: ``"bf16"``, ``"s32"``, or ``"weights"`` (the config's router weight dtype).
    ``rows``: ``"num_rows"`` (any count, passed as that value), ``"m"`` (the first such
    operand fixes m), ``"out_rows"`` (the algorithm's), ``"shared"`` (m with the shared
    expert, else a [0, cols] placeholder), or None for a vector. ``cols``: ``"hidden"`` or
    ``"top_k"``. ``epilogue``: present only with the epilogue."""

    name: str
    io: str
    dtype: str
    rows: str | None
    cols: str
    epilogue: bool = False


OPERANDS: tuple[Operand, ...] = (
    Operand("routed", "arg", "bf16", "num_rows", "hidden"),
    Operand("weights", "arg", "weights", "m", "top_k"),
    Operand("indices", "arg", "s32", "m", "top_k"),
    Operand("shared", "arg", "bf16", "shared", "hidden"),
    Operand("residual", "arg", "bf16", "out_rows", "hidden", epilogue=True),
    Operand("norm_weight", "arg", "bf16", None, "hidden", epilogue=True),
    Operand("out", "ret", "bf16", "out_rows", "hidden"),
    Operand("residual_out", "ret", "bf16", "out_rows", "hidden", epilogue=True),
)
"""Every array of a call of the op; a config takes those its epilogue has."""

DTYPES = {"bf16": 2, "f32": 4, "s32": 4}
"""Bytes per element of each operand dtype."""

TARGETS = {"none": "jax_moe_publish", "rmsnorm": "jax_moe_publish_rmsnorm"}
"""The FFI target of a call, by epilogue (the rmsnorm one takes ``norm_eps``)."""


def call_operands(config) -> list[dict]:
    """`OPERANDS` resolved for ``config``, as the sidecar records them: name, io, dtype
    (``"bf16"``, ``"f32"`` or ``"s32"``), rows (``"num_rows"``, ``"m"``, ``"owned"``, ``"zero"``
    or None for a vector) and cols (a count)."""
    algorithm = ALGORITHMS[config.algorithm]
    rows = {"num_rows": "num_rows", "m": "m", "out_rows": algorithm.out_rows,
            "shared": "m" if config.include_shared_expert else "zero", None: None}
    dtypes = {"bf16": "bf16", "s32": "s32", "weights": "f32" if config.fp32_weights else "bf16"}
    cols = {"hidden": config.hidden, "top_k": config.top_k}
    return [{"name": o.name, "io": o.io, "dtype": dtypes[o.dtype], "rows": rows[o.rows], "cols": cols[o.cols]}
            for o in OPERANDS if not o.epilogue or config.epilogue != "none"]
