"""Per-CTA clock trace of the fused epilogue kernel (KernelConfig.trace), in the benchmark's chain.

Each CTA's thread 0 writes 16 int64 into its own region of row ``first_row`` of
``out`` (so the last layer's ``out``, which the chain returns, holds that
layer's trace): 0 globaltimer at entry, 1 clock at entry, 2 after
griddepcontrol.wait, 3 after the publishes, 4 the previous layer's exit
globaltimer (read from the shared input), then for
rows 0 and 1 (5 to 9, 10 to 14): poll started, polled and added, CTA barrier
of the row sum passed, row sum done, stores issued; 15 globaltimer at exit.
"""
import json
import sys

import jax
import numpy as np

import bench_moe_publish as bench
import jax_moe_publish as jmp

NAME = "deepseek-v3+rmsnorm"


def trace(mesh, m, exchange_wait, iterations=8):
    problem = bench.problem_spec(NAME)
    config = bench.case_config(NAME, 2, "oneshot", m).replace(trace=True, residual_ahead=bool(exchange_wait))
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
    return {"m": m, "residual_ahead": bool(exchange_wait), "config": config.key, "ctas_per_token": config.ctas_per_token, "waves": config.waves,
            "runs": runs}


NAMES = (["entry", "pdl_wait", "published", "previous_exit"]
         + [f"r{r}_{what}" for r in range(2) for what in ("poll_start", "polled", "cta_ready", "sum", "stored")]
         + ["exit"])
CYCLES_PER_NS = 1.98  # SM clock 1980 MHz (nvidia-smi; 1.971 to 1.980 clocks per globaltimer ns measured)


def timeline(records):
    """[CTA, point] ns since the first CTA's entry: globaltimer at entry plus own clock since."""
    r = np.array(records, dtype=np.int64)
    origin = r[:, 0].min()
    entry = (r[:, 0] - origin).astype(float)
    out = entry[:, None] + (r[:, 1:16] - r[:, 1:2]) / CYCLES_PER_NS
    out[r[:, 1:16] == 0] = np.nan
    # Globaltimer columns: the previous layer's exit (read by this CTA) and this CTA's exit.
    out[:, 3] = r[:, 4] - origin
    out[:, 14] = r[:, 15] - origin
    return out


def summarize(result):
    cluster = result["ctas_per_token"]
    for records in result["runs"][-2:]:
        ns = timeline(records)
        print(f"m={result['m']} residual_ahead={result['residual_ahead']} ({result['config']}, {len(records) // cluster} clusters of {cluster}): "
              f"previous layer's last exit {np.nanmax(ns[:, 3]):.0f} ns, this layer's first entry 0, "
              f"first pdl_wait {np.nanmin(ns[:, 1]):.0f}, last exit {np.nanmax(ns[:, 14]):.0f}")
        for i, name in enumerate(NAMES):
            col = ns[:, i]
            if np.isnan(col).any():
                continue
            print(f"  {name:14s} p10 {np.percentile(col, 10):6.0f} p50 {np.median(col):6.0f} "
                  f"p90 {np.percentile(col, 90):6.0f} max {col.max():6.0f} ns")
        by_cluster = ns.reshape(-1, cluster, ns.shape[1])
        for row in range(2):
            base = 4 + 5 * row  # poll_start of the row, in timeline columns
            if np.isnan(by_cluster[:, :, base + 3]).any():
                continue
            last_ready = by_cluster[:, :, base + 2].max(axis=1)
            sums = by_cluster[:, :, base + 3]
            poll = (by_cluster[:, :, base + 1] - by_cluster[:, :, base]).ravel()
            print(f"  r{row}: row sum after the cluster's last CTA barrier: p50 "
                  f"{np.median(sums.min(axis=1) - last_ready):.0f} ns, max {np.max(sums.max(axis=1) - last_ready):.0f}; "
                  f"CTA barrier after thread 0 polled: p50 "
                  f"{np.median(by_cluster[:, :, base + 2] - by_cluster[:, :, base + 1]):.0f} ns; "
                  f"thread 0 poll + add: p10 {np.percentile(poll, 10):.0f} p50 {np.median(poll):.0f} ns")


def main():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    results = [trace(mesh, m, wait) for wait in map(int, sys.argv[2].split(",")) for m in map(int, sys.argv[3:])]
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
    for result in results:
        summarize(result)


if __name__ == "__main__":
    main()
