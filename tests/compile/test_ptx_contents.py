"""Compile tier (CPU, CI): what the PTX of each kernel must (not) contain: the loads of its
inputs and when they happen, the store pattern of each algorithm, the mailbox polls, trap
counts, barriers, PDL instructions and shared memory within the launch's.

CuTe DSL compiles for sm_90a/sm_100a without a GPU; nothing here launches a kernel.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

from built_configs import ALL_CONFIGS, config_ids, expected_roles  # noqa: E402
from jax_moe_publish import _abi, protocol  # noqa: E402
from jax_moe_publish.config import KernelConfig  # noqa: E402
from ptx import first, kernels_by_role, opcodes  # noqa: E402


def _kernel_params(configs, roles=tuple(_abi.ROLES)):
    """(config, role) of every kernel of ``configs`` whose role is in ``roles``."""
    return [
        pytest.param(c, role, id=f"{c.key}-{role}")
        for c in configs
        for role in expected_roles(c)
        if role in roles
    ]


def publish_load(config: KernelConfig) -> str:
    """The vector load of routed and shared rows: 8 bf16 → 16 bytes (v4), 4 bf16 → 8 bytes (v2)."""
    vector = {8: "v4", 4: "v2"}[config.elements_per_thread]
    return f"ld.global.nc.L1::no_allocate.{vector}.u32"


def publish_role(config) -> str:
    """The kernel that finalizes: the publish, or the fused kernel."""
    return expected_roles(config)[0]


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=config_ids(ALL_CONFIGS))
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


@pytest.mark.parametrize("config", UNFUSED_CONFIGS, ids=config_ids(UNFUSED_CONFIGS))
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
TWOSHOT_EPILOGUE_CONFIGS = [c for c in ALL_CONFIGS
                            if c.algorithm == "twoshot" and c.epilogue != "none" and c.fp8_out == "none"]


@pytest.mark.parametrize("config", TWOSHOT_EPILOGUE_CONFIGS, ids=config_ids(TWOSHOT_EPILOGUE_CONFIGS))
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


@pytest.mark.parametrize("config", FUSED_TWOSHOT_CONFIGS, ids=config_ids(FUSED_TWOSHOT_CONFIGS))
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


@pytest.mark.parametrize("config", FUSED_CONFIGS, ids=config_ids(FUSED_CONFIGS))
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


EPILOGUE_CONFIGS = [c for c in ALL_CONFIGS if c.epilogue != "none" and c.fp8_out == "none"]
FP8_CONFIGS = [c for c in ALL_CONFIGS if c.fp8_out != "none"]


@pytest.mark.parametrize("config", FP8_CONFIGS, ids=config_ids(FP8_CONFIGS))
def test_fp8_ptx(builds, config):
    """The FP8 kernels quantize: e4m3 conversions in each epilogue kernel that writes ``out``;
    with a scale per group, a NaN-propagating maximum and a scale store; one reciprocal per
    fragment (`kernels.fp8_out`), never a division per value."""
    for role, body in kernels_by_role(builds(config)).items():
        if role not in _abi.FP8_BASES:
            continue
        fragments = 1 if config.fuse_reduce else config.norm_fragments_per_thread
        assert opcodes(body, "cvt.rn.satfinite.e4m3x2.f32"), role
        # One per fragment (the compiler may keep two copies of a loop), fewer than its 4 or 8 values.
        assert 0 < len(opcodes(body, "div.rn.f32")) <= 2 * fragments, role
        dynamic = config.fp8_out == "group"
        assert bool(opcodes(body, "max.NaN.f32")) == dynamic, role
        assert bool(opcodes(body, "st.global.f32")) == dynamic, role


@pytest.mark.parametrize("config", EPILOGUE_CONFIGS, ids=config_ids(EPILOGUE_CONFIGS))
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
        cluster = config.ctas_per_row
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
    if _abi.FP8_BASES.get(role, role) in ("finalize", "publish", "publish_reduce", "publish_reduce_gather",
                                           "publish_reduce_norm"):
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


@pytest.mark.parametrize("config", ALL_CONFIGS, ids=config_ids(ALL_CONFIGS))
def test_no_local_memory(builds, config):
    """Register arrays stay in registers: no stack frame, no local loads or stores."""
    ptx = builds(config).ptx
    assert not re.search(r"\.local\b", ptx)
    assert "__local_depot" not in ptx
