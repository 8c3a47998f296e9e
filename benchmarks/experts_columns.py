"""The columns of `bench_moe_experts`: each route to the experts' rows that it times, how a
column's layer is called and which launch config its kernels load, and what its optimized HLO
must hold to be the route its name says. The benchmark's docstring says what each column is."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import re
import sys

import jax

# examples/ is not a package: its modules import by name (as in bench_moe_block.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
import moe_block as mb

import jax_moe_publish as jmp
from jax_moe_publish import experts_tokamax, reference
from jax_moe_publish.experts_layout import Tiling


@dataclasses.dataclass(frozen=True)
class Column:
    """One route to the experts' rows: how its programs are built, and what its optimized HLO
    must hold for the column to be what its name says (``needs_in_hlo``, regexes that must all
    match; ``needs_what`` says it in words)."""

    name: str
    what: str
    route: str  # "ours" (impl="kernel"), or the jmp.moe_experts impl: "reference", "gather", "tokamax"
    prepared: bool = False  # on jmp.prepare_experts's weights (made once, before the timed loop)
    fp8: bool = False  # on the layers' e4m3 weights (BlockScaled of 128 x 128 blocks)
    fp8_tokens: bool = False  # x quantized to e4m3 per token and 128 channels in the step
    shared: str = ""  # the shared expert too: "held" by the prepared weights, or through "xla"
    bulk: bool = False  # ours with ExpertsConfig.with_bulk_loads (prepared weights only)
    changes: tuple = ()  # ours with these (field, value) changes to the default config
    compiler_options: tuple = ()  # XLA options of this column's programs only
    jax_flag: str | None = None  # a JAX config flag set while this column's programs are traced
    needs_in_hlo: tuple = ()
    needs_what: str = ""


_RAGGED_DOT_KEPT = r"\sragged-dot\("  # XLA's default rewrites every ragged dot into dots
COLUMNS = (
    Column("ours", "jmp.moe_experts(impl='kernel'): this package's kernels", "ours"),
    Column("ours_prepared", "jmp.moe_experts(impl='kernel') on jmp.prepare_experts's weights (the kernels' tiled "
           "order, made once before the loop)", "ours", prepared=True),
    Column("ragged_dot", "jmp.moe_experts(impl='reference'): jax.lax.ragged_dot, XLA's default lowering",
           "reference"),
    Column("ragged_dot_pallas_triton", "jmp.moe_experts(impl='reference') traced with "
           "jax_ragged_dot_use_gpu_pallas_triton_lowering: JAX's Pallas Triton ragged dot", "reference",
           jax_flag="jax_ragged_dot_use_gpu_pallas_triton_lowering",
           needs_in_hlo=(r'custom_call_target="[^"]*triton',), needs_what="a Triton custom call"),
    Column("cudnn", "jmp.moe_experts(impl='reference') compiled with xla_gpu_experimental_use_ragged_dot_fusion: "
           "XLA's cuDNN grouped GEMM", "reference",
           compiler_options=(("xla_gpu_experimental_use_ragged_dot_fusion", True),),
           needs_in_hlo=(_RAGGED_DOT_KEPT, r'"kind":\s*"__cudnn\$fusion"'),
           needs_what="a ragged dot in a cuDNN fusion (kind __cudnn$fusion; XLA needs cuDNN >= 9.22 and a CUDA "
                      "GPU of Ampere or later)"),
    Column("xla_triton", "jmp.moe_experts(impl='reference') compiled with xla_gpu_experimental_triton_ragged_dot: "
           "XLA's Triton ragged-dot emitter", "reference",
           compiler_options=(("xla_gpu_experimental_triton_ragged_dot", True),
                             ("xla_gpu_experimental_enable_tiling_propagation", True)),
           needs_in_hlo=(_RAGGED_DOT_KEPT, r'"kind":\s*"__triton_gemm"'),
           needs_what="a ragged dot in a Triton GEMM fusion (kind __triton_gemm)"),
    Column("tokamax", "jmp.moe_experts(impl='tokamax'): the reference's two grouped GEMMs as tokamax.ragged_dot's "
           "Mosaic GPU kernel", "tokamax"),
    Column("gather", "jmp.moe_experts(impl='gather'): the active experts' weights gathered by XLA into slots, "
           "two batched GEMMs", "gather"),
    Column("ours_fp8", "jmp.moe_experts(impl='kernel') on e4m3 weights with 128 x 128 block scales", "ours",
           fp8=True),
    Column("ours_fp8_prepared", "jmp.moe_experts(impl='kernel') on jmp.prepare_experts's order of the e4m3 weights",
           "ours", prepared=True, fp8=True),
    Column("gather_fp8", "jmp.moe_experts(impl='gather') on the e4m3 weights (dequantized after the gather)",
           "gather", fp8=True),
    Column("ours_fp8_tokens_prepared", "jmp.moe_experts(impl='kernel') on e4m3 tokens (quantized in the step by "
           "reference.quantize_fp8) and jmp.prepare_experts's order of the e4m3 weights", "ours", prepared=True,
           fp8=True, fp8_tokens=True),
    Column("ours_shared_prepared", "jmp.moe_experts(impl='kernel') on jmp.prepare_experts's weights holding the "
           "shared expert after the routed ones: the kernels compute its rows too", "ours", prepared=True,
           shared="held"),
    Column("ours_prepared_xla_shared", "ours_prepared, and the shared expert through XLA's GEMMs "
           "(jmp.moe_experts(..., shared=...))", "ours", prepared=True, shared="xla"),
    Column("ours_bulk_prepared", "ours_prepared with both kernels' loads as bulk copies into a ring of the CTA's "
           "(jmp.ExpertsConfig.with_bulk_loads)", "ours", prepared=True, bulk=True),
    Column("ours_fp8_bulk_prepared", "ours_fp8_prepared with both kernels' loads as bulk copies into a ring of the "
           "CTA's (jmp.ExpertsConfig.with_bulk_loads)", "ours", prepared=True, fp8=True, bulk=True),
)
COLUMN_NAMES = tuple(column.name for column in COLUMNS)
COLUMNS_BY_NAME = {column.name: column for column in COLUMNS}
FLOOR_COLUMNS = ("floor", "floor_fp8", "floor_shared")
"""A case's entries beside its columns: the floors (`bench_moe_experts`' docstring)."""
VARIANT_PREFIX = "ours_prepared:"
ROWS_VARIANT_PREFIX = "ours:"
ROWS_VARIANT = "rows:"
"""How a ``--variants`` text asks for a column of ``ours`` (the weights' rows)."""
KEPT_BY_VARIANTS = ("hidden", "intermediate", "experts", "top_k", "fused_gate_up", "tiled_weights", "fp8_weights",
                    "fp8_tokens", "shared_expert", "arch", *(f.name for f in dataclasses.fields(Tiling)))
"""`jmp.ExpertsConfig` fields that a ``--variants`` column may not change: the call's operands and
the weights' tiled order (its columns read the same prepared weights as ``ours_prepared``)."""


def parse_changes(text: str) -> dict:
    """``"field=value,field=value"`` -> changes to a `jmp.ExpertsConfig` (ints, or true/false)."""
    changes = {}
    for item in text.split(","):
        field, _, value = (part.strip() for part in item.partition("="))
        changes[field] = value == "true" if value in ("true", "false") else int(value)
    return changes


def variant_column(text: str) -> Column:
    """The ``--variants`` column of ``text`` (`parse_changes`): of ``ours_prepared``, named
    `VARIANT_PREFIX` + ``text``, or after `ROWS_VARIANT` of ``ours``, named `ROWS_VARIANT_PREFIX` +
    the changes; ValueError where a change is not a launch-shape field (that keeps the tiled
    order, on prepared weights)."""
    rows = text.startswith(ROWS_VARIANT)
    changes_text = text.removeprefix(ROWS_VARIANT)
    try:
        changes = parse_changes(changes_text)
    except ValueError:
        raise ValueError(f"--variants {text}: expected [{ROWS_VARIANT}]FIELD=VALUE[,FIELD=VALUE...] with integer or "
                         "true/false values") from None
    fields = {f.name for f in dataclasses.fields(jmp.ExpertsConfig)}
    kept = set(KEPT_BY_VARIANTS) - ({f.name for f in dataclasses.fields(Tiling)} if rows else set())
    for field in changes:
        if field not in fields or field in kept:
            what = "launch-shape field" if rows else "launch-shape field that keeps the weights' tiled order"
            raise ValueError(f"--variants {text}: {field!r} is not a {what}; expected one of {sorted(fields - kept)}")
    if rows:
        return Column(ROWS_VARIANT_PREFIX + changes_text, f"ours with the op's config changed by {changes_text} (the "
                      "weights' rows)", "ours", changes=tuple(sorted(changes.items())))
    return Column(VARIANT_PREFIX + text, f"ours_prepared with the op's config changed by {text} (the same tiled "
                  "order)", "ours", prepared=True, changes=tuple(sorted(changes.items())))


def selected_columns(args) -> list:
    """The columns of ``--columns`` in `COLUMNS`' order, then those of ``--variants``."""
    return [column for column in COLUMNS if column.name in args.columns] + list(getattr(args, "variant_columns", []))


def column_named(args, name: str) -> Column:
    return next(column for column in selected_columns(args) if column.name == name)


def why_no_shared(column, config):
    """Why ``column``'s shared expert cannot run at ``config``, or None."""
    if not config.shared:
        return f"{config.name} has no shared expert"
    if column.shared == "held" and not mb.holds_shared(config):
        return (f"the shared expert's intermediate ({config.shared_intermediate}) is not the routed experts' "
                f"({config.intermediate}): prepare_experts cannot hold it")
    return None


def operand_kind(column) -> int:
    """0: bf16 operands; 1: e4m3 weights; 2: e4m3 weights and tokens."""
    return int(column.fp8) + int(column.fp8_tokens)


def known_unavailable(column):
    """Whether this Python lacks what ``column`` needs, where that shows without a device (its
    module, its JAX flag); the run records the error itself."""
    if column.route == "tokamax":
        return experts_tokamax.import_error() is not None
    return column.jax_flag is not None and not hasattr(jax.config, column.jax_flag)


def layer_function(column, args):
    """``(layer weights, x, expert ids) -> rows`` of ``column``, the layer's weights as
    `experts_draws.draw_weights` holds them."""
    impl = args.ours_impl if column.route == "ours" else column.route
    if column.fp8_tokens:
        return lambda w, x, ids: jmp.moe_experts(jmp.BlockScaled(*reference.quantize_fp8(x)), ids,
                                                 w["fp8_prepared"], impl=impl)
    if column.shared == "held":
        return lambda w, x, ids: jmp.moe_experts(x, ids, w["prepared_shared"], impl=impl)
    if column.shared == "xla":
        return lambda w, x, ids: jmp.moe_experts(x, ids, w["prepared"], shared=w["shared"], impl=impl)
    if column.prepared:
        name = "fp8_prepared" if column.fp8 else "prepared"
        if column.bulk:
            return lambda w, x, ids: jmp.moe_experts(x, ids, w[name], impl=impl,
                                                     config=bulk_config(w[name], ids.shape, column.fp8))
        if column.changes:
            return lambda w, x, ids: jmp.moe_experts(x, ids, w[name], impl=impl,
                                                     config=variant_config(w[name], ids.shape, column))
        return lambda w, x, ids: jmp.moe_experts(x, ids, w[name], impl=impl)
    if column.fp8:
        return lambda w, x, ids: jmp.moe_experts(x, ids, *w["fp8"], impl=impl)
    if column.changes:
        return lambda w, x, ids: jmp.moe_experts(x, ids, w["gate_up"], w["down"], impl=impl,
                                                 config=rows_variant_config(w["gate_up"], ids.shape, column))
    return lambda w, x, ids: jmp.moe_experts(x, ids, w["gate_up"], w["down"], impl=impl)


def rows_variant_config(gate_up, ids_shape, column):
    """A rows ``--variants`` column's config for the weights' rows (the fused ``gate_up``): the
    op's default with the column's changes."""
    return default_config(gate_up, ids_shape).replace(**dict(column.changes))


def default_config(gate_up, ids_shape, fp8: bool = False):
    """The op's default config for fused ``gate_up`` weights (prepared weights' before their
    tiled order) and ids of ``ids_shape`` (m, top_k)."""
    experts, hidden, gate_up_columns = gate_up.shape
    m, top_k = ids_shape
    return jmp.ExpertsConfig.for_shape(hidden=hidden, intermediate=gate_up_columns // 2, experts=experts,
                                       top_k=top_k, fp8_weights=fp8, m=m)


def bulk_config(prepared, ids_shape, fp8: bool):
    """The bulk-copy columns' config for ``prepared`` weights: the default's, with both kernels'
    bulk loads (`jmp.ExpertsConfig.with_bulk_loads`, the same tiled order)."""
    return default_config(prepared.gate_up, ids_shape, fp8).with_bulk_loads()


def variant_config(prepared, ids_shape, column):
    """A ``--variants`` column's config for ``prepared`` weights: the default's in their tiled
    order, with the column's changes."""
    return prepared.tiling.config_for(default_config(prepared.gate_up, ids_shape)).replace(**dict(column.changes))


def ours_config(config, tp, column, m):
    """The `jmp.ExpertsConfig` that ours' ``column`` loads at ``config``'s shard of ``tp`` for
    ``m`` tokens."""
    ours = jmp.ExpertsConfig.for_shape(hidden=config.hidden, intermediate=config.intermediate // tp,
                                       experts=config.experts, top_k=config.top_k, fp8_weights=column.fp8,
                                       fp8_tokens=column.fp8_tokens, shared_expert=column.shared == "held", m=m)
    if column.bulk:
        return ours.with_bulk_loads()
    return ours.replace(tiled_weights=column.prepared, **dict(column.changes))


@contextlib.contextmanager
def jax_flag(name):
    """JAX's config flag ``name`` set while the block runs (None: nothing), restored after."""
    if name is None:
        yield
        return
    if not hasattr(jax.config, name):
        raise ValueError(f"this jax ({jax.__version__}) has no config flag {name!r}")
    before = getattr(jax.config, name)
    jax.config.update(name, True)
    try:
        yield
    finally:
        jax.config.update(name, before)


_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
_FUSION_KIND = re.compile(r'"kind":\s*"(__[^"]+)"')


def hlo_kernels(hlo):
    """What an optimized HLO module runs its GEMMs with: custom-call targets and fusion kinds
    (``__cudnn$fusion``, ``__triton_gemm``, ...) counted over the module, and its ragged dots
    (XLA's default lowering rewrites every one into dots)."""

    def counts(pattern):
        found = {}
        for name in pattern.findall(hlo):
            found[name] = found.get(name, 0) + 1
        return found

    return {"custom_calls": counts(_CUSTOM_CALL), "fusion_kinds": counts(_FUSION_KIND),
            "ragged_dots": len(re.findall(_RAGGED_DOT_KEPT, hlo))}


def missing_evidence(column, hlo):
    """Why the optimized HLO does not show ``column``'s implementation, or None where it does."""
    if all(re.search(pattern, hlo) for pattern in column.needs_in_hlo):
        return None
    return (f"the optimized HLO lacks {column.needs_what}; it has {json.dumps(hlo_kernels(hlo))}: "
            "the program runs another implementation")
