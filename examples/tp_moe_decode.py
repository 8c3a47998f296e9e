"""A tensor-parallel MoE decode layer whose finalize and all-reduce are one jax-moe-publish call.

The layer (`moe_layer.py`): each rank holds a 1/tp slice of every expert, so
its expert outputs are partial sums that `moe_finalize_publish` adds up over
the group, together with the weighted top-k sum and the shared expert.

On NVIDIA GPUs it uses every local GPU as the TP group, runs the kernels, checks
them against the pure-JAX reference and prints the error and the time per step.
Without a GPU it runs the reference path on 4 virtual CPU devices and says so.

    python examples/tp_moe_decode.py [--tokens 32] [--steps 50]
"""

from __future__ import annotations

import argparse
import os
import time


def _gpu_present() -> bool:
    try:
        from cuda.bindings import driver

        (error,) = driver.cuInit(0)
        return error == driver.CUresult.CUDA_SUCCESS and driver.cuDeviceGetCount()[1] > 0
    except Exception:  # no bindings or no libcuda: a CPU machine
        return False


ON_GPU = _gpu_present()
if not ON_GPU:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_publish as jmp  # noqa: E402
from moe_layer import HIDDEN, TOP_K, init_params, moe_layer  # noqa: E402  (examples/ is on sys.path)


def build_step(mesh, mailbox, impl):
    sharded = {name: P("tp") for name in ("w_in", "w_out", "shared_in", "shared_out")}
    specs = ({"router": P(), **sharded}, P())
    layer = jax.shard_map(lambda p, x: moe_layer(p, x, mailbox=mailbox, impl=impl),
                          mesh=mesh, in_specs=specs, out_specs=P())
    return jax.jit(layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    devices = jax.devices()
    tp = len(devices)
    mesh = jax.make_mesh((tp,), ("tp",), devices=devices)
    if ON_GPU:
        print(f"{tp} GPU(s) ({devices[0].device_kind}): running the jax-moe-publish kernels, tp={tp}")
    else:
        print(f"no NVIDIA GPU found: running the pure-JAX reference path on {tp} virtual CPU devices, tp={tp}")

    params = init_params(jax.random.key(0), tp)
    params = {name: jax.device_put(value, jax.sharding.NamedSharding(mesh, P("tp") if name != "router" else P()))
              for name, value in params.items()}
    x = jax.random.normal(jax.random.key(1), (args.tokens, HIDDEN), jnp.bfloat16)

    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=max(args.tokens, 64)) as mailbox:
        step = build_step(mesh, mailbox, impl="auto")
        # Every program is waited for before the next is dispatched: on virtual CPU devices,
        # programs of collectives queued back to back can starve XLA's rendezvous on a small
        # machine (it aborts after 40 s).
        out = step(params, x).block_until_ready()
        reference = np.asarray(build_step(mesh, mailbox, impl="reference")(params, x), np.float64)
        got = np.asarray(out, np.float64)
        relative = np.linalg.norm(got - reference) / np.linalg.norm(reference)
        print(f"tokens={args.tokens} hidden={HIDDEN} top_k={TOP_K}: relative error against the "
              f"reference {relative:.2e}, max abs difference {np.max(np.abs(got - reference)):.3e}")

        start = time.perf_counter()
        for _ in range(args.steps):
            out = step(params, x).block_until_ready()
        per_step = (time.perf_counter() - start) / args.steps
        print(f"{per_step * 1e6:.1f} us per decode layer step (whole layer, {args.steps} steps, each "
              f"waited for, {'GPU kernels' if ON_GPU else 'CPU reference'})")
        mailbox.check()
        if relative > 1e-2:
            raise SystemExit(f"relative error {relative:.2e} exceeds 1e-2")


if __name__ == "__main__":
    main()
