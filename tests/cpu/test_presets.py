"""The presets hold every config the tuning table can choose for their calls (no DSL, no GPU)."""

from __future__ import annotations

import itertools

from jax_moe_publish import tuning
from jax_moe_publish.aot import presets
from jax_moe_publish.config import EPILOGUE_ALGORITHMS, GROUP_ALGORITHMS, result_of
from jax_moe_publish.testing import gpu_matrix


def test_presets_hold_the_table_choice_of_every_m():
    """A model preset, and the tests preset for the problems the op tests call, hold the
    table's config of every m: a prebuilt folder serves any call without CuTe DSL."""
    tests = set(gpu_matrix.all_configs())
    calls = [(problem, algorithm, "none") for problem in gpu_matrix.DEFAULT_PROBLEMS
             for algorithm in GROUP_ALGORITHMS]
    calls += [(problem, algorithm, "rmsnorm")
              for problem in gpu_matrix.EPILOGUE_PROBLEMS + gpu_matrix.WIDE_EPILOGUE_PROBLEMS
              for algorithm in EPILOGUE_ALGORITHMS]
    deepseek = set(presets.deepseek_v3())
    for m in range(1, 4 * tuning.SMALL_M):
        for problem, algorithm, epilogue in calls:
            config = tuning.kernel_config(problem, tp=2, m=m, result=result_of(algorithm),
                                          epilogue=epilogue, algorithm=algorithm)
            assert config in tests, (m, problem, algorithm, epilogue)
        for tp in presets.TP_SIZES:
            for fp32_weights in (False, True):
                problem = tuning.Problem(**{**vars(presets.DEEPSEEK_V3), "fp32_weights": fp32_weights})
                for result in tuning.RESULTS:
                    for epilogue in ("none", "rmsnorm") if tp > 1 else ("none",):
                        config = tuning.kernel_config(problem, tp=tp, m=m, result=result, epilogue=epilogue)
                        assert config in deepseek, (m, tp, fp32_weights, result, epilogue)


def test_the_model_presets_hold_the_experts_op_s_configs():
    """The experts op's own config (`experts._default_config`) for each model's expert shard at
    every tp, layout and m (the token tiles differ by m), prepared weights' tiled order included,
    is in its preset: a prebuilt folder serves the op's calls."""
    from jax_moe_publish import checks, experts
    from jax_moe_publish.experts_layout import Tiling

    for make, shapes in ((presets.deepseek_v3, presets.DEEPSEEK_V3_EXPERTS),
                         (presets.qwen3_moe, presets.QWEN3_MOE_EXPERTS)):
        built = set(make())
        for hidden, intermediate, count, top_k, shared in shapes:
            for tp, m in itertools.product(presets.TP_SIZES, (1, 16, 64, 65, 256)):
                for fused in (True, False):
                    shape = checks.ExpertsShape(m, top_k, count, hidden, intermediate // tp, fused)
                    assert experts._default_config(shape) in built, (hidden, intermediate, tp, m, fused)
                # prepare_experts's default tiling, as moe_experts then loads it; with the model's
                # shared expert held too.
                tiling = Tiling.of(experts._default_config(shape))
                for held in (False, True) if shared else (False,):
                    prepared = checks.ExpertsShape(m, top_k, count, hidden, intermediate // tp, True, tiling=tiling,
                                                   prepared_shared=held)
                    assert experts._default_config(prepared) in built, (hidden, intermediate, tp, m, "prepared", held)
