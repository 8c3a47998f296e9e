"""GPU tests of deterministic results, through `gpu_harness` on virtual ranks (one GPU suffices):
a token's bits depend on its own inputs only, not on the algorithm, the launch shape, m, the
other tokens of the call, the rank or the run.

For a problem and tp, every config of the ``tests`` preset (`gpu_matrix.publish_configs`: the
tuning table's for every algorithm and m range, and the launch-shape variants) runs the same
probe tokens (`determinism`) in calls of every m range of the table, at different places
among fresh tokens, so that the probe's owners (``t % tp``) change from call to call too.
Then:

* within a config, every copy of a probe token's result (every rank's, every call's) has the
  same bits; the first call, repeated after the others on a later stage, gives the same bits
  for all of its tokens, and so does the largest call with each rank's persistent grid capped
  differently (as GPUs of different occupancy cap them);
* without the epilogue, every config gives the same bits: one-shot, two-shot fused and
  unfused, and reduce_scatter's owner rows. The partials are rounded where the finalize
  rounds them whatever the launch shape, and every reduce sums them from +0.0 in rank order,
  so a sum is never -0.0 and two-shot's turning -0.0 into +0.0 changes nothing;
* with the epilogue, ``residual_out`` is the same bits in every config, and so is ``out``
  between configs that sum a row's squares in the same order (`_row_sum_order`), except that
  two-shot stores +0.0 where the others store -0.0 (a zero token's lanes of a negative
  weight: -0.0 is its gather slots' empty marker). Configs that sum in different orders may
  round the mean of squares differently: their ``out`` differs by at most one bf16 ulp.

The first config's result is also checked against the float64 model, so that bits that
agree are also right. The reference's side of the contract is
`tests/cpu/test_determinism_cpu.py`.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

import determinism
import numerics
from kernel_checks import check_protocol_state, open_test_group
from jax_moe_publish import protocol, tuning
from jax_moe_publish.config import GROUP_ALGORITHMS, result_of
from jax_moe_publish.testing import gpu_matrix

CAPACITY_M = 96  # above the last range bound of the table (tuning.range_ms)
ROUTED_ROWS = 48
EPS = 1e-6
GRID_LIMITS = (3, 7, 64)  # rank r's persistent grid: at most GRID_LIMITS[r % 3] CTAs
# bf16 outputs; the FP8 ones are the bf16 out quantized (test_epilogue_gpu).
ALL_CONFIGS = [c for c in gpu_matrix.publish_configs() if c.fp8_out == "none"]


def _configs(problem: tuning.Problem, tp: int, epilogue: str) -> list:
    """Every config of the ``tests`` preset for ``problem``, ``tp`` and ``epilogue``; they include
    the table's config of every call's m for every algorithm."""
    fields = [field.name for field in dataclasses.fields(tuning.Problem)]
    configs = [c for c in ALL_CONFIGS if c.tp == tp and c.epilogue == epilogue
               and all(getattr(c, name) == getattr(problem, name) for name in fields)]
    for m, _ in determinism.call_places(CAPACITY_M):
        for algorithm in GROUP_ALGORITHMS:
            table = tuning.kernel_config(problem, tp=tp, m=m, result=result_of(algorithm), epilogue=epilogue,
                                         algorithm=algorithm)
            assert table in configs, f"m={m}: the table's {table.key} is not in the tests preset"
    return configs


def _row_sum_order(config) -> tuple:
    """What fixes the order in which the epilogue sums a row's squares (`RowNorm`, `RowSums`):
    the 32-bit words of each fragment a thread holds, the fragments per thread, the threads
    per CTA and the CTAs of the row's cluster."""
    if config.fuse_reduce:
        return config.elements_per_thread // 2, 1, config.reduce_threads, config.ctas_per_row
    return protocol.REDUCE_ELEMENTS // 2, config.norm_fragments_per_thread, config.reduce_threads, 1


def _run(launcher, buffers, call: determinism.Call, norm_weight) -> dict[str, list[np.ndarray]]:
    """One call on poisoned outputs: each output's copies of the result, raw bf16 bits in token
    order (`determinism.token_rows`)."""
    result = result_of(launcher.config.algorithm)
    for rank, (rank_buffers, problem) in enumerate(zip(buffers, call.problems)):
        rank_buffers.upload(problem)
        rank_buffers.out.poison()
        if call.residual is not None:
            rank_buffers.upload_epilogue(call.residual_rows(result, rank), norm_weight, EPS)
            rank_buffers.residual_out.poison()
    launcher.run(buffers, call.m)
    outputs = {"out": determinism.token_rows([b.output() for b in buffers], result, call.m)}
    if call.residual is not None:
        outputs["residual_out"] = determinism.token_rows([b.residual_output() for b in buffers], result, call.m)
    return outputs


def _assert_same(outputs, expected, what) -> None:
    """Every copy of every output in ``outputs`` has ``expected``'s bits."""
    for name, copies in outputs.items():
        for index, copy in enumerate(copies):
            assert np.array_equal(copy, expected[name][index]), f"{what}: copy {index} of {name} differs in bits"


def _probe_results(config, devices, calls, norm_weight) -> dict[str, np.ndarray]:
    """The probe's result under ``config``, after checking that it has the same bits in every
    copy of every call, that the first call repeated and the largest with capped grids (fused
    configs) give the same bits, and that the mailbox is healthy after them."""
    probe = {}
    with open_test_group(config, devices, CAPACITY_M) as launcher:
        buffers = launcher.allocate(CAPACITY_M, ROUTED_ROWS)
        results = []
        for call in calls:
            results.append(_run(launcher, buffers, call, norm_weight))
            for name, copies in results[-1].items():
                for index, copy in enumerate(copies):
                    window = copy[call.window]
                    assert np.array_equal(window, probe.setdefault(name, window)), (
                        f"{config.key} m={call.m} offset={call.offset}: copy {index} of the probe's {name} differs "
                        "in bits from the first call's")
        _assert_same(_run(launcher, buffers, calls[0], norm_weight), results[0], f"{config.key}: the repeated call")
        check_protocol_state(launcher, calls=len(calls) + 1)
    if config.fuse_reduce:
        largest = max(range(len(calls)), key=lambda index: calls[index].m)
        limits = [GRID_LIMITS[rank % len(GRID_LIMITS)] for rank in range(config.tp)]
        with open_test_group(config, devices, CAPACITY_M, limits) as capped:
            outputs = _run(capped, capped.allocate(CAPACITY_M, ROUTED_ROWS), calls[largest], norm_weight)
            _assert_same(outputs, results[largest], f"{config.key} m={calls[largest].m} with grids capped at {limits}")
            check_protocol_state(capped, calls=1)
    return probe


def _problem_id(problem):
    return f"h{problem.hidden}-k{problem.top_k}"


@pytest.mark.gpus(1)
@pytest.mark.parametrize("tp", gpu_matrix.GROUP_TPS, ids=lambda tp: f"tp{tp}")
def test_every_algorithm_gives_a_token_the_same_bits_at_every_m(tp, devices, rng):
    problem = gpu_matrix.DEFAULT_PROBLEMS[0]
    probes = determinism.probe_problems(rng, tp, problem, ROUTED_ROWS)
    calls = determinism.calls(rng, probes, CAPACITY_M)
    configs = _configs(problem, tp, "none")
    results = [_probe_results(config, devices, calls, None)["out"] for config in configs]
    total, bound = numerics.expected_sum(probes, problem.routed_scaling_factor)
    numerics.assert_close(results[0].view(numerics.BF16), total, bound, what=configs[0].key)
    zeros = list(determinism.ZERO_TOKENS)
    assert np.all(results[0][zeros] == 0), f"{configs[0].key}: a token of zero sum is not +0.0"
    for config, out in zip(configs[1:], results[1:]):
        assert np.array_equal(out, results[0]), f"{config.key}: the probe's bits differ from {configs[0].key}'s"


@pytest.mark.gpus(1)
@pytest.mark.parametrize("problem", gpu_matrix.EPILOGUE_PROBLEMS, ids=_problem_id)
@pytest.mark.parametrize("tp", gpu_matrix.GROUP_TPS, ids=lambda tp: f"tp{tp}")
def test_epilogue_bits_differ_only_by_the_row_sum_order_and_twoshot_zeros(tp, problem, devices, rng):
    probes = determinism.probe_problems(rng, tp, problem, ROUTED_ROWS)
    residual, norm_weight = determinism.probe_residual(rng, problem.hidden)
    calls = determinism.calls(rng, probes, CAPACITY_M, residual)
    configs = _configs(problem, tp, "rmsnorm")
    results = [_probe_results(config, devices, calls, norm_weight) for config in configs]
    total, bound = numerics.expected_sum(probes, problem.routed_scaling_factor)
    first = results[0]
    numerics.assert_epilogue_close(first["out"].view(numerics.BF16), first["residual_out"].view(numerics.BF16), total,
                                   bound, residual, norm_weight, EPS, what=configs[0].key)
    zeros = list(determinism.ZERO_TOKENS)
    assert np.all(first["residual_out"][zeros] == 0), f"{configs[0].key}: a zero token's residual_out is not +0.0"
    for config, result in zip(configs, results):
        assert np.array_equal(result["residual_out"], first["residual_out"]), (
            f"{config.key}: the probe's residual_out differs in bits from {configs[0].key}'s")
        expected = determinism.zero_out(norm_weight, positive=config.algorithm == "twoshot")
        for token in zeros:
            assert np.array_equal(result["out"][token], expected), f"{config.key}: token {token}'s out"
    for (a, result_a), (b, result_b) in itertools.combinations(zip(configs, results), 2):
        what = f"{a.key} against {b.key}"
        out_a, out_b = result_a["out"], result_b["out"]
        if _row_sum_order(a) != _row_sum_order(b):
            ulps = determinism.bf16_ulps(out_a, out_b)
            assert ulps.max() <= 1, f"{what}: out differs by {ulps.max()} ulps (rows summed in other orders)"
        elif "twoshot" in (a.algorithm, b.algorithm):
            assert np.array_equal(determinism.positive_zero(out_a), determinism.positive_zero(out_b)), (
                f"{what}: out differs in more than the sign of zeros")
        else:
            assert np.array_equal(out_a, out_b), f"{what}: out differs in bits (rows summed in the same order)"
