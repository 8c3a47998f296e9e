"""Named lists of `KernelConfig`s that ``python -m jax_moe_publish.aot build --preset`` builds.

``tests`` is exactly what the GPU tests run, so a prebuilt ``tests`` folder
lets them run on a machine without CuTe DSL.
"""

from __future__ import annotations

from jax_moe_publish.config import EPILOGUE_MODES, SMALL_M, KernelConfig

TP_SIZES = (1, 2, 4, 8)
MULTI_RANK_MODES = ("oneshot", "twoshot", "reduce_scatter")


# One m of each launch-shape class of `KernelConfig.default`: latency-bound in one pass of a
# fused grid and in two (`KernelConfig.waves`), and bandwidth-bound.
DEFAULT_SHAPE_MS = (SMALL_M // 2, SMALL_M, SMALL_M + 1)


def _model(hidden: int, top_k: int, scale: float, shared: bool, arch: str,
           epilogue_tp: tuple[int, ...] = ()) -> list[KernelConfig]:
    """The default configs of a model for every TP size and mode, and with the RMSNorm
    epilogue for the TP sizes ``epilogue_tp``."""
    configs = []
    for fp32_weights in (False, True):
        for tp in TP_SIZES:
            variants = [(mode, "none") for mode in (("direct",) if tp == 1 else MULTI_RANK_MODES)]
            if tp in epilogue_tp:
                variants += [(mode, "rmsnorm") for mode in EPILOGUE_MODES]
            for mode, epilogue in variants:
                for m in DEFAULT_SHAPE_MS:
                    configs.append(
                        KernelConfig.default(
                            hidden=hidden, top_k=top_k, tp=tp, mode=mode,
                            routed_scaling_factor=scale, include_shared_expert=shared,
                            fp32_weights=fp32_weights, m=m, epilogue=epilogue, arch=arch,
                        )
                    )
    return configs


def deepseek_v3(arch: str = "sm_90a") -> list[KernelConfig]:
    """DeepSeek-V3: hidden 7168, top-k 8, routed scale 2.5, a shared expert; the
    residual + RMSNorm epilogue for tp = 2."""
    return _model(7168, 8, 2.5, True, arch, epilogue_tp=(2,))


def qwen3_moe(arch: str = "sm_90a") -> list[KernelConfig]:
    """Qwen3-MoE: hidden 4096, top-k 8, no shared expert, scale 1.0."""
    return _model(4096, 8, 1.0, False, arch)


# Kernel variants the GPU tests cover: (hidden, top_k, launch and feature choices).
# Together they span both element widths, both weight dtypes, with and without
# the shared expert, several scales, every publish option and hidden sizes that
# are not powers of two.
TEST_VARIANTS = (
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, elements_per_thread=8, prefetch_group=4),
    dict(hidden=7168, top_k=8, routed_scaling_factor=1.0, fp32_weights=True, elements_per_thread=4,
         prefetch_group=1, threads=256, reduce_threads=256),
    dict(hidden=5120, top_k=6, routed_scaling_factor=1.5, fp32_weights=True,
         include_shared_expert=False, prefetch_group=3),
    dict(hidden=2048, top_k=1, routed_scaling_factor=0.5, elements_per_thread=4, prefetch_group=1,
         load_shared_expert_before_pdl=True, threads=64, reduce_threads=64),
    dict(hidden=2880, top_k=10, routed_scaling_factor=2.5, prefetch_group=5, enable_pdl=False,
         threads=96),
    # One kernel per call (oneshot only): 16-byte fragments, own partials in shared memory or
    # in the mailbox; 8-byte ones with a partial last CTA and without PDL.
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, prefetch_group=8, fuse_reduce=True),
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, prefetch_group=8, fuse_reduce=True,
         keep_own_partial=False),
    dict(hidden=2880, top_k=10, routed_scaling_factor=1.0, fp32_weights=True, include_shared_expert=False,
         elements_per_thread=4, prefetch_group=5, enable_pdl=False, threads=96, fuse_reduce=True),
    # A grid of a third of the rows' CTAs: three tiles per CTA even where the GPU holds them all.
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, elements_per_thread=4, prefetch_group=8,
         fuse_reduce=True, waves=3),
)

# The shapes the op tests and the example call with their default configs.
TEST_DEFAULT_PROBLEMS = (
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5),
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, fp32_weights=True),
    dict(hidden=2048, top_k=6, routed_scaling_factor=1.0, include_shared_expert=False),
    dict(hidden=512, top_k=4, routed_scaling_factor=2.5, fp32_weights=True),  # the example
)


# The problems of the epilogue tests: every hidden size of the issue, with varied
# finalize options. Each runs with both epilogue modes, and as tp = 1 (direct, the
# epilogue in jnp).
TEST_EPILOGUE_PROBLEMS = (
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5),
    dict(hidden=5120, top_k=6, routed_scaling_factor=1.5, fp32_weights=True, include_shared_expert=False),
    dict(hidden=2048, top_k=4, routed_scaling_factor=1.0),
)


# Rows wider than the issue's: a fused row over a cluster of 15 CTAs of 160 threads (9216,
# its last CTA part-filled) or 16 CTAs of 256 threads (16384), and, unfused, several 16-byte
# fragments per reduce thread (3 and 4). Kernel tests only, for a group.
TEST_WIDE_EPILOGUE_PROBLEMS = (
    dict(hidden=9216, top_k=4, routed_scaling_factor=1.5, fp32_weights=True),
    dict(hidden=16384, top_k=8, routed_scaling_factor=2.5),
)


def test_epilogues(tp: int) -> list[KernelConfig]:
    """The default configs of `TEST_EPILOGUE_PROBLEMS`: with the fused epilogue for a group,
    the plain direct kernel for tp = 1; for a group also those of
    `TEST_WIDE_EPILOGUE_PROBLEMS`, fused and not."""
    if tp == 1:
        variants = [("direct", "none")]
    else:
        variants = [(mode, "rmsnorm") for mode in EPILOGUE_MODES]
    configs = [
        KernelConfig.default(tp=tp, mode=mode, m=m, epilogue=epilogue, **problem)
        for problem in TEST_EPILOGUE_PROBLEMS
        for mode, epilogue in variants
        for m in DEFAULT_SHAPE_MS
    ]
    if tp > 1:
        # Oneshot unfused (publish, then reduce_norm), which is not a default, stays tested;
        # and fused with one CTA (no cluster) per row, with the own partials in the mailbox,
        # with 8-byte fragments (twice the threads, in as many CTAs), and with 8-byte fragments
        # in twice the CTAs (14 for hidden 7168: a cluster beyond the portable 8), and with a
        # grid of a third of the rows' clusters.
        configs += [KernelConfig.default(tp=tp, m=m, epilogue="rmsnorm", fuse_reduce=False, **problem)
                    for problem in TEST_EPILOGUE_PROBLEMS for m in DEFAULT_SHAPE_MS]
        fused = KernelConfig.default(tp=tp, m=SMALL_M, epilogue="rmsnorm", **TEST_EPILOGUE_PROBLEMS[0])
        configs.append(fused.replace(threads=fused.reduce_fragments, reduce_threads=fused.reduce_fragments))
        configs.append(fused.replace(keep_own_partial=False))
        configs.append(fused.replace(elements_per_thread=4, threads=2 * fused.threads,
                                     reduce_threads=2 * fused.threads))
        configs.append(fused.replace(elements_per_thread=4))
        configs.append(fused.replace(waves=3))
        configs += [KernelConfig.default(tp=tp, mode=mode, m=m, epilogue="rmsnorm", fuse_reduce=fuse, **problem)
                    for problem in TEST_WIDE_EPILOGUE_PROBLEMS for m in DEFAULT_SHAPE_MS
                    for mode, fuse in (("oneshot", None), ("oneshot", False), ("reduce_scatter", None))]
    return list(dict.fromkeys(configs))


def test_variants(tp: int) -> list[KernelConfig]:
    """The kernel-level GPU test configs for a group of ``tp``."""
    configs = []
    for index, variant in enumerate(TEST_VARIANTS):
        if tp == 1 and variant.get("fuse_reduce"):
            continue  # a group's option
        if tp == 1:
            modes = ("direct",)
        elif index < 2:
            modes = MULTI_RANK_MODES
        else:
            modes = ("oneshot",)
        for mode in modes:
            transport = "direct" if mode == "direct" else "unicast"
            configs.append(KernelConfig(tp=tp, mode=mode, transport=transport, **variant))
    return configs


def test_defaults(tp: int) -> list[KernelConfig]:
    """The default configs that the op tests reach through the public API."""
    modes = ("direct",) if tp == 1 else MULTI_RANK_MODES
    return [
        KernelConfig.default(tp=tp, mode=mode, m=m, **problem)
        for problem in TEST_DEFAULT_PROBLEMS
        for mode in modes
        for m in DEFAULT_SHAPE_MS
    ]


def tests(arch: str = "sm_90a") -> list[KernelConfig]:
    """Everything the GPU tests need, for groups of 1 and 2."""
    configs = []
    for tp in (1, 2):
        configs += test_variants(tp) + test_defaults(tp) + test_epilogues(tp)
    unique = list(dict.fromkeys(configs))
    return [c.replace(arch=arch) for c in unique]


PRESETS = {"tests": tests, "deepseek-v3": deepseek_v3, "qwen3-moe": qwen3_moe}
