"""Child programs of the multi-process tests: one device per process, joined by ``jax.distributed``.

    python tests/programs/process_programs.py PROGRAM --process-id I --num-processes N --port P [--gpu ORDINAL]

With ``--gpu`` a process owns that GPU and calls the kernels (``impl="kernel"``);
without it, one CPU device (gloo collectives) and ``impl="auto"``, which runs
the reference. Every process draws every rank's inputs from the same seed, so
each checks its own output against the float64 model of `numerics`; the
parent compares the processes' output hashes for bitwise equality. Each
reports its result (`local_processes.report`, which the parent reads back with
`local_processes.read_result`) and leaves through `local_processes.leave`: a
last barrier (so that the coordinator, process 0, outlives the others), then
``os._exit``. A program that raises leaves the same way, with exit code 1.

* ``match``: for each of ``--results`` and ``--problems``, a mailbox and calls
  with m in `M_VALUES`, fresh inputs each.
* ``chain``: ``--calls`` calls in jitted chains of `CHAIN_LAYERS`, each
  layer's output the next one's shared input, a random m per chain.
* ``exit-mid-run``: healthy calls, then process 1 exits without a word; the
  survivor's next call must fail within ``--timeout`` with the mailbox
  diagnostic, and its ``close`` must end within ``--process-timeout``.
* ``cross-host``: run with a different host identity per process
  (``JAX_MOE_PUBLISH_TEST_HOST_ID``): nothing is allocated, ``auto`` runs the
  reference and warns once on GPUs, ``kernel`` raises.
* ``mismatch``: process 1 creates a mailbox of another hidden size.
* ``missing``: process 1 creates no mailbox at all.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "support"))  # as tests/conftest.py does for tests
import numerics  # noqa: E402
from jax_moe_publish.testing import local_processes  # noqa: E402

CAPACITY = 64
M_VALUES = (1, 3, 37, CAPACITY)
CHAIN_MS = (1, 5, 17, CAPACITY)
CHAIN_LAYERS = 10
RESULTS = ("allreduce", "reduce_scatter")
HEALTHY_CALLS = 3
# Problems with prebuilt kernels in the `tests` preset (jax_moe_publish.testing.gpu_matrix.DEFAULT_PROBLEMS).
PROBLEMS = (
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, fp32_weights=False, shared=True),
    dict(hidden=7168, top_k=8, routed_scaling_factor=2.5, fp32_weights=True, shared=True),
    dict(hidden=2048, top_k=6, routed_scaling_factor=1.0, fp32_weights=False, shared=False),
)


class Process:
    """This process's view: JAX, the mesh over every process's device, its rank, the impl to call."""

    def __init__(self, args) -> None:
        local_processes.join(args.port, args.num_processes, args.process_id, args.gpu)
        import jax

        import jax_moe_publish

        self.jax = jax
        self.jmp = jax_moe_publish
        self.on_gpu = args.gpu is not None
        self.impl = "kernel" if self.on_gpu else "auto"
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if args.order == "mesh-reversed":
            devices = devices[::-1]
        self.mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
        self.tp = len(devices)
        (self.device,) = jax.local_devices()
        self.rank = devices.index(self.device)
        self.problem = PROBLEMS[args.problems[0]]

    def random_problems(self, rng, m: int) -> list[numerics.RankInputs]:
        p = self.problem
        return [numerics.random_problem(rng, m=m, hidden=p["hidden"], top_k=p["top_k"],
                                        fp32_weights=p["fp32_weights"], shared=p["shared"])
                for _ in range(self.tp)]

    def stacked(self, arrays: list[np.ndarray]):
        """The [tp, ...] array laid out along "tp"; this process supplies its own rank's slice."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        full = np.stack(arrays)
        return self.jax.make_array_from_callback(full.shape, NamedSharding(self.mesh, P("tp")),
                                                 lambda index: full[index])

    def inputs(self, problems: list[numerics.RankInputs]) -> list:
        fields = ["routed", "weights", "indices"] + (["shared"] if problems[0].shared is not None else [])
        return [self.stacked([getattr(p, f) for p in problems]) for f in fields]

    def step(self, mailbox, impl: str | None = None):
        """One call per rank in jit + shard_map; returns the global output."""
        from jax.sharding import PartitionSpec as P

        jmp, scale = self.jmp, self.problem["routed_scaling_factor"]
        scatter = mailbox.result == "reduce_scatter"

        def shard(routed, weights, indices, *shared):
            out = jmp.moe_finalize_publish(routed[0], weights[0], indices[0], shared[0][0] if shared else None,
                                           mailbox=mailbox, routed_scaling_factor=scale, impl=impl or self.impl)
            return out[None] if scatter else out

        return self.jax.jit(self.jax.shard_map(shard, mesh=self.mesh, in_specs=P("tp"),
                                               out_specs=P("tp") if scatter else P()))

    def local(self, out, result: str = "allreduce") -> np.ndarray:
        """This process's copy of the output (of a reduce-scatter, its own rows)."""
        data = np.asarray(out.addressable_data(0))
        return data[0] if result == "reduce_scatter" else data

    def failure(self, out: np.ndarray, problems, result: str) -> str | None:
        """Why this rank's output is not the float64 model; None if it is."""
        expected, bound = numerics.expected_sum(problems, self.problem["routed_scaling_factor"])
        if result == "reduce_scatter":
            expected = numerics.owned(expected, self.tp, self.rank)
            bound = numerics.owned(bound, self.tp, self.rank)
        try:
            numerics.assert_close(out, expected, bound, what=f"rank {self.rank}")
        except AssertionError as error:
            return str(error)
        return None

    def mailbox(self, **options):
        p = self.problem
        return self.jmp.Mailbox(self.mesh, "tp", hidden=p["hidden"], capacity_m=CAPACITY, **options)

    def describe(self) -> dict:
        return {"process": self.jax.process_index(), "rank": self.rank, "device": str(self.device),
                "ordinal": self.device.local_hardware_id, "platform": self.device.platform}

    def execute_counts(self) -> int:
        if not self.on_gpu:
            return 0
        from jax_moe_publish import _extension

        return sum(_extension.execute_counts())


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8)).hexdigest()


def finish(result: dict, *, barrier: bool = True) -> None:
    """Print the result and leave; with ``barrier``, after the others (the coordinator goes last)."""
    local_processes.report(result)
    local_processes.leave(0, wait_for_peers=barrier)


def match(args) -> None:
    proc = Process(args)
    rng = np.random.default_rng(args.seed)
    calls, mailboxes = [], []
    executes = proc.execute_counts()
    for problem in args.problems:
        proc.problem = PROBLEMS[problem]
        for result in args.results:
            with proc.mailbox(result=result, process_timeout_s=60) as mailbox:
                step = proc.step(mailbox)
                for m in M_VALUES:
                    problems = proc.random_problems(rng, m)
                    with mailbox.diagnose():
                        out = proc.local(step(*proc.inputs(problems)), result)
                    calls.append({"problem": problem, "result": result, "m": m, "sha256": digest(out),
                                  "failure": proc.failure(out, problems, result)})
                mailboxes.append({"id": mailbox.id, "result": result, "status": mailbox.status()})
    finish({**proc.describe(), "calls": calls, "mailboxes": mailboxes,
            "kernel_executes": proc.execute_counts() - executes})


def chain(args) -> None:
    """Chains of CHAIN_LAYERS calls in one jit; layer l+1's shared input is layer l's output."""
    proc = Process(args)
    jax, jmp = proc.jax, proc.jmp
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(args.seed)
    scale = proc.problem["routed_scaling_factor"]
    failures, digests, ms = [], [], []
    with proc.mailbox(process_timeout_s=60) as mailbox:

        def shard(routed, weights, indices, shared):
            y, outputs = shared[0], []
            for layer in range(CHAIN_LAYERS):
                y = jmp.moe_finalize_publish(routed[0, layer], weights[0, layer], indices[0, layer], y,
                                             mailbox=mailbox, routed_scaling_factor=scale, impl=proc.impl)
                outputs.append(y)
            return jnp.stack(outputs)

        step = jax.jit(jax.shard_map(shard, mesh=proc.mesh, in_specs=P("tp"), out_specs=P()))
        calls = 0
        while calls < args.calls:
            m = int(rng.choice(CHAIN_MS))
            layers = [proc.random_problems(rng, m) for _ in range(CHAIN_LAYERS)]
            stacks = [proc.stacked([np.stack([getattr(layer[r], f) for layer in layers]) for r in range(proc.tp)])
                      for f in ("routed", "weights", "indices")]
            with mailbox.diagnose():
                out = proc.local(step(*stacks, proc.stacked([p.shared for p in layers[0]])))
            previous = [p.shared for p in layers[0]]
            for layer, problems in enumerate(layers):
                for rank, problem in enumerate(problems):
                    problem.shared = previous[rank]
                if text := proc.failure(out[layer], problems, "allreduce"):
                    failures.append(f"call {calls + layer} (m={m}): {text}")
                previous = [out[layer]] * proc.tp
            digests.append(digest(out))
            ms.append(m)
            calls += CHAIN_LAYERS
        status = mailbox.status()
    finish({**proc.describe(), "calls": calls, "ms": ms, "failures": failures[:5], "sha256": digests,
            "status": status})


def exit_mid_run(args) -> None:
    proc = Process(args)
    rng = np.random.default_rng(args.seed)
    mailbox = proc.mailbox(timeout_s=args.timeout, process_timeout_s=args.process_timeout)
    step = proc.step(mailbox)
    healthy = []
    for _ in range(HEALTHY_CALLS):
        problems = proc.random_problems(rng, 5)
        healthy.append(proc.failure(proc.local(step(*proc.inputs(problems))), problems, "allreduce"))
    if proc.jax.process_index() == 1:
        finish({**proc.describe(), "left_after": HEALTHY_CALLS, "healthy": healthy}, barrier=False)
    inputs = proc.inputs(proc.random_problems(rng, 5))
    start = time.monotonic()
    outcome = {"raised": None}
    try:
        with mailbox.diagnose():
            step(*inputs).block_until_ready()
    except Exception as error:
        outcome = {"raised": type(error).__name__, "message": str(error), "cause": repr(error.__cause__)[:2000]}
    outcome["elapsed_s"] = time.monotonic() - start
    status = mailbox.status()
    start = time.monotonic()
    closing = {"raised": None}
    try:
        mailbox.close()
    except Exception as error:
        closing = {"raised": type(error).__name__, "message": str(error)[:2000]}
    closing["elapsed_s"] = time.monotonic() - start
    finish({**proc.describe(), "healthy": healthy, "outcome": outcome, "status": status, "close": closing},
           barrier=False)


def cross_host(args) -> None:
    proc = Process(args)
    rng = np.random.default_rng(args.seed)
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with proc.mailbox(result=args.result, process_timeout_s=60) as mailbox:
            for m in (3, 37):  # two traces: the warning must still come once
                problems = proc.random_problems(rng, m)
                out = proc.local(proc.step(mailbox, impl="auto")(*proc.inputs(problems)), args.result)
                calls.append({"m": m, "sha256": digest(out), "failure": proc.failure(out, problems, args.result)})
            try:
                proc.step(mailbox, impl="kernel")(*proc.inputs(proc.random_problems(rng, 3)))
                kernel_error = None
            except ValueError as error:
                kernel_error = str(error)
            result = {"spans_hosts": mailbox.spans_hosts, "hosts": mailbox.group_hosts,
                      "allocated_devices": len(mailbox.status()), "repr": repr(mailbox)}
    ours = [str(w.message) for w in caught if "NVLink does not join hosts" in str(w.message)]
    finish({**proc.describe(), **result, "calls": calls, "warnings": ours, "kernel_error": kernel_error})


def mismatch(args) -> None:
    proc = Process(args)
    hidden = proc.problem["hidden"] * (2 if proc.jax.process_index() == 1 else 1)
    start = time.monotonic()
    try:
        proc.jmp.Mailbox(proc.mesh, "tp", hidden=hidden, capacity_m=CAPACITY, process_timeout_s=args.process_timeout)
        outcome = {"raised": None}
    except Exception as error:
        outcome = {"raised": type(error).__name__, "message": str(error)}
    finish({**proc.describe(), "outcome": outcome, "elapsed_s": time.monotonic() - start})


def missing(args) -> None:
    proc = Process(args)
    if proc.jax.process_index() == 1:
        finish({**proc.describe(), "skipped": True})
    start = time.monotonic()
    try:
        proc.mailbox(process_timeout_s=args.process_timeout)
        outcome = {"raised": None}
    except Exception as error:
        outcome = {"raised": type(error).__name__, "message": str(error),
                   "timed_out": getattr(error, "timed_out", None)}
    finish({**proc.describe(), "outcome": outcome, "elapsed_s": time.monotonic() - start})


PROGRAMS = {"match": match, "chain": chain, "exit-mid-run": exit_mid_run, "cross-host": cross_host,
            "mismatch": mismatch, "missing": missing}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("program", choices=sorted(PROGRAMS))
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--gpu", type=int, help="this process's GPU; none: one CPU device")
    parser.add_argument("--order", choices=("straight", "mesh-reversed"), default="straight",
                        help="mesh-reversed: rank 0 is the last process's device")
    parser.add_argument("--result", choices=RESULTS, default="allreduce")
    parser.add_argument("--results", choices=RESULTS, nargs="+", default=list(RESULTS), help="match only")
    parser.add_argument("--problems", type=int, nargs="+", default=[0], choices=range(len(PROBLEMS)),
                        help="indices into PROBLEMS (match: each; others: the first)")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--timeout", type=float, default=1.0, help="the mailbox's timeout_s")
    parser.add_argument("--process-timeout", type=float, default=5.0, help="the mailbox's process_timeout_s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    local_processes.run_and_leave(PROGRAMS[args.program], args)


if __name__ == "__main__":
    main()
