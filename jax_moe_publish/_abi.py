"""The launch contracts between the kernels, the compile step and the launchers: written once.

Each op states its contract in the same form (`Contract`, `CONTRACTS`): the publish op's
(`PUBLISH`: `VALUES`, `ROLES`, `OPERANDS`, `TARGETS`, below) and the experts op's (`EXPERTS`:
`EXPERTS_VALUES`, `EXPERTS_ROLES`, `EXPERTS_OPERANDS`). A config names its op, and AOT, the
store, the sidecar, the FFI registry and the launchers read that op's contract.

Every value a kernel of the publish op can receive is in `VALUES`, with its PTX parameter type,
in the order `kernels.program.MoePublishProgram.__call__` takes them (the compile step
builds its fake arguments from this table). Each kernel role (`ROLES`) takes some of them,
in the order of its ``.entry`` parameters, and is or is not persistent, and does or does
not group a row's CTAs into one thread block cluster.

Every algorithm is a row of `ALGORITHMS`: the facts derived from it (its result layout,
the rows it reduces and returns, whether its owners fan out, its NVLink exchanges, its
kernels) are read from there, never from its name. Every array of a call is a row of
`OPERANDS`, with the rules for its dtype, rows and trailing shape; `call_operands` resolves
an op's operands for one config into the sidecar's call record, which the C++ handler checks
the call against.

The compile step writes each kernel's parameter names and launch plan into the sidecar
(`aot.artifact`); the C++ launcher (``ffi/launch_values.h`` lists every op's values,
`ALL_VALUES`, a CPU test keeps the lists equal) and the kernel harness of the tests fill the
parameters by name from it.
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
    "out_scales": "u64",  # f32 [rows, hidden / 128]: an FP8 out's scales (dynamic)
    "out_scale": "u64",  # f32 [1]: an FP8 out's static scale
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
    # The epilogue's kernels with an FP8 out: with its scales, or with the static scale.
    "reduce_norm_fp8": Role(_WAIT + _EPILOGUE + ("out_scales",)),
    "gather_norm_fp8": Role(_WAIT + _EPILOGUE + ("out_scales",)),
    "publish_reduce_norm_fp8": Role(_FUSED + _EPILOGUE + ("out_scales",), persistent=True, clustered=True),
    "reduce_norm_fp8_static": Role(_WAIT + _EPILOGUE + ("out_scale",)),
    "gather_norm_fp8_static": Role(_WAIT + _EPILOGUE + ("out_scale",)),
    "publish_reduce_norm_fp8_static": Role(_FUSED + _EPILOGUE + ("out_scale",), persistent=True, clustered=True),
}

FP8_ROLES = {
    mode: {base: f"{base}_fp8{suffix}" for base in ("reduce_norm", "gather_norm", "publish_reduce_norm")}
    for mode, suffix in (("group", ""), ("static", "_static"))
}
"""The role of each epilogue kernel when ``out`` is FP8, by `KernelConfig.fp8_out`; the other
roles of the call stay. Each takes only its mode's operand: the C++ handler refuses a kernel
parameter that addresses an operand the call lacks."""
FP8_BASES = {fp8: base for roles in FP8_ROLES.values() for base, fp8 in roles.items()}
"""The bf16 role of each FP8 role, whose launch it shares."""
FP8_OUTS = ("none", "group", "static")
"""``KernelConfig.fp8_out``: a bf16 out, or e4m3 with a scale per row and 128 columns, or with
the caller's one scale."""

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


@dataclasses.dataclass(frozen=True)
class Operand:
    """One array of a call, in the FFI target's order: an input (``io="arg"``) or a result
    (``"ret"``), named like the value that carries its address.

    ``dtype``: ``"bf16"``, ``"f32"``, ``"s32"``, ``"weights"`` (the config's router weight
    dtype), ``"out"`` (the config's out dtype, ``KernelConfig.operand_dtypes``) or
    ``"expert_weights"`` and ``"tokens"`` (the experts' weights' and tokens' dtypes,
    ``ExpertsConfig.operand_dtypes``).
    ``rows``: the leading dimension's rule: ``"num_rows"`` (any count, passed as that value),
    ``"m"`` (the first such operand fixes m), ``"out_rows"`` (the algorithm's), ``"shared"`` (m
    with the shared expert, else a [0, ...] placeholder), ``"pairs"`` (``m * top_k``), or None
    for an array of fixed shape. ``shape``: the config's dimensions that follow (`dimensions`).
    ``when``: present only where the config's `conditions` hold this word (None: always)."""

    name: str
    io: str
    dtype: str
    rows: str | None
    shape: tuple[str, ...]
    when: str | None = None


OPERANDS: tuple[Operand, ...] = (
    Operand("routed", "arg", "bf16", "num_rows", ("hidden",)),
    Operand("weights", "arg", "weights", "m", ("top_k",)),
    Operand("indices", "arg", "s32", "m", ("top_k",)),
    Operand("shared", "arg", "bf16", "shared", ("hidden",)),
    Operand("residual", "arg", "bf16", "out_rows", ("hidden",), when="epilogue"),
    Operand("norm_weight", "arg", "bf16", None, ("hidden",), when="epilogue"),
    Operand("out_scale", "arg", "f32", None, ("single",), when="fp8_static"),
    Operand("out", "ret", "out", "out_rows", ("hidden",)),
    Operand("residual_out", "ret", "bf16", "out_rows", ("hidden",), when="epilogue"),
    Operand("out_scales", "ret", "f32", "out_rows", ("fp8_groups",), when="fp8_group"),
)
"""Every array of a call of the op; a config takes those its epilogue has."""

FP8_GROUP = 128
"""Columns that share one scale of the dynamic FP8 out (`reference.quantize_fp8`)."""
FP8_MAX = 448.0
"""The largest finite float8_e4m3fn: a scale is a group's or block's amax over it."""

DTYPES = {"bf16": 2, "f32": 4, "s32": 4, "e4m3": 1}
"""Bytes per element of each operand dtype."""

TARGETS = {"none": "jax_moe_publish", "rmsnorm": "jax_moe_publish_rmsnorm"}
"""The FFI target of a call, by epilogue (the rmsnorm one takes ``norm_eps``)."""


# --- the experts' decode GEMM, the second op ---------------------------------------------

EXPERTS_VALUES: dict[str, str] = {
    "x": "u64",  # bf16 [m, hidden]: the tokens (e4m3 with ExpertsConfig.fp8_tokens)
    "expert_ids": "u64",  # int32 [m, top_k]
    "gate_up": "u64",  # bf16 [experts, hidden, 2 * intermediate], gate columns first (fused layout)
    "gate": "u64",  # bf16 [experts, hidden, intermediate] (split layout)
    "up": "u64",  # bf16 [experts, hidden, intermediate] (split layout)
    "down": "u64",  # bf16 [experts, intermediate, hidden]
    # With e4m3 weights (ExpertsConfig.fp8_weights), each weight array's float32 scales, one per
    # 128 x 128 block: [experts, k / 128, columns / 128].
    "gate_up_scales": "u64",
    "gate_scales": "u64",
    "up_scales": "u64",
    "down_scales": "u64",
    # With e4m3 tokens (ExpertsConfig.fp8_tokens), their float32 scales: [m, hidden / 128].
    "x_scales": "u64",
    "activations": "u64",  # bf16 [m, top_k (+ 1), intermediate]: SwiGLU of each pair, between the kernels
    "out": "u64",  # bf16 [m * top_k, hidden]: each pair's row
    "shared": "u64",  # bf16 [m, hidden]: each token's shared expert row (ExpertsConfig.shared_expert)
    "m": "u32",  # tokens of the call
}
"""Name -> PTX type of every value a kernel of the experts op can receive, in the order of
`kernels.experts_program.ExpertsProgram.__call__`. The addresses of the layout a config does
not take (gate and up, or gate_up) are 0."""

EXPERTS_ROLES: dict[str, Role] = {
    # Each token's gate and up rows through its experts, and their SwiGLU: from the fused
    # gate_up array, or from gate and up. A cluster splits an item's K (`gate_up_split_k`).
    "expert_gate_up": Role(("x", "expert_ids", "gate_up", "activations", "m"), persistent=True,
                           clustered=True),
    "expert_gate_up_split": Role(("x", "expert_ids", "gate", "up", "activations", "m"), persistent=True,
                                 clustered=True),
    # The activations through down: each pair's row; zero for a skipped pair.
    "expert_down": Role(("expert_ids", "down", "activations", "out", "m"), persistent=True),
    # The same with e4m3 weights and their block scales.
    "expert_gate_up_fp8": Role(("x", "expert_ids", "gate_up", "gate_up_scales", "activations", "m"),
                               persistent=True, clustered=True),
    "expert_gate_up_split_fp8": Role(("x", "expert_ids", "gate", "up", "gate_scales", "up_scales", "activations",
                                      "m"), persistent=True, clustered=True),
    "expert_down_fp8": Role(("expert_ids", "down", "down_scales", "activations", "out", "m"), persistent=True),
    # The gate/up kernels with e4m3 tokens and their scales too.
    "expert_gate_up_fp8_tokens": Role(("x", "expert_ids", "gate_up", "gate_up_scales", "x_scales", "activations",
                                       "m"), persistent=True, clustered=True),
    "expert_gate_up_split_fp8_tokens": Role(("x", "expert_ids", "gate", "up", "gate_scales", "up_scales", "x_scales",
                                             "activations", "m"), persistent=True, clustered=True),
    # With the shared expert (the weights' last), down writes its rows apart; the gate/up roles
    # take the same values (the shared pairs' activations are rows of theirs).
    "expert_down_shared": Role(("expert_ids", "down", "activations", "out", "shared", "m"), persistent=True),
    "expert_down_fp8_shared": Role(("expert_ids", "down", "down_scales", "activations", "out", "shared", "m"),
                                   persistent=True),
}

EXPERTS_OPERANDS: tuple[Operand, ...] = (
    Operand("x", "arg", "tokens", "m", ("hidden",)),
    Operand("expert_ids", "arg", "s32", "m", ("top_k",)),
    # The weight arrays hold the routed experts, then the shared expert where there is one.
    Operand("gate_up", "arg", "expert_weights", None, ("weight_experts", "hidden", "gate_up_columns"),
            when="fused_gate_up"),
    Operand("gate", "arg", "expert_weights", None, ("weight_experts", "hidden", "intermediate"), when="split_gate_up"),
    Operand("up", "arg", "expert_weights", None, ("weight_experts", "hidden", "intermediate"), when="split_gate_up"),
    Operand("down", "arg", "expert_weights", None, ("weight_experts", "intermediate", "hidden")),
    Operand("gate_up_scales", "arg", "f32", None, ("weight_experts", "hidden_blocks", "gate_up_column_blocks"),
            when="fused_gate_up_fp8"),
    Operand("gate_scales", "arg", "f32", None, ("weight_experts", "hidden_blocks", "intermediate_blocks"),
            when="split_gate_up_fp8"),
    Operand("up_scales", "arg", "f32", None, ("weight_experts", "hidden_blocks", "intermediate_blocks"),
            when="split_gate_up_fp8"),
    Operand("down_scales", "arg", "f32", None, ("weight_experts", "intermediate_blocks", "hidden_blocks"),
            when="fp8_weights"),
    Operand("x_scales", "arg", "f32", "m", ("hidden_blocks",), when="fp8_tokens"),
    Operand("out", "ret", "bf16", "pairs", ("hidden",)),
    Operand("shared", "ret", "bf16", "m", ("hidden",), when="shared_expert"),
    # Scratch between the two kernels, which XLA allocates like any result: a row per pair.
    Operand("activations", "ret", "bf16", "m", ("token_pairs", "intermediate")),
)


@dataclasses.dataclass(frozen=True)
class Contract:
    """The launch contract of one op: the values its kernels can receive (name -> PTX type, in
    its program's parameter order), its kernel roles, the arrays of a call (`Operand`), its FFI
    targets by variant, and the roles a config's call launches, in order (``call_roles``)."""

    name: str
    values: dict[str, str]
    roles: dict[str, Role]
    operands: tuple[Operand, ...]
    targets: dict[str, str]
    call_roles: object

    def target(self, config) -> str:
        """The FFI target of ``config``'s calls: by epilogue for the publish op."""
        return self.targets[getattr(config, "epilogue", "none")]


def _publish_roles(config) -> tuple[str, ...]:
    roles = ALGORITHMS[config.algorithm].roles[config.fuse_reduce, config.epilogue]
    if config.fp8_out == "none":
        return roles
    return tuple(FP8_ROLES[config.fp8_out].get(role, role) for role in roles)


PUBLISH = Contract("publish", VALUES, ROLES, OPERANDS, TARGETS, call_roles=_publish_roles)
def _experts_roles(config) -> tuple[str, ...]:
    gate_up, down = ("expert_gate_up" if config.fused_gate_up else "expert_gate_up_split", "expert_down")
    shared = "_shared" if config.shared_expert else ""
    if config.fp8_tokens:
        return f"{gate_up}_fp8_tokens", f"{down}_fp8{shared}"
    return (f"{gate_up}_fp8", f"{down}_fp8{shared}") if config.fp8_weights else (gate_up, f"{down}{shared}")


EXPERTS = Contract("experts", EXPERTS_VALUES, EXPERTS_ROLES, EXPERTS_OPERANDS, {"none": "jax_moe_publish_experts"},
                   call_roles=_experts_roles)
CONTRACTS = {contract.name: contract for contract in (PUBLISH, EXPERTS)}
"""Every op's contract, by the name its configs give as ``op``."""


def _union(tables) -> dict:
    merged = {}
    for table in tables:
        for name, entry in table.items():
            if merged.setdefault(name, entry) != entry:
                raise ValueError(f"{name!r} means {merged[name]} in one op's contract and {entry} in another's")
    return merged


ALL_VALUES: dict[str, str] = _union(contract.values for contract in CONTRACTS.values())
"""Every op's values, each name once with one type (a value two ops share, such as ``out`` or
``m``, means the same in both): the C++ launcher's list, in this order."""
ALL_ROLES: dict[str, Role] = _union(contract.roles for contract in CONTRACTS.values())
"""Every op's kernel roles; a role belongs to one op."""
ALL_TARGETS: dict[str, str] = {target: contract.name for contract in CONTRACTS.values()
                               for target in contract.targets.values()}
"""FFI target -> the op it calls."""


def contract_of(config) -> Contract:
    """The contract of ``config`` (a `KernelConfig` or an `ExpertsConfig`)."""
    return CONTRACTS[config.op]


def call_roles(config) -> tuple[str, ...]:
    """The kernels of one call of ``config``, in launch order."""
    return contract_of(config).call_roles(config)


def call_operands(config) -> list[dict]:
    """``config``'s contract's operands resolved for it, as the sidecar records them: name, io,
    dtype (``"bf16"``, ``"f32"``, ``"s32"`` or ``"e4m3"``), rows (``"num_rows"``, ``"m"``, ``"owned"``,
    ``"pairs"``, ``"zero"`` or None for a fixed shape) and shape (the counts after the rows)."""
    rows = config.operand_rows()
    dimensions = config.dimensions()
    dtypes = {"bf16": "bf16", "f32": "f32", "s32": "s32", **config.operand_dtypes()}
    conditions = config.conditions()
    return [{"name": o.name, "io": o.io, "dtype": dtypes[o.dtype], "rows": rows.get(o.rows, o.rows),
             "shape": [dimensions[d] for d in o.shape]}
            for o in contract_of(config).operands if o.when is None or o.when in conditions]
