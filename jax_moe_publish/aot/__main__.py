"""``python -m jax_moe_publish.aot build``: compile kernel sets into a folder.

Examples::

    python -m jax_moe_publish.aot build --preset deepseek-v3 --out kernels/
    python -m jax_moe_publish.aot build --hidden 7168 --top-k 8 --tp 2 --out kernels/
    python -m jax_moe_publish.aot build --op experts --hidden 7168 --intermediate 256 --experts 256 \
        --top-k 8 --out kernels/
    python -m jax_moe_publish.aot build --experts-model 7168,2048,384,8 --experts-tp 4 8 --out kernels/

Point ``$JAX_MOE_PUBLISH_KERNEL_DIR`` at the folder on machines without CuTe DSL.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time

from jax_moe_publish import protocol, tuning
from jax_moe_publish.aot import compile as aot_compile
from jax_moe_publish.aot import presets
from jax_moe_publish.aot.artifact import CONFIGS
from jax_moe_publish.config import ALGORITHMS, EPILOGUES, result_of
from jax_moe_publish.experts_config import ExpertsConfig
from jax_moe_publish.testing import gpu_matrix

PRESETS = {"tests": gpu_matrix.all_configs, "deepseek-v3": presets.deepseek_v3, "qwen3-moe": presets.qwen3_moe}
CHOICES = {"algorithm": ALGORITHMS, "epilogue": EPILOGUES}
"""Flags of a fixed set of values, which argparse checks: the tuning table reads them before
`KernelConfig` would."""


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false", "1", "0"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return lowered in ("true", "1")


def _experts_model(text: str) -> tuple[int, int, int, int, bool]:
    """``HIDDEN,INTERMEDIATE,EXPERTS,TOP_K[,shared]`` as a `presets.experts` shape."""
    parts = text.split(",")
    shared = parts[4:] == ["shared"]
    if len(parts) - shared != 4 or not all(part.isdigit() and int(part) > 0 for part in parts[:4]):
        raise argparse.ArgumentTypeError(f"{text!r}: expected HIDDEN,INTERMEDIATE,EXPERTS,TOP_K (positive ints, "
                                         "the model's unsharded intermediate), then ',shared' for a shared expert "
                                         "of that intermediate")
    return (*map(int, parts[:4]), shared)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jax_moe_publish.aot")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="compile kernel sets into --out")
    build.add_argument("--out", required=True, help="folder for <key>.cubin/.ptx/.json")
    build.add_argument("--preset", action="append", choices=sorted(PRESETS), default=[],
                       help="a named list of configs (repeatable)")
    build.add_argument("--experts-model", action="append", type=_experts_model, default=[],
                       metavar="HIDDEN,INTERMEDIATE,EXPERTS,TOP_K[,shared]",
                       help="every experts-op set of a model's routed experts, sharded at each --experts-tp, as a "
                            "preset holds them (repeatable)")
    build.add_argument("--experts-tp", type=int, nargs="+", default=list(presets.TP_SIZES), metavar="TP",
                       help=f"the TP sizes of --experts-model (default {' '.join(map(str, presets.TP_SIZES))})")
    build.add_argument("--op", choices=sorted(CONFIGS), default="publish",
                       help="the op of an explicit config: its flags are that config class's fields")
    types = {int: int, float: float, bool: _bool, str: str}
    for field in _fields():
        default = field.default
        if default is None:  # keep_own_partial (None: fuse_reduce's), gate_up_token_tiles (None: token_tiles)
            kind = _bool if str(field.type).startswith("bool") else int
        else:
            kind = types[type(default)] if default is not dataclasses.MISSING else int
        owners = "/".join(cls.__name__ for cls in CONFIGS.values() if field.name in _names(cls))
        build.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, type=kind,
                           choices=CHOICES.get(field.name), default=None, help=f"{owners}.{field.name}")
    return parser


def _names(cls) -> list[str]:
    return [field.name for field in dataclasses.fields(cls)]


def _fields() -> list:
    """The fields of every op's config class, each name once (ops share hidden, top_k, ...)."""
    fields = {}
    for cls in CONFIGS.values():
        for field in dataclasses.fields(cls):
            fields.setdefault(field.name, field)
    return list(fields.values())


def _configs(args) -> list:
    explicit = {f.name: getattr(args, f.name) for f in _fields()}
    arch = explicit.pop("arch") or "sm_90a"
    configs = [c for name in args.preset for c in PRESETS[name](arch)]
    for hidden, intermediate, count, top_k, shared in args.experts_model:
        uneven = [tp for tp in args.experts_tp if tp < 1 or intermediate % tp]
        if uneven:
            raise SystemExit(f"--experts-tp {' '.join(map(str, uneven))}: expected TP sizes that divide the "
                             f"intermediate of --experts-model {hidden},{intermediate},{count},{top_k} evenly")
        for tp in args.experts_tp:
            try:
                configs += presets.experts([(hidden, intermediate, count, top_k, shared)], arch, tps=(tp,))
            except ValueError as error:
                raise SystemExit(f"--experts-model {hidden},{intermediate},{count},{top_k} at tp {tp} (intermediate "
                                 f"{intermediate // tp} per rank): {error}") from None
    given = {name: value for name, value in explicit.items() if value is not None}
    others = sorted(set(given) - set(_names(CONFIGS[args.op])))
    if others:
        flags = " ".join(f"--{name.replace('_', '-')}" for name in others)
        raise SystemExit(f"{flags}: not a field of {CONFIGS[args.op].__name__} (--op {args.op}); expected flags of "
                         f"{', '.join(_names(CONFIGS[args.op]))}")
    if given and args.op == "experts":
        missing = [name for name in ("hidden", "intermediate", "experts", "top_k") if name not in given]
        if missing:
            raise SystemExit(f"an explicit experts config needs --{' --'.join(missing).replace('_', '-')}")
        shape = {name: given[name] for name in ("hidden", "intermediate", "experts", "top_k")}
        base = ExpertsConfig.for_shape(**shape, fused_gate_up=given.get("fused_gate_up", True),
                                       fp8_weights=given.get("fp8_weights", False), arch=arch)
        configs.append(base.replace(**given))
    elif given:
        missing = [name for name in ("hidden", "top_k", "tp") if name not in given]
        if missing:
            raise SystemExit(f"an explicit config needs --{' --'.join(missing).replace('_', '-')}")
        tp, epilogue = given["tp"], given.get("epilogue", "none")
        if not 1 <= tp <= protocol.MAX_TP:
            raise SystemExit(f"--tp {tp}: expected an int in [1, {protocol.MAX_TP}], the size of the TP group")
        if tp == 1 and epilogue != "none":
            raise SystemExit(f"--epilogue {epilogue} with --tp 1: expected --tp 2 or more, or no --epilogue; with "
                             "tp = 1 the op runs the epilogue in jnp after the direct kernel, whose set has none")
        algorithm = given.get("algorithm")
        # The tuning table's shape for large m, then the flags given.
        base = tuning.kernel_config(tuning.Problem(given["hidden"], given["top_k"]), tp=given["tp"], m=None,
                                    result=result_of(algorithm) if algorithm else "allreduce", epilogue=epilogue,
                                    algorithm=algorithm, arch=arch)
        configs.append(base.replace(**given))
    if not configs:
        raise SystemExit("nothing to build: give --preset, --experts-model or an explicit config "
                         "(--hidden --top-k --tp)")
    return list(dict.fromkeys(configs))


def _writable_folder(out: str) -> pathlib.Path:
    """``--out`` as a folder that exists or is made now, and that this process can write in:
    checked before the first compile, which may be hours before the last."""
    path = pathlib.Path(out)
    if path.exists() and not path.is_dir():
        raise SystemExit(f"--out {out}: expected a folder, but it is a file")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise SystemExit(f"--out {out}: cannot make or write in this folder ({error.strerror or error}); expected "
                         "a folder that exists or can be made, and that this process can write in") from None
    return path


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        configs = _configs(args)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    out = _writable_folder(args.out)
    for index, config in enumerate(configs, 1):
        start = time.perf_counter()
        aot_compile.compile_config(config).save(out)
        print(f"[{index}/{len(configs)}] {config.key}  {time.perf_counter() - start:.1f} s", flush=True)
    print(f"built {len(configs)} kernel sets into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
