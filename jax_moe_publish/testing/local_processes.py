"""Processes of one machine joined by ``jax.distributed`` on localhost: start them, join, leave.

The parent starts the processes with `run`, which forwards what each prints,
kills any still running at the deadline (or ``grace_s`` after another one
failed) and returns how each ended. Each process joins with `join` (one GPU,
or one CPU device with gloo collectives), may report a JSON result on a line
of its stdout (`report`, read back with `read_result`) and ends with `leave`:

* a last barrier, so that process 0, which serves the coordinator, goes last.
  A process still talking to a coordinator that is gone (its heartbeat, its
  shutdown) fails with gRPC "Connection refused" instead of exiting cleanly;
* then ``os._exit``, which skips JAX's shutdown at exit: that talks to the
  coordinator again, and waits for every process to do the same.

Nothing here touches CUDA except `local_gpu_count`, which asks the driver.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import NoReturn

import jax
from cuda.bindings import driver
from jax._src import distributed

RESULT_PREFIX = "RESULT "
_FINAL_BARRIER = "jax_moe_publish/local_processes/leave"
# The barrier shows that every process reached it, not that each has its answer yet.
_COORDINATOR_LINGER_S = 0.5


def local_gpu_count() -> int:
    """NVIDIA GPUs visible through the driver, counted without starting JAX (which would claim
    them); 0 where there is no driver."""
    try:
        (error,) = driver.cuInit(0)
        if error != driver.CUresult.CUDA_SUCCESS:
            return 0
        error, count = driver.cuDeviceGetCount()
    except Exception:  # the bindings raise when libcuda itself is missing
        return 0
    return count if error == driver.CUresult.CUDA_SUCCESS else 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_environment(*, cpu_devices: int | None = None, extra: dict | None = None) -> dict:
    """This process's environment for a child: XLA's virtual CPU device count set to
    ``cpu_devices`` (None: removed, one CPU device), XLA's preallocation of GPU memory off
    (each process allocates as it goes, beside what others hold), then ``extra``."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    if cpu_devices is not None:
        flags += f" --xla_force_host_platform_device_count={cpu_devices}"
    env["XLA_FLAGS"] = " ".join(flags.split())
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env.update(extra or {})
    return env


@dataclasses.dataclass
class Outcome:
    """How one process of `run` ended: its exit code (None: killed, ``killed`` says why) and
    everything it printed."""

    name: str
    returncode: int | None
    stdout: str
    stderr: str
    killed: str | None = None

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    @property
    def result(self) -> dict | None:
        return read_result(self.stdout)

    def describe(self) -> str:
        if self.killed:
            return f"{self.name}: killed, {self.killed}"
        return f"{self.name}: exit code {self.returncode}"


def _collect(pipe, lines: list[str], echo_to, prefix: str) -> None:
    for line in pipe:
        lines.append(line)
        # A result is for the parent's code (`Outcome.result`), not for its reader.
        if echo_to is not None and not line.startswith(RESULT_PREFIX):
            echo_to.write(prefix + line)
            echo_to.flush()
    pipe.close()


def run(commands: list[list[str]], *, envs: list[dict], names: list[str] | None = None,
        deadline_s: float, grace_s: float = 30.0, echo: bool = True) -> list[Outcome]:
    """Start every command at once, each its own process, and wait for them all.

    A process still running ``deadline_s`` after the start, or ``grace_s``
    after another one failed (its peers may wait for it forever), is killed.
    With ``echo`` every line a process prints, but its `report`, is printed
    here as it comes, after ``[name]`` (stdout to stdout, stderr to stderr).
    """
    names = names or [f"process {i}" for i in range(len(commands))]
    children, readers, captured = [], [], []
    start = time.monotonic()
    try:
        for command, env, name in zip(commands, envs, names):
            child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     errors="replace", env=env)
            children.append(child)
            out, err = [], []
            captured.append((out, err))
            for pipe, lines, stream in ((child.stdout, out, sys.stdout), (child.stderr, err, sys.stderr)):
                reader = threading.Thread(target=_collect, args=(pipe, lines, stream if echo else None,
                                                                 f"[{name}] "), daemon=True)
                reader.start()
                readers.append(reader)
        deadline, reason = start + deadline_s, f"still running {deadline_s:g} s after the start"
        killed = {}
        while any(child.poll() is None for child in children):
            failed = [name for name, child in zip(names, children) if child.returncode not in (None, 0)]
            if failed and time.monotonic() + grace_s < deadline:
                deadline, reason = time.monotonic() + grace_s, f"still running {grace_s:g} s after {failed[0]} failed"
            if time.monotonic() >= deadline:
                for i, child in enumerate(children):
                    if child.poll() is None:
                        child.kill()
                        killed[i] = reason
                break
            time.sleep(0.1)
    finally:
        for child in children:
            if child.poll() is None:  # an interrupt of the parent: leave no process behind
                child.kill()
            child.wait()
        for reader in readers:
            reader.join()
    return [Outcome(name, None if i in killed else child.returncode, "".join(out), "".join(err), killed.get(i))
            for i, (name, child, (out, err)) in enumerate(zip(names, children, captured))]


def join(port: int, num_processes: int, process_id: int, gpu: int | None = None,
         timeout_s: float = 120.0) -> None:
    """Join the others through the coordinator on ``127.0.0.1:port`` (before any other JAX
    call): with ``gpu``, this process owns that GPU; without, one CPU device and gloo
    collectives."""
    if gpu is None:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id,
                               local_device_ids=None if gpu is None else [gpu],
                               initialization_timeout=int(timeout_s))


def report(result: dict) -> None:
    """Print ``result`` for the parent, on one line of stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def read_result(stdout: str) -> dict | None:
    """The last result a process printed with `report`; None if it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX):]) if lines else None


def leave(code: int = 0, *, wait_for_peers: bool = True, timeout_s: float = 60.0) -> NoReturn:
    """Exit with ``code``; with ``wait_for_peers``, first wait (at most ``timeout_s``) until
    every process of ``jax.distributed`` gets here, so that the coordinator goes last.

    Print results before: a peer that never comes is reported on stderr and does not change
    ``code``. Without ``jax.distributed`` (a single process) it just exits.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if wait_for_peers:
        state = distributed.global_state
        if state.client is not None:
            try:
                state.client.wait_at_barrier(_FINAL_BARRIER, max(1, int(timeout_s * 1000)))
                if state.service is not None:
                    time.sleep(_COORDINATOR_LINGER_S)
            except Exception as error:  # the client raises XLA runtime errors
                print(f"final barrier: {error}", file=sys.stderr, flush=True)
    os._exit(code)


def run_and_leave(program, *args) -> NoReturn:
    """Call ``program(*args)``, then `leave` with its exit status: what it returned (None: 0),
    the code of a `SystemExit` it raised (a message is printed, and is 1), or 1 after printing
    the traceback of anything else it raised."""
    try:
        code = program(*args) or 0
    except SystemExit as stop:
        code = stop.code or 0
        if not isinstance(code, int):  # sys.exit(message)
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    leave(code)
