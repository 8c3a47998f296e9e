"""Deterministic results on the reference path (virtual CPU devices), and the launch shape of a
call as a function of what every rank shares.

* A token's bits do not depend on the call: the same probe tokens (`determinism`) in calls of
  every range of the tuning table's launch shapes, at different places among fresh tokens,
  in either result layout (``allreduce``, or the owner's row of ``reduce_scatter``), with and
  without the epilogue, give the same bits on every rank, and a repeated call gives the same
  bits for all of its tokens.
* `tuning.kernel_config` gives the same config for the same (problem, tp, m, result,
  epilogue), whatever it was asked before; and the op's traced program, as each rank of a
  group traces it with its own data and its own devices, names that config's kernels.

The kernels' side of the contract is `tests/gpu/test_determinism_gpu.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import determinism
import jaxprs
import stand_in_kernels
import jax_moe_publish as jmp
import numerics
from jax_moe_publish import config as config_module
from jax_moe_publish import tuning
from jax_moe_publish.mailbox import Mailbox
from jax_moe_publish.testing import gpu_matrix

TP = 4
PROBLEM = tuning.Problem(hidden=2880, top_k=10, routed_scaling_factor=2.5)  # hidden not a power of two
ROUTED_ROWS = 48
CAPACITY_M = 96
EPS = 1e-6


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:TP]), ("tp",))


def _step(mailbox, epilogue: bool, impl: str = "auto"):
    """A fresh jit(shard_map(op)) over per-rank stacks [tp, ...], returning every rank's own
    result [tp, rows, hidden] (a pair with the epilogue); with the epilogue the residual is per
    rank too, in the result's layout."""

    def shard(routed, weights, indices, shared, *rest):
        residual, norm_weight = (rest[0][0], rest[1]) if epilogue else (None, None)
        out = jmp.moe_finalize_publish(routed[0], weights[0], indices[0], shared[0], mailbox=mailbox,
                                       routed_scaling_factor=PROBLEM.routed_scaling_factor, impl=impl,
                                       residual=residual, norm_weight=norm_weight, norm_eps=EPS)
        return jax.tree.map(lambda x: x[None], out)

    in_specs = (P("tp"),) * 4 + ((P("tp"), P()) if epilogue else ())
    return jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=in_specs, out_specs=P("tp")))


def _inputs(call: determinism.Call, result: str, norm_weight):
    stacks = [jnp.asarray(np.stack([getattr(p, field) for p in call.problems]))
              for field in ("routed", "weights", "indices", "shared")]
    if call.residual is None:
        return stacks
    rows = [call.residual_rows(result, rank) for rank in range(TP)]
    return stacks + [jnp.asarray(np.stack(rows)), jnp.asarray(norm_weight)]


def _run(step, call, result, norm_weight) -> dict[str, list[np.ndarray]]:
    """Each output's copies of the call's result, as raw bf16 bits in token order."""
    outputs = step(*_inputs(call, result, norm_weight))
    names = ("out", "residual_out") if call.residual is not None else ("out",)
    outputs = outputs if call.residual is not None else (outputs,)
    return {name: determinism.token_rows(list(np.asarray(x).view(np.uint16)), result, call.m)
            for name, x in zip(names, outputs)}


@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
def test_a_tokens_bits_depend_on_neither_the_call_nor_the_layout(epilogue, rng):
    probes = determinism.probe_problems(rng, TP, PROBLEM, ROUTED_ROWS)
    residual, norm_weight = determinism.probe_residual(rng, PROBLEM.hidden) if epilogue else (None, None)
    calls = determinism.calls(rng, probes, CAPACITY_M, residual)
    baseline: dict[str, np.ndarray] = {}
    for result in tuning.RESULTS:
        with jmp.Mailbox(_mesh(), "tp", hidden=PROBLEM.hidden, capacity_m=CAPACITY_M, result=result) as mailbox:
            step = _step(mailbox, epilogue)
            first = None
            for call in calls:
                outputs = _run(step, call, result, norm_weight)
                if first is None:
                    first = outputs
                for name, copies in outputs.items():
                    for index, copy in enumerate(copies):
                        what = f"{result} m={call.m} offset={call.offset} {name} copy {index}"
                        probe = baseline.setdefault(name, copy[call.window])
                        assert np.array_equal(copy[call.window], probe), f"{what}: the probe's bits differ"
            again = _run(step, calls[0], result, norm_weight)
            for name in first:
                for copy, copy_again in zip(first[name], again[name]):
                    assert np.array_equal(copy_again, copy), f"{result} {name}: a repeated call's bits differ"
    total, bound = numerics.expected_sum(probes, PROBLEM.routed_scaling_factor)
    zeros = list(determinism.ZERO_TOKENS)
    if epilogue:
        out, residual_out = (baseline[name].view(numerics.BF16) for name in ("out", "residual_out"))
        numerics.assert_epilogue_close(out, residual_out, total, bound, residual, norm_weight, EPS)
        assert np.all(baseline["residual_out"][zeros] == 0), "a zero token's residual_out is not +0.0"
        expected = determinism.zero_out(norm_weight, positive=False)
        for token in zeros:
            assert np.array_equal(baseline["out"][token], expected), f"token {token}'s out is not +0.0 * norm_weight"
    else:
        numerics.assert_close(baseline["out"].view(numerics.BF16), total, bound)
        assert np.all(baseline["out"][zeros] == 0), "a zero token's result is not +0.0"


# --- the launch shape: a function of what every rank shares ------------------------------------

PROBLEMS = tuple(dict.fromkeys((*gpu_matrix.DEFAULT_PROBLEMS, *gpu_matrix.EPILOGUE_PROBLEMS, PROBLEM)))
SHARED_ARGUMENTS = [
    (problem, tp, m, result, epilogue)
    for problem in PROBLEMS
    for tp in (1, *gpu_matrix.GROUP_TPS)
    for result in (tuning.RESULTS if tp > 1 else ("allreduce",))
    for epilogue in (config_module.EPILOGUES if tp > 1 else ("none",))
    for m in (1, 7, *tuning.range_ms(), 1000, None)
]


def _kernel_config(arguments):
    problem, tp, m, result, epilogue = arguments
    return tuning.kernel_config(problem, tp=tp, m=m, result=result, epilogue=epilogue)


def test_kernel_config_is_a_function_of_the_shared_arguments():
    """Asked for the same arguments in any order, among any others, the table gives the same
    config: nothing it remembers from earlier calls enters the choice."""
    forward = [_kernel_config(arguments) for arguments in SHARED_ARGUMENTS]
    backward = [_kernel_config(arguments) for arguments in reversed(SHARED_ARGUMENTS)][::-1]
    assert forward == backward
    assert [c.key for c in forward] == [c.key for c in backward]
    for arguments, config in zip(SHARED_ARGUMENTS, forward):
        assert _kernel_config(arguments) == config, f"{arguments}: a second call chose another config"


@pytest.fixture
def traced_kernels(monkeypatch):
    """The kernel path on the CPU mailbox, traced only (`stand_in_kernels`), and the loads it
    made: each traced call carries its set's index as ``set_id``, so that the traced program
    names the kernels it would launch."""
    return monkeypatch, stand_in_kernels.install(monkeypatch)


def _kernel_sets(jaxpr) -> list[int]:
    """The ``set_id`` of every stand-in kernel call in ``jaxpr`` and the jaxprs inside it."""
    return [dict(eqn.params["attributes"])["set_id"] for eqn in jaxprs.equations(jaxpr, "ffi_call")]


@pytest.mark.parametrize("epilogue", [False, True], ids=["y", "epilogue"])
@pytest.mark.parametrize("result", tuning.RESULTS)
def test_every_rank_traces_the_same_kernel_choice(result, epilogue, traced_kernels, rng):
    """Each rank of a group traces the op as its own process would: a trace of its own, with
    its own (fresh) data and its own devices (the mailbox's local ordinals are [rank], and the
    kernels load there). Every rank's program is the same, and names the table's config for
    the shared (problem, tp, m, result, epilogue), at m of every range of the table."""
    monkeypatch, loads = traced_kernels
    table_epilogue = "rmsnorm" if epilogue else "none"
    with jmp.Mailbox(_mesh(), "tp", hidden=PROBLEM.hidden, capacity_m=CAPACITY_M, result=result) as mailbox:
        monkeypatch.setattr(mailbox, "on_cuda", True)
        for m in (1, *tuning.range_ms()):
            programs, kernel_sets = [], []
            for rank in range(TP):
                monkeypatch.setattr(Mailbox, "local_ordinals", property(lambda self, rank=rank: [rank]))
                problems = [numerics.random_problem(rng, m=m, hidden=PROBLEM.hidden, top_k=PROBLEM.top_k,
                                                    num_rows=ROUTED_ROWS) for _ in range(TP)]
                residual, norm_weight = numerics.epilogue_inputs(rng, m, PROBLEM.hidden) if epilogue else (None, None)
                call = determinism.Call(m, 0, problems, residual)
                first_load = len(loads)
                program = jax.make_jaxpr(_step(mailbox, epilogue, impl="kernel"))(*_inputs(call, result, norm_weight))
                programs.append(str(program))
                kernel_sets.append(_kernel_sets(program.jaxpr))
                assert [ordinals for _, ordinals in loads[first_load:]] == [[rank]], f"m={m} rank {rank}: loads"
            expected = tuning.kernel_config(PROBLEM, tp=TP, m=m, result=result, epilogue=table_epilogue)
            assert all(program == programs[0] for program in programs), f"m={m}: the ranks' programs differ"
            assert loads[-1][0] == expected, f"m={m}: the op chose {loads[-1][0].key}, the table {expected.key}"
            assert kernel_sets == [[[c for c, _ in loads].index(expected)]] * TP, f"m={m}: kernel sets {kernel_sets}"
