"""`KernelConfig`: validation, the key and the dict round trip (no DSL, no GPU)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_moe_publish import tuning
from jax_moe_publish._abi import MAX_CLUSTER_CTAS
from jax_moe_publish.config import ARCHS, KernelConfig

# A valid oneshot config; each invalid case below changes a few fields of it.
BASE = dict(hidden=1024, top_k=4, tp=2)
DIRECT = dict(tp=1, algorithm="direct")

# (changes to BASE, the field the error must name, the bad value it must show)
INVALID = [
    ({"hidden": 0}, "hidden", 0),
    ({"hidden": -8}, "hidden", -8),
    ({"hidden": 1024.0}, "hidden", 1024.0),
    ({"hidden": 1020, **DIRECT}, "hidden", 1020),  # not a multiple of elements_per_thread=8
    ({"hidden": 1022, "elements_per_thread": 4, **DIRECT}, "hidden", 1022),
    ({"hidden": 1028, "elements_per_thread": 4}, "hidden", 1028),  # tp > 1 needs 16-byte lanes
    ({"top_k": 0}, "top_k", 0),
    ({"top_k": 65}, "top_k", 65),
    ({"tp": 0}, "tp", 0),
    ({"tp": 9}, "tp", 9),
    ({"tp": 1}, "algorithm", "oneshot"),
    ({"algorithm": "direct"}, "algorithm", "direct"),
    ({"algorithm": "allreduce"}, "algorithm", "allreduce"),
    ({"algorithm": "multicast"}, "algorithm", "multicast"),
    ({"elements_per_thread": 2}, "elements_per_thread", 2),
    ({"elements_per_thread": 16}, "elements_per_thread", 16),
    ({"elements_per_thread": 8.0}, "elements_per_thread", 8.0),
    ({"include_shared_expert": "no"}, "include_shared_expert", "no"),
    ({"top_k": True}, "top_k", True),
    ({"threads": 0}, "threads", 0),
    ({"threads": 33}, "threads", 33),
    ({"threads": 2048}, "threads", 2048),
    ({"reduce_threads": 48}, "reduce_threads", 48),
    ({"prefetch_group": 0}, "prefetch_group", 0),
    ({"prefetch_group": 5}, "prefetch_group", 5),  # > top_k
    ({"routed_scaling_factor": math.nan}, "routed_scaling_factor", math.nan),
    ({"routed_scaling_factor": math.inf}, "routed_scaling_factor", math.inf),
    ({"routed_scaling_factor": -math.inf}, "routed_scaling_factor", -math.inf),
    ({"load_shared_expert_before_pdl": True, "include_shared_expert": False},
     "load_shared_expert_before_pdl", True),
    ({"load_shared_expert_before_pdl": True, "enable_pdl": False},
     "load_shared_expert_before_pdl", True),
    ({"arch": "sm_80"}, "arch", "sm_80"),
    ({"arch": "sm_90"}, "arch", "sm_90"),
    ({"epilogue": "layernorm"}, "epilogue", "layernorm"),
    ({"epilogue": None}, "epilogue", None),
    ({"epilogue": "rmsnorm", **DIRECT}, "algorithm", "direct"),
    # 16384 / 8 = 2048 fragments of a row over 32 threads: 64 per thread, more than 8.
    ({"epilogue": "rmsnorm", "hidden": 16384, "reduce_threads": 32}, "reduce_threads", 32),
    ({"fuse_reduce": 1}, "fuse_reduce", 1),
    ({"waves": 0, "fuse_reduce": True}, "waves", 0),
    ({"waves": 2.0, "fuse_reduce": True}, "waves", 2.0),
    ({"waves": 2}, "waves", 2),  # several passes need the persistent (fused) grid
    ({"fuse_reduce": True, "algorithm": "twoshot", "epilogue": "rmsnorm"}, "epilogue", "rmsnorm"),
    ({"fuse_reduce": True, "algorithm": "twoshot", "keep_own_partial": True}, "keep_own_partial", True),
    ({"fuse_reduce": True, "algorithm": "reduce_scatter"}, "algorithm", "reduce_scatter"),
    ({"fuse_reduce": True, **DIRECT}, "algorithm", "direct"),
    # With the epilogue a row's CTAs (one cluster) publish: one fragment per thread.
    ({"fuse_reduce": True, "epilogue": "rmsnorm", "reduce_threads": 256}, "threads", 128),
    ({"fuse_reduce": True, "epilogue": "rmsnorm", "threads": 256}, "threads", 256),
    # 9216 / 8 = 1152 fragments over 128 threads: more than 8 per reduce thread (and more than
    # 8 CTAs of a cluster).
    ({"fuse_reduce": True, "epilogue": "rmsnorm", "hidden": 9216, "threads": 128, "reduce_threads": 128},
     "reduce_threads", 128),
]


def _case_id(case) -> str:
    changes = case.values[0] if hasattr(case, "values") else case[0]
    return ",".join(f"{k}={v}" for k, v in changes.items())


@pytest.mark.parametrize("changes, field, value", INVALID, ids=[_case_id(c) for c in INVALID])
def test_invalid_config_names_field_and_value(changes, field, value):
    """Every way of building a config validates, and the message names the field and value."""
    valid = KernelConfig(**BASE)
    builders = {
        "constructor": lambda: KernelConfig(**{**BASE, **changes}),
        "replace": lambda: valid.replace(**changes),
        "from_dict": lambda: KernelConfig.from_dict({**valid.to_dict(), **changes}),
    }
    for name, build in builders.items():
        with pytest.raises(ValueError, match=re.escape(f"KernelConfig.{field}={value!r}")):
            build()
            pytest.fail(f"{name} accepted {changes}")


# One valid new value per field of KernelConfig(**BASE).
CHANGED = {
    "hidden": 2048,
    "top_k": 8,
    "tp": 4,
    "algorithm": "twoshot",
    "routed_scaling_factor": 2.5,
    "include_shared_expert": False,
    "fp32_weights": True,
    "elements_per_thread": 4,
    "threads": 256,
    "prefetch_group": 2,
    "load_shared_expert_before_pdl": True,
    "enable_pdl": False,
    "reduce_threads": 64,
    "fuse_reduce": True,
    "epilogue": "rmsnorm",
    "arch": "sm_100a",
}


def test_key_changes_with_every_field():
    # keep_own_partial and waves need fuse_reduce, fp8_out the epilogue: see
    # test_keep_own_partial_follows_fuse_reduce, test_waves_need_fuse_reduce and
    # test_an_fp8_out_has_its_own_keys.
    assert set(CHANGED) | {"keep_own_partial", "waves", "fp8_out"} == {f.name for f in dataclasses.fields(KernelConfig)}
    base = KernelConfig(**BASE)
    keys = {base.key}
    for name, value in CHANGED.items():
        changed = base.replace(**{name: value})
        assert getattr(changed, name) == value and changed != base
        assert changed.key != base.key, name
        keys.add(changed.key)
    assert len(keys) == len(CHANGED) + 1


def test_an_fp8_out_has_its_own_keys():
    """Each FP8 out names its own cubin, and a bf16 config's key is what it was before fp8_out
    existed (its dict leaves the field out)."""
    base = KernelConfig(hidden=2048, top_k=6, tp=4, epilogue="rmsnorm")
    assert "fp8_out" not in base.to_dict() and base.fp8_out == "none"
    fp8 = {mode: base.replace(fp8_out=mode) for mode in ("group", "static")}
    assert len({base.key, *(c.key for c in fp8.values())}) == 3
    for mode, config in fp8.items():
        assert f"-fp8{mode}-" in config.key and KernelConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("fields, words", [
    (dict(hidden=2048, tp=4, epilogue="rmsnorm", fp8_out="dynamic"), "KernelConfig.fp8_out='dynamic': expected one of"),
    (dict(hidden=2048, tp=4, fp8_out="group"), "KernelConfig.fp8_out='group': expected 'none' without an epilogue"),
    (dict(hidden=2056, tp=4, epilogue="rmsnorm", fp8_out="group"),
     "KernelConfig.hidden=2056: expected a multiple of 128 with fp8_out='group'"),
])
def test_fp8_out_errors_name_the_field(fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        KernelConfig(top_k=6, **fields)
    if fields.get("fp8_out") == "group" and fields["hidden"] % 128:
        KernelConfig(top_k=6, **{**fields, "fp8_out": "static"})  # a static scale takes any hidden


def test_fused_epilogue_cluster_beyond_the_portable_size():
    # 8-byte fragments double a row's fragments: 1792 over 128-thread CTAs, 14 CTAs in one
    # cluster, beyond the portable 8 (the launcher opts the kernel in).
    narrow = KernelConfig(hidden=7168, top_k=8, tp=2, fuse_reduce=True, epilogue="rmsnorm", elements_per_thread=4)
    assert narrow.ctas_per_row == 14 and narrow.own_partial_tiles == 16
    wide = KernelConfig(hidden=7168, top_k=8, tp=2, fuse_reduce=True, epilogue="rmsnorm", elements_per_thread=4,
                        threads=256, reduce_threads=256)
    assert wide.ctas_per_row == 7 and wide.own_partial_tiles == 8
    # At most 8 16-byte fragments per reduce thread keep a row within Hopper's 16 CTAs.
    with pytest.raises(ValueError, match=re.escape(
            "KernelConfig.reduce_threads=128: expected at least 256 with epilogue='rmsnorm' "
            "(at most 8 fragments of the 2048 of a row per thread)")):
        KernelConfig(hidden=16384, top_k=8, tp=2, fuse_reduce=True, epilogue="rmsnorm", elements_per_thread=4)
    accepted = 0
    for hidden in range(1024, 16385, 1024):
        for elements in (4, 8):
            for threads in range(32, 1025, 32):
                try:
                    config = KernelConfig(hidden=hidden, top_k=8, tp=2, fuse_reduce=True, epilogue="rmsnorm",
                                          elements_per_thread=elements, threads=threads, reduce_threads=threads)
                except ValueError:
                    continue
                accepted += 1
                assert config.ctas_per_row <= MAX_CLUSTER_CTAS, config
    assert accepted > 100


def test_keep_own_partial_follows_fuse_reduce():
    plain = KernelConfig(hidden=7168, top_k=8, tp=2)
    assert plain.keep_own_partial is False and plain.own_partial_tiles == 0
    fused = plain.replace(fuse_reduce=True)
    assert fused.keep_own_partial is True
    assert fused == KernelConfig(hidden=7168, top_k=8, tp=2, fuse_reduce=True, keep_own_partial=None)
    # 16 KiB of 128 threads x 16 bytes: 8 tiles.
    assert fused.own_partial_tiles == 8
    assert fused.replace(threads=1024).own_partial_tiles == 1
    assert fused.replace(elements_per_thread=4).own_partial_tiles == 16
    opted_out = fused.replace(keep_own_partial=False)
    assert opted_out.own_partial_tiles == 0 and opted_out.key != fused.key
    # Unfusing drops it, unless it is given.
    assert fused.replace(fuse_reduce=False) == plain
    with pytest.raises(ValueError, match=re.escape(
            "KernelConfig.keep_own_partial=True: expected False unless fuse_reduce is True")):
        fused.replace(fuse_reduce=False, keep_own_partial=True)
    with pytest.raises(ValueError, match=re.escape("KernelConfig.keep_own_partial=1: expected a bool")):
        fused.replace(keep_own_partial=1)


def test_waves_need_fuse_reduce():
    fused = KernelConfig(hidden=7168, top_k=8, tp=2, fuse_reduce=True)
    assert fused.waves == 1
    two = fused.replace(waves=2)
    assert two.key != fused.key and KernelConfig.from_dict(two.to_dict()) == two
    epilogue = tuning.kernel_config(tuning.Problem(7168, 8), tp=2, m=64, epilogue="rmsnorm")
    assert epilogue.fuse_reduce and epilogue.replace(waves=4).waves == 4
    with pytest.raises(ValueError, match=re.escape("KernelConfig.waves=2: expected 1 unless fuse_reduce is True")):
        two.replace(fuse_reduce=False)


def test_key_is_stable_for_equal_configs():
    assert KernelConfig(**BASE).key == KernelConfig(**BASE).key
    # The scale is stored as a float, so 2 and 2.0 name the same cubin.
    as_int = KernelConfig(**BASE, routed_scaling_factor=2)
    assert as_int.routed_scaling_factor == 2.0 and type(as_int.routed_scaling_factor) is float
    assert as_int.key == KernelConfig(**BASE, routed_scaling_factor=2.0).key


def test_replace_copies_and_config_is_frozen():
    base = KernelConfig(**BASE)
    changed = base.replace(top_k=8)
    assert (base.top_k, changed.top_k) == (4, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.top_k = 8


@st.composite
def valid_configs(draw) -> KernelConfig:
    """Any valid config: the draws respect every cross-field rule of `KernelConfig`."""
    tp = draw(st.integers(1, 8))
    algorithm = "direct" if tp == 1 else draw(st.sampled_from(["oneshot", "twoshot", "reduce_scatter"]))
    elements = draw(st.sampled_from([4, 8]))
    top_k = draw(st.integers(1, 64))
    include_shared, enable_pdl = draw(st.booleans()), draw(st.booleans())
    epilogue = draw(st.sampled_from(["none", "rmsnorm"])) if algorithm in ("oneshot", "reduce_scatter") else "none"
    hidden = (8 if tp > 1 else elements) * draw(st.integers(1, 4096))
    # The epilogue needs at most 8 fragments of 8 elements per thread.
    fewest_warps = -(-hidden // (8 * 8 * 32)) if epilogue == "rmsnorm" else 1
    return KernelConfig(
        hidden=hidden,
        top_k=top_k,
        tp=tp,
        algorithm=algorithm,
        routed_scaling_factor=draw(st.floats(allow_nan=False, allow_infinity=False)),
        include_shared_expert=include_shared,
        fp32_weights=draw(st.booleans()),
        elements_per_thread=elements,
        threads=32 * draw(st.integers(1, 32)),
        prefetch_group=draw(st.integers(1, top_k)),
        load_shared_expert_before_pdl=include_shared and enable_pdl and draw(st.booleans()),
        enable_pdl=enable_pdl,
        reduce_threads=32 * draw(st.integers(fewest_warps, 32)),
        epilogue=epilogue,
        arch=draw(st.sampled_from(ARCHS)),
    )


@given(valid_configs())
def test_dict_round_trip(config):
    # Through JSON, as the sidecar stores it.
    restored = KernelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config
    assert restored.key == config.key
    assert restored.replace() == config


@given(valid_configs())
def test_key_names_the_problem(config):
    kind = config.algorithm if config.epilogue == "none" else f"{config.algorithm}-{config.epilogue}"
    prefix = f"{kind}-h{config.hidden}-k{config.top_k}-tp{config.tp}-{config.arch}-"
    assert config.key.startswith(prefix)
    assert re.fullmatch(r"[A-Za-z0-9_.-]+-[0-9a-f]{12}", config.key)  # a safe file name


def _covers(ctas: int, span: int, hidden: int) -> bool:
    """``ctas`` CTAs of ``span`` elements cover ``hidden`` with less than one CTA to spare."""
    return (ctas - 1) * span < hidden <= ctas * span


@given(valid_configs())
def test_grid_covers_a_row(config):
    assert _covers(config.ctas_per_row, config.threads * config.elements_per_thread, config.hidden)
    if config.epilogue != "none":
        # One CTA holds the row, with fewer than a thread's fragments to spare.
        assert config.reduce_ctas_per_row == 1
        assert _covers(config.norm_fragments_per_thread, config.reduce_threads * 8, config.hidden)
    elif config.tp > 1:
        # 8 bf16 per 16-byte reduce fragment.
        assert _covers(config.reduce_ctas_per_row, config.reduce_threads * 8, config.hidden)
