"""Side-by-side timing of jax-moe-publish against XLA's finalize + psum, on the same GPUs in one run.

For every case one ``jit`` + ``shard_map`` runs a ``fori_loop`` whose body is a
chain of L = 32 layers, each layer with its own inputs (so XLA can neither
hoist nor merge layers) and each layer's output fed into the next layer's
shared-expert input, as in a model (without a shared expert, the output is
tied to the next layer's router weights by a tiny fusion, on both paths):

* ``ours``: `moe_finalize_publish` (the kernels);
* ``xla``: the same finalize in ``jnp`` followed by ``lax.psum`` (tp > 1), or
  the ``jnp`` finalize alone, which XLA fuses (tp = 1).

Time per call = ``(T(12 iterations) - T(4 iterations)) / (8 * 32)``: one
dispatch per run, so host dispatch cancels, and the loop's own cost per
iteration is spread over 32 calls. Each T is the median of ``--reps`` timed
runs after a warm-up; the spread is the 10th-90th percentile of the paired
per-call estimates.

    python benchmarks/bench_moe_publish.py --out results.json [--no-command-buffer]
"""

from __future__ import annotations

import argparse
import os
import sys


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for every figure")
    parser.add_argument("--problems", nargs="+", default=["deepseek-v3", "qwen3-moe"])
    parser.add_argument("--m", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["oneshot", "twoshot"])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-command-buffer", action="store_true",
                        help="turn XLA command buffers (CUDA graphs) off for this run")
    parser.add_argument("--hlo", help="write the optimized HLO of the first case's chains here")
    return parser.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.no_command_buffer:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import datetime  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_moe_publish as jmp  # noqa: E402

LAYERS = 32
SHORT, LONG = 4, 12  # loop iterations
PROBLEMS = {
    "deepseek-v3": dict(hidden=7168, top_k=8, shared=True, scale=2.5),
    "qwen3-moe": dict(hidden=4096, top_k=8, shared=False, scale=1.0),
}


def xla_finalize(routed, weights, indices, shared, scale):
    """The finalize a JAX user writes: gather, float32 weighted sum, round to bf16."""
    valid = (indices >= 0) & (indices < routed.shape[0])
    rows = jnp.take(routed, jnp.where(valid, indices, 0), axis=0).astype(jnp.float32)
    w = jnp.where(valid, weights.astype(jnp.float32) * scale, 0.0)
    out = jnp.einsum("mk,mkh->mh", w, rows)
    if shared is not None:
        out = out + shared.astype(jnp.float32)
    return out.astype(jnp.bfloat16)


def make_chain(impl, mailbox, problem, config, iterations):
    """``iterations`` passes over a chain of LAYERS calls, in one jitted program."""
    scale, with_shared, top_k = problem["scale"], problem["shared"], problem["top_k"]

    def layer(args, y):
        routed, weights, indices = args
        if not with_shared:
            weights = weights + 0.0 * y[:, :top_k].astype(jnp.float32)
        if impl == "ours":
            return jmp.moe_finalize_publish(routed, weights, indices, y if with_shared else None,
                                            mailbox=mailbox, routed_scaling_factor=scale,
                                            impl="kernel", config=config)
        out = xla_finalize(routed, weights, indices, y if with_shared else None, scale)
        return lax.psum(out, "tp") if mailbox.tp > 1 else out

    def shard(routed, weights, indices, shared):
        def body(_, y):
            for index in range(LAYERS):
                y = layer((routed[index][0], weights[index][0], indices[index][0]), y)
            return y

        return lax.fori_loop(0, iterations, body, shared[0])

    # Without varying-axes types the loop carry's type need not track psum (and tp = 1,
    # where XLA's path has no psum).
    return jax.jit(jax.shard_map(shard, mesh=mailbox.mesh, in_specs=P("tp"), out_specs=P(),
                                 check_vma=False))


def chain_inputs(mesh, m, problem, key):
    """Per-layer lists of [tp, ...] arrays (routed, weights, indices) and the first shared input."""
    tp, hidden, top_k = mesh.shape["tp"], problem["hidden"], problem["top_k"]
    num_rows = m * top_k
    sharding = jax.sharding.NamedSharding(mesh, P("tp"))

    def put(x):
        return jax.device_put(x, sharding)

    routed, weights, indices = [], [], []
    for layer_key in jax.random.split(key, LAYERS):
        keys = jax.random.split(layer_key, 3)
        routed.append(put(jax.random.normal(keys[0], (tp, num_rows, hidden), jnp.bfloat16)))
        weights.append(put(jax.random.uniform(keys[1], (tp, m, top_k), jnp.float32, 0.0, 0.25)))
        # Each token's experts are distinct rows, as after a routing permutation.
        order = jax.random.permutation(keys[2], num_rows).reshape(m, top_k).astype(jnp.int32)
        indices.append(put(jnp.broadcast_to(order, (tp, m, top_k))))
    shared = put(jax.random.normal(key, (tp, m, hidden), jnp.bfloat16) * 0.1)
    return routed, weights, indices, shared


def time_runs(fn, args, reps):
    fn(*args).block_until_ready()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return np.array(times)


def per_call_us(programs, inputs, reps):
    """Median per-call time and the 10-90 % spread of paired per-call estimates."""
    short = time_runs(programs[SHORT], inputs, reps)
    long = time_runs(programs[LONG], inputs, reps)
    calls = (LONG - SHORT) * LAYERS
    estimates = (np.sort(long) - np.sort(short)) / calls * 1e6
    median = (np.median(long) - np.median(short)) / calls * 1e6
    return {"us": float(median), "p10": float(np.percentile(estimates, 10)),
            "p90": float(np.percentile(estimates, 90))}


def measure_case(mesh, name, m, mode, reps, key):
    problem = PROBLEMS[name]
    tp = mesh.shape["tp"]
    mode = mode if tp > 1 else "direct"
    config = jmp.KernelConfig.default(
        hidden=problem["hidden"], top_k=problem["top_k"], tp=tp, mode=mode,
        routed_scaling_factor=problem["scale"], include_shared_expert=problem["shared"],
        fp32_weights=True,
    )
    result = {"problem": name, "m": m, "tp": tp, "mode": mode}
    with jmp.Mailbox(mesh, "tp", hidden=problem["hidden"], capacity_m=m) as mailbox:
        inputs = chain_inputs(mesh, m, problem, key)
        outputs = {}
        for impl in ("ours", "xla"):
            programs = {n: make_chain(impl, mailbox, problem, config, n) for n in (1, SHORT, LONG)}
            outputs[impl] = np.asarray(programs[1](*inputs), np.float64)
            result[impl] = per_call_us(programs, inputs, reps)
            if ARGS.hlo and not os.path.exists(f"{ARGS.hlo}.{impl}.txt"):
                with open(f"{ARGS.hlo}.{impl}.txt", "w") as f:
                    f.write(programs[SHORT].lower(*inputs).compile().as_text())
        mailbox.check()
    # Both chains compute the same layers: their outputs must agree before their times count.
    difference = np.linalg.norm(outputs["ours"] - outputs["xla"]) / np.linalg.norm(outputs["xla"])
    result["relative_difference"] = float(difference)
    result["ratio"] = result["ours"]["us"] / result["xla"]["us"]
    return result


def environment():
    gpu = jax.devices()[0]
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().splitlines()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(__file__)).stdout.strip()
    return {"date": datetime.date.today().isoformat(), "gpu": gpu.device_kind, "gpus": smi,
            "jax": jax.__version__, "commit": commit or os.environ.get("JMP_COMMIT", "unknown"),
            "command_buffer": not ARGS.no_command_buffer, "layers": LAYERS,
            "iterations": [SHORT, LONG], "reps": ARGS.reps}


def main():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    results = []
    key = jax.random.key(0)
    print(f"{'problem':12} {'tp':>2} {'mode':8} {'m':>5} {'ours us':>9} {'xla us':>9} {'ratio':>6} {'diff':>8}")
    for tp in ARGS.tp:
        if tp > len(gpus):
            print(f"skipping tp={tp}: {len(gpus)} GPU(s)")
            continue
        mesh = jax.sharding.Mesh(np.array(gpus[:tp]), ("tp",))
        for name in ARGS.problems:
            for mode in (ARGS.modes if tp > 1 else ["direct"]):
                for m in ARGS.m:
                    key, sub = jax.random.split(key)
                    r = measure_case(mesh, name, m, mode, ARGS.reps, sub)
                    results.append(r)
                    print(f"{name:12} {tp:>2} {r['mode']:8} {m:>5} {r['ours']['us']:9.2f} "
                          f"{r['xla']['us']:9.2f} {r['ratio']:6.3f} {r['relative_difference']:8.1e}",
                          flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump({"environment": environment(), "results": results}, f, indent=1)
    print(f"wrote {ARGS.out}")


if __name__ == "__main__":
    sys.exit(main())
