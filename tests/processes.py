"""Run a program of `process_programs` in several processes joined by ``jax.distributed`` on localhost.

Each process prints one ``RESULT {json}`` line. Every run has a deadline: a
process still running at it is killed, and the test fails with the output of
every process, so that a hang never stalls pytest.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

PROGRAMS = pathlib.Path(__file__).with_name("process_programs.py")
RESULT_PREFIX = "RESULT "
DEADLINE_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_environment(extra: dict | None = None) -> dict:
    """This environment, minus the virtual CPU devices of conftest (one device per process)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env.update(extra or {})
    return env


def run(program: str, *options: str, gpus: list[int] | None = None, processes: int = 2,
        env: list[dict] | None = None, deadline_s: float = DEADLINE_S, expect_results: list[int] | None = None
        ) -> list[dict | None]:
    """Results of ``program`` in ``processes`` processes; ``gpus[i]`` is process i's GPU (None: CPU).

    ``expect_results`` lists the processes that must print a result (all by default).
    """
    port = free_port()
    children = []
    for i in range(processes):
        command = [sys.executable, str(PROGRAMS), program, "--process-id", str(i), "--num-processes",
                   str(processes), "--port", str(port), *options]
        if gpus is not None:
            command += ["--gpu", str(gpus[i])]
        children.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         env=child_environment(env[i] if env else None)))
    start = time.monotonic()
    outputs = []
    hung = []
    for i, child in enumerate(children):
        try:
            out, err = child.communicate(timeout=max(1.0, deadline_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            hung.append(i)
            child.kill()
            out, err = child.communicate()
        outputs.append((child.returncode, out, err))
    report = "\n".join(f"--- process {i} (exit {code})\nstdout: {out[-3000:]}\nstderr: {err[-3000:]}"
                       for i, (code, out, err) in enumerate(outputs))
    if hung:
        pytest.fail(f"{program} {' '.join(options)}: process(es) {hung} hung, killed after {deadline_s} s\n{report}")
    results = []
    for i, (code, out, _) in enumerate(outputs):
        lines = [line for line in out.splitlines() if line.startswith(RESULT_PREFIX)]
        results.append(json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None)
    for i in expect_results if expect_results is not None else range(processes):
        if results[i] is None:
            pytest.fail(f"{program} {' '.join(options)}: process {i} printed no result\n{report}")
    return results
