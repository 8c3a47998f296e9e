"""What JAX, XLA and CUDA allow when N processes of one ``jax.distributed`` job share one GPU.

    python tools/shared_gpu_probe.py [--processes 2 4 8] [--out probe.json]

For each process count and each way of naming the device (``local_device_ids=[0]``, or none),
N processes join on localhost with the same GPU visible to all, and each tries, in order,
recording what happened at every step: the global device list; memory per process; a local
computation; a ``shard_map`` over the N-device mesh with no collective; an exchange through
the distributed key-value store; a ``Mailbox`` across the processes (VMM memory exported and
mapped on the same device), closed again; and last, an XLA ``psum`` over the mesh (NCCL
refuses duplicate GPUs: whatever happens is recorded, a hang is killed at the deadline).
Prints one JSON line per run; docs/testing.md says what it found.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

STEPS = ("devices", "memory", "local", "shard_map", "key_value", "mailbox", "psum")


def child(process_id: int, processes: int, port: int, name_device: bool) -> None:
    from jax_moe_publish.testing import local_processes

    result = {"process": process_id, "steps": {}}

    def step(name, body):
        start = time.monotonic()
        try:
            value = body()
            result["steps"][name] = {"ok": True, "value": value, "s": round(time.monotonic() - start, 3)}
        except Exception as error:
            result["steps"][name] = {"ok": False, "error": f"{type(error).__name__}: {error}"[:800],
                                     "s": round(time.monotonic() - start, 3)}
        local_processes.report(result)  # after every step: a hang later still leaves this much

    import jax

    try:
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=process_id,
                                   local_device_ids=[0] if name_device else None, initialization_timeout=60)
    except Exception as error:
        result["initialize"] = f"{type(error).__name__}: {error}"[:2000]
        local_processes.report(result)
        local_processes.leave(1, wait_for_peers=False)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    def devices():
        return [dict(id=d.id, process=d.process_index, ordinal=d.local_hardware_id, kind=d.device_kind)
                for d in jax.devices()]

    step("devices", devices)
    step("memory", lambda: {k: v for k, v in (jax.local_devices()[0].memory_stats() or {}).items()
                            if k in ("bytes_in_use", "bytes_limit", "bytes_reservable_limit")})
    step("local", lambda: float(jax.device_put(jnp.arange(8.0) + process_id, jax.local_devices()[0]).sum()))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("tp",))

    def shard_map():
        whole = np.arange(processes * 4, dtype=np.float32).reshape(processes, 4)
        x = jax.make_array_from_callback(whole.shape, NamedSharding(mesh, P("tp")), lambda i: whole[i])
        y = jax.jit(jax.shard_map(lambda a: a * 2 + 1, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(x)
        (shard,) = y.addressable_shards
        return np.asarray(shard.data).tolist()

    step("shard_map", shard_map)

    def key_value():
        client = jax._src.distributed.global_state.client
        client.key_value_set_bytes(f"probe/{process_id}", bytes([process_id]) * 16)
        return [client.blocking_key_value_get_bytes(f"probe/{p}", 30_000)[0] for p in range(processes)]

    step("key_value", key_value)

    def mailbox():
        import jax_moe_publish as jmp

        with jmp.Mailbox(mesh, "tp", hidden=2048, capacity_m=16) as mb:
            return {"repr": repr(mb), "status": mb.status()}

    step("mailbox", mailbox)

    def psum():
        x = jax.make_array_from_callback((processes, 4), NamedSharding(mesh, P("tp")),
                                         lambda i: np.ones((1, 4), np.float32))
        y = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "tp"), mesh=mesh, in_specs=P("tp"),
                                  out_specs=P()))(x)
        return np.asarray(y.addressable_shards[0].data).tolist()

    step("psum", psum)
    local_processes.leave(0, timeout_s=20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--deadline", type=float, default=90.0)
    parser.add_argument("--out")
    parser.add_argument("--child", nargs=4, type=int, metavar=("ID", "N", "PORT", "NAMED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        process_id, processes, port, named = args.child
        child(process_id, processes, port, bool(named))
        return 0
    from jax_moe_publish.testing import local_processes

    runs = []
    for processes in args.processes:
        for named in (1, 0):
            port = local_processes.free_port()
            commands = [[sys.executable, __file__, "--child", str(i), str(processes), str(port), str(named)]
                        for i in range(processes)]
            envs = [local_processes.child_environment(extra={"CUDA_VISIBLE_DEVICES": os.environ.get(
                "CUDA_VISIBLE_DEVICES", "0").split(",")[0]}) for _ in range(processes)]
            start = time.monotonic()
            outcomes = local_processes.run(commands, envs=envs, deadline_s=args.deadline, grace_s=20, echo=False)
            run = {"processes": processes, "local_device_ids": [0] if named else None,
                   "wall_s": round(time.monotonic() - start, 1),
                   "outcomes": [{"process": i, "exit": o.returncode, "killed": o.killed, "result": o.result,
                                 "stderr_tail": o.stderr[-1500:]} for i, o in enumerate(outcomes)]}
            runs.append(run)
            summary = {s: sum(bool(o.result and o.result.get("steps", {}).get(s, {}).get("ok")) for o in outcomes)
                       for s in STEPS}
            print(json.dumps({"processes": processes, "named": bool(named), "ok_per_step": summary,
                              "exits": [o.returncode for o in outcomes], "wall_s": run["wall_s"]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(2)
