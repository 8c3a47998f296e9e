"""A tensor-parallel MoE decode layer whose finalize and all-reduce are one jax-moe-publish call.

Each rank holds a 1/tp slice of every expert's intermediate dimension (and of
the shared expert), so its expert outputs are partial sums that the group must
add up. The layer routes tokens, runs the sliced experts on expert-sorted rows,
and calls `moe_finalize_publish`, which does the weighted top-k sum, adds the
shared expert and reduces over the group.

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

HIDDEN = 512
EXPERTS = 16
TOP_K = 4
INTERMEDIATE = 256
ROUTED_SCALE = 2.5


def init_params(key, tp: int):
    """Router (replicated), experts and shared expert sliced along the intermediate dim."""
    k = jax.random.split(key, 5)
    scale = HIDDEN**-0.5
    return {
        "router": jax.random.normal(k[0], (HIDDEN, EXPERTS), jnp.float32) * scale,
        "w_in": jax.random.normal(k[1], (tp, EXPERTS, HIDDEN, INTERMEDIATE // tp), jnp.bfloat16) * scale,
        "w_out": jax.random.normal(k[2], (tp, EXPERTS, INTERMEDIATE // tp, HIDDEN), jnp.bfloat16) * scale,
        "shared_in": jax.random.normal(k[3], (tp, HIDDEN, INTERMEDIATE // tp), jnp.bfloat16) * scale,
        "shared_out": jax.random.normal(k[4], (tp, INTERMEDIATE // tp, HIDDEN), jnp.bfloat16) * scale,
    }


def moe_layer(params, x, *, mailbox, impl):
    """One shard of the layer: x bf16 [m, hidden] (replicated) -> bf16 [m, hidden] (the group's sum)."""
    m = x.shape[0]
    logits = x.astype(jnp.float32) @ params["router"]
    top_logits, experts = jax.lax.top_k(logits, TOP_K)
    weights = jax.nn.softmax(top_logits, axis=-1)  # float32 [m, top_k]
    # Expert-sorted rows, as a grouped GEMM would produce them.
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    permuted_indices = jnp.argsort(order).astype(jnp.int32).reshape(m, TOP_K)
    rows = x[order // TOP_K]
    w_in, w_out = params["w_in"][0], params["w_out"][0]
    hidden_rows = jax.nn.silu(jnp.einsum("rh,rhi->ri", rows, w_in[flat_experts[order]]))
    routed_output = jnp.einsum("ri,rih->rh", hidden_rows, w_out[flat_experts[order]]).astype(jnp.bfloat16)
    shared = (jax.nn.silu(x @ params["shared_in"][0]) @ params["shared_out"][0]).astype(jnp.bfloat16)
    return jmp.moe_finalize_publish(
        routed_output, weights, permuted_indices, shared,
        mailbox=mailbox, routed_scaling_factor=ROUTED_SCALE, impl=impl,
    )


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
        out = step(params, x)
        reference = np.asarray(build_step(mesh, mailbox, impl="reference")(params, x), np.float64)
        got = np.asarray(out, np.float64)
        relative = np.linalg.norm(got - reference) / np.linalg.norm(reference)
        print(f"tokens={args.tokens} hidden={HIDDEN} top_k={TOP_K}: relative error against the "
              f"reference {relative:.2e}, max abs difference {np.max(np.abs(got - reference)):.3e}")

        out.block_until_ready()
        start = time.perf_counter()
        for _ in range(args.steps):
            out = step(params, x)
        out.block_until_ready()
        per_step = (time.perf_counter() - start) / args.steps
        print(f"{per_step * 1e6:.1f} us per decode layer step (whole layer, {args.steps} steps, "
              f"{'GPU kernels' if ON_GPU else 'CPU reference'})")
        mailbox.check()
        if relative > 1e-2:
            raise SystemExit(f"relative error {relative:.2e} exceeds 1e-2")


if __name__ == "__main__":
    main()
