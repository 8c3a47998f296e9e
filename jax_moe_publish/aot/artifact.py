"""A compiled kernel set on disk: ``<key>.cubin``, ``<key>.ptx`` and the ``<key>.json`` sidecar.

Reading an artifact needs neither CuTe DSL nor a GPU, so a machine without the
DSL can run kernels built elsewhere.

A set is complete once its sidecar exists: `KernelArtifact.save` writes each file to a
temporary name and renames it into place, the sidecar last, so that an interrupted build
leaves no set that looks complete. A set whose files cannot be used (a sidecar that is not
JSON or lacks a field, a cubin that is missing or not a CUDA ELF file) raises
`DamagedKernelError` when it is loaded, naming the file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import threading

from jax_moe_publish import _abi
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.experts_config import ExpertsConfig

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
# The files whose text decides what a cubin contains.
_FINGERPRINTED = ("config.py", "experts_config.py", "protocol.py", "_abi.py", "kernels")
SIDECAR_VERSION = 4
"""Version 2: each kernel's parameter names and launch plan (persistent, cluster) are recorded,
and the call's shape checks in ``call``. Version 3: ``call`` names the FFI target and lists the
call's operands with their dtype and rows rules (`_abi.call_operands`). Version 4: the set names
its ``op`` (`_abi.CONTRACTS`), an operand's trailing dimensions are a ``shape`` list, and
``call`` holds ``top_k`` and ``max_m``."""

CONFIGS = {"publish": KernelConfig, "experts": ExpertsConfig}
"""The config class of each op's kernel sets."""

SIDECAR_FIELDS = ("sidecar_version", "key", "op", "config", "arch", "dsl_version", "source_fingerprint", "call",
                  "kernels")
"""The fields of a sidecar, as `compile.compile_config` writes them."""
KERNEL_FIELDS = ("role", "symbol", "params", "param_types", "block", "smem", "ctas_per_row", "rows", "waves",
                 "persistent", "cluster")
"""The fields of each record of a sidecar's ``kernels``, which the checks and the launcher read."""

ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190
"""The ELF machine of a CUDA cubin (``e_machine``)."""
_ELF64_HEADER_BYTES = 64


class DamagedKernelError(RuntimeError):
    """A file of a kernel set cannot be used (corrupt, half-written by another tool, or missing);
    the message names the file and what is wrong with it."""

    def __init__(self, path: os.PathLike, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = pathlib.Path(path)
        self.problem = problem


def cubin_problem(cubin: bytes) -> str | None:
    """Why ``cubin`` is no module for ``cuModuleLoadData``, or None. A cubin as the compile step
    writes it is a little-endian ELF64 file whose machine is ``EM_CUDA``; PTX, a truncated file
    or another architecture's object would fail in the driver with a less helpful error."""
    if not cubin:
        return "it is empty"
    if not cubin.startswith(ELF_MAGIC):
        return f"it starts with {cubin[:8]!r}, not with the ELF magic {ELF_MAGIC!r}"
    if len(cubin) < _ELF64_HEADER_BYTES:
        return f"it has {len(cubin)} bytes, fewer than an ELF64 header's {_ELF64_HEADER_BYTES}: it is truncated"
    if cubin[4] != 2 or cubin[5] != 1:
        return f"its ELF class and data bytes are {cubin[4]} and {cubin[5]}, not 2 and 1 (64-bit, little-endian)"
    machine = int.from_bytes(cubin[18:20], "little")
    if machine != EM_CUDA:
        return f"its ELF machine is {machine}, not EM_CUDA ({EM_CUDA}): it is no CUDA cubin"
    return None


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, flush it to disk and rename it into
    place: a reader finds the old file, or none, or all of the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_sidecar(sidecar: pathlib.Path) -> dict | None:
    """The sidecar's metadata, or None when there is no sidecar; `DamagedKernelError` when it
    cannot be read or is not a sidecar of this version's form. A sidecar of another version
    is returned as it is: it is stale, which the store handles, not damaged."""
    try:
        text = sidecar.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise DamagedKernelError(sidecar, f"cannot be read ({error.strerror or error})") from error
    try:
        metadata = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedKernelError(sidecar, f"is not valid JSON ({error}): it is corrupt or half-written") from None
    if not isinstance(metadata, dict):
        raise DamagedKernelError(sidecar, f"holds a JSON {type(metadata).__name__}, not the sidecar's object")
    if metadata.get("sidecar_version") != SIDECAR_VERSION:
        return metadata
    missing = [name for name in SIDECAR_FIELDS if name not in metadata]
    if missing:
        raise DamagedKernelError(sidecar, f"lacks the field(s) {missing} of a version {SIDECAR_VERSION} sidecar")
    kernels = metadata["kernels"]
    if not isinstance(kernels, list) or not kernels:
        got = "an empty list" if isinstance(kernels, list) else f"a {type(kernels).__name__}"
        raise DamagedKernelError(sidecar, f"has kernels of {got}, expected a list of kernel records")
    for index, kernel in enumerate(kernels):
        if not isinstance(kernel, dict):
            raise DamagedKernelError(sidecar, f"kernels[{index}] is a {type(kernel).__name__}, not a kernel record")
        missing = [name for name in KERNEL_FIELDS if name not in kernel]
        if missing:
            raise DamagedKernelError(sidecar, f"kernels[{index}] lacks the field(s) {missing}")
    for name in ("config", "call"):
        if not isinstance(metadata[name], dict):
            got = type(metadata[name]).__name__
            raise DamagedKernelError(sidecar, f"has a {name} of type {got}, expected an object")
    return metadata


def dsl_version() -> str | None:
    """The installed CuTe DSL (``nvidia-cutlass-dsl``) version, or None without it."""
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """Hash of the kernel sources: a prebuilt or cached cubin is valid only for the same text."""
    digest = hashlib.sha256()
    for name in _FINGERPRINTED:
        path = PACKAGE_DIR / name
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            digest.update(file.relative_to(PACKAGE_DIR).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def build_fingerprint() -> str:
    """What a cached build depends on: the kernel sources, the sidecar version and the CuTe DSL
    version (names the cache folder, so that an upgrade never reuses stale cubins)."""
    text = f"{source_fingerprint()}/sidecar{SIDECAR_VERSION}/dsl{dsl_version()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class KernelArtifact:
    """The cubin of one config (`CONFIGS`), its PTX and its metadata."""

    cubin: bytes
    ptx: str
    metadata: dict

    def save(self, directory: os.PathLike) -> pathlib.Path:
        """Write the three files and return the sidecar path. Each file is written atomically, and
        the sidecar, which makes the set complete, is taken away first and written last: an
        interrupted save leaves no set, or the old one incomplete, never a mixed one."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        key = self.metadata["key"]
        sidecar = directory / f"{key}.json"
        sidecar.unlink(missing_ok=True)
        for path, data in ((directory / f"{key}.cubin", self.cubin), (directory / f"{key}.ptx", self.ptx.encode()),
                           (sidecar, json.dumps(self.metadata, indent=1).encode())):
            _write_atomically(path, data)
        return sidecar

    @classmethod
    def load(cls, directory: os.PathLike, key: str) -> "KernelArtifact | None":
        """The artifact named ``key`` in ``directory``, or None when its sidecar is not there.

        Raises `DamagedKernelError` for a sidecar that is not JSON or lacks a field, and for a
        cubin that is missing or not a CUDA cubin (`cubin_problem`). The PTX is optional (a
        folder may be carried without it)."""
        directory = pathlib.Path(directory)
        sidecar = directory / f"{key}.json"
        metadata = _read_sidecar(sidecar)
        if metadata is None:
            return None
        cubin_path = directory / f"{key}.cubin"
        try:
            cubin = cubin_path.read_bytes()
        except FileNotFoundError:
            raise DamagedKernelError(cubin_path, f"is missing, but its sidecar {sidecar.name} is there") from None
        except OSError as error:
            raise DamagedKernelError(cubin_path, f"cannot be read ({error.strerror or error})") from error
        problem = cubin_problem(cubin)
        if problem is not None:
            raise DamagedKernelError(cubin_path, f"is not a CUDA cubin: {problem}")
        ptx_path = directory / f"{key}.ptx"
        try:
            ptx = ptx_path.read_text()
        except FileNotFoundError:
            ptx = ""
        except (OSError, UnicodeDecodeError) as error:
            raise DamagedKernelError(ptx_path, f"cannot be read as PTX text ({error})") from None
        return cls(cubin=cubin, ptx=ptx, metadata=metadata)

    @property
    def is_current(self) -> bool:
        """Built by this sidecar version from the kernel sources of this installation, and, where
        CuTe DSL is installed, by that DSL version (without it, nothing could rebuild it)."""
        installed = dsl_version()
        return (self.metadata.get("sidecar_version") == SIDECAR_VERSION
                and self.metadata.get("source_fingerprint") == source_fingerprint()
                and (installed is None or self.metadata.get("dsl_version") == installed))

    @property
    def config(self):
        """The config the set was built from, of its op's class (`CONFIGS`)."""
        return CONFIGS[self.metadata["op"]].from_dict(self.metadata["config"])

    def check(self, key: str) -> None:
        """The artifact is the one named ``key``, with the kernels its config's call launches, each
        taking the values its role takes (its op's contract) with their contract types."""
        if self.metadata.get("sidecar_version") != SIDECAR_VERSION:
            raise RuntimeError(f"kernel artifact {key} has sidecar version {self.metadata.get('sidecar_version')}, "
                               f"expected {SIDECAR_VERSION}: rebuild it")
        if self.metadata.get("key") != key:
            raise RuntimeError(f"kernel artifact {self.metadata.get('key')!r} was loaded for {key!r}")
        if self.metadata.get("op") not in CONFIGS:
            raise RuntimeError(f"kernel artifact {key} is of op {self.metadata.get('op')!r}, expected one of "
                               f"{tuple(CONFIGS)}")
        contract = _abi.CONTRACTS[self.metadata["op"]]
        roles = [kernel["role"] for kernel in self.metadata["kernels"]]
        expected = list(_abi.call_roles(self.config))
        if roles != expected:
            raise RuntimeError(f"kernel artifact {key} has kernels {roles}, expected {expected}")
        for kernel in self.metadata["kernels"]:
            role = contract.roles[kernel["role"]]
            params = list(role.params)
            types = [contract.values[name] for name in params]
            if kernel["params"] != params or kernel["param_types"] != types:
                raise RuntimeError(
                    f"kernel {kernel['symbol']} ({kernel['role']}) of {key} takes {kernel['params']} of types "
                    f"{kernel['param_types']}, expected {params} of types {types}"
                )
            if kernel["persistent"] != role.persistent or (kernel["cluster"] > 1 and not role.clustered):
                raise RuntimeError(f"kernel {kernel['symbol']} ({kernel['role']}) of {key} has persistent="
                                   f"{kernel['persistent']} cluster={kernel['cluster']}, against its role's "
                                   f"{role}")
