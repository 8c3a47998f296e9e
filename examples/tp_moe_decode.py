"""A tensor-parallel MoE decode layer whose finalize and all-reduce are one jax-moe-publish call.

The layer (`moe_layer.py`): each rank holds a 1/tp slice of every expert, so
its expert outputs are partial sums that `moe_finalize_publish` adds up over
the group, together with the weighted top-k sum and the shared expert.

On NVIDIA GPUs it uses every local GPU as the TP group and runs the kernels;
without a GPU it runs the pure-JAX reference path on 4 virtual CPU devices, and
says which. Either way it checks the op's result against a float64 NumPy model
of the op (`model.py`) fed with every rank's inputs of the call, prints the
error and the time per step, and exits non-zero if an element is outside the
model's bound. ``--rank-processes N`` runs a group of N ranks as N processes that share
the GPUs (`platform_choice`): tp = N on one GPU.

    python examples/tp_moe_decode.py [--tokens 32] [--steps 50] [--rank-processes N]

``--steps 0`` checks the result and times nothing.
"""

from __future__ import annotations

import argparse
import time

import platform_choice  # examples/ is on sys.path (choose before JAX is imported)

ON_GPU = platform_choice.choose(cpu_devices=4)

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_publish as jmp  # noqa: E402
import model  # noqa: E402  (examples/ is on sys.path)
from jax_moe_publish.testing import rank_processes  # noqa: E402
from moe_layer import (  # noqa: E402
    HIDDEN, PARAM_SPECS, ROUTED_SCALE, TOP_K, check_programs, init_params, moe_layer,
)


def build_step(mesh, mailbox):
    """The layer over the group, in one jitted program."""
    return jax.jit(jax.shard_map(lambda p, x: moe_layer(p, x, mailbox=mailbox), mesh=mesh,
                                 in_specs=(PARAM_SPECS, P()), out_specs=P()))


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=platform_choice.positive_int, default=32, help="m, tokens per step")
    parser.add_argument("--steps", type=platform_choice.non_negative_int, default=50,
                        help="host-timed decode steps (0: none)")
    platform_choice.add_rank_processes(parser)
    return parser.parse_args()


def main(args) -> None:
    devices = jax.devices()
    tp = len(devices)
    mesh = jax.make_mesh((tp,), ("tp",), devices=devices)
    shared = rank_processes.current() is not None
    if ON_GPU:
        print(f"{tp} GPU(s) ({devices[0].device_kind}): running the jax-moe-publish kernels, tp={tp}"
              + (f", as {tp} rank processes that share the GPU(s): times mean nothing" if shared else ""))
    else:
        print(f"no NVIDIA GPU found: running the pure-JAX reference path on {tp} "
              f"{'CPU processes' if shared else 'virtual CPU devices'}, tp={tp}")

    # Every process computes the same host values and places its own devices' parts.
    params = {name: rank_processes.place(mesh, PARAM_SPECS[name], value)
              for name, value in init_params(jax.random.key(0), tp).items()}
    x = rank_processes.place(mesh, P(), jax.random.normal(jax.random.key(1), (args.tokens, HIDDEN), jnp.bfloat16))

    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=max(args.tokens, 64)) as mailbox:
        # Every program is waited for before the next is dispatched: on virtual CPU devices,
        # programs of collectives queued back to back can starve XLA's rendezvous on a small
        # machine (it aborts after 40 s).
        experts, finalize = check_programs(mesh, mailbox)
        inputs = experts(params, x)
        out = finalize(*inputs).block_until_ready()
        reference, bound = model.finalize_publish(*map(rank_processes.to_host, inputs), ROUTED_SCALE)
        passed = model.check(rank_processes.to_host(out), reference, bound, f"tokens={args.tokens} hidden={HIDDEN} top_k={TOP_K} tp={tp}")

        if args.steps:
            step = build_step(mesh, mailbox)
            step(params, x).block_until_ready()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(params, x).block_until_ready()
            per_step = (time.perf_counter() - start) / args.steps
            print(f"{per_step * 1e6:.1f} us per decode layer step (whole layer, {args.steps} steps, each "
                  f"waited for, {'GPU kernels' if ON_GPU else 'CPU reference'})")
        mailbox.check()
    if not passed:
        raise SystemExit("the result is outside the float64 model's bound")


if __name__ == "__main__":
    raise SystemExit(platform_choice.run(main, parse()))
