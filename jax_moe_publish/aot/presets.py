"""Named lists of `KernelConfig`s that ``python -m jax_moe_publish.aot build --preset`` builds.

A model's preset holds what its calls can get: the tuning table's config for every tp,
algorithm and m range, with both router weight dtypes, and with the epilogue where the
model runs it fused.
"""

from __future__ import annotations

from jax_moe_publish import tuning
from jax_moe_publish.config import (EPILOGUE_ALGORITHMS, GROUP_ALGORITHMS, SINGLE_ALGORITHMS, KernelConfig,
                                    result_of)

TP_SIZES = (1, 2, 4, 8)

DEEPSEEK_V3 = tuning.Problem(hidden=7168, top_k=8, routed_scaling_factor=2.5, include_shared_expert=True)
QWEN3_MOE = tuning.Problem(hidden=4096, top_k=8, routed_scaling_factor=1.0, include_shared_expert=False)


def model(problem: tuning.Problem, arch: str = "sm_90a", epilogue_tp: tuple[int, ...] = ()) -> list[KernelConfig]:
    """The configs of ``problem`` for every TP size, algorithm and m range of the tuning table,
    with bf16 and float32 router weights, and with the RMSNorm epilogue for the TP sizes
    ``epilogue_tp``."""
    configs = []
    for fp32_weights in (False, True):
        weighted = tuning.Problem(**{**vars(problem), "fp32_weights": fp32_weights})
        for tp in TP_SIZES:
            variants = [(algorithm, "none") for algorithm in (SINGLE_ALGORITHMS if tp == 1 else GROUP_ALGORITHMS)]
            if tp in epilogue_tp:
                variants += [(algorithm, "rmsnorm") for algorithm in EPILOGUE_ALGORITHMS]
            for algorithm, epilogue in variants:
                for m in tuning.range_ms():
                    configs.append(tuning.kernel_config(weighted, tp=tp, m=m, result=result_of(algorithm),
                                                        epilogue=epilogue, algorithm=algorithm, arch=arch))
    return list(dict.fromkeys(configs))


def deepseek_v3(arch: str = "sm_90a") -> list[KernelConfig]:
    """DeepSeek-V3: hidden 7168, top-k 8, routed scale 2.5, a shared expert; with and without
    the residual + RMSNorm epilogue."""
    return model(DEEPSEEK_V3, arch, epilogue_tp=TP_SIZES[1:])


def qwen3_moe(arch: str = "sm_90a") -> list[KernelConfig]:
    """Qwen3-MoE: hidden 4096, top-k 8, no shared expert, scale 1.0; with and without the
    residual + RMSNorm epilogue."""
    return model(QWEN3_MOE, arch, epilogue_tp=TP_SIZES[1:])
