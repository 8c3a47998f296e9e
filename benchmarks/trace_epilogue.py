"""Per-CTA clock trace of the fused epilogue kernel (KernelConfig.trace), in the benchmark's chain.

Each CTA's thread 0 writes 16 int64 into its own region of row ``first_row`` of
``out`` (so the last layer's ``out``, which the chain returns, holds that
layer's trace): 0 globaltimer at entry, 1 clock at entry, 2 after
griddepcontrol.wait, 3 after the publishes, 4 after the cluster wait, 5/8 row
0/1 polled and added, 6/9 row sum done, 7/10 stores issued, 11 clock at exit,
12 globaltimer at exit, 13 SM, 14 rows.
"""
import json
import sys

import jax
import numpy as np

import bench_moe_publish as bench
import jax_moe_publish as jmp

NAME = "deepseek-v3+rmsnorm"


def trace(mesh, m, iterations=8):
    problem = bench.problem_spec(NAME)
    config = bench.case_config(NAME, 2, "oneshot", m).replace(trace=True)
    with jmp.Mailbox(mesh, "tp", hidden=problem["hidden"], capacity_m=m) as mailbox:
        fn = bench.make_chain("ours", mailbox, problem, config, iterations)
        inputs = bench.chain_inputs(mesh, m, problem, jax.random.key(m))
        runs = []
        for _ in range(5):
            y = np.asarray(jax.device_get(fn(*inputs))).view(np.uint16)
            clusters = min(m, -(-m // config.waves))
            records = []
            for row in range(clusters):
                for cta in range(config.ctas_per_token):
                    start = cta * config.threads * config.elements_per_thread
                    records.append(y[row, start:start + 64].copy().view(np.int64).tolist())
            runs.append(records)
        mailbox.check()
    return {"m": m, "config": config.key, "ctas_per_token": config.ctas_per_token, "waves": config.waves,
            "runs": runs}


def summarize(result):
    rows = []
    for records in result["runs"]:
        r = np.array(records, dtype=np.int64)
        start = r[:, 1]
        rel = (r[:, 1:12] - start[:, None]).astype(float)
        gt0, gt1 = r[:, 0], r[:, 12]
        cycles_per_ns = (r[:, 11] - r[:, 1]).sum() / max(1, (gt1 - gt0).sum())
        rows.append((cycles_per_ns, rel, gt0 - gt0.min(), gt1 - gt0.min()))
    for cycles_per_ns, rel, g0, g1 in rows[-2:]:
        ns = rel / cycles_per_ns
        names = ["entry", "pdl_wait", "published", "cluster_wait", "r0_polled", "r0_sum", "r0_stored",
                 "r1_polled", "r1_sum", "r1_stored", "exit"]
        print(f"m={result['m']} cycles/ns={cycles_per_ns:.3f} entry spread (gt) {g0.min()}..{g0.max()} ns, "
              f"exit (gt) {g1.min()}..{g1.max()} ns")
        for i, name in enumerate(names):
            col = ns[:, i]
            print(f"  {name:13s} p10 {np.percentile(col, 10):8.0f} p50 {np.median(col):8.0f} "
                  f"p90 {np.percentile(col, 90):8.0f} max {col.max():8.0f} ns")


def main():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    results = [trace(mesh, m) for m in map(int, sys.argv[2:])]
    for result in results:
        summarize(result)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
