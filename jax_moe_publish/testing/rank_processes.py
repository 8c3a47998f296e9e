"""A TP group of N ranks as N processes of one ``jax.distributed`` job on fewer GPUs.

Where a machine has fewer GPUs than a group has ranks (one, typically), every rank runs in a
process of its own, and process ``i`` takes GPU ``i % gpus``: the processes share GPUs, and the
global mesh still has N devices. The Mailbox maps each process's memory into the others, as it
does across GPUs. The GPU time-slices between the processes' contexts, so their kernels never
run at the same time: a Lamport wait completes across time slices, slowly but correctly. Speed
cannot be measured this way (`refuse_timing`).

XLA's collectives cannot run here: NCCL refuses two ranks on one GPU ("Duplicate GPU detected",
``tools/shared_gpu_probe.py``). What would take a collective goes through the host instead:
`gather` exchanges every device's shard through files in a folder that the processes share
(they are on one machine), announced through the distributed key-value store.

The launcher (`launch`) gives each child its place in ``RANK_PROCESS_ENV``; the child calls
`join` before any other JAX call. Every process draws every rank's inputs from the shared
``seed``, so that each can check its own outputs against a model of the whole group.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import pathlib
import secrets
import sys
import tempfile

import numpy as np

from jax_moe_publish.testing import local_processes

RANK_PROCESS_ENV = "JAX_MOE_PUBLISH_RANK_PROCESS"
"""Set by `launch` in each child: its `RankProcess` as JSON."""
ON_CPU_ENV = "JAX_MOE_PUBLISH_RANK_PROCESSES_ON_CPU"
"""Where set, ranks run as processes of one CPU device each (gloo), for testing this module
without a GPU."""
_KEY = "jax_moe_publish/rank_processes"
GATHER_TIMEOUT_S = 300.0

_joined: "RankProcess | None" = None
_gathers = itertools.count()
_barriers = itertools.count()


@dataclasses.dataclass(frozen=True)
class RankProcess:
    """One process of a launch: its number among ``processes``, the coordinator's port, the
    GPUs the processes share (0: CPU devices), the launch's seed and its exchange folder."""

    process: int
    processes: int
    port: int
    gpus: int
    seed: int
    folder: str

    @property
    def gpu(self) -> int | None:
        return self.process % self.gpus if self.gpus else None

    @classmethod
    def from_environment(cls) -> "RankProcess | None":
        text = os.environ.get(RANK_PROCESS_ENV)
        return None if not text else cls(**json.loads(text))


def current() -> RankProcess | None:
    """This process's place once it joined (`join`); None in a process of its own."""
    return _joined


def join(timeout_s: float = 120.0) -> RankProcess | None:
    """Join the launch named in the environment, before any other JAX call; None (and nothing
    done) where this process was not started by `launch`."""
    global _joined
    rank = RankProcess.from_environment()
    if rank is not None and _joined is None:
        local_processes.join(rank.port, rank.processes, rank.process, rank.gpu, timeout_s=timeout_s)
        _joined = rank
    return rank


def _on_cpu() -> bool:
    return bool(os.environ.get(ON_CPU_ENV))


def sharing_possible(gpus: int) -> bool:
    """True where ranks can run as processes on a machine of ``gpus`` GPUs (as the caller
    counted them): a GPU to share, or the CPU switch."""
    return gpus > 0 or _on_cpu()


def launch(command: list[str], processes: int, *, deadline_s: float, seed: int | None = None,
           folder: str | None = None, extra_env: dict | None = None, echo: bool = False,
           grace_s: float = 30.0) -> list[local_processes.Outcome]:
    """Run ``command`` as ``processes`` rank processes on this machine's GPUs (or CPU devices,
    under `ON_CPU_ENV`); how each ended (`local_processes.run`). ``seed``: fresh unless given;
    ``folder``: the processes' exchange folder, a temporary one unless given (it must outlive
    the call if the caller reads what the processes leave there)."""
    if folder is None:
        with tempfile.TemporaryDirectory(prefix="jax-moe-publish-ranks-") as temporary:
            return launch(command, processes, deadline_s=deadline_s, seed=seed, folder=temporary,
                          extra_env=extra_env, echo=echo, grace_s=grace_s)
    gpus = 0 if _on_cpu() else local_processes.local_gpu_count()
    seed = secrets.randbits(62) if seed is None else seed
    port = local_processes.free_port()
    envs = []
    for i in range(processes):
        rank = RankProcess(i, processes, port, gpus, seed, folder)
        envs.append(local_processes.child_environment(
            extra={**(extra_env or {}), RANK_PROCESS_ENV: json.dumps(dataclasses.asdict(rank))}))
    names = [f"rank process {i}" for i in range(processes)]
    return local_processes.run([command] * processes, envs=envs, names=names, deadline_s=deadline_s,
                               grace_s=grace_s, echo=echo)


def place(mesh, spec, value):
    """A global array of ``value`` (the same host value in every process) laid out by ``spec``
    over ``mesh``: each process supplies its own devices' parts."""
    import jax

    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, jax.sharding.NamedSharding(mesh, spec), lambda index: value[index])


def _client():
    from jax._src import distributed

    return distributed.global_state.client


def gather(array) -> dict:
    """Every device's shard of the global ``array``, as NumPy, in every process:
    ``{device: data}`` for each device of its sharding (a replicated array: one copy per device)."""
    import jax.numpy as jnp

    shards = {s.device: np.asarray(s.data) for s in array.addressable_shards}
    devices = array.sharding.device_set
    if len(shards) == len(devices):
        return shards
    rank = current()
    if rank is None:
        raise RuntimeError("the array spans processes that were not started by rank_processes.launch")
    n = next(_gathers)
    folder = pathlib.Path(rank.folder)
    for device, data in shards.items():
        (folder / f"gather-{n}-{device.id}.bin").write_bytes(np.ascontiguousarray(data).tobytes())
    client = _client()
    client.key_value_set(f"{_KEY}/gather/{n}/{rank.process}", "written")
    for process in range(rank.processes):
        client.blocking_key_value_get(f"{_KEY}/gather/{n}/{process}", int(GATHER_TIMEOUT_S * 1000))
    dtype = jnp.dtype(array.dtype)
    for device in devices - set(shards):
        shape = array.sharding.shard_shape(array.shape)
        data = np.frombuffer((folder / f"gather-{n}-{device.id}.bin").read_bytes(), dtype=dtype)
        shards[device] = data.reshape(shape)
    return shards


def barrier(timeout_s: float = GATHER_TIMEOUT_S) -> None:
    """Wait until every rank process gets here (each must call it as often); nothing in a
    single process. Before a call whose wait timeout is short: the processes compile at
    different speeds, and that skew must not count as a late rank."""
    rank = current()
    if rank is None:
        return
    _client().wait_at_barrier(f"{_KEY}/barrier/{next(_barriers)}", max(1, int(timeout_s * 1000)))


def to_host(array) -> np.ndarray:
    """The whole global ``array`` as NumPy, in every process."""
    shards = gather(array)
    whole = np.empty(array.shape, np.dtype(array.dtype))
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        whole[index] = shards[device]
    return whole


def refuse_timing(what: str) -> None:
    """Exit with a message where ranks share GPUs: their kernels take turns on the GPU, so no
    time measured here says anything about real GPUs."""
    if RankProcess.from_environment() is not None:
        sys.exit(f"{what} measures speed, which cannot be measured with ranks as processes that share "
                 "GPUs (jax_moe_publish.testing.rank_processes): run it on as many GPUs as ranks")
