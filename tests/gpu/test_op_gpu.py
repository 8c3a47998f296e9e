"""The op through jit + shard_map on NVIDIA GPUs: the FFI call, the Mailbox and the kernels together.

Kernels come from the prebuilt ``tests`` preset (``$JAX_MOE_PUBLISH_KERNEL_DIR``)
or are compiled on demand where CuTe DSL is installed. A test of tp ranks runs on tp GPUs in
one process, or as tp rank processes on fewer GPUs (``rank_processes``, tests/support/rank_runs.py):
inputs are placed and outputs gathered through `rank_processes`, which works either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp
import numerics
from jax_moe_publish import _extension, protocol
from jax_moe_publish import tuning
from jax_moe_publish.config import result_of
from jax_moe_publish.testing import gpu_matrix, rank_processes

pytestmark = pytest.mark.rank_processes
CAPACITY = 64
M_VALUES = (1, 3, 37, CAPACITY)


def _gpus(count):
    return [d for d in jax.devices() if d.platform == "gpu"][:count]


def _mesh(count, reverse=False):
    devices = _gpus(count)
    return jax.sharding.Mesh(np.array(devices[::-1] if reverse else devices), ("tp",))


def _problems(rng, tp, m, config):
    return [
        numerics.random_problem(rng, m=m, hidden=config.hidden, top_k=config.top_k,
                                fp32_weights=config.fp32_weights, shared=config.include_shared_expert)
        for _ in range(tp)
    ]


def _per_rank_outputs(mailbox, problems, scale, config=None, impl="kernel"):
    """Each rank's own output buffer (NumPy), in rank order, from one jitted shard_map call."""
    mesh = mailbox.mesh
    stacks = [np.stack([getattr(p, f) for p in problems]) for f in ("routed", "weights", "indices")]
    shared = None if problems[0].shared is None else np.stack([p.shared for p in problems])
    scatter = mailbox.result == "reduce_scatter"

    def shard(routed, weights, indices, *rest):
        out = jmp.moe_finalize_publish(routed[0], weights[0], indices[0], rest[0][0] if rest else None,
                                       mailbox=mailbox, routed_scaling_factor=scale, config=config,
                                       impl=impl)
        return out[None] if scatter else out

    args = [rank_processes.place(mesh, P("tp"), x) for x in stacks + ([] if shared is None else [shared])]
    step = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P("tp"), out_specs=P("tp") if scatter else P()))
    by_device = rank_processes.gather(step(*args))
    return [by_device[d].reshape(by_device[d].shape[-2:]) for d in mesh.devices.flat]


def _check(outputs, problems, scale, result):
    expected, bound = numerics.expected_sum(problems, scale)
    tp = len(problems)
    for rank, out in enumerate(outputs):
        if result == "reduce_scatter":
            numerics.assert_close(out, numerics.owned(expected, tp, rank),
                                  numerics.owned(bound, tp, rank), what=f"rank {rank}")
        else:
            numerics.assert_close(out, expected, bound, what=f"rank {rank}")
    if result != "reduce_scatter":
        for rank, out in enumerate(outputs[1:], 1):
            assert np.array_equal(out.view(np.uint16), outputs[0].view(np.uint16)), f"rank {rank} differs"


def _on_gpus(configs):
    """Each config as a parameter that needs its tp GPUs."""
    return [pytest.param(c, marks=pytest.mark.gpus(c.tp), id=c.key) for c in configs]


@pytest.mark.parametrize("config", _on_gpus(c for tp in gpu_matrix.GROUP_TPS for c in gpu_matrix.variants(tp)))
def test_group_variants_match_float64(config, rng):
    mesh = _mesh(config.tp)
    with jmp.Mailbox(mesh, "tp", hidden=config.hidden, capacity_m=CAPACITY, result=result_of(config.algorithm)) as mb:
        for m in M_VALUES:
            problems = _problems(rng, config.tp, m, config)
            outputs = _per_rank_outputs(mb, problems, config.routed_scaling_factor, config=config)
            _check(outputs, problems, config.routed_scaling_factor, mb.result)
        mb.check()


@pytest.mark.gpus(1)
@pytest.mark.parametrize("config", gpu_matrix.variants(1), ids=lambda c: c.key)
def test_direct_variants_match_float64_on_one_gpu(config, rng):
    with jmp.Mailbox(_mesh(1), "tp", hidden=config.hidden, capacity_m=CAPACITY) as mb:
        for m in M_VALUES:
            problems = _problems(rng, 1, m, config)
            outputs = _per_rank_outputs(mb, problems, config.routed_scaling_factor, config=config)
            _check(outputs, problems, config.routed_scaling_factor, mb.result)


@pytest.mark.parametrize("tp", [pytest.param(tp, marks=pytest.mark.gpus(tp)) for tp in gpu_matrix.GROUP_TPS])
@pytest.mark.parametrize("result", tuning.RESULTS)
@pytest.mark.parametrize("problem", gpu_matrix.DEFAULT_PROBLEMS, ids=lambda p: f"h{p.hidden}-k{p.top_k}")
def test_table_configs_both_results_and_reversed_mesh(problem, result, tp, rng):
    scale = problem.routed_scaling_factor
    config = tuning.kernel_config(problem, tp=tp, m=None, result=result)
    for reverse in (False, True):
        with jmp.Mailbox(_mesh(tp, reverse), "tp", hidden=config.hidden, capacity_m=CAPACITY, result=result) as mb:
            for m in (1, 37):
                problems = _problems(rng, tp, m, config)
                outputs = _per_rank_outputs(mb, problems, scale)
                _check(outputs, problems, scale, result)


def _chain(mailbox, layers, scale, impl="auto"):
    """``layers`` calls in one jit; each layer's output is the next layer's shared input.

    Every input is per rank, ``[tp, ...]`` laid out along ``tp``, and so is the result:
    ``[tp, layers, m, hidden]``, each rank's own outputs."""

    def shard(routed, weights, indices, shared):
        outputs = []
        y = shared[0]
        for layer in range(layers):
            y = jmp.moe_finalize_publish(routed[0, layer], weights[0, layer], indices[0, layer], y,
                                         mailbox=mailbox, routed_scaling_factor=scale, impl=impl)
            outputs.append(y)
        return jnp.stack(outputs)[None]

    # Each rank's own output buffers, so that every rank's result is checked, not one copy.
    return jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))


def _chain_inputs(rng, tp, layers, m, hidden, top_k):
    """Fresh inputs of every layer for every rank, different on each: routed [tp, layers, rows,
    hidden], weights and indices [tp, layers, m, top_k], the first layer's shared [tp, m, hidden]."""
    num_rows = m * top_k
    routed = rng.standard_normal((tp, layers, num_rows, hidden), dtype=np.float32).astype(numerics.BF16)
    weights = rng.uniform(0.05, 0.3, (tp, layers, m, top_k)).astype(np.float32)
    indices = rng.integers(-1, num_rows, (tp, layers, m, top_k)).astype(np.int32)
    shared = rng.standard_normal((tp, m, hidden), dtype=np.float32).astype(numerics.BF16)
    return routed, weights, indices, shared


def _run_chain(chain, mailbox, inputs):
    """The chain on ``inputs`` placed rank by rank; each rank's outputs as NumPy [tp, layers, m, hidden]."""
    return rank_processes.to_host(chain(*(rank_processes.place(mailbox.mesh, P("tp"), x) for x in inputs)))


def _check_chain(out, inputs, scale):
    """Every rank's outputs of a chain: layer l sums the ranks' own partials, each over the
    same shared input (the first layer: each rank's own; then the layer before's sum), and
    every rank holds the same bits."""
    routed, weights, indices, shared = inputs
    tp = len(routed)
    for rank in range(1, tp):
        assert np.array_equal(out[rank].view(np.uint16), out[0].view(np.uint16)), f"rank {rank} differs from rank 0"
    for layer in range(out.shape[1]):
        problems = [numerics.RankInputs(routed[r, layer], weights[r, layer], indices[r, layer],
                                     shared[r] if layer == 0 else out[0, layer - 1]) for r in range(tp)]
        expected, bound = numerics.expected_sum(problems, scale)
        numerics.assert_close(out[0, layer], expected, bound, what=f"layer {layer}")


@pytest.mark.gpus(2)
def test_chained_calls_with_varying_m_rotate_the_stages(rng):
    """500 calls through XLA, in chains of 10, with a random m per chain and fresh data."""
    hidden, top_k, scale, layers = 7168, 8, 2.5, 10
    mesh = _mesh(2)
    with jmp.Mailbox(mesh, "tp", hidden=hidden, capacity_m=CAPACITY) as mb:
        chains = {}
        calls = 0
        while calls < 500:
            m = int(rng.choice([1, 5, 17, CAPACITY]))
            if m not in chains:
                chains[m] = _chain(mb, layers, scale)
            inputs = _chain_inputs(rng, mb.tp, layers, m, hidden, top_k)
            _check_chain(_run_chain(chains[m], mb, inputs), inputs, scale)
            calls += layers
        mb.check()
        assert calls == 500


@pytest.mark.gpus(2)
def test_command_buffer_chain_of_32_layers(rng):
    """Under XLA's default command-buffer settings the custom call is captured and stays right."""
    hidden, top_k, scale, layers, m = 7168, 8, 2.5, 32, 8
    captured_before, _ = _extension.execute_counts()
    with jmp.Mailbox(_mesh(2), "tp", hidden=hidden, capacity_m=CAPACITY) as mb:
        chain = _chain(mb, layers, scale)
        for _ in range(4):  # the first runs record the graph, later ones replay it
            inputs = _chain_inputs(rng, mb.tp, layers, m, hidden, top_k)
            _check_chain(_run_chain(chain, mb, inputs), inputs, scale)
        mb.check()
    captured, _ = _extension.execute_counts()
    assert captured > captured_before, "XLA never launched the op inside a CUDA graph capture"


@pytest.mark.gpus(1)
def test_auto_takes_xla_where_the_table_says(rng):
    """tp = 1, a shared expert: at m = 1 the table chooses XLA's fused path, which launches no
    kernel of ours; at m = 2 the direct kernel. Both match the model."""
    config = tuning.kernel_config(gpu_matrix.DEFAULT_PROBLEMS[0], tp=1, m=None)
    with jmp.Mailbox(_mesh(1), "tp", hidden=config.hidden, capacity_m=CAPACITY) as mb:
        for m, launches in ((1, 0), (2, 1)):
            assert (tuning.algorithm_for(gpu_matrix.DEFAULT_PROBLEMS[0], 1, m, "allreduce").algorithm == "xla") == (
                launches == 0)
            problems = _problems(rng, 1, m, config)
            before = sum(_extension.execute_counts())
            outputs = _per_rank_outputs(mb, problems, config.routed_scaling_factor, impl="auto")
            assert sum(_extension.execute_counts()) - before == launches, m
            _check(outputs, problems, config.routed_scaling_factor, mb.result)


@pytest.mark.gpus(1)
def test_single_gpu_direct_path_has_no_mailbox_memory(rng):
    config = tuning.kernel_config(gpu_matrix.DEFAULT_PROBLEMS[0], tp=1, m=None)
    with jmp.Mailbox(_mesh(1), "tp", hidden=config.hidden, capacity_m=CAPACITY) as mb:
        assert mb.status() == []
        problems = _problems(rng, 1, 37, config)
        outputs = _per_rank_outputs(mb, problems, config.routed_scaling_factor)
        _check(outputs, problems, config.routed_scaling_factor, mb.result)


@pytest.mark.gpus(2)
def test_call_after_close_is_an_error_not_a_crash(rng):
    config = tuning.kernel_config(gpu_matrix.DEFAULT_PROBLEMS[0], tp=2, m=None)
    mb = jmp.Mailbox(_mesh(2), "tp", hidden=config.hidden, capacity_m=CAPACITY)
    problems = _problems(rng, 2, 3, config)
    _per_rank_outputs(mb, problems, config.routed_scaling_factor)
    mb.close()
    with pytest.raises(ValueError, match="is closed"):
        _per_rank_outputs(mb, problems, config.routed_scaling_factor)


def _fused_config():
    return next(c for c in gpu_matrix.variants(2) if c.fuse_reduce and c.hidden == 7168)


@pytest.mark.gpus(2)
def test_fused_call_larger_than_the_resident_grid(rng):
    """A fused call whose tiles far outnumber the CTAs the GPU holds at once (4096 tokens:
    28672 publish CTA positions, against 1320 resident on an H200): the launcher caps the
    persistent grid and every CTA loops; the result is exact, and so is a small call after
    it on the same mailbox."""
    config = _fused_config()
    capacity = 4096
    with jmp.Mailbox(_mesh(2), "tp", hidden=config.hidden, capacity_m=capacity) as mb:
        for m in (capacity, 5):
            problems = _problems(rng, 2, m, config)
            outputs = _per_rank_outputs(mb, problems, config.routed_scaling_factor, config=config)
            _check(outputs, problems, config.routed_scaling_factor, mb.result)
        mb.check()


@pytest.mark.gpus(2)
def test_status_block_stays_healthy(rng):
    config = tuning.kernel_config(gpu_matrix.DEFAULT_PROBLEMS[0], tp=2, m=None)
    with jmp.Mailbox(_mesh(2), "tp", hidden=config.hidden, capacity_m=CAPACITY) as mb:
        for _ in range(4):
            _per_rank_outputs(mb, _problems(rng, 2, 5, config), config.routed_scaling_factor)
        assert all(s["code"] == protocol.STATUS_OK for s in mb.status())


@st.composite
def _drawn_calls(draw, tp):
    """A prebuilt ``tests``-preset config (its compile-time choices are fixed) and fresh data for
    it: m, routed rows and one index pattern per rank, as in the CPU property test. At least one
    routed row: with none, XLA's compiler crashed (segfault) on two H200s, jax 0.11.2."""
    config = draw(st.sampled_from(gpu_matrix.variants(tp)))
    m = draw(st.integers(1, CAPACITY))
    num_rows = draw(st.integers(1, 64))
    patterns = [draw(st.sampled_from(numerics.INDEX_PATTERNS)) for _ in range(tp)]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    problems = []
    for pattern in patterns:
        problem = numerics.random_problem(rng, m=m, hidden=config.hidden, top_k=config.top_k,
                                          num_rows=num_rows, fp32_weights=config.fp32_weights,
                                          shared=config.include_shared_expert)
        problems.append(numerics.RankInputs(
            problem.routed, problem.weights,
            numerics.pattern_indices(rng, pattern, m, config.top_k, num_rows), problem.shared,
        ))
    return config, problems


@pytest.mark.parametrize("tp", [pytest.param(tp, marks=pytest.mark.gpus(tp)) for tp in (1, *gpu_matrix.GROUP_TPS)])
def test_property_draws_through_the_kernels(tp):
    """A sample of the CPU property test's draws, through the kernel path."""
    mailboxes = {}

    @settings(max_examples=30, deadline=None, database=None)
    @given(_drawn_calls(tp))
    def check(drawn):
        config, problems = drawn
        # Shown with -s: the last draw before a crash.
        print(f"draw: {config.key} m={problems[0].weights.shape[0]} rows={problems[0].routed.shape[0]}",
              flush=True)
        result = result_of(config.algorithm)
        if result not in mailboxes:
            mailboxes[result] = jmp.Mailbox(_mesh(tp), "tp", hidden=config.hidden, capacity_m=CAPACITY,
                                            result=result)
        mailbox = mailboxes[result]
        if mailbox.hidden != config.hidden:
            mailbox.close()
            mailbox = mailboxes[result] = jmp.Mailbox(_mesh(tp), "tp", hidden=config.hidden,
                                                      capacity_m=CAPACITY, result=result)
        outputs = _per_rank_outputs(mailbox, problems, config.routed_scaling_factor, config=config)
        _check(outputs, problems, config.routed_scaling_factor, result)
        mailbox.check()

    try:
        check()
    finally:
        for mailbox in mailboxes.values():
            mailbox.close()
