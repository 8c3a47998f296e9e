"""Named lists of configs that ``python -m jax_moe_publish.aot build --preset`` builds.

A model's preset holds what its calls can get: the tuning table's `KernelConfig` for every tp,
algorithm and m range, with both router weight dtypes, and with the epilogue where the
model runs it fused, its out bf16 or FP8 (`fp8_twins`); and the `ExpertsConfig` of its experts'
shard at every tp, with gate and up fused, split, and prepared (`jmp.prepare_experts`'s tiled order;
with the model's shared expert, prepared with them too), bf16, and where the shard holds whole
128 x 128 blocks e4m3 weights with bf16 or e4m3 tokens.
"""

from __future__ import annotations

from jax_moe_publish import tuning
from jax_moe_publish.config import (EPILOGUE_ALGORITHMS, GROUP_ALGORITHMS, SINGLE_ALGORITHMS, KernelConfig,
                                    fp8_twins, result_of)
from jax_moe_publish.experts_config import FP8_BLOCK, MAX_PAIRS, ExpertsConfig

TP_SIZES = (1, 2, 4, 8)

DEEPSEEK_V3 = tuning.Problem(hidden=7168, top_k=8, routed_scaling_factor=2.5, include_shared_expert=True)
QWEN3_MOE = tuning.Problem(hidden=4096, top_k=8, routed_scaling_factor=1.0, include_shared_expert=False)

DEEPSEEK_V3_EXPERTS = ((7168, 2048, 256, 8, True),)
QWEN3_MOE_EXPERTS = ((4096, 1536, 128, 8, False), (2048, 768, 128, 8, False))
"""(hidden, intermediate, experts, top_k, a shared expert of the same intermediate) of the models'
routed experts: DeepSeek-V3; Qwen3-235B-A22B and Qwen3-30B-A3B."""


def experts(shapes, arch: str = "sm_90a", tps=TP_SIZES) -> list[ExpertsConfig]:
    """The experts op's configs for each of ``shapes`` sharded at every TP size of ``tps``
    (intermediate / tp columns per rank), at every m the kernels take and at an unknown m
    (`ExpertsConfig.for_shape`'s launch shapes change with m): gate and up fused, split, and in
    the tiled order of prepared weights; the same with e4m3 weights, and with e4m3 weights and
    tokens, where the shard holds whole 128 x 128 blocks; with a shared expert, the tiled order
    with it too."""
    configs = []
    for hidden, intermediate, count, top_k, shared in shapes:
        for tp in tps:
            whole_blocks = hidden % FP8_BLOCK == 0 and intermediate // tp % FP8_BLOCK == 0
            # (fp8_weights, fp8_tokens): bf16; e4m3 weights with bf16 or e4m3 tokens.
            for fp8 in ((False, False), (True, False), (True, True)) if whole_blocks else ((False, False),):
                def for_shape(m, fused_gate_up=True, shared_expert=False):
                    return ExpertsConfig.for_shape(hidden=hidden, intermediate=intermediate // tp, experts=count,
                                                   top_k=top_k, fused_gate_up=fused_gate_up, fp8_weights=fp8[0],
                                                   fp8_tokens=fp8[1], shared_expert=shared_expert, arch=arch, m=m)

                # The launch shapes change with m at a few thresholds: every m, then unknown.
                for m in (*range(1, MAX_PAIRS // top_k + 1), None):
                    fused = for_shape(m)
                    configs += [fused, for_shape(m, fused_gate_up=False), fused.replace(tiled_weights=True)]
                    if shared:
                        # The shared expert's group counts in the launch shapes.
                        configs.append(for_shape(m, shared_expert=True).replace(tiled_weights=True))
    return list(dict.fromkeys(configs))


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
    configs = list(dict.fromkeys(configs))
    return configs + fp8_twins(configs)


def deepseek_v3(arch: str = "sm_90a") -> list:
    """DeepSeek-V3: hidden 7168, top-k 8, routed scale 2.5, a shared expert; with and without
    the residual + RMSNorm epilogue; its 256 routed experts of intermediate 2048."""
    return model(DEEPSEEK_V3, arch, epilogue_tp=TP_SIZES[1:]) + experts(DEEPSEEK_V3_EXPERTS, arch)


def qwen3_moe(arch: str = "sm_90a") -> list:
    """Qwen3-MoE: hidden 4096, top-k 8, no shared expert, scale 1.0; with and without the
    residual + RMSNorm epilogue; the experts of Qwen3-235B-A22B and Qwen3-30B-A3B."""
    return model(QWEN3_MOE, arch, epilogue_tp=TP_SIZES[1:]) + experts(QWEN3_MOE_EXPERTS, arch)
