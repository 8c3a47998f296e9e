"""The experts kernels' routing tables alone, compiled for `routing_time.cu` to time on a GPU.

Every CTA of the experts kernels builds the call's routing tables before its first weight
load (`jax_moe_publish.kernels.expert_routing.ExpertRouting`). This compiles a kernel that does
only that, with the gate/up kernel's threads per CTA and shared memory for the tables, then
writes its totals (active groups, valid pairs) to ``totals[2 * block]``, so that the host can
check them. Where CuTe DSL is (no GPU needed):

    python benchmarks/routing_probe.py --out DIR

writes ``DIR/routing-<shard>.cubin`` per shard of `SHARDS` (and ``routing-<shard>-warp.cubin``
with `ExpertsConfig.warp_routing`), and ``DIR/routing.txt``, one line
per cubin: its file, kernel symbol, threads, shared memory bytes, experts, top_k and whether
the shared expert is held, which `routing_time.cu` reads.
"""

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax_moe_publish as jmp  # noqa: E402
from jax_moe_publish.experts_config import routing_bytes  # noqa: E402

SHARDS = {
    # DeepSeek-V3's tp = 8 shard, its shared expert held (top_k + 1 pairs per token), and not.
    "deepseek-v3-shared": dict(hidden=7168, intermediate=256, experts=256, top_k=8, shared_expert=True),
    "deepseek-v3": dict(hidden=7168, intermediate=256, experts=256, top_k=8),
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=96, experts=128, top_k=8),
}


def compile_probe(config):
    """``(cubin bytes, kernel symbol, threads, shared memory bytes, PTX)`` of the probe of ``config``."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    from jax_moe_publish.kernels import ptx
    from jax_moe_publish.kernels.expert_routing import ACTIVE, VALID, ExpertRouting

    shape = config.gemm("gate_up")
    threads = shape.threads
    smem = routing_bytes(config.groups, config.experts, threads // 32)

    class RoutingProbe:
        def __init__(self):
            self.routing = ExpertRouting(config, shape)

        @cute.kernel
        def routing_probe(self, expert_ids: Int64, totals: Int64, m: Int32) -> None:
            tidx, _, _ = cute.arch.thread_idx()
            block, _, _ = cute.arch.block_idx()
            tables = self.routing.allocate()
            self.routing.build(tables, expert_ids, m, tidx)
            sTotals = tables[4]
            if tidx == 0:
                ptx.store_u32(totals + Int64(block) * 8, sTotals[ACTIVE])
                ptx.store_u32(totals + Int64(block) * 8 + 4, sTotals[VALID])

        @cute.jit
        def __call__(self, expert_ids: Int64, totals: Int64, m: Int32, stream: cuda.CUstream) -> None:
            self.routing_probe(expert_ids, totals, m).launch(grid=(1, 1, 1), block=(threads, 1, 1), smem=smem,
                                                            stream=stream)

    with tempfile.TemporaryDirectory() as dump_dir:
        compiled = cute.compile(RoutingProbe(), Int64(0), Int64(0), Int32(0), cuda.CUstream(0),
                                options=f"--gpu-arch {config.arch} --keep-cubin --keep-ptx --dump-dir {dump_dir}")
    symbols = [s for s in compiled.kernel_info if "routing_probe" in s]
    if len(symbols) != 1:
        raise RuntimeError(f"expected one routing_probe kernel, found {list(compiled.kernel_info)}")
    return compiled.__cubin__, symbols[0], threads, smem, compiled.__ptx__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the cubins and routing.txt")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, fields in SHARDS.items():
        # Each shard as the op builds its tables, and with `ExpertsConfig.warp_routing`.
        for suffix, warp_routing in (("", False), ("-warp", True)):
            config = jmp.ExpertsConfig.for_shape(**fields).replace(warp_routing=warp_routing)
            cubin, symbol, threads, smem, _ = compile_probe(config)
            path = out / f"routing-{name}{suffix}.cubin"
            path.write_bytes(cubin)
            lines.append(f"{path.name} {symbol} {threads} {smem} {config.experts} {config.top_k} "
                         f"{int(config.shared_expert)}")
            print(lines[-1], flush=True)
    (out / "routing.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
