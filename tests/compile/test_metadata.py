"""Compile tier (CPU, CI): the sidecar of every compiled config (the call, each kernel's role,
parameters and launch geometry) agrees with the config, its PTX and its cubin.

CuTe DSL compiles for sm_90a/sm_100a without a GPU; nothing here launches a kernel.
"""

from __future__ import annotations

import importlib.metadata

import pytest

pytest.importorskip("cutlass")

from built_configs import ALL_CONFIGS, SM100_CONFIG, config_ids, expected_roles  # noqa: E402
from jax_moe_publish import _abi  # noqa: E402
from jax_moe_publish.aot import artifact, compile  # noqa: E402
from jax_moe_publish.config import KernelConfig  # noqa: E402
from ptx import kernel_bodies  # noqa: E402


def own_partial_smem(config) -> int:
    """16 KiB of whole tiles (a tile: one fragment per thread), at least one; 0 without."""
    tile = config.threads * config.elements_per_thread * 2
    return max(1, 16384 // tile) * tile if config.keep_own_partial else 0


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the 16-byte alignment of each shared-memory area."""
    return -(-nbytes // 16) * 16


def fused_norm_smem(config) -> int:
    cluster = config.ctas_per_row
    return (aligned(2 * config.threads // 32 * 4) + (aligned(2 * cluster * 4) + 16 if cluster > 1 else 0)
            + own_partial_smem(config))


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=config_ids(ALL_CONFIGS))
def test_metadata(builds, config):
    built = builds(config)
    meta = built.metadata
    assert meta["key"] == config.key
    assert KernelConfig.from_dict(meta["config"]) == config
    assert meta["arch"] == config.arch
    assert meta["dsl_version"] == importlib.metadata.version("nvidia-cutlass-dsl")
    assert meta["source_fingerprint"] == artifact.source_fingerprint()
    assert meta["sidecar_version"] == artifact.SIDECAR_VERSION
    assert meta["op"] == "publish"
    assert meta["call"] == {
        "target": _abi.TARGETS[config.epilogue], "tp": config.tp, "hidden": config.hidden, "top_k": config.top_k,
        "max_m": 2**31 - 1, "pdl": config.enable_pdl, "operands": _abi.call_operands(config),
    }
    assert f".target {config.arch}" in built.ptx

    kernels = meta["kernels"]
    assert [k["role"] for k in kernels] == expected_roles(config)
    entries = compile.ptx_entry_params(built.ptx)
    assert set(entries) == {k["symbol"] for k in kernels}  # no kernel missing, none extra
    assert set(kernel_bodies(built.ptx)) == set(entries)
    rows = "m" if config.algorithm == "oneshot" else "owned"
    geometry = {  # role: (block, smem, ctas_per_row, rows)
        "finalize": (config.threads, 0, config.ctas_per_row, "m"),
        "publish": (config.threads, 0, config.ctas_per_row, "m"),
        "reduce": (config.reduce_threads, 0, config.reduce_ctas_per_row, rows),
        # One CTA per row, and two floats per warp of dynamic shared memory (`RowSums`).
        "reduce_norm": (config.reduce_threads, aligned(2 * config.reduce_threads // 32 * 4), 1, rows),
        "gather": (config.reduce_threads, 0, config.reduce_ctas_per_row, "m"),
        "gather_norm": (config.reduce_threads, 0, 1, "m"),
        # The publish's shape: each thread reduces the fragment it published, its own partials
        # in shared memory.
        "publish_reduce": (config.threads, own_partial_smem(config), config.ctas_per_row, "m"),
        # The publish's shape, with no shared memory: a twoshot keeps no own partial.
        "publish_reduce_gather": (config.threads, 0, config.ctas_per_row, "m"),
        # The publish's shape, a cluster of CTAs per row: two floats per warp, then (with more
        # than one CTA) two per CTA and two mbarriers, each area 16-byte aligned, and the own
        # partials.
        "publish_reduce_norm": (config.threads, fused_norm_smem(config), config.ctas_per_row, "m"),
    }
    # An FP8 out's kernel launches as its bf16 role does.
    geometry.update({fp8: geometry[base] for fp8, base in _abi.FP8_BASES.items()})
    for kernel in kernels:
        role = kernel["role"]
        contract = _abi.ROLES[role]
        assert kernel["symbol"].startswith(f"kernel_cutlass_{role}_jax_moe_publish")
        assert kernel["params"] == list(contract.params)
        assert kernel["param_types"] == entries[kernel["symbol"]] == [_abi.VALUES[p] for p in contract.params]
        launch = (kernel["block"], kernel["smem"], kernel["ctas_per_row"], kernel["rows"])
        assert launch == geometry[role]
        assert kernel["persistent"] is contract.persistent
        assert kernel["waves"] == (config.waves if contract.persistent else 1)
        assert kernel["cluster"] == (config.ctas_per_row if contract.clustered else 1)
        assert kernel["symbol"].encode() in built.cubin

    assert built.cubin.startswith(b"\x7fELF")
    assert int.from_bytes(built.cubin[18:20], "little") == 190  # e_machine: EM_CUDA
    assert artifact.cubin_problem(built.cubin) is None
    assert tuple(meta) == artifact.SIDECAR_FIELDS  # what loading a sidecar requires
    assert all(tuple(kernel) == artifact.KERNEL_FIELDS for kernel in kernels)
    built.check(built.metadata["key"])


def test_ptx_entry_params_parses_every_entry():
    ptx = """
.visible .entry first(
\t.param .u64 first_param_0,
\t.param .u32 first_param_1
)
{ ret; }
.entry second(
\t.param .u32 second_param_0
)
{ ret; }
"""
    assert compile.ptx_entry_params(ptx) == {"first": ["u64", "u32"], "second": ["u32"]}
    assert list(kernel_bodies(ptx)) == ["first", "second"]


def test_sm100a(builds):
    built = builds(SM100_CONFIG)
    assert ".target sm_100a" in built.ptx and ".target sm_90a" not in built.ptx
    assert built.metadata["arch"] == "sm_100a"
    assert built.cubin.startswith(b"\x7fELF")
