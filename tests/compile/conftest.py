"""The compile tier needs CuTe DSL (``nvidia-cutlass-dsl``, the ``compile`` extra); without it
its modules skip (``pytest.importorskip("cutlass")``), unless that skip would hide a broken setup.

A module's skip becomes a collection error where

* CuTe DSL is installed (``importlib.util.find_spec("cutlass")`` finds it) but does not import;
* or it is not installed, and ``JAX_MOE_PUBLISH_REQUIRE_CUTE_DSL=1`` says that this run must
  have it (``.ci/run`` sets it, since CI installs the ``compile`` extra).

Elsewhere (the GPU machine has no CuTe DSL) the tier skips, with the reason.

The tier's modules share one build of each config per session (`builds`): the sidecar checks
of ``test_metadata.py``, the PTX checks of ``test_ptx_contents.py``, the manifest check of
``test_ptx_manifest.py`` and the resource check of ``test_preset_resources.py`` read the same
sets (`preset_folder`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import threading

import pytest

from jax_moe_publish.aot import artifact
from jax_moe_publish.aot.compile import compile_config  # bound before tests patch it
from jax_moe_publish.config import KernelConfig

REQUIRE_CUTE_DSL = "JAX_MOE_PUBLISH_REQUIRE_CUTE_DSL"


def cute_dsl_failure() -> str | None:
    """Why this run must not skip for want of CuTe DSL; None where CuTe DSL imports, or where
    it is not installed and not required."""
    if importlib.util.find_spec("cutlass") is None:
        if os.environ.get(REQUIRE_CUTE_DSL, "0") in ("", "0"):
            return None
        return (f"CuTe DSL is not installed (no module 'cutlass'), and {REQUIRE_CUTE_DSL}=1 requires "
                "it: install the 'compile' extra (nvidia-cutlass-dsl)")
    try:
        importlib.import_module("cutlass")
    except Exception as error:
        return f"CuTe DSL is installed, but 'import cutlass' fails: {type(error).__name__}: {error}"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if isinstance(collector, pytest.Module) and report.skipped and (failure := cute_dsl_failure()):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"{failure}; the compile tier cannot run (the module would have skipped: {reason})"
    return report


class Builds:
    """Compiles each config once per session: saved under ``root``, returned as loaded back."""

    def __init__(self, root) -> None:
        self.root = root
        self._artifacts: dict[str, artifact.KernelArtifact] = {}
        self._lock = threading.Lock()

    def __call__(self, config: KernelConfig) -> artifact.KernelArtifact:
        with self._lock:
            if config.key not in self._artifacts:
                compile_config(config).save(self.root)
                self._artifacts[config.key] = artifact.KernelArtifact.load(self.root, config.key)
            return self._artifacts[config.key]


@pytest.fixture(scope="session")
def builds(tmp_path_factory) -> Builds:
    return Builds(tmp_path_factory.mktemp("kernels"))


@pytest.fixture(scope="module")
def preset_folder(builds) -> pathlib.Path:
    """The session's folder of built sets, holding every preset's."""
    from jax_moe_publish.aot.__main__ import PRESETS

    for config in dict.fromkeys(config for make in PRESETS.values() for config in make()):
        builds(config)
    return builds.root
