"""Run a program of ``tests/programs/process_programs.py`` in several processes joined by
``jax.distributed`` on localhost.

Each process reports one result (`local_processes.report`), read back here through
`local_processes.Outcome.result`. Every run has a deadline: a
process still running at it is killed, and the test fails with the output of
every process, so that a hang never stalls pytest.
"""

from __future__ import annotations

import pathlib
import sys

import pytest

from jax_moe_publish.testing import local_processes

PROGRAMS = pathlib.Path(__file__).resolve().parents[1] / "programs" / "process_programs.py"
DEADLINE_S = 300


def run(program: str, *options: str, gpus: list[int] | None = None, processes: int = 2,
        env: list[dict] | None = None, deadline_s: float = DEADLINE_S, expect_results: list[int] | None = None
        ) -> list[dict | None]:
    """Results of ``program`` in ``processes`` processes; ``gpus[i]`` is process i's GPU (None: CPU).

    ``expect_results`` lists the processes that must print a result (all by default).
    """
    port = local_processes.free_port()
    commands = []
    for i in range(processes):
        command = [sys.executable, str(PROGRAMS), program, "--process-id", str(i), "--num-processes",
                   str(processes), "--port", str(port), *options]
        if gpus is not None:
            command += ["--gpu", str(gpus[i])]
        commands.append(command)
    # One CPU device per process: conftest's virtual devices are for this process only.
    envs = [local_processes.child_environment(extra=env[i] if env else None) for i in range(processes)]
    outcomes = local_processes.run(commands, envs=envs, deadline_s=deadline_s, echo=False)
    report = "\n".join(f"--- {o.describe()}\nstdout: {o.stdout[-3000:]}\nstderr: {o.stderr[-3000:]}"
                       for o in outcomes)
    killed = [o.describe() for o in outcomes if o.killed]
    if killed:
        pytest.fail(f"{program} {' '.join(options)}: {'; '.join(killed)}\n{report}")
    results = [o.result for o in outcomes]
    for i in expect_results if expect_results is not None else range(processes):
        if results[i] is None:
            pytest.fail(f"{program} {' '.join(options)}: process {i} printed no result\n{report}")
    return results
