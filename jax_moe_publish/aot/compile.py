"""Compile a config of either op (`KernelConfig`, `ExpertsConfig`) into a cubin and its metadata
sidecar (needs CuTe DSL, no GPU)."""

from __future__ import annotations

import importlib
import re
import tempfile
import threading

from jax_moe_publish import _abi
from jax_moe_publish.aot.artifact import SIDECAR_VERSION, KernelArtifact, dsl_version, source_fingerprint

PROGRAMS = {"publish": "jax_moe_publish.kernels.program:MoePublishProgram",
            "experts": "jax_moe_publish.kernels.experts_program:ExpertsProgram"}
"""The program class of each op (`_abi.CONTRACTS`): its ``__call__`` takes the op's values in
order, then the stream. Imported only to compile, since it needs CuTe DSL."""

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


def program_of(config):
    """The program that compiles ``config`` (`PROGRAMS`)."""
    module, name = PROGRAMS[config.op].split(":")
    return getattr(importlib.import_module(module), name)(config)


def compile_config(config) -> KernelArtifact:
    """Trace and compile every kernel of ``config`` for ``config.arch``.

    The fake arguments passed to ``cute.compile`` fix the compiled ABI: one scalar of its
    contract type per value of the op's contract (`_abi.CONTRACTS`: ``u64`` addresses and
    ``timeout_ns``, ``u32`` extents, ``f32`` eps), in that order, which is its program's
    ``__call__``'s (`PROGRAMS`). The sidecar records, for each kernel, the names of the values
    it takes (the contract's roles), their PTX types as compiled (which must be the
    contract's) and its launch plan.
    """
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64

    contract = _abi.contract_of(config)
    scalars = {"u64": lambda: Int64(0), "u32": lambda: Int32(0), "f32": lambda: Float32(0.0)}
    program = program_of(config)
    fake_values = [scalars[ptx_type]() for ptx_type in contract.values.values()]
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
        params = list(contract.roles[launch.role].params)
        contract_types = [contract.values[name] for name in params]
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
        "op": config.op,
        "config": config.to_dict(),
        "arch": config.arch,
        "dsl_version": dsl_version(),
        "source_fingerprint": source_fingerprint(),
        "call": call_record(config),
        "kernels": kernels,
    }
    return KernelArtifact(cubin=compiled.__cubin__, ptx=compiled.__ptx__, metadata=metadata)


def call_record(config) -> dict:
    """The sidecar's ``call``: the FFI target, the shape facts the handler checks a call against
    (tp, hidden, top_k, the most tokens ``max_m``), PDL, and the operands (`_abi.call_operands`)."""
    return {
        "target": _abi.contract_of(config).target(config), "tp": getattr(config, "tp", 1), "hidden": config.hidden,
        "top_k": config.top_k, "max_m": config.max_m, "pdl": config.enable_pdl,
        "operands": _abi.call_operands(config),
    }
