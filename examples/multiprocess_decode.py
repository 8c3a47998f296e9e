"""Tensor parallelism across processes: one process per GPU under ``jax.distributed``.

    python examples/multiprocess_decode.py [--processes N] [--tokens 16] [--layers 4] [--steps 20]

The script starts N copies of itself (by default one per local GPU) joined by
``jax.distributed`` through a coordinator on a free localhost port. Each copy
owns one GPU, builds the mesh over every process's device, creates the
`Mailbox` (creation is collective: the same Mailboxes in the same order in
every process), and runs decode steps through a stack of MoE layers
(``x += layer(x)``, `moe_layer.py`) whose finalize and all-reduce are one
`moe_finalize_publish` call: the processes' GPUs write into each other's
mailboxes over NVLink. Each process checks every layer's op, called alone on
that layer's inputs, against a float64 NumPy model of the op (`model.py`, fed
with every rank's inputs), prints the error and the time per step, and fails
if an element is outside the model's bound.

The launcher prints each process's lines after its name and exits non-zero,
naming each process that failed and its exit code, if any did; a process
still running after ``--deadline`` seconds is killed. Each process prints its
lines first and then leaves through a last barrier, so that process 0, which
serves the ``jax.distributed`` coordinator, exits after the others
(`jax_moe_publish.testing.local_processes.leave`). The time per layer is measured on
the host around whole steps; ``benchmarks/bench_multiprocess.py`` times the
op per call.

Without a GPU it starts N = 2 processes with one CPU device each (gloo
collectives) on the reference path, and says so. ``--single-process`` runs the
same steps in this process over every local device, for comparison.
"""

from __future__ import annotations

import argparse
import sys
import time

import platform_choice  # examples/ is on sys.path
from jax_moe_publish.testing import local_processes


def launch(args) -> int:
    """Start the processes, print what each prints, and say which failed; the exit status."""
    gpus = local_processes.local_gpu_count()
    processes = args.processes or gpus or 2
    if gpus and processes > gpus:
        raise SystemExit(f"--processes {processes}: only {gpus} GPU(s) here, one per process")
    if gpus:
        print(f"{processes} processes, one GPU each: the jax-moe-publish kernels across processes, tp={processes}")
    else:
        print(f"no NVIDIA GPU found: {processes} CPU processes (gloo) on the pure-JAX reference path, "
              f"tp={processes}")
    port = local_processes.free_port()
    commands = [[sys.executable, __file__, "--worker", str(i), "--processes", str(processes), "--port", str(port),
                 "--tokens", str(args.tokens), "--layers", str(args.layers), "--steps", str(args.steps)]
                + (["--gpu"] if gpus else []) for i in range(processes)]
    outcomes = local_processes.run(commands, envs=[local_processes.child_environment()] * processes,
                                   deadline_s=args.deadline)
    failed = [outcome for outcome in outcomes if outcome.failed]
    for outcome in failed:
        print(f"failed: {outcome.describe()}", file=sys.stderr)
    return 1 if failed else 0


def work(args) -> None:
    """One process: its GPU (or CPU device), the global mesh, the mailbox and the decode steps.

    With ``args.worker`` None: the only process, over every local device.
    """
    if args.worker is not None:
        local_processes.join(args.port, args.processes, args.worker, args.worker if args.gpu else None)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_moe_publish as jmp
    import model  # examples/ is on sys.path
    from moe_layer import HIDDEN, PARAM_SPECS, ROUTED_SCALE, check_programs, init_params, moe_layer

    def say(text: str) -> None:
        print(text, flush=True)  # the launcher names the process

    tp = jax.device_count()
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices())

    def global_array(value, spec):
        """Every process computes the same host value; each supplies its own devices' part."""
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])

    layers = [{name: global_array(value, PARAM_SPECS[name]) for name, value in init_params(key, tp).items()}
              for key in jax.random.split(jax.random.key(0), args.layers)]
    x = global_array(jax.random.normal(jax.random.key(1), (args.tokens, HIDDEN), jnp.bfloat16), P())

    def build_step(mailbox):
        def decode(layers, x):
            for params in layers:
                x = x + moe_layer(params, x, mailbox=mailbox)
            return x

        return jax.jit(jax.shard_map(decode, mesh=mesh, in_specs=([PARAM_SPECS] * args.layers, P()), out_specs=P()))

    def check(mailbox) -> bool:
        """The layers one by one, each op alone on its inputs (``[tp, ...]``, every rank's),
        against the float64 model (`moe_layer.check_programs`)."""
        experts, finalize = check_programs(mesh, mailbox)
        h, outs, references, bounds = x, [], [], []
        for params in layers:
            inputs = experts(params, h)
            y = finalize(*inputs).block_until_ready()
            reference, bound = model.finalize_publish(*multihost_utils.process_allgather(inputs, tiled=True),
                                                      ROUTED_SCALE)
            outs.append(np.asarray(y.addressable_data(0)))
            references.append(reference)
            bounds.append(bound)
            h = jax.jit(jnp.add)(h, y)
        return model.check(np.stack(outs), np.stack(references), np.stack(bounds),
                           f"tokens={args.tokens} layers={args.layers} tp={tp}")

    with jmp.Mailbox(mesh, "tp", hidden=HIDDEN, capacity_m=max(args.tokens, 64)) as mailbox:
        device = jax.local_devices()[0]
        rank = list(mesh.devices.flat).index(device)
        say(f"{device} is rank {rank} of {tp} ({jax.process_count()} process(es)); {mailbox!r}")
        with mailbox.diagnose():
            passed = check(mailbox)

        if args.steps:
            step = build_step(mailbox)
            step(layers, x).block_until_ready()
            start = time.perf_counter()
            # Each step is waited for: CPU collectives queued back to back can starve XLA's
            # rendezvous on a small machine.
            for _ in range(args.steps):
                step(layers, x).block_until_ready()
            per_layer = (time.perf_counter() - start) / (args.steps * args.layers)
            say(f"{per_layer * 1e6:.1f} us per MoE layer ({args.steps} steps of {args.layers} layers, each waited "
                f"for, {'GPU kernels' if mailbox.on_cuda else 'CPU reference'})")
        mailbox.check()
    if not passed:
        raise SystemExit("the result is outside the float64 model's bound")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=platform_choice.non_negative_int, default=0,
                        help="default (0): one per local GPU, 2 without GPUs")
    parser.add_argument("--tokens", type=platform_choice.positive_int, default=16)
    parser.add_argument("--layers", type=platform_choice.positive_int, default=4)
    parser.add_argument("--steps", type=platform_choice.non_negative_int, default=20,
                        help="host-timed decode steps (0: none)")
    parser.add_argument("--deadline", type=platform_choice.positive_float, default=600.0,
                        help="seconds before a process still running is killed")
    parser.add_argument("--single-process", action="store_true",
                        help="run the same steps in this one process over every local device")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gpu", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.single_process:
        work(args)
    elif args.worker is None:
        sys.exit(launch(args))
    else:
        local_processes.run_and_leave(work, args)


if __name__ == "__main__":
    main()
