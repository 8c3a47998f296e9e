"""Compile tier (CPU, CI): every preset compiles to what ``tests/compile/ptx_manifest.json``
records (``python tools/compare_ptx.py manifest``), and the check names what changed.

The sets are the session's builds (`builds`), which ``test_metadata.py`` and ``test_ptx_contents.py`` have already compiled in a
run of the whole tier; the tool reads them from that folder and compiles nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")

from jax_moe_publish.aot import store  # noqa: E402
from jax_moe_publish.aot.__main__ import PRESETS  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "compare_ptx.py"
MANIFEST = pathlib.Path(__file__).with_name("ptx_manifest.json")
PRESET_CONFIGS = list(dict.fromkeys(config for make in PRESETS.values() for config in make()))


def run_tool(tmp_path, *args) -> subprocess.CompletedProcess:
    """``python tools/compare_ptx.py ARGS``, with a cache of its own and no prebuilt folder from the
    environment."""
    env = {name: value for name, value in os.environ.items() if name != store.KERNEL_DIR_ENV}
    env[store.CACHE_DIR_ENV] = str(tmp_path / "cache")
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_presets_compile_to_the_committed_manifest(preset_folder, tmp_path):
    run = run_tool(tmp_path, "manifest", "--kernels", str(preset_folder))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(PRESET_CONFIGS)} kernel sets of {len(PRESETS)} presets ({len(PRESET_CONFIGS)} prebuilt" in run.stdout


def test_a_changed_launch_plan_or_kernel_is_named_with_the_command(preset_folder, tmp_path):
    recorded = json.loads(MANIFEST.read_text())
    key = next(key for key, record in sorted(recorded["sets"].items()) if len(record["kernels"]) > 1)
    first, last = recorded["sets"][key]["kernels"][0], recorded["sets"][key]["kernels"][-1]
    smem, ptx = first["smem"], last["ptx"]
    first["smem"] += 16
    last["ptx"] = "0" * 16
    tampered = tmp_path / "manifest.json"
    tampered.write_text(json.dumps(recorded))
    run = run_tool(tmp_path, "manifest", "--kernels", str(preset_folder), "--manifest", str(tampered))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "2 differences" in run.stdout, run.stdout
    assert f"{key} {first['role']}: smem {smem + 16} -> {smem}" in run.stdout, run.stdout
    assert f"{key} {last['role']}: ptx {'0' * 16} -> {ptx}" in run.stdout, run.stdout
    assert "must update the manifest in the same commit" in run.stdout
    assert "python tools/compare_ptx.py manifest --write" in run.stdout


def test_entry_names_do_not_count(builds, tmp_path):
    built = builds(PRESET_CONFIGS[0])
    symbol = built.metadata["kernels"][0]["symbol"]
    renamed = built.ptx.replace(symbol, symbol.replace("jax_moe_publishkernels", "jax_moe_publishkernelsmoved"))
    changed = renamed.replace("ret;", "exit;", 1)
    assert renamed != built.ptx and changed != renamed
    for name, ptx in (("before", built.ptx), ("renamed", renamed), ("changed", changed)):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{built.metadata['key']}.ptx").write_text(ptx)
    same = run_tool(tmp_path, str(tmp_path / "before"), str(tmp_path / "renamed"))
    assert same.returncode == 0 and "identical apart from entry names" in same.stdout, same.stdout + same.stderr
    other = run_tool(tmp_path, str(tmp_path / "before"), str(tmp_path / "changed"))
    assert other.returncode == 1 and "DIFFERS" in other.stdout, other.stdout + other.stderr
