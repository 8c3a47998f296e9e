"""Compile a `KernelConfig` into a cubin and its metadata sidecar (needs CuTe DSL, no GPU)."""

from __future__ import annotations

import re
import tempfile
import threading

from jax_moe_publish.aot.artifact import KernelArtifact, source_fingerprint
from jax_moe_publish.config import KernelConfig

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+\w+")
# CuTe DSL keeps global compiler state: one compile at a time per process.
_COMPILE_LOCK = threading.Lock()


def dsl_version() -> str:
    from importlib.metadata import version

    return version("nvidia-cutlass-dsl")


def ptx_entry_params(ptx: str) -> dict[str, list[str]]:
    """Parameter types of every ``.entry`` in ``ptx``, in order (e.g. ``["u64", "u32"]``)."""
    return {name: _PARAM.findall(params) for name, params in _ENTRY.findall(ptx)}


def compile_config(config: KernelConfig) -> KernelArtifact:
    """Trace and compile every kernel of ``config`` for ``config.arch``.

    The fake scalars passed to ``cute.compile`` fix the compiled ABI: every
    buffer is one ``u64`` address, every extent one ``u32`` and ``eps`` one ``f32``.
    """
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from jax_moe_publish.kernels.program import MoePublishProgram

    program = MoePublishProgram(config)
    address, extent, eps = Int64(0), Int32(0), Float32(0.0)
    # The DSL writes the kept cubin and PTX to files too; keep them out of the caller's folder.
    with _COMPILE_LOCK, tempfile.TemporaryDirectory(prefix="jax_moe_publish-") as dump_dir:
        compiled = cute.compile(
            program,
            *([address] * 14),
            *([extent] * 4),
            eps,
            cuda.CUstream(0),
            options=f"--gpu-arch {config.arch} --keep-cubin --keep-ptx --dump-dir {dump_dir}",
        )
    entries = ptx_entry_params(compiled.__ptx__)
    symbols = list(compiled.kernel_info)
    kernels = []
    for launch in program.launches():
        matches = [s for s in symbols if s.startswith(f"kernel_cutlass_{launch.role}_")]
        if len(matches) != 1:
            raise RuntimeError(f"expected one {launch.role!r} kernel in {symbols}, found {matches}")
        symbol = matches[0]
        kernels.append(
            {
                "role": launch.role,
                "symbol": symbol,
                "block": launch.block,
                "smem": launch.smem,
                "ctas_per_row": launch.ctas_per_row,
                "rows": launch.rows,
                "waves": launch.waves,
                "params": entries[symbol],
            }
        )
    metadata = {
        "key": config.key,
        "config": config.to_dict(),
        "arch": config.arch,
        "dsl_version": dsl_version(),
        "source_fingerprint": source_fingerprint(),
        "pdl": config.enable_pdl,
        "kernels": kernels,
    }
    return KernelArtifact(cubin=compiled.__cubin__, ptx=compiled.__ptx__, metadata=metadata)
