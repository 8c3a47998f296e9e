"""Where compiled kernel sets come from: memory, prebuilt folders, the disk cache, or CuTe DSL.

Lookup order for a config of either op (`KernelConfig`, `ExpertsConfig`):

1. this process's memory;
2. every folder in ``$JAX_MOE_PUBLISH_KERNEL_DIR`` (``os.pathsep``-separated), as
   written by ``python -m jax_moe_publish.aot build``;
3. the disk cache (``$JAX_MOE_PUBLISH_CACHE_DIR``, default
   ``~/.cache/jax_moe_publish``), keyed by the config and `artifact.build_fingerprint`
   (the kernel sources, the sidecar version and the CuTe DSL version);
4. a fresh compile with CuTe DSL, under a file lock so that concurrent processes
   compile a kernel once, saved into the cache.

Without CuTe DSL a miss raises `MissingKernelError`, which names the command that builds it.

A damaged set (`artifact.DamagedKernelError`: a sidecar that is not JSON or lacks a field, a
cubin that is missing or not a CUDA cubin) is never used. With CuTe DSL the store warns once,
naming the file and the command that rebuilds the folder, and builds the kernel into the cache
(a damaged cached set is built over); without it, `MissingKernelError` names the file and that
command.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import shlex
import threading
import warnings

import filelock

from jax_moe_publish.aot import compile as aot_compile
from jax_moe_publish.aot.artifact import (
    SIDECAR_VERSION, DamagedKernelError, KernelArtifact, build_fingerprint, source_fingerprint,
)

KERNEL_DIR_ENV = "JAX_MOE_PUBLISH_KERNEL_DIR"
CACHE_DIR_ENV = "JAX_MOE_PUBLISH_CACHE_DIR"


class MissingKernelError(RuntimeError):
    """No usable cubin for a config, and CuTe DSL is not installed to build one."""


def dsl_available() -> bool:
    return importlib.util.find_spec("cutlass") is not None


def build_command(config, out: str = "DIR") -> str:
    """The CLI command that builds ``config`` into folder ``out`` (a field left None, which
    follows another, is left out: the CLI's default)."""
    flags = ["--op", config.op]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is not None:
            flags += [f"--{field.name.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return shlex.join(["python", "-m", "jax_moe_publish.aot", "build", *flags, "--out", out])


@dataclasses.dataclass
class StoreStats:
    memory_hits: int = 0
    prebuilt_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0


class KernelStore:
    """Finds or builds the `KernelArtifact` of a config; thread-safe."""

    def __init__(self, cache_dir: os.PathLike | None = None, prebuilt_dirs=None) -> None:
        if cache_dir is None:
            cache_dir = os.environ.get(CACHE_DIR_ENV) or pathlib.Path.home() / ".cache" / "jax_moe_publish"
        if prebuilt_dirs is None:
            prebuilt_dirs = [d for d in os.environ.get(KERNEL_DIR_ENV, "").split(os.pathsep) if d]
        self.cache_dir = pathlib.Path(cache_dir) / build_fingerprint()
        self.prebuilt_dirs = [pathlib.Path(d) for d in prebuilt_dirs]
        self.stats = StoreStats()
        self._memory: dict[str, KernelArtifact] = {}
        self._warned: set[pathlib.Path] = set()  # damaged files already reported
        self._lock = threading.Lock()

    def get(self, config) -> KernelArtifact:
        key = config.key
        with self._lock:
            if key in self._memory:
                self.stats.memory_hits += 1
                return self._memory[key]
            artifact = self._find_or_build(config)
            artifact.check(key)
            self._memory[key] = artifact
            return artifact

    def _find_or_build(self, config) -> KernelArtifact:
        key = config.key
        stale, damaged = [], []
        for directory in self.prebuilt_dirs:
            try:
                artifact = KernelArtifact.load(directory, key)
            except DamagedKernelError as error:
                damaged.append((directory, error))
                continue
            if artifact is None:
                continue
            if artifact.is_current:
                self._warn_damaged(config, damaged, f"using the set in {directory}")
                self.stats.prebuilt_hits += 1
                return artifact
            stale.append(directory)
        artifact = self._load_cached(config, damaged)
        if artifact is not None:
            self._warn_damaged(config, damaged, f"using the set built in the cache {self.cache_dir}")
            self.stats.disk_hits += 1
            return artifact
        if not dsl_available():
            raise MissingKernelError(self._missing_message(config, stale, damaged))
        self._warn_damaged(config, damaged, f"building it into the cache {self.cache_dir}")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(self.cache_dir / f"{key}.lock")):
            # Another process may have built it meanwhile; a damaged set is built over.
            artifact = self._load_cached(config, [])
            if artifact is not None:
                self.stats.disk_hits += 1
                return artifact
            artifact = aot_compile.compile_config(config)
            artifact.save(self.cache_dir)
            self.stats.compiles += 1
            return artifact

    def _load_cached(self, config, damaged: list) -> KernelArtifact | None:
        """The cached set of ``config``, or None; a damaged one is added to ``damaged``."""
        try:
            return KernelArtifact.load(self.cache_dir, config.key)
        except DamagedKernelError as error:
            damaged.append((self.cache_dir, error))
            return None

    def _warn_damaged(self, config, damaged: list, action: str) -> None:
        """Say once per file that a damaged set is passed over, and how to repair its folder."""
        for directory, error in damaged:
            if error.path in self._warned:
                continue
            self._warned.add(error.path)
            repair = ("" if directory == self.cache_dir else
                      f". To repair the folder, rebuild the set: {build_command(config, str(directory))}")
            warnings.warn(f"kernel set {config.key} in {directory} is damaged, so it is not used: {error}; "
                          f"{action}{repair}", RuntimeWarning, stacklevel=4)

    def _missing_message(self, config, stale: list, damaged: list) -> str:
        key = config.key
        if damaged:
            directory, error = damaged[0]
            return (
                f"kernel set {key} in {directory} is damaged: {error}. CuTe DSL is not installed to "
                f"build it here; rebuild the set where CuTe DSL is: {build_command(config, str(directory))}"
            )
        if stale:
            return (
                f"prebuilt kernel {key} in {stale[0]} was built from other kernel sources or by another "
                f"sidecar version (this installation's are {source_fingerprint()} and {SIDECAR_VERSION}), "
                f"and CuTe DSL is not installed to build it; rebuild it where CuTe DSL is: "
                f"{build_command(config, str(stale[0]))}"
            )
        where = os.pathsep.join(map(str, self.prebuilt_dirs)) or "(unset)"
        # The experts op's launch shapes change with m: one set per call shape would miss the next.
        model = ("" if config.op != "experts" else
                 "\n(or every set of the model's experts, at each m and TP size: python -m jax_moe_publish.aot build "
                 "--experts-model HIDDEN,INTERMEDIATE,EXPERTS,TOP_K --out DIR, INTERMEDIATE unsharded)")
        return (
            f"no compiled kernel for {config} in ${KERNEL_DIR_ENV}={where} or in the cache "
            f"{self.cache_dir}, and CuTe DSL (the 'compile' extra, nvidia-cutlass-dsl) is not "
            f"installed to build it. On a machine with CuTe DSL run:\n  "
            f"{build_command(config)}\nand point ${KERNEL_DIR_ENV} at DIR.{model}"
        )


_default_store: KernelStore | None = None
_default_lock = threading.Lock()


def default_store() -> KernelStore:
    """The process-wide store, configured from the environment on first use."""
    global _default_store
    with _default_lock:
        if _default_store is None:
            _default_store = KernelStore()
        return _default_store
