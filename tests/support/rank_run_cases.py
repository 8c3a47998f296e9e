"""Cases for `rank_runs` itself, run by ``tests/cpu/test_rank_runs.py`` as rank processes on CPU
devices (`rank_processes.ON_CPU_ENV`); not collected on their own (no ``test_`` file name).

Each needs two "GPUs", so that on a machine without them it runs as two rank processes.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_moe_publish.testing import rank_processes

pytestmark = [pytest.mark.gpus(2), pytest.mark.rank_processes]


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("tp",))


def test_each_rank_sees_every_rank_output(rng):
    """Every rank's own output comes back to every process, through the host."""
    mesh = _mesh()
    values = rng.standard_normal((mesh.size, 3, 5)).astype(np.float32)
    step = jax.jit(jax.shard_map(lambda x: x * 2 + jax.lax.axis_index("tp"), mesh=mesh, in_specs=P("tp"),
                                 out_specs=P("tp")))
    out = rank_processes.to_host(step(rank_processes.place(mesh, P("tp"), values)))
    expected = values * 2 + np.arange(mesh.size, dtype=np.float32)[:, None, None]
    np.testing.assert_array_equal(out, expected)
    shards = rank_processes.gather(step(rank_processes.place(mesh, P("tp"), values)).astype(jnp.bfloat16))
    assert sorted(d.id for d in shards) == sorted(d.id for d in mesh.devices.flat)
    for rank, device in enumerate(mesh.devices.flat):
        assert shards[device].dtype == jnp.bfloat16
        np.testing.assert_array_equal(shards[device][0], expected[rank].astype(jnp.bfloat16))


def test_the_processes_draw_the_same_data(rng):
    mesh = _mesh()
    drawn = rng.integers(0, 2**31, 8)
    copies = rank_processes.to_host(rank_processes.place(mesh, P("tp"), np.stack([drawn] * mesh.size)[:, None]))
    for rank in range(mesh.size):
        np.testing.assert_array_equal(copies[rank, 0], copies[0, 0], err_msg=f"rank {rank} drew other data")


def test_a_barrier_waits_for_the_slowest_process():
    """Process 1 arrives 2 s late and leaves a mark first: no process passes before the mark."""
    client = rank_processes._client()
    if jax.process_index() == 1:
        time.sleep(2.0)
        client.key_value_set("rank_run_cases/late", "arrived")
    rank_processes.barrier()
    assert client.key_value_try_get("rank_run_cases/late") == "arrived", "passed the barrier before process 1"


def test_a_failure_in_one_rank_process_fails_the_test():
    assert jax.process_index() != 1, "planted failure in process 1"


def test_a_skip_inside_the_body_skips():
    pytest.skip("planted skip inside the body")
