"""Rank processes under pytest (`rank_runs`), on CPU devices: the parent's verdict for each
test follows what its rank processes did.

``tests/support/rank_run_cases.py`` holds tests of two "GPUs"; with
`rank_processes.ON_CPU_ENV` set they run as two processes of one CPU device each, joined
by ``jax.distributed``, exactly as GPU tests run on one GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from jax_moe_publish.testing import rank_processes

CASES = pathlib.Path(__file__).resolve().parents[1] / "support" / "rank_run_cases.py"
ROOT = CASES.parents[2]


def _verdicts(tmp_path) -> tuple[dict, str]:
    report = tmp_path / "report.xml"
    env = {**os.environ, rank_processes.ON_CPU_ENV: "1"}
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "--rootdir",
                          str(ROOT), "-c", str(ROOT / "pyproject.toml"), f"--junitxml={report}", str(CASES)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    verdicts = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        children = {child.tag: child for child in case}
        verdict = next((tag for tag in ("failure", "error", "skipped") if tag in children), "passed")
        verdicts[case.get("name")] = (verdict, (children[verdict].get("message") or "") if verdict != "passed" else "")
    return verdicts, run.stdout + run.stderr


def test_each_verdict_follows_the_rank_processes(tmp_path):
    verdicts, output = _verdicts(tmp_path)
    assert verdicts["test_each_rank_sees_every_rank_output"][0] == "passed", output
    assert verdicts["test_the_processes_draw_the_same_data"][0] == "passed", output
    assert verdicts["test_a_barrier_waits_for_the_slowest_process"][0] == "passed", output
    verdict, message = verdicts["test_a_failure_in_one_rank_process_fails_the_test"]
    assert verdict == "failure" and "rank process 1" in message and "rank process 0" not in message, output
    verdict, message = verdicts["test_a_skip_inside_the_body_skips"]
    assert verdict == "skipped" and "planted skip" in message, output
    assert "5 test(s) as 2 rank processes" in output, output


@pytest.mark.parametrize("benchmark", ["bench_moe_publish.py", "bench_moe_block.py", "bench_multiprocess.py"])
def test_the_benchmarks_refuse_to_time_ranks_that_share_a_gpu(benchmark, tmp_path):
    place = rank_processes.RankProcess(0, 2, 1, 1, 0, str(tmp_path))
    env = {**os.environ, rank_processes.RANK_PROCESS_ENV: json.dumps(dataclasses.asdict(place))}
    command = [sys.executable, str(ROOT / "benchmarks" / benchmark), "--cpu", "--out", str(tmp_path / "x.json")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode != 0 and "cannot be measured with ranks as processes that share GPUs" in run.stderr, (
        run.stdout[-2000:], run.stderr[-2000:])
