"""The kernel configs the GPU tests run: the ``tests`` preset.

A prebuilt ``tests`` folder (``python -m jax_moe_publish.aot build --preset tests``) lets
the GPU tests run on a machine without CuTe DSL.
"""

from __future__ import annotations

from jax_moe_publish import tuning
from jax_moe_publish.config import (EPILOGUE_ALGORITHMS, FUSED_ALGORITHMS, GROUP_ALGORITHMS, SINGLE_ALGORITHMS,
                                    KernelConfig, fp8_twins, result_of)
from jax_moe_publish.experts_config import THREE_GATE_UP_TILES_MIN_PAIRS_PER_EXPERT, ExpertsConfig

GROUP_TPS = (2, 4, 8)
"""The group sizes the GPU tests run (on one GPU with virtual ranks)."""

# Kernel variants the GPU tests cover: (hidden, top_k, launch and feature choices).
# Together they span both element widths, both weight dtypes, with and without
# the shared expert, several scales, every publish option and hidden sizes that
# are not powers of two.
VARIANTS = (
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, elements_per_thread=8, prefetch_group=4),
    dict(hidden=7168, top_k=8, routed_scaling_factor=1.0, fp32_weights=True, elements_per_thread=4,
         prefetch_group=1, threads=256, reduce_threads=256),
    dict(hidden=5120, top_k=6, routed_scaling_factor=1.5, fp32_weights=True,
         include_shared_expert=False, prefetch_group=3),
    dict(hidden=2048, top_k=1, routed_scaling_factor=0.5, elements_per_thread=4, prefetch_group=1,
         load_shared_expert_before_pdl=True, threads=64, reduce_threads=64),
    dict(hidden=2880, top_k=10, routed_scaling_factor=2.5, prefetch_group=5, enable_pdl=False,
         threads=96),
    # One kernel per call (oneshot and twoshot): 16-byte fragments, own partials (oneshot) in
    # shared memory or in the mailbox; 8-byte ones with a partial last CTA and without PDL.
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, prefetch_group=8, fuse_reduce=True),
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, prefetch_group=8, fuse_reduce=True,
         keep_own_partial=False),
    dict(hidden=2880, top_k=10, routed_scaling_factor=1.0, fp32_weights=True, include_shared_expert=False,
         elements_per_thread=4, prefetch_group=5, enable_pdl=False, threads=96, fuse_reduce=True),
    # A grid of a third of the rows' CTAs: three tiles per CTA even where the GPU holds them all.
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, elements_per_thread=4, prefetch_group=8,
         fuse_reduce=True, waves=3),
)

DEFAULT_PROBLEMS = (
    tuning.Problem(hidden=7168, top_k=8, routed_scaling_factor=2.5),
    tuning.Problem(hidden=7168, top_k=8, routed_scaling_factor=2.5, fp32_weights=True),
    tuning.Problem(hidden=2048, top_k=6, routed_scaling_factor=1.0, include_shared_expert=False),
    tuning.Problem(hidden=512, top_k=4, routed_scaling_factor=2.5, fp32_weights=True),  # the example's
)
"""The problems the op tests and the example call with the tuning table's configs."""

EPILOGUE_PROBLEMS = (
    tuning.Problem(hidden=7168, top_k=8, routed_scaling_factor=2.5),
    tuning.Problem(hidden=5120, top_k=6, routed_scaling_factor=1.5, fp32_weights=True, include_shared_expert=False),
    tuning.Problem(hidden=2048, top_k=4, routed_scaling_factor=1.0),
)
"""The problems of the epilogue tests, with varied finalize options. Each runs with both
epilogue algorithms, and as tp = 1 (direct, the epilogue in jnp)."""

WIDE_EPILOGUE_PROBLEMS = (
    tuning.Problem(hidden=9216, top_k=4, routed_scaling_factor=1.5, fp32_weights=True),
    tuning.Problem(hidden=16384, top_k=8, routed_scaling_factor=2.5),
)
"""Rows wider than a model's: a fused row over a cluster of 15 CTAs of 160 threads (9216,
its last CTA part-filled) or 16 CTAs of 256 threads (16384), and, unfused, several 16-byte
fragments per reduce thread (3 and 4). Kernel tests only, for a group."""


def variants(tp: int) -> list[KernelConfig]:
    """The kernel-level GPU test configs for a group of ``tp``: every algorithm for the first
    two `VARIANTS`, both fused algorithms for the fused ones (a group's option), oneshot for
    the rest."""
    configs = []
    for index, variant in enumerate(VARIANTS):
        if tp == 1 and variant.get("fuse_reduce"):
            continue
        if tp == 1:
            algorithms = SINGLE_ALGORITHMS
        elif index < 2:
            algorithms = GROUP_ALGORITHMS
        elif variant.get("fuse_reduce"):
            algorithms = FUSED_ALGORITHMS
        else:
            algorithms = ("oneshot",)
        configs += [KernelConfig(tp=tp, algorithm=algorithm, **variant) for algorithm in algorithms]
    return list(dict.fromkeys(configs))  # a twoshot keeps no own partial: two variants coincide


def defaults(tp: int) -> list[KernelConfig]:
    """The tuning table's configs that the op tests reach through the public API."""
    algorithms = SINGLE_ALGORITHMS if tp == 1 else GROUP_ALGORITHMS
    return [
        tuning.kernel_config(problem, tp=tp, m=m, result=result_of(algorithm), algorithm=algorithm)
        for problem in DEFAULT_PROBLEMS
        for algorithm in algorithms
        for m in tuning.range_ms()
    ]


def epilogues(tp: int, ms: tuple[int, ...] | None = None) -> list[KernelConfig]:
    """The configs of `EPILOGUE_PROBLEMS`: the table's epilogue of every algorithm for a group,
    the plain direct kernel for tp = 1; for a group also oneshot unfused, those of
    `WIDE_EPILOGUE_PROBLEMS`, and at tp = 2 variants of the fused epilogue's launch shape. The
    table's choices for every m range, or for calls of ``ms`` tokens."""
    ms = tuning.range_ms() if ms is None else ms
    def epilogue_config(problem, m, algorithm, **changes):
        return tuning.kernel_config(problem, tp=tp, m=m, result=result_of(algorithm), epilogue="rmsnorm",
                                    algorithm=algorithm, **changes)

    if tp == 1:
        return list(dict.fromkeys(tuning.kernel_config(problem, tp=1, m=m)
                                  for problem in EPILOGUE_PROBLEMS for m in ms))
    configs = [epilogue_config(problem, m, algorithm)
               for problem in EPILOGUE_PROBLEMS for algorithm in EPILOGUE_ALGORITHMS for m in ms]
    # Oneshot unfused (publish, then reduce_norm), which the table does not choose, stays
    # tested; and fused with one CTA (no cluster) per row, with the own partials in the
    # mailbox, with 8-byte fragments (twice the threads, in as many CTAs), and with 8-byte
    # fragments in twice the CTAs (14 for hidden 7168: a cluster beyond the portable 8), and
    # with a grid of a third of the rows' clusters.
    configs += [epilogue_config(problem, m, "oneshot", fuse_reduce=False)
                for problem in EPILOGUE_PROBLEMS for m in ms]
    if tp == 2:  # the launch shapes do not depend on tp
        fused = epilogue_config(EPILOGUE_PROBLEMS[0], tuning.SMALL_M, "oneshot")
        configs.append(fused.replace(threads=fused.reduce_fragments, reduce_threads=fused.reduce_fragments))
        configs.append(fused.replace(keep_own_partial=False))
        configs.append(fused.replace(elements_per_thread=4, threads=2 * fused.threads,
                                     reduce_threads=2 * fused.threads))
        configs.append(fused.replace(elements_per_thread=4))
        configs.append(fused.replace(waves=3))
    configs += [epilogue_config(problem, m, algorithm, **changes)
                for problem in WIDE_EPILOGUE_PROBLEMS for m in ms
                for algorithm, changes in (("oneshot", {}), ("oneshot", {"fuse_reduce": False}),
                                           ("twoshot", {}), ("reduce_scatter", {}))]
    return list(dict.fromkeys(configs))


EXPERTS_SHAPES = (
    # (hidden, intermediate, experts, top_k, fused_gate_up): the op's own choice of launch shapes.
    (512, 64, 16, 4, True),
    (1024, 96, 40, 6, False),  # 40 experts (no power of two), 6 of 16-column gate/up items
    (7168, 256, 32, 8, True),  # DeepSeek-V3's tp = 8 shard, with fewer experts
    (2048, 96, 24, 8, False),  # Qwen3-30B's tp = 8 shard: 3 K-steps of down per warp pair
)
RING = dict(gate_up_async_loads=True, down_async_loads=True)
"""Both kernels' loads through their warps' cp.async rings."""
BULK = dict(tiled_weights=True, gate_up_bulk_loads=True, down_bulk_loads=True)
"""Both kernels' loads as bulk copies into the CTA's ring, by its copying warp."""

EXPERTS_VARIANTS = (
    # Launch shapes the heuristic does not choose, over an `EXPERTS_SHAPES` entry's: one 8-token
    # tile per pass, or four; gate/up warps side by side; 64-column gate/up warps and 32-column
    # down warps; an unroll of 3; down without a K split; no PDL.
    ((512, 64, 16, 4, True), dict(token_tiles=1)),
    ((1024, 128, 8, 2, True), dict(token_tiles=4, gate_up_warps_k=4, gate_up_warps_n=2, gate_up_warp_cols=64,
                                   gate_up_unroll=2, down_warp_cols=32, down_warps_k=1, down_warps_n=8,
                                   down_unroll=4)),
    ((768, 48, 12, 3, False), dict(gate_up_warps_k=4, gate_up_unroll=2, down_warps_k=1, down_warps_n=4,
                                   down_unroll=3, enable_pdl=False)),
    # The gate/up K split over a cluster: 16 CTAs (beyond the portable 8) of whole rows; 8 CTAs of
    # 6 warps, two token tiles; 2 CTAs that each also split K over their warps, each finishing
    # one of the two column blocks.
    ((7168, 256, 32, 8, True), dict(token_tiles=1, gate_up_split_k=16, gate_up_warps_k=1, gate_up_warps_n=8,
                                    gate_up_warp_cols=64, gate_up_unroll=4)),
    ((2048, 96, 24, 8, False), dict(gate_up_split_k=8, gate_up_warps_k=1, gate_up_warps_n=6, gate_up_warp_cols=32,
                                    gate_up_unroll=4)),
    ((1024, 128, 8, 2, True), dict(gate_up_split_k=2, gate_up_warps_k=4, gate_up_warps_n=2, gate_up_warp_cols=32,
                                   gate_up_unroll=2)),
    # Loads through each warp's cp.async ring: 8-byte rows with one token tile, and with a
    # K split; two tiles and split gate/up (down: a ring of 2 of a warp's 6 steps); 16-byte
    # rows of gate/up and 8-byte rows of down with four tiles.
    ((7168, 256, 32, 8, True), dict(**RING, token_tiles=1)),
    ((7168, 256, 32, 8, True), dict(**RING, token_tiles=1, gate_up_split_k=16, gate_up_warps_k=1,
                                    gate_up_warps_n=8, gate_up_warp_cols=64, gate_up_unroll=4)),
    ((2048, 96, 24, 8, False), dict(**RING, down_warps_k=1, down_unroll=2)),
    ((1024, 128, 8, 2, True), dict(**RING, token_tiles=4, gate_up_warps_k=4, gate_up_warps_n=2,
                                   gate_up_warp_cols=64, gate_up_unroll=2, down_warp_cols=32, down_warps_k=1,
                                   down_warps_n=8, down_unroll=4)),
    # Weights in the tiled order: the heuristic's launch shapes; with the ring and one token tile,
    # in both kernels and in gate/up alone; with the K split over a cluster; warps side by side
    # in both kernels, four token tiles.
    ((7168, 256, 32, 8, True), dict(tiled_weights=True)),
    ((7168, 256, 32, 8, True), dict(tiled_weights=True, **RING, token_tiles=1)),
    ((7168, 256, 32, 8, True), dict(tiled_weights=True, gate_up_async_loads=True, token_tiles=1)),
    ((7168, 256, 32, 8, True), dict(tiled_weights=True, token_tiles=1, gate_up_split_k=16, gate_up_warps_k=1,
                                    gate_up_warps_n=8, gate_up_warp_cols=64, gate_up_unroll=4)),
    ((2048, 96, 24, 8, True), dict(tiled_weights=True)),
    ((1024, 128, 8, 2, True), dict(tiled_weights=True, token_tiles=4, gate_up_warps_k=4, gate_up_warps_n=2,
                                   gate_up_warp_cols=64, gate_up_unroll=2, down_warp_cols=32, down_warps_k=1,
                                   down_warps_n=8, down_unroll=4)),
    # e4m3 weights with 128 x 128 scale blocks: the heuristic's shapes, fused and split (4-byte
    # rows of gate/up, 8-byte rows of down); 8-byte rows of gate/up and 4-byte rows of down with
    # warps side by side and three token tiles (one step in flight: at four tiles, or two steps,
    # ptxas held 128 registers and spilled).
    ((7168, 256, 32, 8, True), dict(fp8_weights=True)),
    ((7168, 256, 32, 8, False), dict(fp8_weights=True)),
    ((1024, 128, 8, 2, True), dict(fp8_weights=True, token_tiles=3, gate_up_warps_k=4, gate_up_warps_n=2,
                                   gate_up_warp_cols=64, gate_up_unroll=1, down_warp_cols=32, down_warps_k=1,
                                   down_warps_n=8, down_unroll=4)),
    # e4m3 weights in the tiled order, without and with the ring (scales copied beside the
    # weights); the ring and the K split over 8 CTAs (896 rows each: whole blocks) in the rows.
    ((7168, 256, 32, 8, True), dict(fp8_weights=True, tiled_weights=True)),
    ((7168, 256, 32, 8, True), dict(fp8_weights=True, tiled_weights=True, **RING, token_tiles=1)),
    ((7168, 256, 32, 8, True), dict(fp8_weights=True, **RING, gate_up_split_k=8, gate_up_warps_k=1,
                                    gate_up_warps_n=8, gate_up_warp_cols=64, gate_up_unroll=4)),
    # e4m3 tokens too (1 x 128 scale blocks): with register loads, fused and split; with the
    # ring in the tiled order; the ring with the K split (each CTA's tokens from its first
    # block); four token tiles with the ring.
    ((7168, 256, 32, 8, True), dict(fp8_weights=True, fp8_tokens=True)),
    ((7168, 256, 32, 8, False), dict(fp8_weights=True, fp8_tokens=True)),
    ((7168, 256, 32, 8, True), dict(fp8_weights=True, fp8_tokens=True, tiled_weights=True, **RING,
                                    token_tiles=1)),
    ((7168, 256, 32, 8, True), dict(fp8_weights=True, fp8_tokens=True, **RING, gate_up_split_k=8,
                                    gate_up_warps_k=1, gate_up_warps_n=8, gate_up_warp_cols=64, gate_up_unroll=4)),
    ((1024, 128, 8, 2, True), dict(fp8_weights=True, fp8_tokens=True, **RING, token_tiles=4,
                                   gate_up_warps_k=4, gate_up_warps_n=2, gate_up_warp_cols=64, gate_up_unroll=2,
                                   down_warp_cols=32, down_warps_k=1, down_warps_n=8, down_unroll=4)),
    # The shared expert held after the routed ones (`prepare_experts(..., shared=...)`: the tiled
    # order): the heuristic's shapes (33 groups); the ring and one token tile; the K split over a
    # cluster (the shared pairs in CTA 0's order); four token tiles at top-2 (3 pairs a token);
    # e4m3 weights; e4m3 tokens with the ring.
    ((7168, 256, 32, 8, True), dict(shared_expert=True, tiled_weights=True)),
    ((7168, 256, 32, 8, True), dict(shared_expert=True, tiled_weights=True, **RING, token_tiles=1)),
    ((7168, 256, 32, 8, True), dict(shared_expert=True, tiled_weights=True, token_tiles=1, gate_up_split_k=16,
                                    gate_up_warps_k=1, gate_up_warps_n=8, gate_up_warp_cols=64, gate_up_unroll=4)),
    ((1024, 128, 8, 2, True), dict(shared_expert=True, tiled_weights=True, token_tiles=4, gate_up_warps_k=4,
                                   gate_up_warps_n=2, gate_up_warp_cols=64, gate_up_unroll=2, down_warp_cols=32,
                                   down_warps_k=1, down_warps_n=8, down_unroll=4)),
    ((7168, 256, 32, 8, True), dict(shared_expert=True, fp8_weights=True, tiled_weights=True)),
    ((7168, 256, 32, 8, True), dict(shared_expert=True, fp8_weights=True, fp8_tokens=True, tiled_weights=True,
                                    **RING, token_tiles=1)),
    # Gate/up in 16 warps (`ONE_CTA_GATE_UP_WARPS_K`, one item per SM) over the tiled order.
    ((7168, 256, 32, 8, True), dict(tiled_weights=True, gate_up_warps_k=16, gate_up_unroll=7)),
    # The routing tables of at most 32 ids in one warp (`warp_routing`): bf16, the tiled order,
    # the shared expert held (33 groups at m = 4), and Qwen3-30B's tp = 8 shard.
    ((7168, 256, 32, 8, True), dict(warp_routing=True)),
    ((7168, 256, 32, 8, True), dict(shared_expert=True, tiled_weights=True, warp_routing=True)),
    ((2048, 96, 24, 8, True), dict(tiled_weights=True, warp_routing=True)),
    # Gate/up's own token tiles (`gate_up_token_tiles`): more than down's, with the shared expert
    # held too; fewer than down's, at Qwen3-30B's tp = 8 shard.
    ((7168, 256, 32, 8, True), dict(tiled_weights=True, gate_up_token_tiles=4)),
    ((7168, 256, 32, 8, True), dict(shared_expert=True, tiled_weights=True, gate_up_token_tiles=3)),
    ((2048, 96, 24, 8, True), dict(tiled_weights=True, token_tiles=2, gate_up_token_tiles=1)),
    # Three token tiles of both kernels (`three_token_tiles`, DeepSeek-V3's shards from m = 256):
    # in the weights' rows, in the tiled order, and with the shared expert held.
    ((7168, 256, 32, 8, True), dict(token_tiles=3)),
    ((7168, 256, 32, 8, True), dict(tiled_weights=True, token_tiles=3)),
    ((7168, 256, 32, 8, True), dict(shared_expert=True, tiled_weights=True, token_tiles=3)),
    # Gate/up items of two column blocks (`gate_up_column_blocks`): in the tiled order, with the
    # shared expert held too, and in the weights' rows at Qwen3-30B's tp = 8 shard (3 blocks of 32).
    ((7168, 256, 32, 8, True), dict(tiled_weights=True, gate_up_column_blocks=2, gate_up_unroll=4)),
    ((7168, 256, 32, 8, True), dict(shared_expert=True, tiled_weights=True, gate_up_column_blocks=2)),
    ((2048, 96, 24, 8, True), dict(gate_up_column_blocks=2, gate_up_unroll=4)),
    # Down launched early (`early_down`: its routing and an L2 prefetch while gate/up finishes):
    # bf16, e4m3 weights, and with the shared expert.
    ((7168, 256, 32, 8, True), dict(tiled_weights=True, early_down=True)),
    ((7168, 256, 32, 8, True), dict(fp8_weights=True, tiled_weights=True, early_down=True)),
    ((7168, 256, 32, 8, True), dict(shared_expert=True, tiled_weights=True, early_down=True)),
    # e4m3 weights widened by the exponent shift (`fp8_shift_widening`): split rows in registers;
    # the tiled order through the ring with e4m3 tokens.
    ((7168, 256, 32, 8, False), dict(fp8_weights=True, fp8_shift_widening=True)),
    ((7168, 256, 32, 8, True), dict(fp8_weights=True, fp8_tokens=True, fp8_shift_widening=True, tiled_weights=True,
                                    **RING, token_tiles=1)),
    # Bulk copies into a ring of the CTA's (`*_bulk_loads`: one copying warp): the heuristic's
    # warps; four token tiles, warps side by side, an odd number of stages; e4m3 weights with
    # the shared expert; Qwen3-30B's tp = 8 shard (3 rounds of down into 2 stages); e4m3
    # weights and tokens (an odd number of 16-byte pieces per token slice).
    ((7168, 256, 32, 8, True), dict(**BULK, gate_up_unroll=8)),
    ((1024, 128, 8, 2, True), dict(**BULK, token_tiles=4, gate_up_warps_k=4, gate_up_warps_n=2, gate_up_warp_cols=64,
                                   gate_up_unroll=3, down_warp_cols=32, down_warps_k=1, down_warps_n=8,
                                   down_unroll=2)),
    ((7168, 256, 32, 8, True), dict(**BULK, fp8_weights=True, shared_expert=True)),
    ((2048, 96, 24, 8, True), dict(**BULK, down_unroll=2)),
    ((1024, 128, 8, 2, True), dict(**BULK, fp8_weights=True, fp8_tokens=True, gate_up_warps_k=1, gate_up_warps_n=4,
                                   gate_up_unroll=4, down_unroll=2)),
)
"""The experts op's GPU test configs: `EXPERTS_SHAPES` with `ExpertsConfig.for_shape`'s launch
shapes, and `EXPERTS_VARIANTS` with the rest of the choices."""


def experts_configs(arch: str = "sm_90a") -> list[ExpertsConfig]:
    """The experts op's GPU test configs (`EXPERTS_SHAPES` at any m, at m = 1, where the op
    may take one token tile, and at the least m whose pairs per expert give gate/up three;
    `EXPERTS_VARIANTS`)."""
    def heuristic(hidden, intermediate, experts, top_k, fused, m=None):
        return ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate, experts=experts, top_k=top_k,
                                       fused_gate_up=fused, arch=arch, m=m)

    configs = []
    for shape in EXPERTS_SHAPES:
        experts, top_k = shape[2], shape[3]
        many_pairs = -(-THREE_GATE_UP_TILES_MIN_PAIRS_PER_EXPERT * experts // top_k)
        configs += [heuristic(*shape, m=m) for m in (None, 1, many_pairs)]
    configs += [heuristic(*shape).replace(**changes) for shape, changes in EXPERTS_VARIANTS]
    return list(dict.fromkeys(configs))


def fp8_outs(tp: int) -> list[KernelConfig]:
    """The epilogue configs of a group (`epilogues`) for the first m range, with an FP8 out
    (`config.fp8_twins`): every epilogue kernel, both fragment widths and the wide rows, not
    every m range's launch shape."""
    return fp8_twins(epilogues(tp, tuning.range_ms()[:1]))


def publish_configs(arch: str = "sm_90a") -> list[KernelConfig]:
    """The publish op's GPU test configs, for tp = 1 and the `GROUP_TPS`."""
    configs = []
    for tp in (1, *GROUP_TPS):
        configs += variants(tp) + defaults(tp) + epilogues(tp) + fp8_outs(tp)
    return [c.replace(arch=arch) for c in dict.fromkeys(configs)]


def all_configs(arch: str = "sm_90a") -> list:
    """Everything the GPU tests need: the publish op's (`publish_configs`) and the experts op's."""
    return publish_configs(arch) + experts_configs(arch)
