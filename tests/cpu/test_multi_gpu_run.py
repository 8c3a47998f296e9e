"""`tools/multi_gpu_run.sh` without GPUs: every step's commands (``DRY_RUN``) name scripts and
options that exist, and bad calls are refused before anything runs."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "multi_gpu_run.sh"
STEPS = ["tests", "sanitize", "soak", "pingpong", "sweep", "bench-deepseek", "bench-qwen", "multiprocess", "block"]


def run_script(*args, **env):
    environment = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env=environment, cwd=ROOT)


def known_options(script: str) -> set[str]:
    """The long options of a Python script, from its --help."""
    help_text = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True,
                               timeout=120, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", help_text))


def check_commands(lines):
    for line in lines:
        words = line.split()
        script = next((w for w in words if w.endswith(".py") and "/" in w), None)
        if script is None:
            continue
        unknown = {w for w in words if w.startswith("--")} - known_options(script)
        assert not unknown, f"{script}: unknown options {unknown} in: {line}"


@pytest.mark.parametrize("tp", ["2", "8"])
def test_every_step_names_existing_scripts_and_options(tp, tmp_path):
    run = run_script(*STEPS, DRY_RUN="1", JMP_COMMIT="0123abc", TP=tp, OUT_DIR=str(tmp_path))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    for needed in ("bash tools/gpu_check.sh", "bash tools/sanitize.sh", f"tools/soak.py --tp {tp} --calls 20000",
                   "benchmarks/nvlink_pingpong.cu", "tune_algorithms.py --measure",
                   "--problems deepseek-v3", "--problems qwen3-moe", "bench_multiprocess.py", "bench_moe_block.py"):
        assert any(needed in line for line in lines), needed
    for line in lines:
        if "bench_moe_publish.py" in line:
            assert f"--tp {tp} " in line and "--xla-columns xla xla_nccl" in line and "--rounds 2" in line, line
            assert "--m 1 2 4 8 16 32 64 128 256 512 1024 " in line and "--epilogue" in line, line
    assert all(str(tmp_path) in line for line in lines if "--out" in line or "--json" in line)
    check_commands(lines)


def test_build_names_existing_options():
    run = run_script("build", "4", DRY_RUN="1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert any("aot build --preset tests --preset deepseek-v3 --preset qwen3-moe" in line for line in lines)
    assert any("bench_moe_publish.py --build-kernels" in line and "--tp 4 " in line for line in lines)
    assert any(line.startswith("find ") and "*.ptx" in line for line in lines)
    check_commands(lines)


@pytest.mark.parametrize("args, env, words", [
    (["nope"], {"JMP_COMMIT": "abc"}, "unknown step: nope"),
    (["tests"], {"JMP_COMMIT": ""}, "set JMP_COMMIT"),
    (["build", "3"], {}, "build: TP=3: expected 2, 4 or 8"),
    ([], {}, "Steps:"),
])
def test_bad_calls_are_refused(args, env, words):
    run = run_script(*args, **env)
    assert run.returncode == 2 and words in run.stderr, run.stderr


def test_the_option_check_has_teeth():
    with pytest.raises(AssertionError, match="unknown options {'--bogus'}"):
        check_commands(["python3 benchmarks/bench_moe_publish.py --tp 2 --bogus 1"])
