"""Where an example runs: on NVIDIA GPUs where the driver finds one, else on virtual CPU
devices. Call `choose` before JAX is imported: the CPU device count is an XLA flag.

With ``--rank-processes N`` (`add_rank_processes`, `run`) the TP group is N processes that share
this machine's GPUs (one GPU suffices; on a machine without one, N processes of one CPU
device each): `jax_moe_publish.testing.rank_processes`. Their kernels take turns on the GPU,
so the checks hold and the times printed mean nothing.

`positive_int`, `non_negative_int` and `positive_float` are the argparse types of the examples'
flags: a value out of range is a usage error that says so.
"""

from __future__ import annotations

import argparse
import os
import sys


def gpu_present() -> bool:
    """True where the CUDA driver initializes and finds a GPU."""
    try:
        from cuda.bindings import driver

        (error,) = driver.cuInit(0)
        return error == driver.CUresult.CUDA_SUCCESS and driver.cuDeviceGetCount()[1] > 0
    except Exception:  # no bindings or no libcuda: a CPU machine
        return False


def choose(cpu_devices: int) -> bool:
    """True on a GPU machine; elsewhere asks XLA for ``cpu_devices`` virtual CPU devices and
    returns False."""
    if gpu_present():
        return True
    from jax_moe_publish.testing import rank_processes

    if rank_processes.RankProcess.from_environment() is not None:
        return False  # a rank process on CPU: one device
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={cpu_devices}"
    return False


def _int_at_least(low: int):
    """An argparse type: an int >= ``low``; anything else is a usage error that says so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value}")
        return value

    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def positive_float(text: str) -> float:
    """An argparse type: a float > 0 (not nan or inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def add_rank_processes(parser) -> None:
    parser.add_argument("--rank-processes", type=positive_int, metavar="N",
                        help="run the TP group as N processes that share this machine's GPUs (one GPU "
                             "suffices): the checks hold, the times mean nothing")


def run(main, args, deadline_s: float = 1800.0) -> int:
    """``main(args)``'s exit status; with ``args.rank_processes`` N, this script as N rank
    processes (each runs ``main`` and leaves through a last barrier), and theirs."""
    from jax_moe_publish.testing import local_processes, rank_processes

    if rank_processes.join() is not None:
        local_processes.run_and_leave(main, args)
    if not args.rank_processes:
        return main(args) or 0
    outcomes = rank_processes.launch([sys.executable, *sys.argv], args.rank_processes, deadline_s=deadline_s,
                                     echo=True)
    failed = [outcome.describe() for outcome in outcomes if outcome.failed]
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failed else 0
