"""A compiled kernel set on disk: ``<key>.cubin``, ``<key>.ptx`` and the ``<key>.json`` sidecar.

Reading an artifact needs neither CuTe DSL nor a GPU, so a machine without the
DSL can run kernels built elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib

from jax_moe_publish import _abi
from jax_moe_publish.config import KernelConfig

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
# The files whose text decides what a cubin contains.
_FINGERPRINTED = ("config.py", "protocol.py", "_abi.py", "kernels")
SIDECAR_VERSION = 2
"""Version 2: each kernel's parameter names and launch plan (persistent, cluster) are recorded,
and the call's shape checks in ``call``."""


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
    """The cubin of one `KernelConfig`, its PTX and its metadata."""

    cubin: bytes
    ptx: str
    metadata: dict

    def save(self, directory: os.PathLike) -> pathlib.Path:
        """Write the three files atomically (rename into place) and return the sidecar path."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        key = self.metadata["key"]
        for suffix, data in ((".cubin", self.cubin), (".ptx", self.ptx.encode()),
                             (".json", json.dumps(self.metadata, indent=1).encode())):
            tmp = directory / f".{key}{suffix}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, directory / f"{key}{suffix}")
        return directory / f"{key}.json"

    @classmethod
    def load(cls, directory: os.PathLike, key: str) -> "KernelArtifact | None":
        """The artifact named ``key`` in ``directory``, or None when it is not there."""
        directory = pathlib.Path(directory)
        sidecar = directory / f"{key}.json"
        if not sidecar.exists():
            return None
        metadata = json.loads(sidecar.read_text())
        cubin = (directory / f"{key}.cubin").read_bytes()
        ptx_path = directory / f"{key}.ptx"
        ptx = ptx_path.read_text() if ptx_path.exists() else ""
        return cls(cubin=cubin, ptx=ptx, metadata=metadata)

    @property
    def is_current(self) -> bool:
        """Built by this sidecar version from the kernel sources of this installation, and, where
        CuTe DSL is installed, by that DSL version (without it, nothing could rebuild it)."""
        installed = dsl_version()
        return (self.metadata.get("sidecar_version") == SIDECAR_VERSION
                and self.metadata.get("source_fingerprint") == source_fingerprint()
                and (installed is None or self.metadata.get("dsl_version") == installed))

    def check(self, key: str) -> None:
        """The artifact is the one named ``key``, with the kernels its config's call launches, each
        taking the values its role takes (`_abi.ROLES`) with their contract types."""
        if self.metadata.get("sidecar_version") != SIDECAR_VERSION:
            raise RuntimeError(f"kernel artifact {key} has sidecar version {self.metadata.get('sidecar_version')}, "
                               f"expected {SIDECAR_VERSION}: rebuild it")
        if self.metadata.get("key") != key:
            raise RuntimeError(f"kernel artifact {self.metadata.get('key')!r} was loaded for {key!r}")
        roles = [kernel["role"] for kernel in self.metadata["kernels"]]
        expected = list(_abi.call_roles(KernelConfig.from_dict(self.metadata["config"])))
        if roles != expected:
            raise RuntimeError(f"kernel artifact {key} has kernels {roles}, expected {expected}")
        for kernel in self.metadata["kernels"]:
            role = _abi.ROLES[kernel["role"]]
            params = list(role.params)
            types = [_abi.VALUES[name] for name in params]
            if kernel["params"] != params or kernel["param_types"] != types:
                raise RuntimeError(
                    f"kernel {kernel['symbol']} ({kernel['role']}) of {key} takes {kernel['params']} of types "
                    f"{kernel['param_types']}, expected {params} of types {types}"
                )
            if kernel["persistent"] != role.persistent or (kernel["cluster"] > 1 and not role.cluster):
                raise RuntimeError(f"kernel {kernel['symbol']} ({kernel['role']}) of {key} has persistent="
                                   f"{kernel['persistent']} cluster={kernel['cluster']}, against its role's "
                                   f"{role}")
