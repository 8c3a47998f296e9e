"""A decode stack of model-shaped MoE blocks (`moe_block.py`) on every local GPU, checked
against a float64 NumPy model.

    python examples/moe_block_decode.py [--problems deepseek-v3 qwen3-moe] [--paths ragged decode ours]
        [--tokens 8] [--layers 3] [--experts N] [--check-layers N] [--steps 10]

On NVIDIA GPUs the TP group is every local GPU, the dimensions are the models' own and
the finalize runs the jax-moe-publish kernels; ``--experts`` scales the expert count down
where the weights would not fit (the output states it, with the weights' bytes per GPU).
Without a GPU it runs on 4 virtual CPU devices, on the reference path, at small
dimensions, and says so.

For each problem and GEMM path it runs the stack once and checks that every rank's
``out`` and ``residual_out`` are bitwise equal. Then, layer by layer (each layer given
the previous one's computed outputs), it compares

* the block with `moe_block_model.numpy_layer`: the exact float64 layer, with a bound
  propagated from each of the block's rounding points (bf16 GEMM outputs from float32
  sums, the SwiGLU, the partials, the group's sum, the residual add and RMSNorm), each
  rounding error modelled as independent and the bound six standard deviations: a
  bound with every rounding at its worst exceeds the values themselves at hidden 7168;
* the op's part with `moe_block_model.op_part`: the float64 finalize, group sum and
  epilogue of the block's own finalize arguments (`model.py`), with the op's tight
  worst-case bounds;

and prints ‖Δ‖/‖ref‖ and the largest share of the bound used. A token that the block's
float32 router sends to other experts than the float64 one is left out of the block
check and counted; it must be a near-tie (a gap at a selection boundary within the
float32 router's error bound). It exits non-zero if an element leaves its bound, a
relative error exceeds ``MAX_RELATIVE``, a token is routed otherwise without a tie or
two ranks differ. The time per layer it
prints is host-timed around whole steps; ``benchmarks/bench_moe_block.py`` times it
properly. ``--rank-processes N`` runs a group of N ranks as N processes that share the GPUs
(`platform_choice`): tp = N on one GPU, with ``--experts`` small enough for N shards of the
weights on it; the times then mean nothing.
"""

from __future__ import annotations

import argparse
import time

import platform_choice  # examples/ is on sys.path (choose before JAX is imported)

CPU_DEVICES = 4
ON_GPU = platform_choice.choose(CPU_DEVICES)

import functools  # noqa: E402

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import numpy as np  # noqa: E402

import jax_moe_publish as jmp  # noqa: E402
import moe_block as mb  # noqa: E402  (examples/ is on sys.path)
import moe_block_model as bm  # noqa: E402
from jax_moe_publish.testing import rank_processes  # noqa: E402

# Small dimensions for CPU runs: every split over 4 ranks, the routers' structure kept.
CPU_DIMS = dict(hidden=256, intermediate=128, experts=32, shared_intermediate=128)
MAX_RELATIVE = 1e-2
MEMORY_SHARE = 0.8  # of a GPU's memory for the weights; the rest for XLA's buffers and the mailbox


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=list(mb.PROBLEMS), choices=list(mb.PROBLEMS))
    parser.add_argument("--paths", nargs="+", default=list(mb.PATHS), choices=list(mb.PATHS))
    parser.add_argument("--tokens", type=platform_choice.positive_int, default=8, help="m, tokens per decode step")
    parser.add_argument("--layers", type=platform_choice.positive_int, default=3)
    parser.add_argument("--experts", type=platform_choice.positive_int,
                        help="scale the expert count down to this, at least each problem's top-k (default: the "
                             "model's)")
    parser.add_argument("--check-layers", type=platform_choice.positive_int,
                        help="layers compared with the NumPy model, at most --layers (default: all on CPU, 1 on "
                             "GPUs)")
    parser.add_argument("--steps", type=platform_choice.non_negative_int, default=10,
                        help="host-timed decode steps (0: none)")
    platform_choice.add_rank_processes(parser)
    args = parser.parse_args()
    if args.check_layers is not None and args.check_layers > args.layers:
        parser.error(f"argument --check-layers: expected at most --layers {args.layers}, got {args.check_layers}")
    for name in args.problems:
        top_k = mb.PROBLEMS[name].top_k
        if args.experts is not None and args.experts < top_k:
            parser.error(f"argument --experts: expected at least {name}'s top-k {top_k}, got {args.experts}")
    return args


def problem_config(name, experts):
    base = mb.PROBLEMS[name]
    dims = {} if ON_GPU else CPU_DIMS
    return mb.scaled(base, **{**dims, **({} if experts is None else {"experts": experts})})


def check_memory(config, tp, layers, device, prepared):
    """Stop before allocating where the weights (``prepared``: with their prepared copy) would
    not fit on one GPU; the bytes per GPU (per rank: rank processes that share a GPU each hold
    their shards)."""
    needed = layers * config.weight_bytes(tp, prepared)
    if not ON_GPU:
        return needed
    sharing = rank_processes.current()
    if sharing is not None:
        needed *= -(-sharing.processes // sharing.gpus)
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit and needed > MEMORY_SHARE * limit:
        fits = mb.max_experts(config, tp, layers, int(MEMORY_SHARE * limit), prepared)
        raise SystemExit(f"{config.name}: {layers} layers need {needed / 1e9:.1f} GB per GPU, more than "
                         f"{MEMORY_SHARE:.0%} of {limit / 1e9:.1f} GB: use --experts {fits} or fewer --layers")
    return needed


def report(what, result):
    flag = "" if result["outside"] == 0 and result["relative"] <= MAX_RELATIVE else "  FAILED"
    return (f"{what} ‖Δ‖/‖ref‖ {result['relative']:.2e}, max |Δ|/bound {result['bound_use']:.2f}"
            + (f", {result['outside']} outside" if result["outside"] else "") + flag)


def check_layers(config, mesh, params, x, residual, mailbox, path, count):
    """Layers 0..count-1 against the NumPy models; True where every check holds."""
    tp = mesh.shape[mb.TP]
    one_layer = mb.make_decode(config, mesh, functools.partial(mb.moe_layer, config, path=path, finalize="ours",
                                                               mailbox=mailbox), 1)
    parts_of = mb.make_parts(config, mesh, path)
    ok = True
    host = functools.partial(jax.tree.map, rank_processes.to_host)  # every rank's parts, in every process
    for index in range(count):
        layer = params[index]
        parts, experts = jax.block_until_ready(parts_of(layer, x))
        out, residual_out = jax.block_until_ready(one_layer([layer], x, residual))
        next_x, next_residual = out, residual_out
        layer, x, residual, parts, experts, out, residual_out = host(
            (layer, x, residual, parts, experts, out, residual_out))
        model = bm.numpy_layer(config, layer, x, residual, tp, experts=experts)
        keep = ~model["rerouted"]
        op = bm.op_part(config, parts, residual, layer["norm"], residual_out)
        results = {
            "block out": bm.compare(out, model["out"], model["out_bound"], keep),
            "block residual_out": bm.compare(residual_out, model["residual_out"], model["residual_bound"], keep),
            "op part out": bm.compare(out, op["out"], op["out_bound"]),
            "op part residual_out": bm.compare(residual_out, op["residual_out"], op["residual_bound"]),
        }
        skipped = (f" ({int(np.sum(~keep))} token(s) routed otherwise at a near-tie, left out of the block check)"
                   if not keep.all() else "")
        unexplained = int(np.sum(model["unexplained"]))
        print(f"    layer {index}{skipped}:" + (f" {unexplained} token(s) ROUTED OTHERWISE WITHOUT A TIE"
                                               if unexplained else ""))
        ok &= unexplained == 0
        for what, result in results.items():
            print(f"      {report(what, result)}")
            ok &= result["outside"] == 0 and result["relative"] <= MAX_RELATIVE
        x, residual = next_x, next_residual
    return ok


def run_problem(name, args, mesh, devices):
    tp = mesh.shape[mb.TP]
    config = problem_config(name, args.experts)
    config.check_tp(tp)
    weights = check_memory(config, tp, args.layers, jax.local_devices()[0], "prepared" in args.paths)
    dims = "" if ON_GPU else " (small dimensions for CPU)"
    print(f"{config.describe()}{dims}\n  {args.layers} layers, {weights / 1e9:.3f} GB of weights per "
          f"{'GPU' if ON_GPU else 'device'}, m = {args.tokens}, tp = {tp}", flush=True)
    params = mb.init_params(jax.random.key(0), config, mesh, args.layers, prepared="prepared" in args.paths)
    x, residual = mb.init_inputs(jax.random.key(1), config, mesh, args.tokens)
    count = args.check_layers if args.check_layers is not None else (1 if ON_GPU else args.layers)
    ok = True
    with jmp.Mailbox(mesh, mb.TP, hidden=config.hidden, capacity_m=args.tokens) as mailbox:
        for path in args.paths:
            layer = functools.partial(mb.moe_layer, config, path=path, finalize="ours", mailbox=mailbox)
            step = mb.make_decode(config, mesh, layer, args.layers)
            # Every program is waited for before the next: on virtual CPU devices, programs of
            # collectives queued back to back can starve XLA's rendezvous on a small machine.
            out, residual_out = jax.block_until_ready(step(params, x, residual))
            copies = [mb.rank_copies(a) for a in (out, residual_out)]
            equal = all(np.array_equal(c, kind[0]) for kind in copies for c in kind)
            finite = bool(np.all(np.isfinite(rank_processes.to_host(out).astype(np.float32))))
            print(f"  {path} path: the {args.layers}-layer stack's out and residual_out on {len(copies[0])} ranks: "
                  f"{'bitwise equal' if equal else 'DIFFER'}{'' if finite else ', NOT FINITE'}")
            ok &= equal and finite
            ok &= check_layers(config, mesh, params, x, residual, mailbox, path, count)
            if args.steps:
                start = time.perf_counter()
                for _ in range(args.steps):
                    jax.block_until_ready(step(params, x, residual))
                per_layer = (time.perf_counter() - start) / args.steps / args.layers
                print(f"    {per_layer * 1e6:.0f} us per layer, host-timed over {args.steps} steps "
                      f"({'GPU kernels' if ON_GPU else 'CPU reference: meaningless as a time'})")
        mailbox.check()
    return ok


def main(args) -> int:
    devices = jax.devices()
    tp = len(devices)
    mesh = jax.make_mesh((tp,), (mb.TP,), devices=devices)
    shared = rank_processes.current() is not None
    if ON_GPU:
        print(f"{tp} GPU(s) ({devices[0].device_kind}): the jax-moe-publish kernels, tp={tp}, the models' dimensions"
              + (f", as {tp} rank processes that share the GPU(s): times mean nothing" if shared else ""))
    else:
        print(f"no NVIDIA GPU found: the pure-JAX reference path on {tp} "
              f"{'CPU processes' if shared else 'virtual CPU devices'}, tp={tp}, at small dimensions")
    ok = True
    for name in args.problems:
        ok &= run_problem(name, args, mesh, devices)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(platform_choice.run(main, _parse()))
