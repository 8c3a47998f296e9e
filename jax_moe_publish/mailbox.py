"""`Mailbox`: the op's memory outside XLA, one per TP group of a mesh axis.

A mailbox is made once, before the jitted functions that use it, and lives
until `close`. Every rank of a group must call the op on it in the same order.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings

import jax
import numpy as np
from jax._src import distributed

from jax_moe_publish import _abi, _launch, protocol
from jax_moe_publish.checks import check_result, checked_float, checked_int
from jax_moe_publish.config import MAX_NORM_FRAGMENTS_PER_THREAD
from jax_moe_publish.memory.cross_process import MailboxSpec, ProcessMailboxMemory, RankPlace
from jax_moe_publish.memory.group import GroupMemory

ON_TIMEOUT = {"abort": protocol.ON_TIMEOUT_ABORT, "flag": protocol.ON_TIMEOUT_FLAG}
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_PROCESS_TIMEOUT_S = 300.0

MAX_HIDDEN = _abi.MAX_THREADS * MAX_NORM_FRAGMENTS_PER_THREAD * protocol.REDUCE_ELEMENTS
"""The largest ``hidden`` (65536): the widest row that the epilogue's reduce holds in one CTA
(1024 threads of 8 fragments of 8 bf16 lanes), so that a mailbox's calls, with the epilogue or
without, all have kernels. Models stay far below it (DeepSeek-V3: 7168)."""
MAX_SLOT_ELEMENTS = 2**31
"""The largest ``capacity_m * hidden``: bf16 elements of one ``[capacity_m][hidden]`` slot area.
A device's mailbox holds ``STAGES * (tp + GATHER_AREAS)`` of them (`protocol.mailbox_elements`),
``6 * (tp + 2) * capacity_m * hidden`` bytes: at this bound 48 GiB at tp = 2 and 120 GiB at
tp = 8, most of an H200's 141 GB. Below it the kernels' 32-bit values stay in range: m and
capacity_m are int32 kernel parameters, and a call launches at most ``m * ceil(hidden / 128)``
CTAs (32 threads of 4 lanes at the narrowest) on a 1-D grid (``gridDim.x < 2**31``) whose tile
index is an int32; offsets into the mailbox are 64-bit."""

_ids = itertools.count(1)


def _check_mesh_type(mesh) -> None:
    """TypeError unless ``mesh`` is a concrete `jax.sharding.Mesh`: a mailbox's memory lives on
    the mesh's devices, which an `AbstractMesh` does not name."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        raise TypeError(f"mesh={mesh!r}: expected a jax.sharding.Mesh of devices, got an AbstractMesh, which "
                        "names none; pass the concrete Mesh (the one whose .abstract_mesh this is)")
    if not isinstance(mesh, jax.sharding.Mesh):
        hint = ""
        if isinstance(mesh, (list, tuple, np.ndarray)):
            hint = ("; make one of the devices, e.g. jax.make_mesh((len(devices),), ('tp',), devices=devices), "
                    "and name its TP axis as axis_name")
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}{hint}")


def _is_cuda(device) -> bool:
    return device.platform in ("gpu", "cuda")


def _distributed_client():
    """The client of ``jax.distributed``; RuntimeError if it was never initialized."""
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("the mesh spans processes, but jax.distributed is not initialized: call "
                           "jax.distributed.initialize() in every process first")
    return client


def _mesh_layout(mesh, with_devices: bool) -> tuple:
    """What makes ranks the same on two meshes: axes and sizes in order, and the device ids."""
    axes = tuple(mesh.shape.items())
    return (axes, tuple(mesh.device_ids.flat)) if with_devices else axes


def _describe_mesh(mesh) -> str:
    axes = "{" + ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items()) + "}"
    if isinstance(mesh, jax.sharding.Mesh):
        return f"{axes} on devices {mesh.device_ids.tolist()}"
    return axes


def _finish_dispatched_calls() -> None:
    """Wait for the computations dispatched so far that have side effects, as the op's calls on
    devices without mailbox memory do (`Mailbox.check_open_at_run_time`): a call made before
    `Mailbox.close` then runs on an open mailbox, as on GPUs, where close synchronizes the
    devices before it halts the mailbox."""
    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError:
        pass  # an earlier computation failed: its own results carry the error


class MailboxStatusError(RuntimeError):
    """A device of the mailbox recorded a failure (a timed-out wait, or a call after `close`);
    the message says where and why."""


class Mailbox:
    """Lamport mailboxes for every TP group along ``axis_name`` of ``mesh``.

    Parameters
    ----------
    mesh : jax.sharding.Mesh
        The mesh the op runs on (inside ``shard_map``). Other axes are allowed;
        each group of devices along ``axis_name`` gets its own mailboxes.
    axis_name : str
        The tensor-parallel axis. A device's rank is its position along it.
    hidden : int
        Row width of the op's inputs and output: a multiple of 8, at most
        `MAX_HIDDEN` (65536).
    capacity_m : int
        Largest number of tokens per call; ``capacity_m * hidden`` at most
        `MAX_SLOT_ELEMENTS` (2**31). Each device's mailbox takes
        ``6 * (tp + 2) * capacity_m * hidden`` bytes.
    result : {"allreduce", "reduce_scatter"}
        The layout of the op's result: ``allreduce``, every rank gets the sum of
        all m tokens (``out_specs=P()`` in a ``shard_map``); ``reduce_scatter``,
        rank r gets the sums of tokens t with t % tp == r, which differ between
        ranks (``out_specs=P(axis_name)``; with ``P()`` JAX refuses the result
        where it checks varying axes, and keeps only rank 0's rows where not).
    timeout_s : float
        A reduce that waits longer than this for a peer records a diagnostic
        instead of hanging (0 waits forever).
    on_timeout : {"abort", "flag"}
        What a timed-out wait does after recording it. ``abort`` traps the
        kernel, so XLA raises (and the device's context is lost); run steps
        under `diagnose` to get `MailboxStatusError`. ``flag`` halts the
        mailbox instead: that call and every later one return NaN without
        waiting, and `check` raises; the process and its GPUs stay usable, but
        the mailbox is spent (make a new one).
    process_timeout_s : float
        When the mesh spans processes: how long setup and `close` wait for
        the other processes before raising `ProcessGroupError`.

    On a mesh of non-CUDA devices, or when the axis has size 1, nothing is
    allocated: the op runs the reference (or the single-GPU direct kernel).
    Use as a context manager, or call `close`.

    A mesh may span processes (``jax.distributed``, one process per GPU or
    per host). Then creation and `close` are collective: every process of the
    mesh creates its Mailboxes in the same order and closes them. Processes
    of one host map each other's mailboxes (`jax_moe_publish.memory.cross_process`).
    Where a TP group spans hosts nothing is allocated, and the op runs the
    reference, whose ``psum`` XLA lowers to NCCL; see `spans_hosts`.
    """

    def __init__(
        self,
        mesh,
        axis_name: str = "tp",
        *,
        hidden: int,
        capacity_m: int,
        result: str = "allreduce",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        on_timeout: str = "abort",
        process_timeout_s: float = DEFAULT_PROCESS_TIMEOUT_S,
    ) -> None:
        _check_mesh_type(mesh)
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name={axis_name!r}: expected one of the mesh axes {mesh.axis_names}")
        if not 0 < checked_int("hidden", hidden) <= MAX_HIDDEN or hidden % protocol.REDUCE_ELEMENTS:
            raise ValueError(f"hidden={hidden!r}: expected a positive multiple of {protocol.REDUCE_ELEMENTS}, "
                             f"at most {MAX_HIDDEN}")
        if checked_int("capacity_m", capacity_m) <= 0:
            raise ValueError(f"capacity_m={capacity_m!r}: expected a positive int")
        if int(capacity_m) * int(hidden) > MAX_SLOT_ELEMENTS:
            raise ValueError(
                f"capacity_m={capacity_m!r}: expected at most {MAX_SLOT_ELEMENTS // int(hidden)} with hidden={hidden}, "
                f"as capacity_m * hidden may be at most 2**31 (a device's mailbox takes 6 * (tp + 2) * "
                "capacity_m * hidden bytes, and the kernels count tokens in 32-bit ints)"
            )
        check_result(result)
        if not 0 <= checked_float("timeout_s", timeout_s) < 3600:
            raise ValueError(f"timeout_s={timeout_s!r}: expected seconds in [0, 3600)")
        if on_timeout not in ON_TIMEOUT:
            raise ValueError(f"on_timeout={on_timeout!r}: expected one of {tuple(ON_TIMEOUT)}")
        if not 0 < checked_float("process_timeout_s", process_timeout_s) <= 3600:
            raise ValueError(f"process_timeout_s={process_timeout_s!r}: expected seconds in (0, 3600]")
        self.mesh = mesh
        self.axis_name = axis_name
        self.hidden = int(hidden)
        self.capacity_m = int(capacity_m)
        self.result = result
        self.tp = int(mesh.shape[axis_name])
        if self.tp > protocol.MAX_TP:
            raise ValueError(f"mesh axis {axis_name!r} has size {self.tp}: expected at most {protocol.MAX_TP}")
        self.timeout_ns = int(timeout_s * 1e9)
        self.on_timeout = on_timeout
        self.id = next(_ids)
        self.groups = self._groups(mesh, axis_name)
        self.on_cuda = all(_is_cuda(d) for d in mesh.devices.flat)
        self.process_timeout_s = float(process_timeout_s)
        self.group_hosts: list[list[str]] | None = None
        self._memories = []
        self._processes = None  # cross_process.ProcessMailboxMemory when the mesh spans processes
        self._host_fallback_warned = False
        self._lock = threading.Lock()
        self._closed = False
        self._ran_after_close = False  # a call without mailbox memory ran after close (`check_open_at_run_time`)
        if self.tp > 1 and self._spans_processes():
            self._setup_across_processes()
        elif self.on_cuda and self.tp > 1:
            self._allocate()

    @staticmethod
    def _groups(mesh, axis_name) -> list[list]:
        """Devices of each TP group, in rank order."""
        axis = mesh.axis_names.index(axis_name)
        devices = np.moveaxis(mesh.devices, axis, -1)
        return [list(group) for group in devices.reshape(-1, devices.shape[-1])]

    def check_mesh(self, mesh) -> None:
        """Raise ValueError unless ``mesh`` (the mesh a call runs on) is this mailbox's: the same
        axes with the same sizes in the same order and, for a concrete `jax.sharding.Mesh`, the
        same devices in the same places. A rank is a device's position along the axis, so the
        same devices in another order would permute the ranks. An `AbstractMesh` names no
        devices: only its axes are compared."""
        concrete = isinstance(mesh, jax.sharding.Mesh)
        if _mesh_layout(mesh, concrete) != _mesh_layout(self.mesh, concrete):
            raise ValueError(
                f"mailbox={self!r} belongs to the mesh {_describe_mesh(self.mesh)}, but the call runs on "
                f"the mesh {_describe_mesh(mesh)}: make the Mailbox on the mesh that the shard_map runs on "
                f"(a rank is a device's position along {self.axis_name!r}, so the same devices in "
                "another order would permute the ranks)"
            )

    @staticmethod
    def _local(devices) -> list:
        """The devices of this process (a group may have others' too)."""
        return [d for d in devices if d.process_index == jax.process_index()]

    def _spans_processes(self) -> bool:
        return any(d.process_index != jax.process_index() for d in self.mesh.devices.flat)

    def _allocate(self) -> None:
        try:
            for group in self.groups:
                ordinals = [d.local_hardware_id for d in group]
                memory = GroupMemory(ordinals, hidden=self.hidden, capacity_m=self.capacity_m,
                                     on_timeout=ON_TIMEOUT[self.on_timeout])
                self._memories.append(memory)
                self._register(memory)
        except BaseException:
            self.close()
            raise

    def _register(self, memory) -> None:
        """Tell the FFI handler where the local ranks of ``memory`` find their mailbox."""
        _launch.register_group(self.id, memory, self.tp, self.hidden, self.capacity_m, self.timeout_ns)

    def _spec(self) -> MailboxSpec:
        """This mailbox as every process of its mesh describes it (`memory.cross_process`)."""
        signature = {
            "axis_name": self.axis_name, "mesh_axes": list(self.mesh.axis_names),
            "mesh_devices": [int(d.id) for d in self.mesh.devices.flat],
            "mesh_shape": list(self.mesh.devices.shape), "hidden": self.hidden,
            "capacity_m": self.capacity_m, "result": self.result,
            "timeout_ns": self.timeout_ns, "on_timeout": self.on_timeout,
        }
        groups = tuple(tuple(RankPlace(int(d.process_index), d.local_hardware_id) for d in group)
                       for group in self.groups)
        return MailboxSpec(self.id, groups, self.hidden, self.capacity_m, ON_TIMEOUT[self.on_timeout],
                           self.on_cuda, signature)

    def _setup_across_processes(self) -> None:
        """Collective setup with the other processes of the mesh (see `memory.cross_process`)."""
        if jax.process_index() not in {d.process_index for d in self.mesh.devices.flat}:
            return  # no device here: nothing to share or allocate
        registered = []

        def register(memory):
            registered.append(memory)
            self._register(memory)

        try:
            self._processes = ProcessMailboxMemory(
                self._spec(), process=jax.process_index(), timeout_s=self.process_timeout_s, register=register,
                client=_distributed_client(), process_count=jax.process_count())
        except BaseException:
            if registered:
                _launch.forget_mailbox(self.id)
            self._closed = True
            raise
        self.group_hosts = self._processes.group_hosts
        self._memories = list(self._processes.groups)

    @property
    def spans_hosts(self) -> bool:
        """A TP group has devices on several hosts: the kernels cannot run, XLA's collectives do."""
        return self._processes is not None and self._processes.spans_hosts

    def hosts_message(self) -> str:
        """Which hosts each TP group that spans hosts lives on (for errors and warnings)."""
        lines = []
        for g, hosts in enumerate(self.group_hosts or []):
            if len(set(hosts)) > 1:
                by_rank = ", ".join(f"rank {r}: {host}" for r, host in enumerate(hosts))
                lines.append(f"TP group {g} spans hosts ({by_rank})")
        return "; ".join(lines)

    @property
    def local_ordinals(self) -> list[int]:
        """The CUDA ordinals of this process's devices in the mailbox's mesh, where the op's
        kernels must be loaded."""
        return [device.local_hardware_id for group in self.groups for device in self._local(group)]

    def first_host_fallback(self) -> bool:
        """True the first time it is asked: the op warns once per mailbox that it runs the
        reference because a group spans hosts."""
        first, self._host_fallback_warned = not self._host_fallback_warned, True
        return first

    # Lifetime and health.

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ValueError(f"mailbox={self!r} is closed: create a new Mailbox")

    def check_open_at_run_time(self) -> None:
        """Raise `MailboxStatusError` if the mailbox is closed: what a call on devices without
        mailbox memory (the reference path on CPU) runs on the host each time it executes. A
        function compiled before `close` runs again without the checks of its trace, and there
        no kernel finds the halted memory; `check` and `diagnose` report the close after it."""
        if self._closed:
            self._ran_after_close = True
            raise MailboxStatusError(self._failure_message())

    def status(self) -> list[dict]:
        """Per device: rank, and the diagnostic of its first failure (``code`` 0 = healthy,
        else ``protocol.STATUS_TIMEOUT`` or ``STATUS_CLOSED``). Works after `close` and after
        a device fault: the status blocks are host memory that outlives both. ``call`` counts
        from 0 and wraps at ``protocol.CALL_COUNT_PERIOD``."""
        report = []
        for memory in self._memories:
            for rank_memory in memory.ranks:
                words = memory.status(rank_memory.rank)
                report.append({
                    "device": rank_memory.ordinal,
                    "rank": rank_memory.rank,
                    "code": words[protocol.STATUS_CODE],
                    "stage": words[protocol.STATUS_STAGE],
                    "token": words[protocol.STATUS_TOKEN],
                    "missing_ranks": [r for r in range(self.tp) if words[protocol.STATUS_MISSING_RANKS] >> r & 1],
                    "call": words[protocol.STATUS_CALL],
                })
        return report

    def check(self) -> None:
        """Raise `MailboxStatusError` if any device recorded a failure."""
        message = self._failure_message()
        if message is not None:
            raise MailboxStatusError(message)

    @contextlib.contextmanager
    def diagnose(self):
        """Turn a failed step into the mailbox's diagnostic.

        ``with mailbox.diagnose(): out = step(...); out.block_until_ready()``

        A timed-out wait, or a kernel that runs on a closed mailbox, aborts, so
        XLA raises a generic launch failure (on CPU, a call on a closed mailbox
        fails in its host check, inside XLA's callback error). If an exception
        escapes the block and a device of this mailbox recorded a failure, or
        such a call ran, `MailboxStatusError` is raised from it, naming the
        rank(s) that never arrived or the close; any other exception passes
        through unchanged.
        """
        try:
            yield self
        except Exception as error:
            message = self._failure_message()
            if message is None:
                raise
            raise MailboxStatusError(message) from error

    def _failure_message(self) -> str | None:
        """The `MailboxStatusError` message for the devices that recorded a failure, or for a
        call that ran after `close` without mailbox memory; None if healthy."""
        failures = [s for s in self.status() if s["code"] != protocol.STATUS_OK]
        if not failures:
            if not self._ran_after_close:
                return None
            return (
                f"mailbox {self.id} is closed, but a function compiled before close() called the op on it "
                "again (its devices hold no mailbox memory: the op runs the reference there and checks the "
                "close each time it runs); trace the function again with a new Mailbox."
            )
        timeouts = [s for s in failures if s["code"] == protocol.STATUS_TIMEOUT]
        lines = [
            f"device {s['device']} (rank {s['rank']}), after {s['call']} completed call(s), stage "
            f"{s['stage']}, token {s['token']}: no data from rank(s) {s['missing_ranks']}"
            for s in timeouts
        ]
        if timeouts:
            message = (
                f"{self!r}: a mailbox wait timed out:\n  " + "\n  ".join(lines) + "\nLikely causes: "
                "the ranks called the op in a different order or a different number of times, or a "
                "peer process died."
            )
        else:
            devices = sorted(s["device"] for s in failures)
            message = (
                f"mailbox {self.id} is closed, but kernels that use it still ran on device(s) "
                f"{devices}: a function compiled before close() ran again (XLA replays its recorded "
                "command buffers without the op's checks). Nothing touched the freed memory; trace "
                "the function again with a new Mailbox."
            )
        if self.on_timeout == "flag":
            message += "\nThe mailbox is halted: its calls return NaN. Make a new Mailbox."
        return message

    def close(self) -> None:
        """Free the mailbox memory; later calls on this mailbox raise. Safe to call twice.

        A function compiled before the close may still launch the kernels
        (XLA command buffers replay them without the op's checks): they find
        the mailbox halted and touch none of its freed memory; the call fails
        and `diagnose` / `check` report the close. Where the devices hold no
        mailbox memory (CPU), such a call runs the reference, which checks for
        the close on the host (`check_open_at_run_time`) and fails alike; the
        close first waits for the calls already dispatched, which run on the
        open mailbox.
        After a device fault the driver can free nothing on that device; this
        warns and leaves the memory to the process.
        """
        with self._lock:
            if self._closed:
                return
            if not self.on_cuda:
                _finish_dispatched_calls()
            self._closed = True
            if self._memories:
                _launch.forget_mailbox(self.id)
            lost = []
            if self._processes is not None:
                lost = self._processes.close()  # collective: closes the groups too
            else:
                for memory in self._memories:
                    lost += memory.close()
        if lost:
            warnings.warn(
                f"{self!r}: device(s) {lost} lost their CUDA context to an earlier fault, so their "
                "mailbox memory is not freed; it goes with the process", RuntimeWarning, stacklevel=2,
            )

    def __enter__(self) -> "Mailbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # No CUDA calls from a finalizer (it may run during interpreter shutdown):
        # an unclosed mailbox's memory goes with the process.
        if not getattr(self, "_closed", True) and getattr(self, "_memories", None):
            warnings.warn(f"{self!r} was never closed", ResourceWarning, stacklevel=2)

    def __repr__(self) -> str:
        state = "closed" if self._closed else (
            "spans hosts" if self.spans_hosts else "cuda" if self.on_cuda else "reference")
        return (
            f"Mailbox(id={self.id}, axis={self.axis_name!r}, tp={self.tp}, hidden={self.hidden}, "
            f"capacity_m={self.capacity_m}, result={self.result!r}, {state})"
        )
