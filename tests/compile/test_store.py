"""Compile tier (CPU, CI): the kernel store finds or builds artifacts in its documented order
(memory, prebuilt folders, the disk cache, then CuTe DSL), refuses stale ones, compiles each
config once across threads and processes, and the CLI builds the folders it reads.

CuTe DSL compiles for sm_90a/sm_100a without a GPU; nothing here launches a kernel.
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("cutlass")

from jax_moe_publish import tuning  # noqa: E402
from jax_moe_publish.aot import artifact, compile, presets, store  # noqa: E402
from jax_moe_publish.aot.__main__ import main as cli_main  # noqa: E402
from jax_moe_publish.aot.compile import compile_config  # noqa: E402  (bound before tests patch it)
from jax_moe_publish.config import KernelConfig  # noqa: E402
from jax_moe_publish.experts_config import ExpertsConfig  # noqa: E402
from jax_moe_publish.testing import gpu_matrix  # noqa: E402

# Small problems for the store tests: each compile takes about 0.1 s.
SMALL = tuning.kernel_config(tuning.Problem(512, 2), tp=2, m=None)
OTHER_SMALL = SMALL.replace(top_k=3)


def run_python(args, cwd) -> subprocess.CompletedProcess:
    """A child Python that imports the same jax_moe_publish as this test."""
    env = dict(os.environ)
    package_root = str(artifact.PACKAGE_DIR.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def compile_calls(monkeypatch) -> list:
    """Records the configs that the store compiles (it imports compile_config at call time)."""
    calls = []

    def recording(config):
        calls.append(config)
        return compile_config(config)

    monkeypatch.setattr(compile, "compile_config", recording)
    return calls


def new_store(tmp_path, prebuilt_dirs=()) -> store.KernelStore:
    return store.KernelStore(cache_dir=tmp_path / "cache", prebuilt_dirs=list(prebuilt_dirs))


def test_store_memory_disk_and_compile(tmp_path, compile_calls):
    first_store = new_store(tmp_path)
    built = first_store.get(SMALL)
    assert first_store.stats == store.StoreStats(compiles=1)
    assert first_store.get(SMALL) is built
    assert first_store.stats == store.StoreStats(compiles=1, memory_hits=1)
    # The cache is keyed by the build fingerprint, then the config key.
    assert (first_store.cache_dir / f"{SMALL.key}.cubin").read_bytes() == built.cubin
    assert first_store.cache_dir == tmp_path / "cache" / artifact.build_fingerprint()

    second_store = new_store(tmp_path)  # a new process, in effect
    assert second_store.get(SMALL).metadata == built.metadata
    assert second_store.stats == store.StoreStats(disk_hits=1)

    second_store.get(OTHER_SMALL)
    assert second_store.stats == store.StoreStats(disk_hits=1, compiles=1)
    assert compile_calls == [SMALL, OTHER_SMALL]


def test_store_uses_prebuilt_folder(tmp_path, builds, compile_calls):
    builds(SMALL).save(tmp_path / "prebuilt")
    kernels = new_store(tmp_path, [tmp_path / "empty", tmp_path / "prebuilt"])
    assert kernels.get(SMALL).cubin == builds(SMALL).cubin
    assert kernels.stats == store.StoreStats(prebuilt_hits=1)
    assert compile_calls == []
    assert not kernels.cache_dir.exists()  # a prebuilt hit is not copied into the cache


def _save_stale(built, folder):
    stale = dataclasses.replace(built, metadata={**built.metadata, "source_fingerprint": "0" * 16})
    stale.save(folder)


def test_store_without_dsl_rejects_stale_prebuilt(tmp_path, builds, compile_calls, monkeypatch):
    _save_stale(builds(SMALL), tmp_path / "prebuilt")
    monkeypatch.setattr(store, "dsl_available", lambda: False)
    with pytest.raises(store.MissingKernelError, match="rebuild") as error:
        new_store(tmp_path, [tmp_path / "prebuilt"]).get(SMALL)
    assert store.build_command(SMALL, str(tmp_path / "prebuilt")) in str(error.value)
    assert compile_calls == []


def test_store_with_dsl_recompiles_over_stale_prebuilt(tmp_path, builds, compile_calls):
    _save_stale(builds(SMALL), tmp_path / "prebuilt")
    kernels = new_store(tmp_path, [tmp_path / "prebuilt"])
    assert kernels.get(SMALL).is_current
    assert kernels.stats == store.StoreStats(compiles=1)


def test_a_dsl_upgrade_reuses_no_cached_or_prebuilt_kernel(tmp_path, builds, compile_calls, monkeypatch):
    builds(SMALL).save(tmp_path / "prebuilt")
    old_cache = new_store(tmp_path).cache_dir
    new_store(tmp_path).get(OTHER_SMALL)  # into the cache of this DSL version
    monkeypatch.setattr(artifact, "dsl_version", lambda: "99.0")
    assert not artifact.KernelArtifact.load(tmp_path / "prebuilt", SMALL.key).is_current
    upgraded = new_store(tmp_path, [tmp_path / "prebuilt"])
    assert upgraded.cache_dir != old_cache
    upgraded.get(SMALL)
    upgraded.get(OTHER_SMALL)
    assert upgraded.stats == store.StoreStats(compiles=2)
    assert compile_calls == [OTHER_SMALL, SMALL, OTHER_SMALL]


def test_a_sidecar_of_another_version_is_stale_and_refused(tmp_path, builds):
    old = dataclasses.replace(builds(SMALL), metadata={**builds(SMALL).metadata, "sidecar_version": 1})
    assert not old.is_current
    with pytest.raises(RuntimeError, match=f"sidecar version 1, expected {artifact.SIDECAR_VERSION}: rebuild it"):
        old.check(SMALL.key)


def test_store_without_dsl_names_the_build_command(tmp_path, monkeypatch, compile_calls):
    monkeypatch.setattr(store, "dsl_available", lambda: False)
    with pytest.raises(store.MissingKernelError) as error:
        new_store(tmp_path).get(SMALL)
    message = str(error.value)
    assert "python -m jax_moe_publish.aot build" in message
    assert store.KERNEL_DIR_ENV in message
    for name, value in SMALL.to_dict().items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        assert f"--{name.replace('_', '-')} {text}" in message, name
    assert compile_calls == []


def test_check_rejects_wrong_params(tmp_path, builds):
    wrong = copy.deepcopy(builds(SMALL).metadata)
    wrong["kernels"][-1]["params"] = wrong["kernels"][-1]["params"][:-1]
    artifact.KernelArtifact(builds(SMALL).cubin, builds(SMALL).ptx, wrong).save(tmp_path / "prebuilt")
    loaded = artifact.KernelArtifact.load(tmp_path / "prebuilt", SMALL.key)
    symbol = wrong["kernels"][-1]["symbol"]
    with pytest.raises(RuntimeError, match=re.escape(symbol)):
        loaded.check(SMALL.key)
    kernels = new_store(tmp_path, [tmp_path / "prebuilt"])
    with pytest.raises(RuntimeError, match="expected"):
        kernels.get(SMALL)
    with pytest.raises(RuntimeError):  # not remembered as good
        kernels.get(SMALL)


def test_store_reads_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(store.CACHE_DIR_ENV, str(tmp_path / "cache"))
    folders = [str(tmp_path / "a"), "", str(tmp_path / "b")]  # empty entries are skipped
    monkeypatch.setenv(store.KERNEL_DIR_ENV, os.pathsep.join(folders))
    kernels = store.KernelStore()
    assert kernels.cache_dir == tmp_path / "cache" / artifact.build_fingerprint()
    assert kernels.prebuilt_dirs == [tmp_path / "a", tmp_path / "b"]


@pytest.mark.parametrize("shared_store", [True, False], ids=["one-store", "two-stores"])
def test_concurrent_gets_compile_once(tmp_path, monkeypatch, shared_store):
    """Threads of one store share its lock; two stores on one cache share the file lock."""
    calls = []

    def slow(config):  # widen the window in which a second compile could start
        calls.append(config)
        time.sleep(0.3)
        return compile_config(config)

    monkeypatch.setattr(compile, "compile_config", slow)
    stores = [new_store(tmp_path)] * 2 if shared_store else [new_store(tmp_path), new_store(tmp_path)]
    barrier = threading.Barrier(len(stores))

    def get(kernels):
        barrier.wait()
        return kernels.get(SMALL)

    with concurrent.futures.ThreadPoolExecutor(len(stores)) as pool:
        results = list(pool.map(get, stores))
    assert calls == [SMALL]
    assert results[0].metadata == results[1].metadata
    totals = collections.Counter()
    for kernels in {id(s): s for s in stores}.values():
        totals.update(dataclasses.asdict(kernels.stats))
    assert totals["compiles"] == 1
    assert totals["memory_hits"] + totals["disk_hits"] == 1


# Two stores (two cache folders) compile different configs in two threads.
_RACE = """
import concurrent.futures, sys, threading
from jax_moe_publish import tuning
from jax_moe_publish.aot.store import KernelStore

configs = [tuning.kernel_config(tuning.Problem(512, k), tp=2, m=None) for k in (2, 3)]
stores = [KernelStore(cache_dir=f"{sys.argv[1]}/{k}", prebuilt_dirs=[]) for k in (2, 3)]
barrier = threading.Barrier(2)

def get(kernels, config):
    barrier.wait()
    return kernels.get(config).metadata["key"]

with concurrent.futures.ThreadPoolExecutor(2) as pool:
    assert list(pool.map(get, stores, configs)) == [c.key for c in configs]
"""


def test_concurrent_compiles_of_different_configs(tmp_path):
    # In a child: a failed concurrent compile can leave the DSL unable to compile again.
    result = run_python(["-c", _RACE, str(tmp_path)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]


# The CLI.


def run_cli(args, cwd) -> subprocess.CompletedProcess:
    """``python -m jax_moe_publish.aot ARGS`` in ``cwd``."""
    return run_python(["-m", "jax_moe_publish.aot", *args], cwd)


def built_files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def three_files(key: str) -> list[str]:
    return [f"{key}.cubin", f"{key}.json", f"{key}.ptx"]


def test_cli_builds_explicit_config(tmp_path):
    (tmp_path / "cwd").mkdir()
    out = tmp_path / "out"
    result = run_cli(["build", "--hidden", "1024", "--top-k", "4", "--tp", "2", "--algorithm", "twoshot",
                      "--out", str(out)], cwd=tmp_path / "cwd")
    assert result.returncode == 0, result.stderr
    key = tuning.kernel_config(tuning.Problem(1024, 4), tp=2, m=None, algorithm="twoshot").key
    assert built_files(out) == three_files(key)
    lines = result.stdout.splitlines()
    assert re.fullmatch(rf"\[1/1\] {re.escape(key)}\s+\d+\.\d s", lines[0])
    assert lines[-1] == f"built 1 kernel sets into {out}"
    assert built_files(tmp_path / "cwd") == []  # the DSL's dump files go elsewhere
    artifact.KernelArtifact.load(out, key).check(key)


def test_build_command_rebuilds_the_config(tmp_path):
    config = KernelConfig(
        hidden=2880, top_k=10, tp=2, algorithm="reduce_scatter", routed_scaling_factor=0.1,
        fp32_weights=True, elements_per_thread=4, threads=96, prefetch_group=3,
        load_shared_expert_before_pdl=True, reduce_threads=64, arch="sm_100a",
    )
    out = tmp_path / "out"
    command = shlex.split(store.build_command(config, str(out)))
    assert command[:4] == ["python", "-m", "jax_moe_publish.aot", "build"]
    result = run_cli(command[3:], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert built_files(out) == three_files(config.key)
    assert artifact.KernelArtifact.load(out, config.key).metadata["config"] == config.to_dict()


def test_build_command_rebuilds_an_experts_config(tmp_path):
    config = ExpertsConfig.for_shape(hidden=1024, intermediate=96, experts=40, top_k=6, fused_gate_up=False)
    config = config.replace(token_tiles=1, down_unroll=1)
    out = tmp_path / "out"
    command = shlex.split(store.build_command(config, str(out)))
    assert command[4:6] == ["--op", "experts"]
    result = run_cli(command[3:], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    built = artifact.KernelArtifact.load(out, config.key)
    assert built.metadata["op"] == "experts" and built.config == config
    built.check(config.key)


def test_cli_bad_value_exits_nonzero(tmp_path):
    result = run_cli(["build", "--hidden", "1024", "--top-k", "0", "--tp", "2", "--out", str(tmp_path)],
                     cwd=tmp_path)
    assert result.returncode != 0
    assert "KernelConfig.top_k=0" in result.stderr
    assert built_files(tmp_path) == []


EXPLICIT = ["--hidden", "1024", "--top-k", "4", "--tp", "2"]
CLI_ERRORS = [
    (EXPLICIT + ["--prefetch-group", "5"], "KernelConfig.prefetch_group=5"),
    (EXPLICIT + ["--tp", "1", "--algorithm", "oneshot"], "KernelConfig.algorithm='oneshot'"),
    (EXPLICIT + ["--routed-scaling-factor", "nan"], "KernelConfig.routed_scaling_factor=nan"),
    (EXPLICIT + ["--arch", "sm_80"], "KernelConfig.arch='sm_80'"),
    (EXPLICIT + ["--enable-pdl", "maybe"], "--enable-pdl: expected true or false"),
    (EXPLICIT + ["--top-k", "four"], "--top-k: invalid int value"),
    (EXPLICIT[:-1] + ["0"], "--tp 0: expected an int in [1, 8], the size of the TP group"),
    (EXPLICIT[:-1] + ["9"], "--tp 9: expected an int in [1, 8]"),
    (EXPLICIT[:-1] + ["1", "--epilogue", "rmsnorm"], "--epilogue rmsnorm with --tp 1: expected --tp 2 or more"),
    (EXPLICIT + ["--epilogue", "layernorm"], "--epilogue: invalid choice: 'layernorm'"),
    (EXPLICIT + ["--algorithm", "threeshot"], "--algorithm: invalid choice: 'threeshot'"),
    (["--hidden", "1024"], "needs --top-k --tp"),
    (["--preset", "llama"], "--preset: invalid choice"),
    ([], "nothing to build"),
    (["--op", "experts", "--hidden", "1024", "--top-k", "4"], "an explicit experts config needs --intermediate --experts"),
    (["--op", "experts", "--hidden", "1024", "--intermediate", "64", "--experts", "8", "--top-k", "4", "--tp", "2"],
     "--tp: not a field of ExpertsConfig (--op experts)"),
    (["--op", "experts", "--hidden", "1000", "--intermediate", "64", "--experts", "8", "--top-k", "4"],
     "ExpertsConfig.hidden=1000: expected a positive multiple of 16"),
    (["--op", "matmul"], "--op: invalid choice: 'matmul'"),
]


@pytest.mark.parametrize("args, message", CLI_ERRORS, ids=[m for _, m in CLI_ERRORS])
def test_cli_errors(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.setattr(compile, "compile_config", lambda config: pytest.fail("compiled"))
    with pytest.raises(SystemExit) as exit_:
        cli_main(["build", *args, "--out", str(tmp_path)])
    code = exit_.value.code
    assert code not in (0, None)
    # Config errors exit with the message; argparse prints its own and exits with 2.
    assert message in (code if isinstance(code, str) else capsys.readouterr().err)


@pytest.mark.parametrize("where, message", [
    ("file", "expected a folder, but it is a file"),
    ("file/out", "cannot make or write in this folder (Not a directory)"),
], ids=["a file", "under a file"])
def test_cli_checks_out_before_compiling(tmp_path, monkeypatch, where, message):
    monkeypatch.setattr(compile, "compile_config", lambda config: pytest.fail("compiled"))
    (tmp_path / "file").write_text("")
    out = tmp_path / where
    with pytest.raises(SystemExit) as exit_:
        cli_main(["build", *EXPLICIT, "--out", str(out)])
    assert exit_.value.code == f"--out {out}: {message}" + (
        "; expected a folder that exists or can be made, and that this process can write in" if "/" in where else "")


def test_cli_makes_out_before_the_first_compile(tmp_path, monkeypatch):
    out = tmp_path / "a" / "b"
    made = []

    def fake_compile(config):
        made.append(out.is_dir())
        return artifact.KernelArtifact(b"\x7fELF", "", {"key": config.key})

    monkeypatch.setattr(compile, "compile_config", fake_compile)
    assert cli_main(["build", *EXPLICIT, "--out", str(out)]) == 0
    assert made == [True]


def test_cli_presets(tmp_path, monkeypatch, capsys):
    """--preset is repeatable, takes --arch, and is deduplicated; each build prints its progress."""
    built = []

    def fake_compile(config):
        built.append(config)
        return artifact.KernelArtifact(b"\x7fELF", "", {"key": config.key})

    monkeypatch.setattr(compile, "compile_config", fake_compile)
    assert cli_main(["build", "--preset", "qwen3-moe", "--preset", "tests", "--preset", "qwen3-moe",
                     "--arch", "sm_100a", "--out", str(tmp_path)]) == 0
    expected = list(dict.fromkeys(presets.qwen3_moe("sm_100a") + gpu_matrix.all_configs("sm_100a")))
    assert built == expected
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:-1]] == [
        [f"[{i}/{len(expected)}]", config.key] for i, config in enumerate(expected, 1)
    ]
