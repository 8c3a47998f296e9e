"""Soak test of the public API on a TP group of GPUs (2 by default): many consecutive calls,
every one checked.

Each call draws m in [1, capacity] and fresh inputs, which the jitted step
generates on the devices from the call number. The step runs the op
(``impl="kernel"``) and the pure-JAX reference on the same inputs and returns
an error summary that the host checks for every call:

* the worst ``|ours - reference| / bound`` with
  ``bound = 2^-6 * sum_r sum_k |w * scale * routed| + |shared|  +  2^-7 * |reference|``:
  each rank's partial may round differently by one bf16 ulp (the float32
  accumulations need not match bit for bit), and so may the sum. A stale slot or
  a stage mix-up hands back another call's data, an error of the order of the
  values themselves;
* the number of non-finite outputs (the inputs are finite);
* the number of elements whose bits differ between ranks (all-reduce).

The calls alternate at random between mailbox A (all-reduce, oneshot) and
mailbox B (all-reduce with the twoshot kernels, or reduce_scatter), so two
mailboxes' stages interleave. One jitted step per (mailbox, m), compiled on
first use. Exits 0 when every call passed, 1 on a wrong result, 2 on an error.

On a machine of at least ``--tp`` GPUs, with the prebuilt kernels::

    JAX_MOE_PUBLISH_KERNEL_DIR=kernels-prebuilt NCCL_NVLS_ENABLE=0 python tools/soak.py [--tp 4]

``--impl reference`` runs both sides on the reference: a check of this tool
that runs anywhere JAX sees ``--tp`` devices (on CPU:
``XLA_FLAGS=--xla_force_host_platform_device_count=4``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import jax_moe_publish as jmp
from jax_moe_publish import reference, tuning
from jax_moe_publish.testing import gpu_matrix

AXIS = "tp"


def make_step(mailbox: jmp.Mailbox, m: int, problem: dict, num_rows: int, seed: int, impl: str,
              twoshot: bool):
    """jit(shard_map) of one checked call with m tokens: call number -> f32[3] summary
    (worst error / bound, non-finite outputs, elements whose bits differ between ranks).
    ``twoshot`` runs an all-reduce mailbox with the twoshot kernels."""
    hidden, top_k = problem.hidden, problem.top_k
    scale = problem.routed_scaling_factor
    fp32_weights, shared_expert = problem.fp32_weights, problem.include_shared_expert
    scatter = mailbox.result == "reduce_scatter"
    tp = mailbox.tp
    config = tuning.kernel_config(problem, tp=tp, m=m, algorithm="twoshot") if twoshot else None

    def shard(call):
        rank = lax.axis_index(AXIS)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), call), rank)
        k_routed, k_weights, k_indices, k_shared = jax.random.split(key, 4)
        routed = jax.random.normal(k_routed, (num_rows, hidden), jnp.float32).astype(jnp.bfloat16)
        weights = jax.random.uniform(k_weights, (m, top_k), jnp.float32, 0.05, 1.0)
        weights = weights.astype(jnp.float32 if fp32_weights else jnp.bfloat16)
        # -2, -1, num_rows and num_rows + 1 are skipped: about 4 / (num_rows + 4) of the experts.
        indices = jax.random.randint(k_indices, (m, top_k), -2, num_rows + 2, jnp.int32)
        shared = None
        if shared_expert:
            shared = jax.random.normal(k_shared, (m, hidden), jnp.float32).astype(jnp.bfloat16)

        ours = jmp.moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox,
                                        routed_scaling_factor=scale, impl=impl, config=config)
        expected = jmp.moe_finalize_publish(routed, weights, indices, shared, mailbox=mailbox,
                                            routed_scaling_factor=scale, impl="reference")
        magnitude = reference.moe_finalize(
            jnp.abs(routed), jnp.abs(weights), indices, None if shared is None else jnp.abs(shared),
            routed_scaling_factor=abs(scale),
        )
        magnitude = lax.psum(magnitude.astype(jnp.float32), AXIS)
        if scatter:
            magnitude = reference.owned_rows(magnitude, tp, rank)
        ours32, expected32 = ours.astype(jnp.float32), expected.astype(jnp.float32)
        bound = 2.0**-6 * magnitude + 2.0**-7 * jnp.abs(expected32) + jnp.float32(2.0**-126)
        ratio = jnp.max(jnp.abs(ours32 - expected32) / bound)
        ratio = jnp.where(jnp.isnan(ratio), jnp.inf, ratio)  # a NaN must not vanish in the max
        nonfinite = jnp.sum(~jnp.isfinite(ours32))
        differ = jnp.int32(0)
        if not scatter:
            bits = lax.bitcast_convert_type(ours, jnp.uint16).astype(jnp.int32)
            differ = jnp.sum(lax.pmax(bits, AXIS) != lax.pmin(bits, AXIS))
        return jnp.stack([lax.pmax(ratio, AXIS), lax.psum(nonfinite, AXIS).astype(jnp.float32),
                          lax.pmax(differ, AXIS).astype(jnp.float32)])

    # The summary is made equal on every rank by the collectives; the op's varying-axes
    # marking is not needed for that.
    return jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=P(), out_specs=P(), check_vma=False))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls in all, both mailboxes")
    parser.add_argument("--tp", type=int, default=2, help="ranks of the group: the first tp devices")
    parser.add_argument("--capacity", type=int, default=64, help="capacity_m of both mailboxes")
    parser.add_argument("--problem", type=int, default=0,
                        help=f"index into gpu_matrix.DEFAULT_PROBLEMS (prebuilt): "
                             f"{list(enumerate(gpu_matrix.DEFAULT_PROBLEMS))}")
    parser.add_argument("--second", choices=("twoshot", "reduce_scatter"), default="twoshot",
                        help="what mailbox B runs: all-reduce with the twoshot kernels, or reduce_scatter")
    parser.add_argument("--second-fraction", type=float, default=1 / 3, help="share of calls on mailbox B")
    parser.add_argument("--check-every", type=int,
                        help="calls in flight before the host checks them (default 256 on GPUs; 1 on "
                             "CPUs, whose runtime deadlocked here with several collective programs in flight)")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="the mailboxes' wait timeout")
    parser.add_argument("--impl", choices=("kernel", "reference"), default="kernel")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args(argv)

    if args.tp < 2:
        parser.error(f"--tp {args.tp}: expected at least 2 ranks (tp = 1 has no group to soak)")
    devices = jax.devices()[:args.tp]
    if len(devices) < args.tp or (args.impl == "kernel" and devices[0].platform != "gpu"):
        print(f"soak: needs {args.tp} GPUs for impl={args.impl!r}, JAX sees {jax.devices()}", file=sys.stderr)
        return 2
    problem = gpu_matrix.DEFAULT_PROBLEMS[args.problem]
    check_every = args.check_every or (256 if devices[0].platform == "gpu" else 1)
    mesh = jax.sharding.Mesh(np.array(devices), (AXIS,))
    num_rows = 2 * args.capacity
    rng = np.random.default_rng(args.seed)
    common = dict(hidden=problem.hidden, capacity_m=args.capacity, timeout_s=args.timeout_s)
    mailboxes = {
        "A": jmp.Mailbox(mesh, AXIS, result="allreduce", **common),
        "B": jmp.Mailbox(mesh, AXIS, result="allreduce" if args.second == "twoshot" else "reduce_scatter",
                         **common),
    }
    steps: dict = {}
    counts = {"A": 0, "B": 0}
    compile_s = 0.0
    worst = 0.0
    failures: list[str] = []
    pending: list = []

    def check_pending() -> None:
        nonlocal worst
        for (call, name, m), (ratio, nonfinite, differ) in zip(
            [p[0] for p in pending], jax.device_get([p[1] for p in pending])
        ):
            worst = max(worst, float(ratio))
            if not ratio <= 1.0 or nonfinite or differ:
                failures.append(f"call {call} on mailbox {name}, m={m}: error {ratio:.3g} of the bound, "
                                f"{int(nonfinite)} non-finite, {int(differ)} elements differ between ranks")
        pending.clear()

    start = time.monotonic()
    try:
        with mailboxes["A"].diagnose(), mailboxes["B"].diagnose():
            for call in range(args.calls):
                name = "B" if rng.random() < args.second_fraction else "A"
                m = int(rng.integers(1, args.capacity, endpoint=True))
                fresh = (name, m) not in steps
                if fresh:
                    twoshot = name == "B" and args.second == "twoshot"
                    steps[name, m] = make_step(mailboxes[name], m, problem, num_rows, args.seed,
                                               args.impl, twoshot)
                began = time.monotonic()
                errors = steps[name, m](np.int32(call))
                if fresh:  # the first call compiles the step: time it apart
                    errors.block_until_ready()
                    compile_s += time.monotonic() - began
                pending.append(((call, name, m), errors))
                counts[name] += 1
                if len(pending) >= check_every or call == args.calls - 1:
                    check_pending()
                    if failures:
                        break
                if (call + 1) % 2000 == 0:
                    print(f"soak: {call + 1} calls, worst error {worst:.3f} of the bound, "
                          f"{time.monotonic() - start:.1f} s elapsed", flush=True)
            for mailbox in mailboxes.values():
                mailbox.check()
    except Exception as error:  # a timed-out wait arrives here as MailboxStatusError
        print(f"soak: ERROR after {sum(counts.values())} calls: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    duration = time.monotonic() - start - compile_s
    for mailbox in mailboxes.values():
        mailbox.close()

    calls = sum(counts.values())
    summary = {
        "passed": not failures, "tp": args.tp, "calls": calls, "calls_per_mailbox": counts, "impl": args.impl,
        "mailbox_b": args.second, "capacity": args.capacity, "problem": vars(problem),
        "duration_s": round(duration, 3), "compile_s": round(compile_s, 3), "steps_compiled": len(steps),
        "worst_error_over_bound": worst, "failures": failures[:20],
    }
    print(f"soak: {'PASS' if not failures else 'FAIL'} {calls} calls at tp = {args.tp} (A oneshot {counts['A']}, "
          f"B {args.second} {counts['B']}) in {duration:.1f} s, plus {compile_s:.1f} s compiling "
          f"{len(steps)} steps; worst error {worst:.3f} of the bound")
    for failure in failures[:20]:
        print(f"  {failure}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(summary, file, indent=2)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
