"""`ExpertsConfig`: every compile-time choice of one specialization of the experts op.

A config names one cubin of the experts' decode GEMM (`jax_moe_publish.experts`): the shape of a
rank's expert weights (``hidden``, the rank's ``intermediate`` columns, ``experts``, ``top_k``,
fused or split gate and up) and how each of its two kernels splits a work item over its warps.
Runtime values (m, addresses) are kernel parameters and are not here.

Each kernel covers a work item, one active expert's block of output columns, with
``warps_k * warps_n`` warps: ``warps_n`` of them side by side over the columns, ``warp_cols``
columns each, and ``warps_k`` splitting the reduction dimension K, whose partial sums the CTA
adds in warp order. A warp computes its columns for up to ``8 * token_tiles`` of the expert's
tokens at once with ``mma.sync`` (m16n8k16: 16 columns by 8 tokens per instruction), reading each
weight once per pass over the tokens, ``unroll`` steps of 16 rows of K in flight.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers

MMA_COLUMNS = 16
"""Columns (weight columns, the mma's M) of one tensor-core instruction."""
MMA_TOKENS = 8
"""Tokens (the mma's N) of one tensor-core instruction."""
MMA_K = 16
"""Rows of K of one tensor-core instruction."""
FP8_BLOCK = 128
"""Rows and columns of the weights that share one scale with ``fp8_weights`` (DeepSeek-V3's
128 x 128 ``weight_scale_inv`` blocks)."""
LANE_ROWS = (0, 1, 8, 9)
"""The rows of a 16-row K step that lane ``4g + q`` loads, after ``2q``: its A and B fragments' rows."""
WARP_COLS = (32, 64)
"""Columns a warp covers: its lanes load 8 or 16 contiguous bytes of a weight row."""
MAX_EXPERTS = 1024
MAX_TOP_K = 64
MAX_PAIRS = 8192
"""Token-expert pairs (``m * top_k``, and ``m`` more with the shared expert) of one call: each
CTA keeps their expert order in shared memory (4 bytes each)."""
ROUTING_PAIRS_PER_THREAD = 4
"""Ids a thread of the routing (`kernels.expert_routing`) loads at once, per span of its passes
over the pairs: one round trip to memory per span instead of one per id."""
MAX_THREADS = 1024
ONE_TILE_MAX_HIDDEN = 2048
ONE_TILE_MAX_INTERMEDIATE = 384
ONE_TILE_MAX_PAIRS_PER_EXPERT = 4
"""`one_token_tile`'s bounds: the shard's hidden and intermediate (each kernel's K), and a call's
pairs per expert on average."""
WARP_ROUTING_IDS = 32
"""Routed ids (``m * top_k``) up to which ``warp_routing`` builds the tables in one warp, an id
per lane. Measured on one H100 (2026-12-06, prepared weights, against the CTA's routing at m =
1): 0.51-0.57 µs per launch instead of 0.91-1.39 (`routing_time.cu`), and 0.7-2.3 µs less per
call at the tp = 4 and 8 shards of DeepSeek-V3, Qwen3-235B and Qwen3-30B; 0.5-2.5 µs at m = 4,
some of it within the run's spread (benchmarks/README.md)."""
THREE_GATE_UP_TILES_MIN_PAIRS_PER_EXPERT = 16
"""A call's pairs per expert on average from which `ExpertsConfig.for_shape` gives gate/up three
token tiles (`three_gate_up_tiles`)."""
THREE_TILES_MIN_EXPERTS = 256
THREE_TILES_MIN_PAIRS_PER_EXPERT = 8
"""The experts and a call's pairs per expert on average from which `ExpertsConfig.for_shape` gives
both kernels three token tiles (`three_token_tiles`)."""
ONE_CTA_GATE_UP_WARPS_K = 16
ONE_CTA_MIN_STEPS = 16
"""Gate/up warps where a call's items are at most one per SM and each warp keeps at least
``ONE_CTA_MIN_STEPS`` K steps (`ExpertsConfig.for_shape`). Measured on one H100 (2026-12-06,
prepared weights, against 8 warps): DeepSeek-V3's tp = 8 shard at m = 1 (128 items, 28 steps per
warp) 0.90-0.92 of the time (42.6 and 44.5 against 47.5 and 48.5 µs, two runs), Qwen3-235B's at
m = 1 (96 items, 16 steps) 0.98; Qwen3-30B's tp 8 and 4 shards (8 steps) lost 3-9 %; with 256
items (DeepSeek-V3 tp 4, m = 1; tp 8, m = 2) 16 warps gained nothing."""
SPLIT_K = (1, 2, 4, 8, 16)
"""CTAs of one cluster that split a gate/up work item's K (16: beyond the portable cluster
size, which the launchers opt into)."""
SHARED_MEMORY_BYTES = 227 * 1024
"""Shared memory a CTA of an H100 or H200 may use."""
MBARRIER_BYTES = 8
"""Shared memory of one mbarrier (a 64-bit word): each bulk-loads stage has a full and an empty one."""
ARCHS = ("sm_90a", "sm_100a")
_INT_FIELDS = ("hidden", "intermediate", "experts", "top_k", "token_tiles", "gate_up_warps_k", "gate_up_warps_n",
               "gate_up_warp_cols", "gate_up_unroll", "gate_up_split_k", "down_warps_k", "down_warps_n",
               "down_warp_cols", "down_unroll", "gate_up_column_blocks")
_OPTIONAL_INT_FIELDS = ("gate_up_token_tiles",)
"""Int fields that may be None: they follow another field."""
_BOOL_FIELDS = ("fused_gate_up", "gate_up_async_loads", "down_async_loads", "gate_up_bulk_loads", "down_bulk_loads",
                "tiled_weights", "fp8_weights", "fp8_tokens", "fp8_shift_widening", "shared_expert", "early_down",
                "pass_items", "enable_pdl", "warp_routing")


def _require(condition: bool, field: str, value, expected: str) -> None:
    if not condition:
        raise ValueError(f"ExpertsConfig.{field}={value!r}: expected {expected}")


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """How one kernel of the experts op covers its work items (from an `ExpertsConfig`).

    ``k``: rows of the reduction (hidden for gate/up, intermediate for down); ``columns``: the
    output columns of an expert; ``gated``: each warp's lanes 0-15 read gate columns and lanes
    16-31 the same columns of up, so a warp yields ``warp_cols / 2`` SwiGLU columns;
    ``split_k``: CTAs of a cluster that each take ``k / split_k`` consecutive rows of an item
    (their sums added in cluster order); ``async_loads``: each warp's ``unroll`` steps in
    flight are ``cp.async`` copies into its own ring of shared memory; ``bulk_loads``: one more
    warp copies each round of the item (``warps_k`` consecutive K steps: one block of the tiled
    weights, and each token's slice of K) into a ring of ``unroll`` stages of the CTA's shared
    memory with bulk copies, which the other warps read; ``tiled``: the weights
    are in the tiled order (`tiled_offset`), else in their ``[k, columns]`` rows; ``fp8``: the
    weights are e4m3 with a float32 scale per `FP8_BLOCK` x `FP8_BLOCK` block, else bf16;
    ``fp8_tokens``: the tokens (B) are e4m3 with a float32 scale per token and `FP8_BLOCK` rows
    of K, else bf16 (gate/up only: down's tokens are the activations); ``shift_widening``: e4m3
    weights (and tokens) widened by `ptx`'s exponent shift (`ExpertsConfig.fp8_shift_widening`);
    ``column_blocks``: the column blocks of ``warps_n * warp_cols`` (gated: half as many SwiGLU
    columns) that one work item covers, each lane loading its columns of every block and
    multiplying them by the same token fragments (`ExpertsConfig.gate_up_column_blocks`)."""

    k: int
    columns: int
    gated: bool
    warps_k: int
    warps_n: int
    warp_cols: int
    unroll: int
    token_tiles: int
    split_k: int = 1
    async_loads: bool = False
    bulk_loads: bool = False
    tiled: bool = False
    fp8: bool = False
    fp8_tokens: bool = False
    shift_widening: bool = False
    column_blocks: int = 1

    @property
    def weight_bytes(self) -> int:
        """Bytes of one weight element: e4m3 or bf16."""
        return 1 if self.fp8 else 2

    @property
    def token_bytes(self) -> int:
        """Bytes of one token element (B): e4m3 or bf16."""
        return 1 if self.fp8_tokens else 2

    @property
    def lane_weight_words(self) -> int:
        """Words of a weight row that one lane loads (``warp_cols / 8`` columns): `lane_words`
        in bf16, half as many in e4m3 (each widened to two bf16 words)."""
        return self.lane_words * self.weight_bytes // 2

    @property
    def compute_threads(self) -> int:
        """The threads of the warps that run the mmas (all of them but `bulk_loads`'s copying warp)."""
        return 32 * self.warps_k * self.warps_n

    @property
    def threads(self) -> int:
        return self.compute_threads + (32 if self.bulk_loads else 0)

    @property
    def mma_tiles(self) -> int:
        """mma.sync instructions side by side over a warp's columns, in every column block."""
        return self.warp_cols // MMA_COLUMNS * self.column_blocks

    def tile_column(self, tile: int) -> int:
        """The first of mma tile ``tile``'s two columns of a lane, from the lane's first: the
        lane's columns are ``2 * lane_words`` consecutive ones of each column block."""
        return tile // self.lane_words * self.block_columns + 2 * (tile % self.lane_words)

    @property
    def lane_words(self) -> int:
        """Words (bf16 pairs) of a weight row that one lane loads: ``warp_cols / 8`` columns."""
        return self.warp_cols // 16

    @property
    def block_columns(self) -> int:
        """Output columns of one column block (SwiGLU columns when gated): one item of the tiled order."""
        return self.warps_n * self.warp_cols // (2 if self.gated else 1)

    @property
    def item_columns(self) -> int:
        """Output columns of one work item: `column_blocks` blocks."""
        return self.block_columns * self.column_blocks

    @property
    def items_per_expert(self) -> int:
        return self.columns // self.item_columns

    @property
    def tokens_per_pass(self) -> int:
        return MMA_TOKENS * self.token_tiles

    @property
    def k_rows_per_cta(self) -> int:
        return self.k // self.split_k

    @property
    def k_steps_per_warp(self) -> int:
        return self.k_rows_per_cta // MMA_K // self.warps_k

    @property
    def tile_lane_bytes(self) -> int:
        """Bytes one lane loads of one of its four rows of a K step: ``warp_cols / 8`` columns."""
        return self.lane_weight_words * 4

    @property
    def tile_row_bytes(self) -> int:
        """One of a warp's four loads of a K step in the tiled order: its 32 lanes' bytes."""
        return 32 * self.tile_lane_bytes

    @property
    def tile_step_bytes(self) -> int:
        """A K step (16 rows) of an item's columns in the tiled order: 4 rows of each warp side by side."""
        return self.warps_n * 4 * self.tile_row_bytes

    @property
    def tile_item_bytes(self) -> int:
        """Bytes of one column block of an expert in the tiled order (its ``item``)."""
        return self.k // MMA_K * self.tile_step_bytes

    def tiled_offset(self, item: int, step: int, w_n: int, row: int, lane: int) -> int:
        """The byte offset, within an expert's weights in the tiled order, of what lane ``lane``
        of warp ``w_n`` loads as its row ``row`` (`LANE_ROWS`: rows ``2q``, ``+1``, ``+8``,
        ``+9``) of K step ``step`` of column block ``item``: each item is contiguous, its K
        steps in order, each step warp by warp, each warp's step as four 32-lane loads of
        consecutive bytes. `experts_layout` builds this order; the kernels read it."""
        return (item * self.tile_item_bytes + step * self.tile_step_bytes + w_n * 4 * self.tile_row_bytes
                + row * self.tile_row_bytes + lane * self.tile_lane_bytes)

    def reduction_bytes(self) -> int:
        """Shared memory for the partial sums of the warps that split K (0 without a split):
        every lane's accumulators, lane innermost."""
        if self.warps_k == 1:
            return 0
        return self.warps_k * self.warps_n * self.mma_tiles * self.token_tiles * 4 * 32 * 4

    @property
    def stage_words(self) -> int:
        """Words of one K step in a warp's ring (`async_loads`): each lane's four weight rows
        (as loaded: e4m3 or bf16); the B words (bf16 tokens: two per lane and token tile;
        e4m3 tokens: each tile's 8 tokens' 16 bytes, then two token scales per lane); with
        e4m3 weights each lane's block scale."""
        b_words = 3 if self.fp8_tokens else 2
        return (4 * self.lane_weight_words + b_words * self.token_tiles + int(self.fp8)) * 32

    def ring_bytes(self) -> int:
        """Shared memory for the warps' rings of ``unroll`` steps (0 without `async_loads`)."""
        return self.threads // 32 * self.unroll * self.stage_words * 4 if self.async_loads else 0

    @property
    def round_bytes(self) -> int:
        """`bulk_loads`: the weights of one round, the ``warps_k`` consecutive K steps that the
        warps splitting K take one each: one block of the tiled order."""
        return self.warps_k * self.tile_step_bytes

    @property
    def round_token_bytes(self) -> int:
        """`bulk_loads`: one token's slice of K in a round."""
        return self.warps_k * MMA_K * self.token_bytes

    @property
    def token_slot_bytes(self) -> int:
        """`bulk_loads`: a token's place in a stage: its slice, and 16 bytes more where the slice
        is an even number of 16-byte pieces, so that the eight tokens that a warp's lane groups
        read lie 4 banks apart (their lanes ``q`` read the banks between)."""
        return self.round_token_bytes + (16 if self.round_token_bytes // 16 % 2 == 0 else 0)

    @property
    def bulk_stage_bytes(self) -> int:
        """`bulk_loads`: one stage of the CTA's ring: a round's weights, then its tokens' slices."""
        return self.round_bytes + self.tokens_per_pass * self.token_slot_bytes

    def stage_weight_offset(self, w_k: int, w_n: int, row: int, lane: int) -> int:
        """`bulk_loads`: the byte offset in a stage of what lane ``lane`` of warp ``(w_k, w_n)``
        reads as its row ``row`` (`LANE_ROWS`) of the round's K step ``w_k``: where
        `tiled_offset` puts it within the round's block."""
        return self.tiled_offset(0, w_k, w_n, row, lane)

    def stage_token_offset(self, token: int, w_k: int, q: int) -> int:
        """`bulk_loads`: the byte offset in a stage of the first B word that a lane ``4g + q``
        of a warp ``w_k`` reads of the pass's token ``token`` (K rows ``w_k * 16 + 2q`` and
        ``+1`` of the round; the second, rows ``+8`` and ``+9``, is 8 elements on)."""
        return self.round_bytes + token * self.token_slot_bytes + (w_k * MMA_K + 2 * q) * self.token_bytes

    @property
    def bulk_stage_cost(self) -> int:
        """`bulk_loads`: the shared memory one stage takes: its bytes, and its full and empty mbarriers."""
        return self.bulk_stage_bytes + 2 * MBARRIER_BYTES

    def bulk_ring_bytes(self) -> int:
        """Shared memory of `bulk_loads`'s ring: ``unroll`` stages, then their mbarriers (0 without)."""
        return self.unroll * self.bulk_stage_cost if self.bulk_loads else 0

    def partial_bytes(self) -> int:
        """Shared memory for the CTA's sums that the cluster's CTAs read (0 without a split):
        one warp's accumulators per column block, lane innermost."""
        if self.split_k == 1:
            return 0
        return self.warps_n * self.mma_tiles * self.token_tiles * 4 * 32 * 4


SMEM_ALIGNMENT = 16
BULK_IN_FLIGHT_BYTES = 64 * 1024
"""Weight bytes `ExpertsConfig.with_bulk_loads` keeps in flight per CTA (one per SM): twice what
an H200's 4.3 TB/s needs over 132 SMs at about a microsecond of DRAM latency."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def routing_bytes(groups: int, experts: int, warps: int) -> int:
    """Shared memory of a CTA's routing tables (`kernels.expert_routing`) in a kernel of ``warps``
    warps: four int32 per group (expert, and the shared expert), four totals, one per expert and
    warp, and the pairs in group order, each array 16-byte aligned."""
    return 4 * _aligned(4 * groups) + _aligned(4 * 4) + _aligned(4 * experts * warps) + _aligned(4 * MAX_PAIRS)


@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """Compile-time specialization of the experts' gate/up and down kernels.

    Parameters
    ----------
    hidden : int
        Model width: K of gate and up, the output columns of down.
    intermediate : int
        This rank's intermediate columns of each expert (``I / tp``): the columns of gate and
        of up, K of down.
    experts : int
        Routed experts; an id outside ``[0, experts)`` skips its pair.
    top_k : int
        Experts per token.
    fused_gate_up : bool
        Gate and up as one ``[experts, hidden, 2 * intermediate]`` array (gate columns first),
        else two ``[experts, hidden, intermediate]`` arrays.
    token_tiles : int
        Tokens of an expert computed per pass over its weights, in eights (1 to 4).
    gate_up_warps_k, gate_up_warps_n, gate_up_warp_cols, gate_up_unroll : int
        The gate/up kernel's work item (`GemmShape`): warps splitting K (hidden), warps side by
        side, columns per warp (half gate, half up), 16-row steps of K in flight per warp.
    gate_up_split_k : int
        CTAs of a thread block cluster that split an item's K into consecutive row ranges
        (`SPLIT_K`): more CTAs per active expert, each reading whole spans of rows, their sums
        added in cluster order. 1: one CTA per item, no cluster.
    down_warps_k, down_warps_n, down_warp_cols, down_unroll : int
        The same for the down kernel (K is intermediate, the columns are hidden).
    gate_up_async_loads, down_async_loads : bool
        The kernel's weight and token loads as ``cp.async`` copies into a ring of ``unroll``
        K steps per warp in shared memory, refilled one step at a time, instead of register
        loads that the compiler may schedule after the first ``mma``. Each kernel's own:
        which is faster differs between them (benchmarks/EXPERIMENTS.md).
    gate_up_bulk_loads, down_bulk_loads : bool
        One more warp per CTA streams the kernel's items into a ring of ``unroll`` stages in
        shared memory with bulk copies (``cp.async.bulk``, each stage an mbarrier's), one
        round per stage: the ``warps_k`` consecutive K steps of the item that the compute warps
        take one each (one contiguous block of the tiled weights) and each token's slice of K.
        The copying warp runs ahead across passes and items; the compute warps only read shared
        memory. Needs ``tiled_weights``, no ``async_loads`` and no K split over a cluster;
        ``unroll`` is then the ring's stages (at least 2), and K's steps need only be a multiple
        of ``warps_k``. An experiment, not chosen by `for_shape` (`with_bulk_loads`).
    tiled_weights : bool
        The weights come in `prepare_experts`'s tiled order for this config's work items
        (`GemmShape.tiled_offset`): each item's bytes contiguous, every warp load 32 lanes of
        consecutive bytes. Needs ``fused_gate_up`` (the tiled gate and up are one array).
    fp8_weights : bool
        The weights are e4m3 with a float32 scale per `FP8_BLOCK` x `FP8_BLOCK` block of each
        expert's ``[k, columns]`` (`BlockScaled`): widened to bf16 in registers (exactly), each
        K step's sums times its block's scale added into the float32 sums. Needs hidden and
        intermediate multiples of `FP8_BLOCK`, and a K split of whole blocks.
    fp8_tokens : bool
        With ``fp8_weights``: the tokens ``x`` are e4m3 with a float32 scale per token and
        `FP8_BLOCK` channels (`BlockScaled` of ``(1, FP8_BLOCK)`` blocks: the epilogue's FP8
        out), widened to bf16 exactly; each K step's sums of a token are added times its
        weight block's scale and its own.
    fp8_shift_widening : bool
        With ``fp8_weights``: each e4m3 pair (weights, and tokens with ``fp8_tokens``) is widened
        with one conversion (to float16) and an exponent shift to bf16 (integer operations and
        an exact bf16 multiply by 2**112), instead of three conversions through float32: the
        same bf16 values, fewer instructions on Hopper's conversion pipe, which bounds the e4m3
        kernels. An e4m3 NaN then reads as a finite value: a NaN weight (checkpoints hold none)
        is lost; a token group holding a NaN or an infinity still gives non-finite rows,
        through its scale (`reference.quantize_fp8`). An experiment, not chosen by `for_shape`.
    shared_expert : bool
        The weight arrays hold one more expert after the routed ones, the shared expert, which
        every token uses: its rows are a second result, ``shared`` ``[m, hidden]``. The
        kernels treat it as one more group of ``m`` pairs (`pairs_per_token`), scheduled
        before the routed experts.
    early_down : bool
        The down kernel launches while gate/up runs its last work items (each gate/up CTA lets it
        launch as it starts its last), builds its routing and prefetches its first item's
        weights into L2 (one bulk prefetch: the item is one block in the tiled order), then
        waits for the activations: its start and first reads overlap gate/up's tail. Needs
        ``tiled_weights`` and ``enable_pdl``; an experiment, not chosen by `for_shape`.
    pass_items : bool
        A work item is one column block of one pass (``8 * token_tiles`` pairs) of a group, and
        the passes of a block run side by side on as many CTAs, which evens out the CTAs'
        shares (`kernels.expert_routing`). False: an item is a block of all of a group's pairs,
        its passes one after another on one CTA; kept to compare the two. Either way each pass
        reads the block's weights again.
    enable_pdl : bool
        Programmatic dependent launch: the gate/up kernel waits for its predecessor, the down
        kernel for gate/up, and each lets its successor launch once its CTAs are done.
    warp_routing : bool
        A call of at most `WARP_ROUTING_IDS` routed ids (4 tokens at top-8) builds its routing
        tables in one warp, from ballots of the ids' bits, with no shared-memory atomics and one
        CTA barrier instead of five (`kernels.expert_routing`); the same tables. `for_shape`
        takes it for a call of that many ids.
    gate_up_token_tiles : int or None
        The gate/up kernel's own `token_tiles` (None: the same). Each kernel builds its passes
        from its own, so gate/up, which reads two thirds of the bytes, may take its experts'
        tokens in fewer passes than down, whose accumulators are four times as many per warp.
    gate_up_column_blocks : int
        Column blocks (``gate_up_warps_n * gate_up_warp_cols / 2`` SwiGLU columns each: the
        items of the tiled order, which stays the same) that one gate/up work item covers: each
        warp loads its columns of every block and multiplies them by one load of the tokens.
        A gate/up warp loads 16 bytes of a pass's tokens (two tiles) per 32 bytes of weights
        that it loads for one block: the tokens' share of what the SMs read from L2 halves at 2
        blocks, and the items are half as many. bf16 weights with register loads only (no
        ``gate_up_async_loads``, ``gate_up_bulk_loads`` or ``gate_up_split_k``). An
        experiment, not chosen by `for_shape` (on an H100 it gained at most 2 % at m = 256).
    arch : {"sm_90a", "sm_100a"}
        Target of the cubin (the launch shapes are Hopper's).
    """

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    fused_gate_up: bool = True
    token_tiles: int = 2
    gate_up_warps_k: int = 8
    gate_up_warps_n: int = 1
    gate_up_warp_cols: int = 32
    gate_up_unroll: int = 4
    gate_up_split_k: int = 1
    down_warps_k: int = 2
    down_warps_n: int = 4
    down_warp_cols: int = 64
    down_unroll: int = 4
    gate_up_async_loads: bool = False
    down_async_loads: bool = False
    gate_up_bulk_loads: bool = False
    down_bulk_loads: bool = False
    tiled_weights: bool = False
    fp8_weights: bool = False
    fp8_tokens: bool = False
    fp8_shift_widening: bool = False
    shared_expert: bool = False
    early_down: bool = False
    pass_items: bool = True
    enable_pdl: bool = True
    warp_routing: bool = False
    gate_up_token_tiles: int | None = None
    gate_up_column_blocks: int = 1
    arch: str = "sm_90a"

    op = "experts"
    """The contract this config compiles (`_abi.CONTRACTS`)."""

    def __post_init__(self) -> None:
        for field in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, field)
            if value is None and field in _OPTIONAL_INT_FIELDS:
                continue
            _require(isinstance(value, numbers.Integral) and not isinstance(value, bool), field, value,
                     "an int" if field in _INT_FIELDS else "None or an int")
            object.__setattr__(self, field, int(value))
        for field in _BOOL_FIELDS:
            _require(isinstance(getattr(self, field), bool), field, getattr(self, field), "a bool")
        _require(self.arch in ARCHS, "arch", self.arch, f"one of {ARCHS}")
        _require(1 <= self.experts <= MAX_EXPERTS, "experts", self.experts, f"an int in [1, {MAX_EXPERTS}]")
        _require(1 <= self.top_k <= MAX_TOP_K, "top_k", self.top_k, f"an int in [1, {MAX_TOP_K}]")
        _require(1 <= self.token_tiles <= 4, "token_tiles", self.token_tiles, "an int in [1, 4]")
        _require(self.gate_up_token_tiles is None or 1 <= self.gate_up_token_tiles <= 4, "gate_up_token_tiles",
                 self.gate_up_token_tiles, "None (token_tiles) or an int in [1, 4]")
        _require(1 <= self.gate_up_column_blocks <= 4, "gate_up_column_blocks", self.gate_up_column_blocks,
                 "an int in [1, 4]")
        if self.gate_up_column_blocks > 1:
            for field, value in (("fp8_weights", self.fp8_weights), ("gate_up_async_loads", self.gate_up_async_loads),
                                 ("gate_up_bulk_loads", self.gate_up_bulk_loads)):
                _require(not value, field, value, f"False with gate_up_column_blocks={self.gate_up_column_blocks} "
                                                  "(column blocks are read with bf16 register loads)")
            _require(self.gate_up_split_k == 1, "gate_up_split_k", self.gate_up_split_k,
                     f"1 with gate_up_column_blocks={self.gate_up_column_blocks}")
        for name in ("hidden", "intermediate"):
            _require(getattr(self, name) > 0 and getattr(self, name) % MMA_K == 0, name, getattr(self, name),
                     f"a positive multiple of {MMA_K} (the tensor cores' K step)")
        _require(self.gate_up_split_k in SPLIT_K, "gate_up_split_k", self.gate_up_split_k, f"one of {SPLIT_K}")
        _require(self.fused_gate_up or not self.tiled_weights, "fused_gate_up", self.fused_gate_up,
                 "True with tiled_weights (the tiled gate and up are one array)")
        _require(not self.early_down or (self.tiled_weights and self.enable_pdl), "early_down", self.early_down,
                 "False without tiled_weights and enable_pdl (it prefetches whole tiled items while gate/up runs)")
        _require(self.fp8_weights or not self.fp8_tokens, "fp8_tokens", self.fp8_tokens,
                 "False without fp8_weights (e4m3 tokens go with e4m3 weights)")
        _require(self.fp8_weights or not self.fp8_shift_widening, "fp8_shift_widening", self.fp8_shift_widening,
                 "False without fp8_weights (it widens e4m3 weights)")
        if self.fp8_weights:
            for name in ("hidden", "intermediate"):
                _require(getattr(self, name) % FP8_BLOCK == 0, name, getattr(self, name),
                         f"a multiple of {FP8_BLOCK} with fp8_weights (whole scale blocks)")
            _require(self.hidden // self.gate_up_split_k % FP8_BLOCK == 0, "gate_up_split_k", self.gate_up_split_k,
                     f"hidden / gate_up_split_k a multiple of {FP8_BLOCK} with fp8_weights (each CTA's rows whole "
                     f"scale blocks; hidden={self.hidden})")
        for role in ("gate_up", "down"):
            shape = self.gemm(role)
            prefix = f"{role}_"
            _require(shape.warp_cols in WARP_COLS, prefix + "warp_cols", shape.warp_cols, f"one of {WARP_COLS}")
            for name in ("warps_k", "warps_n", "unroll"):
                _require(getattr(shape, name) >= 1, prefix + name, getattr(shape, name), "an int >= 1")
            _require(shape.threads <= MAX_THREADS, prefix + "warps_k", shape.warps_k,
                     f"warps_k * warps_n * 32 <= {MAX_THREADS} threads (warps_n={shape.warps_n})")
            _require(shape.columns % shape.item_columns == 0,
                     "hidden" if role == "down" else "intermediate", shape.columns,
                     f"a multiple of the {role} kernel's {shape.item_columns} columns per work item "
                     f"({prefix}warps_n={shape.warps_n} x {prefix}warp_cols={shape.warp_cols}"
                     f"{' / 2, half of them up' if shape.gated else ''}"
                     f"{f' x {prefix}column_blocks={shape.column_blocks}' if shape.column_blocks > 1 else ''})")
            steps = shape.k // MMA_K
            if shape.bulk_loads:
                self._check_bulk_loads(role, shape)
            split = f" * {prefix}split_k" if role == "gate_up" else ""
            # The bulk ring runs on across passes and items: it needs whole rounds only.
            unroll = 1 if shape.bulk_loads else shape.unroll
            _require(steps % (shape.warps_k * unroll * shape.split_k) == 0,
                     "intermediate" if role == "down" else "hidden", shape.k,
                     f"{MMA_K}-row steps ({steps}) divisible by {prefix}warps_k * {prefix}unroll{split} = "
                     f"{shape.warps_k} x {unroll}{f' x {shape.split_k}' if split else ''}")
            _require(self.shared_bytes(role) <= SHARED_MEMORY_BYTES, prefix + "warps_k", shape.warps_k,
                     f"shared memory within {SHARED_MEMORY_BYTES} bytes, got {self.shared_bytes(role)}")

    def _check_bulk_loads(self, role: str, shape: GemmShape) -> None:
        field = f"{role}_bulk_loads"
        _require(self.tiled_weights, field, True, "False without tiled_weights (a round is one block of that order)")
        _require(not shape.async_loads, field, True, f"False with {role}_async_loads (one ring or the other)")
        _require(shape.split_k == 1, field, True, "False with gate_up_split_k > 1")
        _require(shape.unroll >= 2, f"{role}_unroll", shape.unroll, f"at least 2 stages with {field}")

    def gemm(self, role: str) -> GemmShape:
        """The work item of the ``gate_up`` or ``down`` kernel."""
        if role == "gate_up":
            return GemmShape(self.hidden, self.intermediate, True, self.gate_up_warps_k, self.gate_up_warps_n,
                             self.gate_up_warp_cols, self.gate_up_unroll,
                             self.token_tiles if self.gate_up_token_tiles is None else self.gate_up_token_tiles,
                             self.gate_up_split_k,
                             self.gate_up_async_loads, self.gate_up_bulk_loads, self.tiled_weights, self.fp8_weights,
                             self.fp8_tokens, self.fp8_shift_widening, self.gate_up_column_blocks)
        return GemmShape(self.intermediate, self.hidden, False, self.down_warps_k, self.down_warps_n,
                         self.down_warp_cols, self.down_unroll, self.token_tiles, 1, self.down_async_loads,
                         self.down_bulk_loads, self.tiled_weights, self.fp8_weights,
                         shift_widening=self.fp8_shift_widening)

    def shared_bytes(self, role: str) -> int:
        """Dynamic shared memory of the ``gate_up`` or ``down`` kernel."""
        shape = self.gemm(role)
        return (routing_bytes(self.groups, self.experts, shape.threads // 32) + shape.reduction_bytes()
                + shape.partial_bytes() + shape.ring_bytes() + shape.bulk_ring_bytes())

    def operand_rows(self) -> dict:
        """No rows rule of `_abi.EXPERTS_OPERANDS` depends on the config."""
        return {}

    def operand_dtypes(self) -> dict:
        """The weights' and the tokens' dtypes (``"expert_weights"`` and ``"tokens"`` of
        `_abi.EXPERTS_OPERANDS`)."""
        return {"expert_weights": "e4m3" if self.fp8_weights else "bf16",
                "tokens": "e4m3" if self.fp8_tokens else "bf16"}

    def dimensions(self) -> dict:
        """The sizes `_abi.EXPERTS_OPERANDS` names (``weight_experts``: the experts the weight
        arrays hold; ``token_pairs``: a token's pairs; the ``*_blocks``: of FP8 scale blocks)."""
        return {"hidden": self.hidden, "top_k": self.top_k, "weight_experts": self.groups,
                "token_pairs": self.pairs_per_token, "intermediate": self.intermediate,
                "gate_up_columns": 2 * self.intermediate,
                "hidden_blocks": self.hidden // FP8_BLOCK, "intermediate_blocks": self.intermediate // FP8_BLOCK,
                "gate_up_column_blocks": 2 * self.intermediate // FP8_BLOCK}

    def conditions(self) -> set:
        """The ``when`` words of the operands this config's calls take: the gate and up layout,
        with ``fp8_weights`` the scales of each weight array, with ``fp8_tokens`` the tokens',
        with ``shared_expert`` its rows."""
        layout = "fused_gate_up" if self.fused_gate_up else "split_gate_up"
        words = {layout, f"{layout}_fp8", "fp8_weights"} if self.fp8_weights else {layout}
        flags = {word for word in ("fp8_tokens", "shared_expert") if getattr(self, word)}
        return words | flags

    @property
    def groups(self) -> int:
        """The experts the weight arrays hold: the routed ones, then the shared expert."""
        return self.experts + int(self.shared_expert)

    @property
    def pairs_per_token(self) -> int:
        """A token's pairs in the kernels: its ``top_k`` routed ones, then its shared expert's.
        Pair ``p = t * pairs_per_token + k`` is token ``t``'s ``k``-th."""
        return self.top_k + int(self.shared_expert)

    @property
    def max_m(self) -> int:
        """The most tokens of a call: ``m * pairs_per_token <= MAX_PAIRS``."""
        return MAX_PAIRS // self.pairs_per_token

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ExpertsConfig":
        return cls(**data)

    def replace(self, **changes) -> "ExpertsConfig":
        return dataclasses.replace(self, **changes)

    @property
    def key(self) -> str:
        """Names the cubin: readable prefix + hash of every field (but the later fields at their
        defaults, so that the keys from before them still name the same cubins)."""
        fields = self.to_dict()
        for name, default in (("gate_up_split_k", 1), ("gate_up_async_loads", False), ("down_async_loads", False),
                              ("tiled_weights", False), ("fp8_weights", False), ("fp8_tokens", False),
                              ("shared_expert", False), ("early_down", False), ("fp8_shift_widening", False),
                              ("gate_up_bulk_loads", False), ("down_bulk_loads", False), ("pass_items", True),
                              ("warp_routing", False), ("gate_up_token_tiles", None),
                              ("gate_up_column_blocks", 1)):
            if fields[name] == default:
                del fields[name]
        text = ",".join(f"{name}={fields[name]!r}" for name in sorted(fields))
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        layout = "fused" if self.fused_gate_up else "split"
        return (f"experts-h{self.hidden}-i{self.intermediate}-e{self.experts}-k{self.top_k}-{layout}-"
                f"{self.arch}-{digest}")

    def with_bulk_loads(self, in_flight_bytes: int = BULK_IN_FLIGHT_BYTES) -> "ExpertsConfig":
        """This config with both kernels' `bulk_loads` (and the tiled order they need), the same
        warps (so the same `prepare_experts` order), each ring as many stages as hold
        ``in_flight_bytes`` of weights, at least 2 and as many as shared memory allows."""
        config = self.replace(tiled_weights=True, gate_up_bulk_loads=True, down_bulk_loads=True, gate_up_unroll=2,
                              down_unroll=2)
        for role in ("gate_up", "down"):
            shape = config.gemm(role)
            stages = max(2, -(-in_flight_bytes // shape.round_bytes))
            budget = SHARED_MEMORY_BYTES - config.shared_bytes(role) + shape.bulk_ring_bytes()
            stages = max(2, min(stages, budget // shape.bulk_stage_cost))
            config = config.replace(**{f"{role}_unroll": stages})
        return config

    @classmethod
    def for_shape(cls, *, hidden: int, intermediate: int, experts: int, top_k: int, fused_gate_up: bool = True,
                  fp8_weights: bool = False, fp8_tokens: bool = False, shared_expert: bool = False,
                  arch: str = "sm_90a", m: int | None = None) -> "ExpertsConfig":
        """The launch shapes for one shard shape (and a call's ``m``, below): both kernels with 8 warps
        (2 CTAs of 256 threads fit an SM), work items sized so that 8 active experts (one token at
        top-8) give about as many items as an H200's 132 SMs hold CTAs, and the most K steps in
        flight that divide a warp's share, up to 8 for gate/up (at one token per expert a few
        CTAs per SM must keep HBM busy: 8 steps are 32 KB in flight per CTA of 32-column warps)
        and 4 for down (its items are many and short). e4m3 weights: the same, but at most 4
        steps of split gate and up in 64-column warps (at 8, their widened rows spilled at
        DeepSeek-V3's tp = 1 shard), and at a hidden of 16 or fewer K steps per gate/up warp
        (Qwen3-30B's) at most 4 of gate/up and 1 of down (ptxas spilled at 8 and at 3).

        Token tiles: 2 (16 tokens per pass over an expert's weights), but 1 for a call of ``m``
        tokens where the experts are small and their pairs few (`one_token_tile`), and 3 of
        gate/up's own where the pairs are many (`three_gate_up_tiles`), and 3 of both kernels where
        the experts are many and so are their pairs (`three_token_tiles`). The routing in
        one warp (``warp_routing``) for a call of at most `WARP_ROUTING_IDS` routed ids. Gate/up with
        `ONE_CTA_GATE_UP_WARPS_K` warps for a call of ``m`` tokens whose items are at most one per
        SM, where each warp keeps `ONE_CTA_MIN_STEPS` K steps (bf16 weights)."""
        sms = 132
        # gate/up: all warps split hidden (K is long, the columns few); 64 columns per warp
        # (32 of gate, 32 of up) once 8 experts still give two items per SM.
        gate_up_cols = 64 if intermediate % 32 == 0 and intermediate // 32 * 8 >= 2 * sms else 32
        # down: K (intermediate) is short and the columns (hidden) many: warps side by side,
        # fewer of them where hidden is small, so that 8 experts still fill the SMs.
        down_cols = 64 if hidden % 64 == 0 else 32
        down_warps_n = 4
        while down_warps_n > 1 and (hidden % (down_warps_n * down_cols)
                                    or hidden // (down_warps_n * down_cols) * 8 < sms):
            down_warps_n //= 2
        down_warps_k = 8 // down_warps_n
        while down_warps_k > 1 and (intermediate // MMA_K) % down_warps_k:
            down_warps_k //= 2

        def unroll(k: int, warps_k: int, most: int) -> int:
            steps = k // MMA_K // warps_k
            return next(u for u in range(most, 0, -1) if steps % u == 0)

        gate_up_warps_k = 8
        while gate_up_warps_k > 1 and (hidden // MMA_K) % gate_up_warps_k:
            gate_up_warps_k //= 2
        # A call whose gate/up items are at most one per SM (a token at DeepSeek-V3's tp = 8 shard:
        # 8 experts of 16 items): 16 warps, twice the bytes in flight of the SM's one CTA.
        if (not fp8_weights and m is not None
                and (min(m * top_k, experts) + int(shared_expert)) * (intermediate // (gate_up_cols // 2)) <= sms
                and hidden // MMA_K % ONE_CTA_GATE_UP_WARPS_K == 0
                and hidden // MMA_K // ONE_CTA_GATE_UP_WARPS_K >= ONE_CTA_MIN_STEPS):
            gate_up_warps_k = ONE_CTA_GATE_UP_WARPS_K
        # e4m3 at 16 or fewer K steps per gate/up warp (Qwen3-30B's hidden): with 8 steps in flight
        # ptxas budgeted 64 registers and spilled, and down at 3 took 128 (spilling) or 255.
        short_fp8 = fp8_weights and hidden // MMA_K // gate_up_warps_k <= 16
        gate_up_steps = 4 if fp8_weights and ((not fused_gate_up and gate_up_cols == 64) or short_fp8) else 8
        one_tile = m is not None and one_token_tile(hidden, intermediate, m * top_k, experts, fp8_weights)
        three_tiles = m is not None and three_token_tiles(m * top_k, experts, fp8_weights)
        token_tiles = 1 if one_tile else 3 if three_tiles else 2
        three_gate_up = m is not None and not three_tiles and three_gate_up_tiles(m * top_k, experts, fp8_weights)
        gate_up_token_tiles = 3 if three_gate_up else None
        warp_routing = m is not None and m * top_k <= WARP_ROUTING_IDS
        return cls(hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k, token_tiles=token_tiles,
                   fused_gate_up=fused_gate_up, gate_up_warps_k=gate_up_warps_k, gate_up_warps_n=1,
                   gate_up_warp_cols=gate_up_cols, gate_up_unroll=unroll(hidden, gate_up_warps_k, gate_up_steps),
                   down_warps_k=down_warps_k, down_warps_n=down_warps_n, down_warp_cols=down_cols,
                   down_unroll=unroll(intermediate, down_warps_k, 1 if short_fp8 else 4), fp8_weights=fp8_weights,
                   fp8_tokens=fp8_tokens, shared_expert=shared_expert, warp_routing=warp_routing,
                   gate_up_token_tiles=gate_up_token_tiles, arch=arch)


def one_token_tile(hidden: int, intermediate: int, pairs: int, experts: int, fp8_weights: bool) -> bool:
    """Whether `ExpertsConfig.for_shape` gives a call one token tile: bf16 weights, hidden and
    intermediate at most ``ONE_TILE_MAX_HIDDEN`` and ``ONE_TILE_MAX_INTERMEDIATE``, and the
    call's ``pairs`` at most ``ONE_TILE_MAX_PAIRS_PER_EXPERT`` per expert. Measured on one H100
    (2026-12-05, the tiled order, `benchmarks/EXPERIMENTS.md`): at Qwen3-30B's tp 2, 4 and 8
    shards (hidden 2048, intermediate 384, 192 and 96) one tile took 0.78-0.96 of two at m = 1
    to 64, and 1.03-1.23 at tp 4 and 8 at m = 128 and 256; at Qwen3-235B's tp 8 and 4 shards
    (hidden 4096; at tp 8 as many bytes per expert as Qwen3-30B's tp 2) and DeepSeek-V3's it
    was slower at most m. Qwen3-30B's tp 1 shard (intermediate 768) was not measured: there one
    tile's down kernel spilled a register."""
    return (not fp8_weights and hidden <= ONE_TILE_MAX_HIDDEN and intermediate <= ONE_TILE_MAX_INTERMEDIATE
            and pairs <= ONE_TILE_MAX_PAIRS_PER_EXPERT * experts)


def three_gate_up_tiles(pairs: int, experts: int, fp8_weights: bool) -> bool:
    """Whether `ExpertsConfig.for_shape` gives gate/up three token tiles (24 tokens per pass over
    an expert's weights; down keeps two): bf16 weights and a call's ``pairs`` at least
    ``THREE_GATE_UP_TILES_MIN_PAIRS_PER_EXPERT`` per expert, where routing that favours some
    experts gives many of them more than 16 pairs, so a second pass over their weights.
    Measured on one H100 (2026-12-07, prepared weights, against two tiles; benchmarks/README.md):
    at 16 pairs per expert (m = 256 at top-8 of 128) 0.72 of the time at Qwen3-30B's tp 1 shard,
    0.89 at its tp 8 and 0.94 at Qwen3-235B's tp 8 (0.71-0.96 at the tp 1, 2 and 4 shards of
    both); at 8 (m = 128 of 128 experts) 0.89-0.99 at Qwen3-30B's shards and Qwen3-235B's tp 1,
    but 1.025-1.06 at Qwen3-235B's tp 2, 4 and 8. At 256 experts `three_token_tiles` decides."""
    return not fp8_weights and pairs >= THREE_GATE_UP_TILES_MIN_PAIRS_PER_EXPERT * experts


def three_token_tiles(pairs: int, experts: int, fp8_weights: bool) -> bool:
    """Whether `ExpertsConfig.for_shape` gives both kernels three token tiles (24 tokens per pass
    over an expert's weights): bf16 weights, at least ``THREE_TILES_MIN_EXPERTS`` experts and a
    call's ``pairs`` at least ``THREE_TILES_MIN_PAIRS_PER_EXPERT`` per expert. DeepSeek-V3's
    grouped router (4 of 8 groups per token) left 75-98 of its 256 experts idle at m = 256 in the
    benchmark's draws and gave the active ones 11-13 pairs on average, more than 16 to over a
    quarter of them. Measured on one H100 (2026-12-07, prepared weights, against two tiles, two runs;
    benchmarks/README.md): at m = 256 0.89 of the time at its tp 2 shard, 0.92-0.93 at tp 4 and
    0.96 at tp 8. At 128 experts the same was mixed (0.92-0.96 at Qwen3-235B's tp 2 and 4 and
    Qwen3-30B's tp 4 and 8 shards, 1.01-1.03 at Qwen3-30B's tp 1 and 2), so there down keeps two
    (`three_gate_up_tiles`)."""
    return (not fp8_weights and experts >= THREE_TILES_MIN_EXPERTS
            and pairs >= THREE_TILES_MIN_PAIRS_PER_EXPERT * experts)
