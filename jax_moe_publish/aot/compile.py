"""Compile a `KernelConfig` into a cubin and its metadata sidecar (needs CuTe DSL, no GPU)."""

from __future__ import annotations

import re
import tempfile
import threading

from jax_moe_publish import _abi
from jax_moe_publish.aot.artifact import SIDECAR_VERSION, KernelArtifact, dsl_version, source_fingerprint
from jax_moe_publish.config import KernelConfig

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)
_PARAM = re.compile(r"\.param\s+\.(\w+)\s+\w+")
# CuTe DSL keeps global compiler state: one compile at a time per process.
_COMPILE_LOCK = threading.Lock()


def ptx_entry_params(ptx: str) -> dict[str, list[str]]:
    """Parameter types of every ``.entry`` in ``ptx``, in order (e.g. ``["u64", "u32"]``)."""
    return {name: _PARAM.findall(params) for name, params in _ENTRY.findall(ptx)}


def _symbol(role: str, symbols: list[str]) -> str:
    """The entry of ``role``: CuTe DSL names it ``kernel_cutlass_<method>_<module and class>...``,
    and each role's kernel method is named after the role."""
    matches = [s for s in symbols if s.startswith(f"kernel_cutlass_{role}_jax_moe_publish")]
    if len(matches) != 1:
        raise RuntimeError(f"expected one {role!r} kernel in {symbols}, found {matches}")
    return matches[0]


def compile_config(config: KernelConfig) -> KernelArtifact:
    """Trace and compile every kernel of ``config`` for ``config.arch``.

    The fake arguments passed to ``cute.compile`` fix the compiled ABI: one scalar of its
    contract type per value of `_abi.VALUES` (``u64`` addresses and ``timeout_ns``,
    ``u32`` extents, ``f32`` eps), in that order, which is
    `MoePublishProgram.__call__`'s. The sidecar records, for each kernel, the names of
    the values it takes (`_abi.ROLES`), their PTX types as compiled (which must be the
    contract's) and its launch plan.
    """
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    from jax_moe_publish.kernels.program import MoePublishProgram

    scalars = {"u64": lambda: Int64(0), "u32": lambda: Int32(0), "f32": lambda: Float32(0.0)}
    program = MoePublishProgram(config)
    fake_values = [scalars[ptx_type]() for ptx_type in _abi.VALUES.values()]
    # The DSL writes the kept cubin and PTX to files too; keep them out of the caller's folder.
    with _COMPILE_LOCK, tempfile.TemporaryDirectory(prefix="jax_moe_publish-") as dump_dir:
        compiled = cute.compile(
            program, *fake_values, cuda.CUstream(0),
            options=f"--gpu-arch {config.arch} --keep-cubin --keep-ptx --dump-dir {dump_dir}",
        )
    entries = ptx_entry_params(compiled.__ptx__)
    symbols = list(compiled.kernel_info)
    kernels = []
    for launch in program.plan:
        symbol = _symbol(launch.role, symbols)
        params = list(_abi.ROLES[launch.role].params)
        contract_types = [_abi.VALUES[name] for name in params]
        if entries[symbol] != contract_types:
            raise RuntimeError(f"kernel {symbol} ({launch.role}) compiled with parameters {entries[symbol]}, "
                               f"but the launch contract says {params} of types {contract_types}")
        kernels.append({
            "role": launch.role, "symbol": symbol, "params": params, "param_types": entries[symbol],
            "block": launch.block, "smem": launch.smem, "ctas_per_row": launch.ctas_per_row, "rows": launch.rows,
            "waves": launch.waves, "persistent": launch.persistent, "cluster": launch.cluster,
        })
    metadata = {
        "sidecar_version": SIDECAR_VERSION,
        "key": config.key,
        "config": config.to_dict(),
        "arch": config.arch,
        "dsl_version": dsl_version(),
        "source_fingerprint": source_fingerprint(),
        "call": {
            "target": _abi.TARGETS[config.epilogue], "tp": config.tp, "hidden": config.hidden,
            "pdl": config.enable_pdl, "operands": _abi.call_operands(config),
        },
        "kernels": kernels,
    }
    return KernelArtifact(cubin=compiled.__cubin__, ptx=compiled.__ptx__, metadata=metadata)
