"""The tuning table (`jax_moe_publish.tuning`): its ranges, the configs it chooses, its overrides."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import sys

import pytest

from jax_moe_publish import _abi, link_model, tuning
from jax_moe_publish.aot.presets import DEEPSEEK_V3
from jax_moe_publish.config import ALGORITHMS as KERNEL_ALGORITHMS
from jax_moe_publish.config import KernelConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import tune_algorithms  # noqa: E402

DEEPSEEK = tuning.Problem(hidden=7168, top_k=8, routed_scaling_factor=2.5)
QWEN3 = tuning.Problem(hidden=4096, top_k=8, include_shared_expert=False)
TABLES = {f"shapes[{k}]": t for k, t in tuning.SHAPES.items()}
ALGORITHM_TABLES = {f"{result}/{epilogue} tp={tp}": entries
                    for (result, epilogue), by_tp in tuning.CHOICES.items() for tp, entries in by_tp.items()}


@pytest.mark.parametrize("name", ALGORITHM_TABLES)
def test_every_algorithm_table_covers_every_size_and_says_why(name):
    entries = ALGORITHM_TABLES[name]
    assert entries[-1].max_bytes is None and entries[-1].shared_expert is None and entries[-1].algorithm != "xla", (
        f"{name}: the last entry must take every call to a kernel")
    bounds = [entry.max_bytes for entry in entries[:-1]]
    assert all(b is not None for b in bounds) and bounds == sorted(bounds), bounds
    for entry in entries:
        assert len(entry.reason) > 20 and entry.source.partition(" (")[0] in tuning.SOURCES, f"{name}: {entry}"
        assert entry.algorithm in ("xla", *KERNEL_ALGORITHMS), f"{name}: {entry}"
        if entry.source.startswith("measured"):
            assert "benchmarks/results/" in entry.reason, f"{name}: a measured entry cites its run: {entry}"


def test_every_result_file_the_table_cites_is_committed():
    root = pathlib.Path(__file__).resolve().parents[2]
    cited = set(re.findall(r"benchmarks/results/[\w.\-]+\.json", tuning.TABLE_FILE.read_text()))
    assert cited and all((root / path).is_file() for path in cited), sorted(cited)


@pytest.mark.parametrize("source", ["measured", "model", "argument",
                                    "measured (unfused two-shot, before the fused kernel)"])
def test_an_entry_source_is_a_known_kind(source):
    assert tuning.AlgorithmChoice(None, "oneshot", "a reason", source).source == source


@pytest.mark.parametrize("source", ["guessed", "Measured", "measured (unclosed", "model ()x", ""])
def test_an_unknown_entry_source_is_refused(source):
    with pytest.raises(ValueError, match=re.escape(f"source={source!r}: expected one of")):
        tuning.AlgorithmChoice(None, "oneshot", "a reason", source)


def test_the_model_entries_are_the_models():
    """Entries marked ``model`` are what `LinkModel` gives for the table's own constants."""
    data = json.loads(tuning.TABLE_FILE.read_text())
    for result, epilogue in tune_algorithms.CASES:
        for tp, entries in data["tables"][f"{result}/{epilogue}"].items():
            if all(entry.get("source") == "model" for entry in entries):
                assert entries == tune_algorithms.model_entries(link_model.MODEL, DEEPSEEK_V3, int(tp), epilogue)


def test_the_link_model_by_hand():
    """tp = 8, m = 64, DeepSeek-V3, NVLink-bound at these constants. One-shot: each rank sends
    its partial to 7 peers after one exchange. Two-shot: each rank sends the 7/8 of its
    partial's rows that others own to their owners, and each owner sends its 8 rows' sums to
    the 7 others, after two exchanges. With the epilogue one-shot is one kernel; two-shot is
    three (publish, reduce_norm, gather_norm), and its owners send both outputs, the
    normalized rows and residual_out."""
    model = link_model.LinkModel(p2p_bytes_per_s=1e11, hbm_bytes_per_s=1e14, exchange_s=1e-6, launch_s=5e-7)
    row = 64 * 7168 * 2  # one rank's bf16 [m, hidden] partial
    owned_rows = 64 // 8 * 7168 * 2  # the 8 tokens a rank owns
    publish = row - owned_rows  # partials of the tokens others own, one to each owner
    fan_out = 7 * owned_rows  # an owner's sums to every other rank
    assert model.call_s(DEEPSEEK_V3, "oneshot", 8, 64) == pytest.approx(1e-6 + 7 * row / 1e11)
    assert model.call_s(DEEPSEEK_V3, "twoshot", 8, 64) == pytest.approx(2e-6 + (publish + fan_out) / 1e11)
    assert model.call_s(DEEPSEEK_V3, "oneshot", 8, 64, "rmsnorm") == pytest.approx(1e-6 + 7 * row / 1e11)
    assert model.call_s(DEEPSEEK_V3, "twoshot", 8, 64, "rmsnorm") == pytest.approx(
        2e-6 + (publish + 2 * fan_out) / 1e11 + 2 * 5e-7)
    # One-shot's 5.25 rows more cost as much as a 10 us exchange at 1e11 B/s up to
    # m = 1e-5 * 1e11 / (5.25 * 14336) = 13.3.
    slow = dataclasses.replace(model, exchange_s=1e-5)
    assert slow.crossover_m(DEEPSEEK_V3, 8) == 13 and model.crossover_m(DEEPSEEK_V3, 8) == 1
    # Two more launches move the epilogue's crossover up; tp = 4 saves fewer bytes per m.
    assert model.crossover_m(DEEPSEEK_V3, 8, "rmsnorm") > model.crossover_m(DEEPSEEK_V3, 8)
    assert model.crossover_m(DEEPSEEK_V3, 4) > model.crossover_m(DEEPSEEK_V3, 8)
    free = dataclasses.replace(model, p2p_bytes_per_s=1e30, hbm_bytes_per_s=1e30)
    assert free.crossover_m(DEEPSEEK_V3, 8) is None  # no byte costs: one-shot's one exchange always wins


def test_the_algorithm_follows_the_table():
    def algorithm(problem, tp, m, result="allreduce", epilogue="none", **kwargs):
        return tuning.algorithm_for(problem, tp, m, result, epilogue, **kwargs).algorithm

    # tp = 1, m = 1, a shared expert: XLA's fused path; the kernel path's own choice is direct.
    assert algorithm(DEEPSEEK, 1, 1) == "xla" and algorithm(DEEPSEEK, 1, 2) == "direct"
    assert algorithm(DEEPSEEK, 1, 1, kernels_only=True) == "direct"
    assert tuning.kernel_config(DEEPSEEK, tp=1, m=1).algorithm == "direct"
    assert algorithm(QWEN3, 1, 1) == "direct"
    assert algorithm(DEEPSEEK, 2, 4096) == "oneshot" and algorithm(DEEPSEEK, 3, 4096) == "oneshot"  # tp 2's
    for tp in (4, 8):
        crossover = tuning.CHOICES["allreduce", "none"][tp][0].max_bytes
        m = crossover // (DEEPSEEK.hidden * 2)
        assert algorithm(DEEPSEEK, tp, m) == "oneshot" and algorithm(DEEPSEEK, tp, m + 1) == "twoshot"
        assert algorithm(DEEPSEEK, tp, None) == "twoshot"
        assert tuning.kernel_config(DEEPSEEK, tp=tp, m=m + 1).algorithm == "twoshot"
    assert algorithm(DEEPSEEK, 8, None, "reduce_scatter", "rmsnorm") == "reduce_scatter"
    with pytest.raises(ValueError, match=re.escape("result='allgather': expected one of")):
        tuning.algorithm_for(DEEPSEEK, 2, 4, "allgather")


@pytest.mark.parametrize("name", TABLES)
def test_every_table_covers_every_m_once_and_says_why(name):
    entries = TABLES[name]
    bounds = [entry.m_max for entry in entries]
    assert bounds[-1] is None, f"{name}: the last entry must take every larger m"
    assert all(b is not None for b in bounds[:-1]) and bounds[:-1] == sorted(set(bounds[:-1])), bounds
    for entry in entries:
        assert len(entry.reason) > 20, f"{name}: {entry} has no reason"
    for m in range(1, 2049):
        covering = [e for e in entries if e.m_max is None or m <= e.m_max]
        assert tuning._covering(entries, m) is covering[0]


def test_fused_algorithms_say_why():
    for (algorithm, epilogue), reason in tuning.FUSED.items():
        assert len(reason) > 20
        assert tuning.kernel_config(DEEPSEEK, tp=4, m=8, epilogue=epilogue, algorithm=algorithm).fuse_reduce


def test_range_ms_hold_one_m_of_every_range():
    ms = tuning.range_ms()
    for entries in TABLES.values():
        assert {tuning._covering(entries, m) for m in ms} == set(entries)


@pytest.mark.parametrize("result", tuning.RESULTS)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("epilogue", ["none", "rmsnorm"])
def test_every_call_gets_a_valid_config_of_its_range(result, tp, epilogue):
    if tp == 1 and epilogue != "none":
        pytest.skip("tp = 1 runs the epilogue in jnp: the op asks for epilogue='none'")
    for hidden in (2048, 2880, 4096, 7168, 9216, 16384):
        problem = tuning.Problem(hidden=hidden, top_k=8)
        for m in (1, 2, 31, 32, 33, 64, 65, 256, 4096, None):
            config = tuning.kernel_config(problem, tp=tp, m=m, result=result, epilogue=epilogue)
            assert isinstance(config, KernelConfig)
            assert config.algorithm == tuning.algorithm_for(problem, tp, m, result, epilogue,
                                                            kernels_only=True).algorithm
            shape = tuning.shape_for(config.fuse_reduce, epilogue, m)
            assert config.prefetch_group == min(shape.prefetch_group, 8)
            assert config.waves == (shape.waves if config.fuse_reduce else 1)
            if config.fuse_reduce and epilogue != "none":
                assert config.ctas_per_row <= shape.cluster_ctas <= _abi.MAX_CLUSTER_CTAS


@pytest.mark.parametrize("most, top_k, group", [(4, 8, 4), (4, 6, 3), (4, 10, 4), (4, 5, 3), (4, 3, 3), (4, 1, 1),
                                                (2, 8, 2), (8, 6, 6)])
def test_prefetch_groups_are_as_even_as_top_k_allows(most, top_k, group):
    assert tuning._prefetch_group(most, top_k) == group


# (problem, tp, kwargs, algorithm, elements_per_thread, prefetch_group, ctas_per_row, reduce_ctas_per_row)
LARGE_M_CALLS = [
    (dict(hidden=7168, top_k=8), 1, {}, "direct", 8, 4, 7, 7),
    (dict(hidden=7168, top_k=8), 2, {}, "oneshot", 8, 4, 7, 7),
    (dict(hidden=5120, top_k=6), 8, dict(algorithm="twoshot"), "twoshot", 8, 3, 5, 5),  # 6 = 3 + 3
    (dict(hidden=2880, top_k=10), 4, dict(result="reduce_scatter"), "reduce_scatter", 8, 4, 3, 3),
    (dict(hidden=2052, top_k=2), 1, {}, "direct", 4, 2, 5, 2),  # 2052 % 8 = 4
    (dict(hidden=4096, top_k=1, routed_scaling_factor=2.5, include_shared_expert=False, fp32_weights=True),
     2, dict(arch="sm_100a"), "oneshot", 8, 1, 4, 4),
]


@pytest.mark.parametrize("problem, tp, kwargs, algorithm, elements, prefetch, ctas, reduce_ctas", LARGE_M_CALLS,
                         ids=[f"{p}-tp{tp}-{k}" for p, tp, k, *_ in LARGE_M_CALLS])
def test_large_m_shape(problem, tp, kwargs, algorithm, elements, prefetch, ctas, reduce_ctas):
    config = tuning.kernel_config(tuning.Problem(**problem), tp=tp, m=None, **kwargs)
    for name, value in problem.items():
        assert getattr(config, name) == value, name
    assert config.algorithm == algorithm and config.arch == kwargs.get("arch", "sm_90a")
    assert (config.elements_per_thread, config.prefetch_group) == (elements, prefetch)
    assert (config.threads, config.reduce_threads, config.enable_pdl) == (128, 128, True)
    assert not config.load_shared_expert_before_pdl
    assert (config.ctas_per_row, config.reduce_ctas_per_row) == (ctas, reduce_ctas)


@pytest.mark.parametrize("problem, tp, kwargs, field", [
    (dict(hidden=1028, top_k=8), 2, {}, "hidden"),  # 8-byte fragments cannot fill 16-byte lanes
    (dict(hidden=1024, top_k=8), 1, dict(algorithm="oneshot"), "algorithm"),
    (dict(hidden=1024, top_k=0), 2, {}, "top_k"),
    (dict(hidden=1024, top_k=8), 2, dict(arch="sm_89"), "arch"),
    (dict(hidden=7168, top_k=8), 2, dict(result="reduce_scatter", fuse_reduce=True), "algorithm"),
])
def test_invalid_calls_name_the_config_field(problem, tp, kwargs, field):
    with pytest.raises(ValueError, match=re.escape(f"KernelConfig.{field}=")):
        tuning.kernel_config(tuning.Problem(**problem), tp=tp, m=None, **kwargs)


def test_an_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match=re.escape("algorithm='threeshot': expected one of")):
        tuning.kernel_config(DEEPSEEK, tp=2, m=1, algorithm="threeshot")


# (hidden, reduce threads, 16-byte fragments per thread) of the unfused epilogue: one CTA per
# row, one fragment per thread up to 1024 threads, then at most 512 threads.
EPILOGUE_SHAPES = [(2048, 256, 1), (2880, 384, 1), (5120, 640, 1), (7168, 896, 1), (8192, 1024, 1),
                   (9216, 384, 3), (16384, 512, 4)]
# (threads, CTAs of the row's cluster) by hidden, of the fused epilogue: 128 threads, or more
# where the cluster would not hold the row; 16-byte fragments in at most 8 CTAs, and up to
# ONE_PASS_M tokens 8-byte ones in at most 16.
FUSED_EPILOGUE_SHAPES = {2048: (128, 2), 2880: (128, 3), 5120: (128, 5), 7168: (128, 7), 8192: (128, 8),
                         9216: (160, 8), 16384: (256, 8)}
NARROW_FUSED_EPILOGUE_SHAPES = {2048: (128, 4), 2880: (128, 6), 5120: (128, 10), 7168: (128, 14),
                                8192: (128, 16), 9216: (160, 15), 16384: (256, 16)}


@pytest.mark.parametrize("hidden, threads, per_thread", EPILOGUE_SHAPES)
@pytest.mark.parametrize("result", tuning.RESULTS)
@pytest.mark.parametrize("m", [1, tuning.ONE_PASS_M, tuning.ONE_PASS_M + 1, 1024, None])
def test_epilogue_shape(hidden, threads, per_thread, result, m):
    problem = tuning.Problem(hidden=hidden, top_k=8)
    config = tuning.kernel_config(problem, tp=2, m=m, result=result, epilogue="rmsnorm")
    unfused = tuning.kernel_config(problem, tp=2, m=m, result=result, epilogue="rmsnorm", fuse_reduce=False)
    assert config.epilogue == "rmsnorm"
    assert config.fuse_reduce == (result == "allreduce")  # fused exactly for oneshot
    if config.fuse_reduce:
        narrow = m is not None and m <= tuning.ONE_PASS_M
        shapes = NARROW_FUSED_EPILOGUE_SHAPES if narrow else FUSED_EPILOGUE_SHAPES
        assert (config.threads, config.ctas_per_row) == shapes[hidden]
        assert (config.reduce_threads, config.elements_per_thread) == (config.threads, 4 if narrow else 8)
    else:
        assert config == unfused
    assert (unfused.reduce_threads, unfused.norm_fragments_per_thread) == (threads, per_thread)
    assert unfused.reduce_ctas_per_row == 1
    # Unfused, the publish is the one without the epilogue.
    plain = tuning.kernel_config(problem, tp=2, m=m, result=result, fuse_reduce=False)
    assert unfused.replace(epilogue="none", reduce_threads=plain.reduce_threads) == plain


@pytest.mark.parametrize("m, result, epilogue, fused", [
    (1, "allreduce", "none", True),
    (tuning.SMALL_M, "allreduce", "none", True),
    (4096, "allreduce", "none", True),  # persistent: any m
    (None, "allreduce", "none", True),
    (1, "reduce_scatter", "none", False),
    (1, "allreduce", "rmsnorm", True),
    (tuning.SMALL_M + 1, "allreduce", "rmsnorm", True),
    (None, "allreduce", "rmsnorm", True),
    (tuning.SMALL_M + 1, "reduce_scatter", "rmsnorm", False),
])
def test_oneshot_calls_are_fused(m, result, epilogue, fused):
    config = tuning.kernel_config(DEEPSEEK, tp=2, m=m, result=result, epilogue=epilogue)
    assert config.fuse_reduce is fused
    assert tuning.kernel_config(DEEPSEEK, tp=2, m=m, result=result, epilogue=epilogue,
                                fuse_reduce=False).fuse_reduce is False
    assert tuning.kernel_config(DEEPSEEK, tp=2, m=m, algorithm="twoshot").fuse_reduce is True


@pytest.mark.parametrize("epilogue, other", [("none", dict(algorithm="twoshot", fuse_reduce=False)),
                                             ("rmsnorm", dict(result="reduce_scatter"))])
def test_waves(epilogue, other):
    def waves(**changes):
        return tuning.kernel_config(DEEPSEEK, tp=2, epilogue=epilogue, **changes).waves

    # Two passes of the fused grid for 33 to 64 tokens; one elsewhere, and for unfused calls.
    assert {m: waves(m=m) for m in (1, 32, 33, 64, 65, 256, None)} == {
        1: 1, 32: 1, 33: 2, 64: 2, 65: 1, 256: 1, None: 1}
    assert waves(m=64, fuse_reduce=False) == 1
    assert waves(m=64, **other) == 1


def test_a_fused_epilogue_on_request_has_a_cluster_per_row():
    fused = tuning.kernel_config(DEEPSEEK, tp=2, m=1, epilogue="rmsnorm", fuse_reduce=True)
    assert fused.fuse_reduce and (fused.threads, fused.reduce_threads, fused.elements_per_thread) == (128, 128, 4)
    assert fused.ctas_per_row == 14
