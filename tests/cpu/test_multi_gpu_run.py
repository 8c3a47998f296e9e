"""`tools/multi_gpu_run.sh` without GPUs: every step's commands (``DRY_RUN``) name scripts and
options that exist, the splits of the benchmarks and of the sweep run each m once, bad calls
are refused before anything runs, and the steps ``build``, ``tests`` and two of the sweep run
for real with stand-ins for what needs the GPU machine (as in ``tests/cpu/test_gpu_check.py``),
the sweep's parts merging, without a GPU, into the table of one unsplit sweep."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jax_moe_publish import tuning
from test_gpu_check import FAKE_GPUS, STAND_IN  # the stand-in GPU test and the plugin that counts it
from test_tune_algorithms import cited_parts, tune_algorithms, uncited

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "multi_gpu_run.sh"
SIMPLE_STEPS = ["tests", "sanitize", "soak", "pingpong"]
BENCHMARKS = {"bench": "bench_moe_publish.py", "block": "bench_moe_block.py", "multiprocess": "bench_multiprocess.py"}
# pip installs nothing, the AOT build copies $KERNEL_SETS into its --out folder (its last
# argument), the benchmarks' kernel builds do nothing, and the sweep runs on CPU devices with
# a fixed machine's figures (FIXED_FIGURES).
PYTHON_STAND_IN = f'''#!/usr/bin/env bash
case "$*" in
    "-m pip "*) exit 0 ;;
    "-m jax_moe_publish.aot build "*) mkdir -p "${{@: -1}}" && exec cp -r "$KERNEL_SETS"/. "${{@: -1}}" ;;
    *--build-kernels*) exit 0 ;;
    *"tune_algorithms.py --measure "*) exec {sys.executable} -m fixed_figures "$@" --cpu --reps 2 ;;
esac
exec {sys.executable} "$@"
'''
FIXED_FIGURES = f'''"""python -m fixed_figures SCRIPT ARG...: SCRIPT on {tune_algorithms.CPU_DEVICES} CPU devices, its
benchmark's programs built and run as ever, but each side's figure a function of its case
alone: two sweeps of the same cases agree."""
import os
import runpy
import sys
import zlib

script, sys.argv = sys.argv[1], sys.argv[1:]
os.environ["JAX_PLATFORMS"] = "cpu"  # before chains imports JAX
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={tune_algorithms.CPU_DEVICES}"
sys.path.insert(0, os.path.dirname(script))
import chains

timed_for_real = chains.time_ours_and_xla


def fixed_figures(mailbox, problem, config, inputs, reps, what, **options):
    timed = timed_for_real(mailbox, problem, config, inputs, reps, what, **options)
    for side in ("ours", *options["xla"]):
        timed[side]["us"] = zlib.crc32(f"{{what}} {{side}}".encode()) % 1000 / 10
    return timed


chains.time_ours_and_xla = fixed_figures
runpy.run_path(script, run_name="__main__")
'''
NVIDIA_SMI_STAND_IN = '''#!/bin/sh
case "$1" in
    --list-gpus) seq "$FAKE_GPUS" | sed 's/^/GPU: a stand-in /' ;;
    topo) echo "a stand-in topology" ;;
    *) echo "0, a stand-in GPU, 0" ;;
esac
'''


def run_script(*args, **env):
    environment = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env=environment, cwd=ROOT)


def output(run: subprocess.CompletedProcess) -> str:
    return f"exit code {run.returncode}\nstdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"


def fitting_splits() -> list[str]:
    """The benchmark and sweep steps of the split that fits, as the script's usage lists them."""
    usage = run_script().stderr
    listed = usage[usage.index("The splits that fit"):usage.index("DRY_RUN=1")]
    return re.findall(r"\b(?:bench|block|multiprocess|sweep)-[\w-]*m[\d-]*\d", listed)


def sweep_tp(step: str) -> int | None:
    """The tp of a sweep step, None for another step."""
    match = re.match(r"sweep-tp(\d+)-", step)
    return match and int(match[1])


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


def option_values(line: str, option: str) -> list[str]:
    words = line.split()
    values = words[words.index(option) + 1:]
    return values[:next((i for i, w in enumerate(values) if w.startswith("--")), len(values))]


@pytest.mark.parametrize("tp", ["2", "8"])
def test_every_step_names_existing_scripts_and_options(tp, tmp_path):
    steps = [step for step in fitting_splits() if (sweep_tp(step) or 0) <= int(tp)]
    run = run_script(*SIMPLE_STEPS, *steps, DRY_RUN="1", JMP_COMMIT="0123abc", TP=tp, OUT_DIR=str(tmp_path))
    assert run.returncode == 0, output(run)
    lines = run.stdout.splitlines()
    for needed in ("bash tools/gpu_check.sh", "bash tools/sanitize.sh", f"tools/soak.py --tp {tp} --calls 20000",
                   "benchmarks/nvlink_pingpong.cu", "tune_algorithms.py --measure",
                   "--problems deepseek-v3 ", "--problems qwen3-moe ", "--problems deepseek-v3+rmsnorm+fp8 ",
                   "bench_multiprocess.py", "bench_moe_block.py"):
        assert any(needed in line for line in lines), needed
    for line in lines:
        if "bench_moe_publish.py" in line:
            assert f"--tp {tp} " in line and "--xla-columns xla xla_nccl" in line and "--rounds 2" in line, line
            # The FP8 steps' problem has the epilogue in its name.
            assert "--algorithms oneshot twoshot" in line and ("--epilogue" in line or "+rmsnorm+fp8 " in line), line
        if "tune_algorithms.py" in line:  # a part of the sweep, which a merge turns into the table later
            part_tp = int(option_values(line, "--tp")[0])
            assert part_tp <= int(tp) and "--table" not in line, line
            assert re.fullmatch(rf"{re.escape(str(tmp_path))}/sweep-tp{part_tp}-m[\d-]+\.json",
                                option_values(line, "--out")[0]), line
    assert all(str(tmp_path) in line for line in lines if "--out" in line or "--json" in line)
    check_commands(lines)


def test_the_splits_run_every_m_of_the_build_once():
    """Each benchmark's steps, per problem, run each m whose kernels the build compiles (the FP8
    steps: ``build-fp8``), once."""
    build = run_script("build", "2", DRY_RUN="1").stdout.splitlines()
    built = {kind: option_values(next(line for line in build if script in line), "--m")
             for kind, script in BENCHMARKS.items()}
    run = run_script(*[step for step in fitting_splits() if sweep_tp(step) is None], DRY_RUN="1",
                     JMP_COMMIT="0123abc")
    assert run.returncode == 0, output(run)
    ran = {}
    for line in run.stdout.splitlines():
        kind = next(kind for kind, script in BENCHMARKS.items() if script in line)
        problem = option_values(line, "--problems")[0] if "--problems" in line else None
        ran.setdefault((kind, problem), []).extend(option_values(line, "--m"))
    assert set(ran) == {(kind, problem) for kind in ("bench", "block") for problem in ("deepseek-v3", "qwen3-moe")} | {
        ("bench", "deepseek-v3+rmsnorm+fp8"), ("multiprocess", None)}
    fp8_build = run_script("build-fp8", "2", DRY_RUN="1").stdout
    fp8_built = option_values(next(line for line in fp8_build.splitlines() if BENCHMARKS["bench"] in line), "--m")
    for (kind, problem), ms in ran.items():
        assert ms == (fp8_built if problem == "deepseek-v3+rmsnorm+fp8" else built[kind]), (kind, problem, ms)


def test_the_sweep_splits_measure_the_m_of_a_merge_once():
    """Each tp's sweep steps measure, together, each m that a merge needs by default, once."""
    run = run_script(*[step for step in fitting_splits() if sweep_tp(step)], DRY_RUN="1", JMP_COMMIT="0123abc",
                     TP="8")
    assert run.returncode == 0, output(run)
    ran = {}
    for line in run.stdout.splitlines():
        ran.setdefault(int(option_values(line, "--tp")[0]), []).extend(map(int, option_values(line, "--m")))
    assert ran == {tp: list(tune_algorithms.DEFAULT_MS) for tp in tune_algorithms.MEASURED_TPS}


def test_build_names_existing_options():
    run = run_script("build", "4", DRY_RUN="1")
    assert run.returncode == 0, output(run)
    lines = run.stdout.splitlines()
    assert any("aot build --preset tests --preset deepseek-v3 --preset qwen3-moe" in line for line in lines)
    assert any("bench_moe_publish.py --build-kernels" in line and "--tp 4 " in line for line in lines)
    assert any(line.startswith("find ") and "*.ptx" in line for line in lines)
    check_commands(lines)


@pytest.mark.parametrize("args, env, words", [
    (["nope"], {"JMP_COMMIT": "abc"}, "unknown step: nope"),
    (["bench-deepseek"], {"JMP_COMMIT": "abc"}, "unknown step: bench-deepseek"),
    (["bench-deepseek-m3-3"], {"JMP_COMMIT": "abc"}, "bench-deepseek-m3-3: none of the m"),
    (["block-qwen-m2"], {"JMP_COMMIT": "abc"}, "block-qwen-m2: none of the m 1 8 32 64 128"),
    (["sweep"], {"JMP_COMMIT": "abc"}, "unknown step: sweep"),
    (["sweep-tp3-m1"], {"JMP_COMMIT": "abc"}, "unknown step: sweep-tp3-m1 (expected sweep-tpN-mLO"),
    (["sweep-tp2-m3"], {"JMP_COMMIT": "abc"}, "sweep-tp2-m3: none of the m"),
    (["sweep-tp8-m1"], {"JMP_COMMIT": "abc", "DRY_RUN": "1", "TP": "4"}, "sweep-tp8-m1: needs 8 GPUs, found 4"),
    (["tests"], {"JMP_COMMIT": ""}, "set JMP_COMMIT"),
    (["build", "3"], {}, "build: TP=3: expected 2, 4 or 8"),
    ([], {}, "Steps:"),
])
def test_bad_calls_are_refused(args, env, words):
    run = run_script(*args, **env)
    assert run.returncode == 2 and words in run.stderr, output(run)


def test_the_option_check_has_teeth():
    with pytest.raises(AssertionError, match="unknown options {'--bogus'}"):
        check_commands(["python3 benchmarks/bench_moe_publish.py --tp 2 --bogus 1"])


def stand_ins(tmp_path) -> dict:
    """The environment of a real run: stand-ins for nvidia-smi (2 GPUs) and, in ``PYTHON``, for
    pip, the kernel builds and the sweep's GPUs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("python", PYTHON_STAND_IN), ("nvidia-smi", NVIDIA_SMI_STAND_IN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "fake_gpus.py").write_text(FAKE_GPUS)
    (tmp_path / "fixed_figures.py").write_text(FIXED_FIGURES)
    environment = {name: value for name, value in os.environ.items() if not name.startswith("JAX_MOE_PUBLISH_")}
    environment.update(PYTHON=str(bin_dir / "python"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                       PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
                       FAKE_GPUS="2", JMP_COMMIT="0123abc", OUT_DIR=str(tmp_path / "out"),
                       JAX_MOE_PUBLISH_KERNEL_DIR=str(tmp_path / "kernels"))
    return environment


def run_step(tmp_path, *args, **env) -> subprocess.CompletedProcess:
    """The script for real, with `stand_ins`."""
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env={**stand_ins(tmp_path), **env}, cwd=ROOT)


def test_the_tests_step_checks_the_folder_that_build_leaves(cuda_tools, kernel_sets, tmp_path):
    """The build deletes the PTX; the resource check beside the tests reads the cubins it keeps."""
    run = run_step(tmp_path, "build", "2", KERNEL_SETS=str(kernel_sets))
    assert run.returncode == 0, output(run)
    kernels = tmp_path / "kernels"
    assert not list(kernels.glob("*.ptx"))
    assert sorted(p.name for p in kernels.glob("*.cubin")) == sorted(p.name for p in kernel_sets.glob("*.cubin"))
    run = run_step(tmp_path, "tests", TESTS=f"-p fake_gpus -p no:cacheprovider {STAND_IN}")
    assert run.returncode == 0, output(run)
    log = (tmp_path / "out" / "tests.log").read_text()
    sets = len(list(kernels.glob("*.json")))
    assert "2 passed" in log and f"checked {sets} of {sets} kernel sets" in log, log


SWEEP_STEPS = {"sweep-tp2-m1": [1], "sweep-tp2-m2": [2]}
"""Two parts of tp = 2's sweep, of the m 1 and 2."""


@pytest.fixture(scope="module")
def sweep_parts(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The parts that `SWEEP_STEPS` leave in OUT_DIR, run for real (`stand_ins`), by step."""
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "kernels").mkdir()
    before = tuning.TABLE_FILE.read_text()
    run = run_step(folder, *SWEEP_STEPS)
    assert run.returncode == 0, output(run)
    assert tuning.TABLE_FILE.read_text() == before
    return {step: folder / "out" / f"{step}.json" for step in SWEEP_STEPS}


def merge(*args: str) -> subprocess.CompletedProcess:
    """``tune_algorithms.py --merge`` as on the development machine: no stand-in, no GPU."""
    return subprocess.run([sys.executable, "benchmarks/tune_algorithms.py", "--merge", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_the_sweep_parts_merge_into_the_table_of_one_unsplit_sweep(sweep_parts, tmp_path):
    """What comes back from the GPU machines is OUT_DIR: each step's part, which a merge turns
    into the table that one ``--measure`` of the same m writes (the same figures: the stand-in's
    fixed machine), each m's reason citing its part."""
    for step, part in sweep_parts.items():
        figures = json.loads(part.read_text())
        assert (figures["tp"], figures["m"], figures["environment"]["commit"]) == (2, SWEEP_STEPS[step], "0123abc")
    merged = tmp_path / "merged.json"
    run = merge(*map(str, sweep_parts.values()), "--m", "1", "2", "--table", str(merged))
    assert run.returncode == 0, output(run)
    whole, table = tmp_path / "sweep-tp2.json", tmp_path / "algorithms.json"
    environment = stand_ins(tmp_path)
    run = subprocess.run([environment["PYTHON"], "benchmarks/tune_algorithms.py", "--measure", "--tp", "2", "--m",
                          "1", "2", "--out", str(whole), "--table", str(table)], capture_output=True, text=True,
                         timeout=600, env=environment, cwd=ROOT)
    assert run.returncode == 0, output(run)
    data = json.loads(merged.read_text())
    assert uncited(data) == uncited(json.loads(table.read_text()))
    package = json.loads(tuning.TABLE_FILE.read_text())
    for case in ("allreduce/none", "allreduce/rmsnorm"):
        entries = data["tables"][case].pop("2")
        assert all(e["source"] == "measured" for e in entries), entries
        assert cited_parts(entries) == [(m, str(sweep_parts[step])) for step, ms in SWEEP_STEPS.items() for m in ms]
        del package["tables"][case]["2"]
    assert data == package


def test_a_merge_of_the_sweep_parts_that_would_guess_is_refused(sweep_parts, tmp_path):
    """Parts that lack an m, or of two tp, leave the table unwritten and say why."""
    table = tmp_path / "algorithms.json"
    first, second = sweep_parts.values()
    run = merge(str(first), "--m", "1", "2", "--table", str(table))
    missing = "tp = 2: no part holds m = 2 of allreduce/none and allreduce/rmsnorm"
    assert run.returncode == 1 and missing in run.stderr, output(run)
    other = json.loads(second.read_text())
    other["tp"] = 4
    (tmp_path / "tp4.json").write_text(json.dumps(other))
    run = merge(str(first), str(tmp_path / "tp4.json"), "--m", "1", "2", "--table", str(table))
    mixed = f"the parts differ in tp: {first} has 2, {tmp_path}/tp4.json has 4"
    assert run.returncode == 1 and mixed in run.stderr, output(run)
    assert not table.exists()
