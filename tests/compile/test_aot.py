"""Compile tier (CPU, CI): every preset compiles, the PTX says what the kernels promise,
the store finds or builds artifacts in its documented order, and the CLI builds them.

CuTe DSL compiles for sm_90a/sm_100a without a GPU; nothing here launches a kernel.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import importlib.metadata
import os
import re
import shlex
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("cutlass")

from jax_moe_publish import _abi, protocol, tuning  # noqa: E402
from jax_moe_publish.aot import artifact, compile, presets, store  # noqa: E402
from jax_moe_publish.aot.__main__ import PRESETS  # noqa: E402
from jax_moe_publish.aot.__main__ import main as cli_main  # noqa: E402
from jax_moe_publish.aot.compile import compile_config  # noqa: E402  (bound before tests patch it)
from jax_moe_publish.config import KernelConfig  # noqa: E402
from jax_moe_publish.testing import gpu_matrix  # noqa: E402

PRESET_CONFIGS = list(dict.fromkeys(c for build in PRESETS.values() for c in build()))
SM100_CONFIG = tuning.kernel_config(tuning.Problem(2048, 8), tp=2, m=None, algorithm="twoshot", arch="sm_100a")
ALL_CONFIGS = PRESET_CONFIGS + [SM100_CONFIG]
# Small problems for the store tests: each compile takes about 0.1 s.
SMALL = tuning.kernel_config(tuning.Problem(512, 2), tp=2, m=None)
OTHER_SMALL = SMALL.replace(top_k=3)


def expected_roles(config: KernelConfig) -> list[str]:
    return list(_abi.call_roles(config))


def _ids(configs) -> list[str]:
    return [c.key for c in configs]


def _kernel_params(configs, roles=tuple(_abi.ROLES)):
    """(config, role) of every kernel of ``configs`` whose role is in ``roles``."""
    return [
        pytest.param(c, role, id=f"{c.key}-{role}")
        for c in configs
        for role in expected_roles(c)
        if role in roles
    ]


# PTX parsing.

_ENTRY_START = re.compile(r"^[ \t]*(?:\.visible[ \t]+)?\.entry[ \t]+(\w+)", re.M)


def kernel_bodies(ptx: str) -> dict[str, str]:
    """The text of each ``.entry``, by symbol: from its ``.entry`` line to the next one."""
    starts = list(_ENTRY_START.finditer(ptx))
    ends = [match.start() for match in starts[1:]] + [len(ptx)]
    return {match.group(1): ptx[match.start():end] for match, end in zip(starts, ends)}


def kernels_by_role(built: artifact.KernelArtifact) -> dict[str, str]:
    bodies = kernel_bodies(built.ptx)
    return {kernel["role"]: bodies[kernel["symbol"]] for kernel in built.metadata["kernels"]}


def opcodes(body: str, prefix: str) -> list[str]:
    """Full opcodes (``ld.global.nc.v4.u32``) of the instructions that start with ``prefix``,
    predicated or not, in text order."""
    return re.findall(rf"^[ \t]*(?:@!?%?\w+[ \t]+)?({re.escape(prefix)}[\w.:]*)", body, re.M)


def first(body: str, text: str) -> int:
    """Offset of the first occurrence of ``text`` (len(body) when absent)."""
    index = body.find(text)
    return len(body) if index < 0 else index


def publish_load(config: KernelConfig) -> str:
    """The vector load of routed and shared rows: 8 bf16 → 16 bytes (v4), 4 bf16 → 8 bytes (v2)."""
    vector = {8: "v4", 4: "v2"}[config.elements_per_thread]
    return f"ld.global.nc.L1::no_allocate.{vector}.u32"


# Metadata of every compiled config.


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_metadata(builds, config):
    built = builds(config)
    meta = built.metadata
    assert meta["key"] == config.key
    assert KernelConfig.from_dict(meta["config"]) == config
    assert meta["arch"] == config.arch
    assert meta["dsl_version"] == importlib.metadata.version("nvidia-cutlass-dsl")
    assert meta["source_fingerprint"] == artifact.source_fingerprint()
    assert meta["sidecar_version"] == artifact.SIDECAR_VERSION
    assert meta["call"] == {
        "tp": config.tp, "hidden": config.hidden, "top_k": config.top_k,
        "weights": "f32" if config.fp32_weights else "bf16", "shared_expert": config.include_shared_expert,
        "out_rows": "owned" if config.algorithm == "reduce_scatter" else "m", "pdl": config.enable_pdl,
    }
    assert f".target {config.arch}" in built.ptx

    kernels = meta["kernels"]
    assert [k["role"] for k in kernels] == expected_roles(config)
    entries = compile.ptx_entry_params(built.ptx)
    assert set(entries) == {k["symbol"] for k in kernels}  # no kernel missing, none extra
    assert set(kernel_bodies(built.ptx)) == set(entries)
    rows = "m" if config.algorithm == "oneshot" else "owned"
    geometry = {  # role: (block, smem, ctas_per_row, rows)
        "finalize": (config.threads, 0, config.ctas_per_token, "m"),
        "publish": (config.threads, 0, config.ctas_per_token, "m"),
        "reduce": (config.reduce_threads, 0, config.reduce_ctas_per_token, rows),
        # One CTA per row, and two floats per warp of dynamic shared memory (`RowSums`).
        "reduce_norm": (config.reduce_threads, aligned(2 * config.reduce_threads // 32 * 4), 1, rows),
        "gather": (config.reduce_threads, 0, config.reduce_ctas_per_token, "m"),
        "gather_norm": (config.reduce_threads, 0, 1, "m"),
        # The publish's shape: each thread reduces the fragment it published, its own partials
        # in shared memory.
        "publish_reduce": (config.threads, own_partial_smem(config), config.ctas_per_token, "m"),
        # The publish's shape, with no shared memory: a twoshot keeps no own partial.
        "publish_reduce_gather": (config.threads, 0, config.ctas_per_token, "m"),
        # The publish's shape, a cluster of CTAs per row: two floats per warp, then (with more
        # than one CTA) two per CTA and two mbarriers, each area 16-byte aligned, and the own
        # partials.
        "publish_reduce_norm": (config.threads, fused_norm_smem(config), config.ctas_per_token, "m"),
    }
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
        assert kernel["cluster"] == (config.ctas_per_token if contract.cluster else 1)
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


# What the PTX of each kernel must (not) contain.


def publish_role(config) -> str:
    """The kernel that finalizes: the publish, or the fused kernel."""
    return expected_roles(config)[0]


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_publish_loads(builds, config):
    body = kernels_by_role(builds(config))[publish_role(config)]
    load = publish_load(config)
    # One vector load per routed row and one for the shared row, all of the configured width.
    vector_loads = [op for op in opcodes(body, "ld.global") if re.search(r"\.v\d", op)]
    # (The fused epilogue also reads the residual and norm_weight fragments.)
    row_inputs = 2 if config.fuse_reduce and config.epilogue != "none" else 0
    # A persistent (fused) kernel finalizes in two places: its first tile, then a loop over the others.
    finalizes = 2 if config.fuse_reduce else 1
    assert vector_loads == [load] * ((config.top_k + config.include_shared_expert) * finalizes + row_inputs)
    if config.enable_pdl:
        # Routed rows are the preceding kernel's output: read only after griddepcontrol.wait.
        before_wait = body[:body.index("griddepcontrol.wait")]
        assert before_wait.count(load) == (1 if config.load_shared_expert_before_pdl else 0)
    if not config.fuse_reduce:
        assert not opcodes(body, "trap") and "%globaltimer" not in body  # the publish never waits


# The fused kernels' stores are counted by test_fused_ptx and test_reduce_norm_ptx.
UNFUSED_CONFIGS = [c for c in ALL_CONFIGS if not c.fuse_reduce]


@pytest.mark.parametrize("config", UNFUSED_CONFIGS, ids=_ids(UNFUSED_CONFIGS))
def test_publish_fan_out(builds, config):
    """Oneshot stores to all tp peers, the owner algorithms to the owner, direct to the output."""
    body = kernels_by_role(builds(config))[publish_role(config)]
    stores = config.tp if config.algorithm == "oneshot" else 1
    vector = {8: "v4", 4: "v2"}[config.elements_per_thread]
    assert opcodes(body, "st.global") == [f"st.global.{vector}.u32"] * stores
    assert "multimem" not in body
    # A group's publish reads one peer-table entry per store; direct reads none.
    assert len(opcodes(body, "ld.global.nc.u64")) == (0 if config.algorithm == "direct" else stores)


@pytest.mark.parametrize("config, role", _kernel_params(ALL_CONFIGS, ("reduce", "reduce_norm", "gather")))
def test_reduce_ptx(builds, config, role):
    body = kernels_by_role(builds(config))[role]
    # Every mailbox read is a 16-byte volatile poll: a cached load could spin forever.
    # (reduce_norm's other vector loads, of its inputs, are checked below.)
    vector_loads = [op for op in opcodes(body, "ld.") if re.search(r"\.v\d", op)
                    and not op.startswith(("ld.global.nc", "ld.shared"))]
    assert vector_loads and set(vector_loads) == {"ld.volatile.global.v4.u32"}
    # A timed-out wait and a call on a closed mailbox abort (unless the mailbox flags instead),
    # in each of reduce_norm's unrolled fragments ...
    fragments = config.norm_fragments_per_thread if role == "reduce_norm" else 1
    assert opcodes(body, "trap") == ["trap", "trap"] * fragments
    assert "%globaltimer" in body  # ... after timeout_ns on the global timer
    assert "multimem" not in body


FUSED_CONFIGS = [c for c in ALL_CONFIGS if c.fuse_reduce and c.epilogue == "none" and c.algorithm == "oneshot"]
TWOSHOT_EPILOGUE_CONFIGS = [c for c in ALL_CONFIGS if c.algorithm == "twoshot" and c.epilogue != "none"]


@pytest.mark.parametrize("config", TWOSHOT_EPILOGUE_CONFIGS, ids=_ids(TWOSHOT_EPILOGUE_CONFIGS))
def test_gather_norm_ptx(builds, config):
    """Per fragment: both gather slots polled together (once, then in the loop), both outputs
    written and both slots re-armed, NaN in both on a halted mailbox; no reduction."""
    body = kernels_by_role(builds(config))["gather_norm"]
    per_thread = config.norm_fragments_per_thread
    assert opcodes(body, "ld.volatile.global.v4.u32") == ["ld.volatile.global.v4.u32"] * (4 * per_thread)
    assert opcodes(body, "st.global") == ["st.global.v4.u32"] * (6 * per_thread)
    assert not opcodes(body, "ld.global.nc") and not opcodes(body, "shfl.sync.bfly.b32")
    assert opcodes(body, "trap") == ["trap", "trap"] * per_thread
FUSED_TWOSHOT_CONFIGS = [c for c in ALL_CONFIGS if c.fuse_reduce and c.algorithm == "twoshot"]


@pytest.mark.parametrize("config", FUSED_TWOSHOT_CONFIGS, ids=_ids(FUSED_TWOSHOT_CONFIGS))
def test_fused_twoshot_ptx(builds, config):
    """Publish to the owner, then the owner's reduce and fan-out, then the gather, in one
    persistent kernel; every poll after every publish."""
    body = kernels_by_role(builds(config))["publish_reduce_gather"]
    vector = {8: "v4", 4: "v2"}[config.elements_per_thread]
    # The owner's mailbox, where the first tile and the loop publish; every peer's, for the fan-out.
    assert len(opcodes(body, "ld.global.nc.u64")) == 2 + config.tp - 1
    # Two publishes, the owned row and tp - 1 fan-out stores, tp re-arms, the gathered row and
    # its re-arm, and NaN on a halted mailbox.
    stores = 2 + 1 + (config.tp - 1) + config.tp + 2 + 1
    assert opcodes(body, "st.global") == [f"st.global.{vector}.u32"] * stores
    polls = [op for op in opcodes(body, "ld.volatile") if re.search(r"\.v\d", op)]
    # The owner polls every rank's slot, the gather the owner's gather slot: once, then in a loop.
    assert polls == [f"ld.volatile.global.{vector}.u32"] * (2 * config.tp + 2)
    publishes_end = [m.start() for m in re.finditer(r"ld\.global\.nc\.u64", body)][1]
    assert publishes_end < body.index("ld.volatile.global.v")
    arrivals = [match.start() for match in re.finditer(r"atom\.global\.add", body)]
    assert len(arrivals) == 2 and publishes_end < arrivals[1] < body.index("ld.volatile.global.v")
    # A call on a closed mailbox, and a timed-out wait of the reduce and of the gather, trap.
    assert opcodes(body, "trap") == ["trap"] * 3 and "%globaltimer" in body
    assert not opcodes(body, "st.shared") and not opcodes(body, "ld.shared")


@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=_ids(FUSED_CONFIGS))
def test_fused_ptx(builds, config):
    """The publish's stores, then the reduce's polls, sum and re-arm, in one persistent kernel."""
    body = kernels_by_role(builds(config))["publish_reduce"]
    keep = int(config.keep_own_partial)
    # The peer table, read where the first tile and the loop over the others publish (the
    # first tile's own partial, when kept, never goes to the mailbox).
    assert len(opcodes(body, "ld.global.nc.u64")) == 2 * config.tp - keep
    vector = {8: "v4", 4: "v2"}[config.elements_per_thread]
    # 2 x tp publish stores, tp re-arms, the output, and NaN on a halted mailbox.
    assert opcodes(body, "st.global") == [f"st.global.{vector}.u32"] * (3 * config.tp + 2 - keep)
    assert_own_partial(body, config, polls=2 * config.tp, rearms=config.tp)
    # Each thread polls the fragment it published, at its width, after all of its publishes.
    polls = [op for op in opcodes(body, "ld.volatile") if re.search(r"\.v\d", op)]
    assert polls and set(polls) == {f"ld.volatile.global.{vector}.u32"}
    assert body.rindex("ld.global.nc.u64") < body.index("ld.volatile.global.v")
    # The CTA arrives in the stage's count between its publishes and its first poll (and on a
    # halted mailbox at once); the call is counted with red.inc, which waits for no result and
    # wraps at a multiple of the stages.
    arrivals = [match.start() for match in re.finditer(r"atom\.global\.add", body)]
    assert len(arrivals) == 2
    assert body.rindex("ld.global.nc.u64") < arrivals[1] < body.index("ld.volatile.global.v")
    assert opcodes(body, "red.global") == ["red.global.inc.u32"]
    assert str(protocol.CALL_COUNT_PERIOD - 1) in body
    assert "%nctaid.x" in body  # the grid's size: the stride of the tile loops
    assert opcodes(body, "trap") == ["trap", "trap"] and "%globaltimer" in body
    assert "multimem" not in body


def assert_own_partial(body: str, config: KernelConfig, *, polls: int, rearms: int, other_shared_stores: int = 0
                       ) -> None:
    """A kept own partial goes to shared memory where the first tile and the loop over the
    others publish, and comes back once for the wait; the loop's own-slot store, the polls
    and the re-arms are predicated on the tile not being kept."""
    words = config.elements_per_thread // 2
    predicated = re.findall(r"^[ \t]*@p[ \t]+((?:st\.global|ld\.volatile\.global)\.v\d)", body, re.M)
    if config.keep_own_partial:
        assert opcodes(body, "st.shared.b32") == ["st.shared.b32"] * (2 * words + other_shared_stores)
        assert len(opcodes(body, "ld.shared.b32")) >= words
        vector = {8: "v4", 4: "v2"}[config.elements_per_thread]
        assert sorted(predicated) == sorted([f"st.global.{vector}"] * (1 + rearms)
                                            + [f"ld.volatile.global.{vector}"] * polls)
    else:
        assert predicated == []


EPILOGUE_CONFIGS = [c for c in ALL_CONFIGS if c.epilogue != "none"]


def own_partial_smem(config) -> int:
    """16 KiB of whole tiles (a tile: one fragment per thread), at least one; 0 without."""
    tile = config.threads * config.elements_per_thread * 2
    return max(1, 16384 // tile) * tile if config.keep_own_partial else 0


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the 16-byte alignment of each shared-memory area."""
    return -(-nbytes // 16) * 16


def fused_norm_smem(config) -> int:
    cluster = config.ctas_per_token
    return (aligned(2 * config.threads // 32 * 4) + (aligned(2 * cluster * 4) + 16 if cluster > 1 else 0)
            + own_partial_smem(config))


@pytest.mark.parametrize("config", EPILOGUE_CONFIGS, ids=_ids(EPILOGUE_CONFIGS))
def test_reduce_norm_ptx(builds, config):
    built = builds(config)
    role = next(role for role in expected_roles(config) if role in ("reduce_norm", "publish_reduce_norm"))
    body = kernels_by_role(built)[role]
    per_thread = 1 if config.fuse_reduce else config.norm_fragments_per_thread
    # Fused, each thread's one fragment has the publish's width; unfused, 16 bytes.
    vector = {8: "v4", 4: "v2"}[config.elements_per_thread] if config.fuse_reduce else "v4"
    if config.fuse_reduce:
        # residual, norm_weight, the routed rows and the shared row: all read only after
        # griddepcontrol.wait (the residual may be the previous call's residual_out), and
        # residual and weight before the mailbox polls.
        # (The finalize is traced twice: the first row, then the loop over the others.)
        input_loads = opcodes(body, "ld.global.nc.L1")
        assert input_loads == [publish_load(config)] * (2 + 2 * (config.top_k + config.include_shared_expert))
        if config.enable_pdl:
            assert body.index("griddepcontrol.wait") < body.index("ld.global.nc.L1")
        polls = [op for op in opcodes(body, "ld.volatile") if re.search(r"\.v\d", op)]
        assert polls and set(polls) == {f"ld.volatile.global.{vector}.u32"}
        assert body.rindex("ld.global.nc.u64") < body.index("ld.volatile.global.v")  # publishes first
        # 2 x tp publish stores (less the first row's own partial, when kept), then as below.
        stores = 2 * config.tp - config.keep_own_partial + per_thread * (1 + config.tp + 2)
        # (The other shared store: the warp's sum of squares.)
        assert_own_partial(body, config, polls=2 * config.tp, rearms=config.tp, other_shared_stores=1)
        # A cluster's CTAs exchange their sums of squares: one asynchronous remote store per
        # thread that delivers, counted on the receiver's mbarrier, which each CTA waits on;
        # the one cluster barrier makes sure that the CTAs have all started and initialized
        # their two mbarriers (its arrive at the top, its wait after the publishes).
        cluster = config.ctas_per_token
        assert opcodes(body, "st.async") == ["st.async.shared::cluster.mbarrier::complete_tx::bytes.b32"] * (
            cluster > 1)
        assert opcodes(body, "barrier.cluster") == ["barrier.cluster.arrive.relaxed", "barrier.cluster.wait"] * (
            cluster > 1)
        assert len(opcodes(body, "mbarrier.init")) == 2 * (cluster > 1)
        assert opcodes(body, "mbarrier.arrive.expect_tx") == ["mbarrier.arrive.expect_tx.shared.b64"] * (cluster > 1)
        assert opcodes(body, "mbarrier.try_wait.parity") == ["mbarrier.try_wait.parity.shared.b64"] * (cluster > 1)
        assert "st.shared::cluster" not in body
        if cluster > 1:
            assert body.rindex("mbarrier.init") < body.index("fence.mbarrier_init.release.cluster") < body.index(
                "barrier.cluster.arrive.relaxed") < first(body, "griddepcontrol.wait")
            assert body.rindex("ld.global.nc.u64") < first(body, "barrier.cluster.wait")
            assert body.index("barrier.cluster.wait") < body.index("st.async")
    else:
        # residual and norm_weight: one 16-byte load each per fragment, all issued before the
        # stage read and the mailbox polls (they do not depend on the publish).
        input_loads = opcodes(body, "ld.global.nc.L1")
        assert input_loads == ["ld.global.nc.L1::no_allocate.v4.u32"] * (2 * per_thread)
        # Twoshot's owner reads each peer's mailbox base for its fan-out (once, or once per fragment).
        peers = config.tp - 1 if config.algorithm == "twoshot" else 0
        assert peers <= len(opcodes(body, "ld.global.nc.u64")) <= per_thread * peers
        last_input_load = body.rfind("ld.global.nc.L1::no_allocate.v4.u32")
        assert last_input_load < first(body, "ld.volatile")
        # Stores per fragment: NaN into residual_out on a halted mailbox, tp re-arms, residual_out
        # and out (and zeros for rows of no token; twoshot's both outputs to every peer).
        zero_rows = 2 if config.algorithm == "reduce_scatter" else 0
        fan_out = 2 * (config.tp - 1) if config.algorithm == "twoshot" else 0
        stores = per_thread * (1 + config.tp + 2 + zero_rows + fan_out)
    assert opcodes(body, "st.global") == [f"st.global.{vector}.u32"] * stores
    # The row's sum of squares: a butterfly in each warp, then one barrier before the
    # warp sums are read back; then one rsqrt.
    assert opcodes(body, "shfl.sync.bfly.b32") == ["shfl.sync.bfly.b32"] * 5
    barriers = [match.start() for match in re.finditer(r"\bbar\.sync\b", body)]
    if config.fuse_reduce:
        # Fused, the CTA first arrives in the stage's count, after its publishes and before its
        # first poll, with the kernel's only atomic add that waits for its result; the call is
        # counted with red.inc, which does not.
        assert body.rindex("ld.global.nc.u64") < barriers[0] < body.index("atom.global.add") < first(
            body, "ld.volatile.global.v")
        assert opcodes(body, "atom.global.add") == ["atom.global.add.s32"]
        assert opcodes(body, "red.global") == ["red.global.inc.u32"]
        barriers = barriers[1:] + barriers[:1]
    barrier = barriers[0]
    assert "st.shared.b32" in body[:barrier] and "ld.shared" in body[barrier:]
    # That barrier and the arrival's (fused, above; else finish_call's): the warp sums
    # alternate between two buffers by row, so that a CTA's next row needs no barrier before
    # it writes them.
    # (A twoshot reduce_norm does not end the call: no arrival.)
    assert len(barriers) == (1 if config.algorithm == "twoshot" else 2)
    assert opcodes(body, "rsqrt.approx.f32") == ["rsqrt.approx.f32"]
    # Shared memory is the dynamic kind, and what the kernel touches fits the launch's.
    assert "__dynamic_shmem__" in body and not re.search(r"^\s*\.shared\b", built.ptx, re.M)
    smem = next(k["smem"] for k in built.metadata["kernels"] if k["role"] == role)
    ends = [int(offset or 0) + {"": 4, "v2.": 8, "v4.": 16}[vector]
            for vector, offset in re.findall(r"ld\.shared\.(v\d\.|)b32\s[^\[]*\[%r\d+(?:\+(\d+))?\]", body)]
    assert ends and max(ends) <= smem


@pytest.mark.parametrize("config, role", _kernel_params(ALL_CONFIGS))
def test_pdl_instructions(builds, config, role):
    """griddepcontrol.wait and .launch_dependents are in every kernel exactly when PDL is on."""
    body = kernels_by_role(builds(config))[role]
    expected = 1 if config.enable_pdl else 0
    assert len(opcodes(body, "griddepcontrol.wait")) == expected
    assert len(opcodes(body, "griddepcontrol.launch_dependents")) == expected
    if not config.enable_pdl:
        return
    wait = body.index("griddepcontrol.wait")
    release = body.index("griddepcontrol.launch_dependents")
    if role in ("finalize", "publish", "publish_reduce", "publish_reduce_gather", "publish_reduce_norm"):
        # The stage and the inputs are read only after the predecessor has finished; the
        # reduce (or, fused, the next call) is released then, before the first store.
        assert wait < release < first(body, "st.global")
        if role != "finalize":
            assert first(body, "ld.volatile") > wait
        if role not in ("finalize", "publish"):
            assert wait < body.index("atom.global.add") < body.rfind("st.volatile.global.s32")
    else:
        # A reduce reads the stage before it releases the next kernel (which may advance
        # it), and ends the call only after its predecessor, the publish, has finished.
        assert first(body, "ld.volatile") < release
        if "atom.global.add" in body:
            assert wait < body.index("atom.global.add") < body.rfind("st.volatile.global.s32")


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=_ids(ALL_CONFIGS))
def test_no_local_memory(builds, config):
    """Register arrays stay in registers: no stack frame, no local loads or stores."""
    ptx = builds(config).ptx
    assert not re.search(r"\.local\b", ptx)
    assert "__local_depot" not in ptx


def test_sm100a(builds):
    built = builds(SM100_CONFIG)
    assert ".target sm_100a" in built.ptx and ".target sm_90a" not in built.ptx
    assert built.metadata["arch"] == "sm_100a"
    assert built.cubin.startswith(b"\x7fELF")


# The store: memory, prebuilt folders, the disk cache, then CuTe DSL.


def run_python(args, cwd) -> subprocess.CompletedProcess:
    """A child Python that imports the same jax_moe_publish as this test."""
    env = dict(os.environ)
    package_root = str(artifact.PACKAGE_DIR.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def compile_calls(monkeypatch) -> list:
    """Records the configs that the store compiles (it imports compile_config at call time)."""
    calls = []

    def recording(config):
        calls.append(config)
        return compile_config(config)

    monkeypatch.setattr(compile, "compile_config", recording)
    return calls


def new_store(tmp_path, prebuilt_dirs=()) -> store.KernelStore:
    return store.KernelStore(cache_dir=tmp_path / "cache", prebuilt_dirs=list(prebuilt_dirs))


def test_store_memory_disk_and_compile(tmp_path, compile_calls):
    first_store = new_store(tmp_path)
    built = first_store.get(SMALL)
    assert first_store.stats == store.StoreStats(compiles=1)
    assert first_store.get(SMALL) is built
    assert first_store.stats == store.StoreStats(compiles=1, memory_hits=1)
    # The cache is keyed by the build fingerprint, then the config key.
    assert (first_store.cache_dir / f"{SMALL.key}.cubin").read_bytes() == built.cubin
    assert first_store.cache_dir == tmp_path / "cache" / artifact.build_fingerprint()

    second_store = new_store(tmp_path)  # a new process, in effect
    assert second_store.get(SMALL).metadata == built.metadata
    assert second_store.stats == store.StoreStats(disk_hits=1)

    second_store.get(OTHER_SMALL)
    assert second_store.stats == store.StoreStats(disk_hits=1, compiles=1)
    assert compile_calls == [SMALL, OTHER_SMALL]


def test_store_uses_prebuilt_folder(tmp_path, builds, compile_calls):
    builds(SMALL).save(tmp_path / "prebuilt")
    kernels = new_store(tmp_path, [tmp_path / "empty", tmp_path / "prebuilt"])
    assert kernels.get(SMALL).cubin == builds(SMALL).cubin
    assert kernels.stats == store.StoreStats(prebuilt_hits=1)
    assert compile_calls == []
    assert not kernels.cache_dir.exists()  # a prebuilt hit is not copied into the cache


def _save_stale(built, folder):
    stale = dataclasses.replace(built, metadata={**built.metadata, "source_fingerprint": "0" * 16})
    stale.save(folder)


def test_store_without_dsl_rejects_stale_prebuilt(tmp_path, builds, compile_calls, monkeypatch):
    _save_stale(builds(SMALL), tmp_path / "prebuilt")
    monkeypatch.setattr(store, "dsl_available", lambda: False)
    with pytest.raises(store.MissingKernelError, match="rebuild") as error:
        new_store(tmp_path, [tmp_path / "prebuilt"]).get(SMALL)
    assert store.build_command(SMALL, str(tmp_path / "prebuilt")) in str(error.value)
    assert compile_calls == []


def test_store_with_dsl_recompiles_over_stale_prebuilt(tmp_path, builds, compile_calls):
    _save_stale(builds(SMALL), tmp_path / "prebuilt")
    kernels = new_store(tmp_path, [tmp_path / "prebuilt"])
    assert kernels.get(SMALL).is_current
    assert kernels.stats == store.StoreStats(compiles=1)


def test_a_dsl_upgrade_reuses_no_cached_or_prebuilt_kernel(tmp_path, builds, compile_calls, monkeypatch):
    builds(SMALL).save(tmp_path / "prebuilt")
    old_cache = new_store(tmp_path).cache_dir
    new_store(tmp_path).get(OTHER_SMALL)  # into the cache of this DSL version
    monkeypatch.setattr(artifact, "dsl_version", lambda: "99.0")
    assert not artifact.KernelArtifact.load(tmp_path / "prebuilt", SMALL.key).is_current
    upgraded = new_store(tmp_path, [tmp_path / "prebuilt"])
    assert upgraded.cache_dir != old_cache
    upgraded.get(SMALL)
    upgraded.get(OTHER_SMALL)
    assert upgraded.stats == store.StoreStats(compiles=2)
    assert compile_calls == [OTHER_SMALL, SMALL, OTHER_SMALL]


def test_a_sidecar_of_another_version_is_stale_and_refused(tmp_path, builds):
    old = dataclasses.replace(builds(SMALL), metadata={**builds(SMALL).metadata, "sidecar_version": 1})
    assert not old.is_current
    with pytest.raises(RuntimeError, match="sidecar version 1, expected 2: rebuild it"):
        old.check(SMALL.key)


def test_store_without_dsl_names_the_build_command(tmp_path, monkeypatch, compile_calls):
    monkeypatch.setattr(store, "dsl_available", lambda: False)
    with pytest.raises(store.MissingKernelError) as error:
        new_store(tmp_path).get(SMALL)
    message = str(error.value)
    assert "python -m jax_moe_publish.aot build" in message
    assert store.KERNEL_DIR_ENV in message
    for name, value in SMALL.to_dict().items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        assert f"--{name.replace('_', '-')} {text}" in message, name
    assert compile_calls == []


def test_check_rejects_wrong_params(tmp_path, builds):
    wrong = copy.deepcopy(builds(SMALL).metadata)
    wrong["kernels"][-1]["params"] = wrong["kernels"][-1]["params"][:-1]
    artifact.KernelArtifact(builds(SMALL).cubin, builds(SMALL).ptx, wrong).save(tmp_path / "prebuilt")
    loaded = artifact.KernelArtifact.load(tmp_path / "prebuilt", SMALL.key)
    symbol = wrong["kernels"][-1]["symbol"]
    with pytest.raises(RuntimeError, match=re.escape(symbol)):
        loaded.check(SMALL.key)
    kernels = new_store(tmp_path, [tmp_path / "prebuilt"])
    with pytest.raises(RuntimeError, match="expected"):
        kernels.get(SMALL)
    with pytest.raises(RuntimeError):  # not remembered as good
        kernels.get(SMALL)


def test_store_reads_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(store.CACHE_DIR_ENV, str(tmp_path / "cache"))
    folders = [str(tmp_path / "a"), "", str(tmp_path / "b")]  # empty entries are skipped
    monkeypatch.setenv(store.KERNEL_DIR_ENV, os.pathsep.join(folders))
    kernels = store.KernelStore()
    assert kernels.cache_dir == tmp_path / "cache" / artifact.build_fingerprint()
    assert kernels.prebuilt_dirs == [tmp_path / "a", tmp_path / "b"]


@pytest.mark.parametrize("shared_store", [True, False], ids=["one-store", "two-stores"])
def test_concurrent_gets_compile_once(tmp_path, monkeypatch, shared_store):
    """Threads of one store share its lock; two stores on one cache share the file lock."""
    calls = []

    def slow(config):  # widen the window in which a second compile could start
        calls.append(config)
        time.sleep(0.3)
        return compile_config(config)

    monkeypatch.setattr(compile, "compile_config", slow)
    stores = [new_store(tmp_path)] * 2 if shared_store else [new_store(tmp_path), new_store(tmp_path)]
    barrier = threading.Barrier(len(stores))

    def get(kernels):
        barrier.wait()
        return kernels.get(SMALL)

    with concurrent.futures.ThreadPoolExecutor(len(stores)) as pool:
        results = list(pool.map(get, stores))
    assert calls == [SMALL]
    assert results[0].metadata == results[1].metadata
    totals = collections.Counter()
    for kernels in {id(s): s for s in stores}.values():
        totals.update(dataclasses.asdict(kernels.stats))
    assert totals["compiles"] == 1
    assert totals["memory_hits"] + totals["disk_hits"] == 1


# Two stores (two cache folders) compile different configs in two threads.
_RACE = """
import concurrent.futures, sys, threading
from jax_moe_publish import tuning
from jax_moe_publish.aot.store import KernelStore

configs = [tuning.kernel_config(tuning.Problem(512, k), tp=2, m=None) for k in (2, 3)]
stores = [KernelStore(cache_dir=f"{sys.argv[1]}/{k}", prebuilt_dirs=[]) for k in (2, 3)]
barrier = threading.Barrier(2)

def get(kernels, config):
    barrier.wait()
    return kernels.get(config).metadata["key"]

with concurrent.futures.ThreadPoolExecutor(2) as pool:
    assert list(pool.map(get, stores, configs)) == [c.key for c in configs]
"""


def test_concurrent_compiles_of_different_configs(tmp_path):
    # In a child: a failed concurrent compile can leave the DSL unable to compile again.
    result = run_python(["-c", _RACE, str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]


# The CLI.


def run_cli(args, cwd) -> subprocess.CompletedProcess:
    """``python -m jax_moe_publish.aot ARGS`` in ``cwd``."""
    return run_python(["-m", "jax_moe_publish.aot", *args], cwd)


def built_files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def three_files(key: str) -> list[str]:
    return [f"{key}.cubin", f"{key}.json", f"{key}.ptx"]


def test_cli_builds_explicit_config(tmp_path):
    (tmp_path / "cwd").mkdir()
    out = tmp_path / "out"
    result = run_cli(["build", "--hidden", "1024", "--top-k", "4", "--tp", "2", "--algorithm", "twoshot",
                      "--out", str(out)], cwd=tmp_path / "cwd")
    assert result.returncode == 0, result.stderr
    key = tuning.kernel_config(tuning.Problem(1024, 4), tp=2, m=None, algorithm="twoshot").key
    assert built_files(out) == three_files(key)
    lines = result.stdout.splitlines()
    assert re.fullmatch(rf"\[1/1\] {re.escape(key)}\s+\d+\.\d s", lines[0])
    assert lines[-1] == f"built 1 kernel sets into {out}"
    assert built_files(tmp_path / "cwd") == []  # the DSL's dump files go elsewhere
    artifact.KernelArtifact.load(out, key).check(key)


def test_build_command_rebuilds_the_config(tmp_path):
    config = KernelConfig(
        hidden=2880, top_k=10, tp=2, algorithm="reduce_scatter", routed_scaling_factor=0.1,
        fp32_weights=True, elements_per_thread=4, threads=96, prefetch_group=3,
        load_shared_expert_before_pdl=True, reduce_threads=64, arch="sm_100a",
    )
    out = tmp_path / "out"
    command = shlex.split(store.build_command(config, str(out)))
    assert command[:4] == ["python", "-m", "jax_moe_publish.aot", "build"]
    result = run_cli(command[3:], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert built_files(out) == three_files(config.key)
    assert artifact.KernelArtifact.load(out, config.key).metadata["config"] == config.to_dict()


def test_cli_bad_value_exits_nonzero(tmp_path):
    result = run_cli(["build", "--hidden", "1024", "--top-k", "0", "--tp", "2", "--out", str(tmp_path)],
                     cwd=tmp_path)
    assert result.returncode != 0
    assert "KernelConfig.top_k=0" in result.stderr
    assert built_files(tmp_path) == []


EXPLICIT = ["--hidden", "1024", "--top-k", "4", "--tp", "2"]
CLI_ERRORS = [
    (EXPLICIT + ["--prefetch-group", "5"], "KernelConfig.prefetch_group=5"),
    (EXPLICIT + ["--tp", "1", "--algorithm", "oneshot"], "KernelConfig.algorithm='oneshot'"),
    (EXPLICIT + ["--routed-scaling-factor", "nan"], "KernelConfig.routed_scaling_factor=nan"),
    (EXPLICIT + ["--arch", "sm_80"], "KernelConfig.arch='sm_80'"),
    (EXPLICIT + ["--enable-pdl", "maybe"], "--enable-pdl: expected true or false"),
    (EXPLICIT + ["--top-k", "four"], "--top-k: invalid int value"),
    (EXPLICIT[:-1] + ["0"], "--tp 0: expected an int in [1, 8], the size of the TP group"),
    (EXPLICIT[:-1] + ["9"], "--tp 9: expected an int in [1, 8]"),
    (EXPLICIT[:-1] + ["1", "--epilogue", "rmsnorm"], "--epilogue rmsnorm with --tp 1: expected --tp 2 or more"),
    (EXPLICIT + ["--epilogue", "layernorm"], "--epilogue: invalid choice: 'layernorm'"),
    (EXPLICIT + ["--algorithm", "threeshot"], "--algorithm: invalid choice: 'threeshot'"),
    (["--hidden", "1024"], "needs --top-k --tp"),
    (["--preset", "llama"], "--preset: invalid choice"),
    ([], "nothing to build"),
]


@pytest.mark.parametrize("args, message", CLI_ERRORS, ids=[m for _, m in CLI_ERRORS])
def test_cli_errors(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setattr(compile, "compile_config", lambda config: pytest.fail("compiled"))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["build", *args, "--out", str(tmp_path)])
    code = exit_.value.code
    assert code not in (0, None)
    # Config errors exit with the message; argparse prints its own and exits with 2.
    assert message in (code if isinstance(code, str) else capsys.readouterr().err)


@pytest.mark.parametrize("where, message", [
    ("file", "expected a folder, but it is a file"),
    ("file/out", "cannot make or write in this folder (Not a directory)"),
], ids=["a file", "under a file"])
def test_cli_checks_out_before_compiling(tmp_path, monkeypatch, where, message):
    monkeypatch.setattr(compile, "compile_config", lambda config: pytest.fail("compiled"))
    (tmp_path / "file").write_text("")
    out = tmp_path / where
    with pytest.raises(SystemExit) as exit_:
        cli_main(["build", *EXPLICIT, "--out", str(out)])
    assert exit_.value.code == f"--out {out}: {message}" + (
        "; expected a folder that exists or can be made, and that this process can write in" if "/" in where else "")


def test_cli_makes_out_before_the_first_compile(tmp_path, monkeypatch):
    out = tmp_path / "a" / "b"
    made = []

    def fake_compile(config):
        made.append(out.is_dir())
        return artifact.KernelArtifact(b"\x7fELF", "", {"key": config.key})

    monkeypatch.setattr(compile, "compile_config", fake_compile)
    assert cli_main(["build", *EXPLICIT, "--out", str(out)]) == 0
    assert made == [True]


def test_cli_presets(tmp_path, monkeypatch, capsys):
    """--preset is repeatable, takes --arch, and is deduplicated; each build prints its progress."""
    built = []

    def fake_compile(config):
        built.append(config)
        return artifact.KernelArtifact(b"\x7fELF", "", {"key": config.key})

    monkeypatch.setattr(compile, "compile_config", fake_compile)
    assert cli_main(["build", "--preset", "qwen3-moe", "--preset", "tests", "--preset", "qwen3-moe",
                     "--arch", "sm_100a", "--out", str(tmp_path)]) == 0
    expected = list(dict.fromkeys(presets.qwen3_moe("sm_100a") + gpu_matrix.all_configs("sm_100a")))
    assert built == expected
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:-1]] == [
        [f"[{i}/{len(expected)}]", config.key] for i, config in enumerate(expected, 1)
    ]
