"""A compiled kernel set on disk: ``<key>.cubin``, ``<key>.ptx`` and the ``<key>.json`` sidecar.

Reading an artifact needs neither CuTe DSL nor a GPU, so a machine without the
DSL can run kernels built elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent
# The files whose text decides what a cubin contains.
_FINGERPRINTED = ("config.py", "protocol.py", "kernels")

# The parameter list each kernel role must have; the C++ launcher fills exactly these.
PUBLISH_PARAMS = ["u64"] * 6 + ["u32"] * 4
REDUCE_PARAMS = ["u64"] * 6 + ["u32"] * 3
# The reduce's parameters, then residual, norm_weight, residual_out and eps.
REDUCE_NORM_PARAMS = REDUCE_PARAMS + ["u64"] * 3 + ["f32"]
# routed, weights, indices, shared, mailbox, peer_table, stage_state, status, out, timeout_ns,
# num_rows, m, capacity_m, rank.
PUBLISH_REDUCE_PARAMS = ["u64"] * 10 + ["u32"] * 4
# Those, then residual, norm_weight, residual_out and eps.
PUBLISH_REDUCE_NORM_PARAMS = PUBLISH_REDUCE_PARAMS + ["u64"] * 3 + ["f32"]
EXPECTED_PARAMS = {
    "publish": PUBLISH_PARAMS,
    "reduce": REDUCE_PARAMS,
    "reduce_norm": REDUCE_NORM_PARAMS,
    "gather": REDUCE_PARAMS,
    "publish_reduce": PUBLISH_REDUCE_PARAMS,
    "publish_reduce_norm": PUBLISH_REDUCE_NORM_PARAMS,
}
# The fused roles: their CTAs loop over the rows and wait on each other's peers, so the
# launcher caps their grid at the CTAs the GPU holds at once.
PERSISTENT_ROLES = ("publish_reduce", "publish_reduce_norm")
# Roles whose CTAs of a row (``ctas_per_row``) form one thread block cluster: the launcher
# sets the cluster dimension, and counts resident clusters for the persistent grid.
CLUSTER_ROLES = ("publish_reduce_norm",)
# The kernels of a call, in launch order, by algorithm (without an epilogue).
ROLES = {
    "direct": ["publish"],
    "oneshot": ["publish", "reduce"],
    "reduce_scatter": ["publish", "reduce"],
    "twoshot": ["publish", "reduce", "gather"],
}


def expected_roles(config: dict) -> list[str]:
    """The kernels of a call of ``config`` (a `KernelConfig.to_dict`), in launch order:
    with an epilogue, reduce_norm takes the reduce's place; with fuse_reduce, one
    publish_reduce (publish_reduce_norm) is the call."""
    if config.get("fuse_reduce", False):
        return ["publish_reduce" if config.get("epilogue", "none") == "none" else "publish_reduce_norm"]
    roles = ROLES[config["algorithm"]]
    if config.get("epilogue", "none") == "none":
        return roles
    return ["reduce_norm" if role == "reduce" else role for role in roles]


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
        """Built from the kernel sources of this installation."""
        return self.metadata.get("source_fingerprint") == source_fingerprint()

    def check(self, key: str) -> None:
        """The artifact is the one named ``key``, with the kernels its algorithm needs and the
        parameter list each kernel role requires."""
        if self.metadata.get("key") != key:
            raise RuntimeError(f"kernel artifact {self.metadata.get('key')!r} was loaded for {key!r}")
        roles = [kernel["role"] for kernel in self.metadata["kernels"]]
        expected = expected_roles(self.metadata["config"])
        if roles != expected:
            raise RuntimeError(f"kernel artifact {key} has kernels {roles}, expected {expected}")
        for kernel in self.metadata["kernels"]:
            expected = EXPECTED_PARAMS[kernel["role"]]
            if kernel["params"] != expected:
                raise RuntimeError(
                    f"kernel {kernel['symbol']} ({kernel['role']}) of {key} has "
                    f"parameters {kernel['params']}, expected {expected}"
                )
