"""`Mailbox`: the op's memory outside XLA, one per TP group of a mesh axis.

A mailbox is made once, before the jitted functions that use it, and lives
until `close`. Every rank of a group must call the op on it in the same order.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import warnings

import jax
import numpy as np

from jax_moe_publish import protocol

MODES = ("allreduce", "reduce_scatter")
TRANSPORTS = ("auto", "unicast", "multicast")
DEFAULT_TIMEOUT_S = 5.0

_ids = itertools.count(1)


def multicast_allowed() -> bool:
    """NVLink multicast may be used: not where ``NCCL_NVLS_ENABLE=0`` forbids it."""
    return os.environ.get("NCCL_NVLS_ENABLE", "1") != "0"


def _is_cuda(device) -> bool:
    return device.platform in ("gpu", "cuda")


class MailboxStatusError(RuntimeError):
    """A reduce wait timed out on some device; the message says where and why."""


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
        Row width of the op's inputs and output.
    capacity_m : int
        Largest number of tokens per call.
    mode : {"allreduce", "reduce_scatter"}
        ``allreduce``: every rank gets the sum of all m tokens.
        ``reduce_scatter``: rank r gets the sums of tokens t with t % tp == r.
    transport : {"auto", "unicast", "multicast"}
        How publishes reach peers. ``auto`` is unicast. Multicast is refused
        where ``NCCL_NVLS_ENABLE=0``.
    timeout_s : float
        A reduce that waits longer than this for a peer aborts with a
        diagnostic instead of hanging (0 waits forever); run steps under
        `diagnose` to get it as `MailboxStatusError`.

    On a mesh of non-CUDA devices, or when the axis has size 1, nothing is
    allocated: the op runs the reference (or the single-GPU direct kernel).
    Use as a context manager, or call `close`.
    """

    def __init__(
        self,
        mesh,
        axis_name: str = "tp",
        *,
        hidden: int,
        capacity_m: int,
        mode: str = "allreduce",
        transport: str = "auto",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name={axis_name!r}: expected one of the mesh axes {mesh.axis_names}")
        if not isinstance(hidden, (int, np.integer)) or hidden <= 0 or hidden % protocol.REDUCE_ELEMENTS:
            raise ValueError(f"hidden={hidden!r}: expected a positive multiple of {protocol.REDUCE_ELEMENTS}")
        if not isinstance(capacity_m, (int, np.integer)) or capacity_m <= 0:
            raise ValueError(f"capacity_m={capacity_m!r}: expected a positive int")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: expected one of {MODES}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}: expected one of {TRANSPORTS}")
        if not (isinstance(timeout_s, (int, float)) and 0 <= timeout_s < 3600):
            raise ValueError(f"timeout_s={timeout_s!r}: expected seconds in [0, 3600)")
        self.mesh = mesh
        self.axis_name = axis_name
        self.hidden = int(hidden)
        self.capacity_m = int(capacity_m)
        self.mode = mode
        self.tp = int(mesh.shape[axis_name])
        if self.tp > protocol.MAX_TP:
            raise ValueError(f"mesh axis {axis_name!r} has size {self.tp}: expected at most {protocol.MAX_TP}")
        self.timeout_ns = int(timeout_s * 1e9)
        self.id = next(_ids)
        self.groups = self._groups(mesh, axis_name)
        self.on_cuda = all(_is_cuda(d) for d in mesh.devices.flat)
        self.transport = self._resolve_transport(transport)
        self._memories = []
        self._loaded: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        if self.on_cuda and self.tp > 1:
            self._allocate()

    @staticmethod
    def _groups(mesh, axis_name) -> list[list]:
        """Devices of each TP group, in rank order."""
        axis = mesh.axis_names.index(axis_name)
        devices = np.moveaxis(mesh.devices, axis, -1)
        return [list(group) for group in devices.reshape(-1, devices.shape[-1])]

    def _resolve_transport(self, transport: str) -> str:
        if self.tp == 1:
            return "direct"
        if transport == "multicast":
            if not multicast_allowed():
                raise ValueError(
                    "transport='multicast': NVLink multicast is disabled here (NCCL_NVLS_ENABLE=0); "
                    "use transport='unicast' or 'auto'"
                )
            raise NotImplementedError(
                "transport='multicast': the multicast kernels compile, but multicast mailbox "
                "allocation is not implemented; use transport='unicast' or 'auto'"
            )
        return "unicast"

    def _allocate(self) -> None:
        from jax_moe_publish import native
        from jax_moe_publish.cuda_memory import GroupMemory

        remote = [d for d in self.mesh.devices.flat if d.process_index != jax.process_index()]
        if remote:
            raise NotImplementedError(
                f"Mailbox over mesh axis {self.axis_name!r} spans devices of other processes "
                f"({remote[:2]}...): groups that cross processes are not supported"
            )
        try:
            for group in self.groups:
                ordinals = [d.local_hardware_id for d in group]
                memory = GroupMemory(ordinals, hidden=self.hidden, capacity_m=self.capacity_m)
                self._memories.append(memory)
                for rank_memory in memory.ranks:
                    native.register_mailbox_device(
                        self.id, rank_memory.ordinal, rank_memory.rank, self.tp, self.hidden,
                        self.capacity_m, rank_memory.mailbox, rank_memory.peer_table,
                        rank_memory.stage_state, rank_memory.status, self.timeout_ns,
                    )
        except BaseException:
            self.close()
            raise

    # Kernel sets: loaded on every device of the mailbox before the first call.

    def ensure_loaded(self, artifact, kernel_set_id: int) -> None:
        """Load ``artifact``'s cubin on every device of this mailbox (idempotent)."""
        from jax_moe_publish import native

        key = artifact.metadata["key"]
        with self._lock:
            self.check_open()
            if key in self._loaded:
                return
            config = artifact.metadata["config"]
            for group in self.groups:
                for device in group:
                    native.load_kernel_set(
                        kernel_set_id, device.local_hardware_id, artifact.cubin,
                        artifact.metadata["kernels"], mode=config["mode"], tp=config["tp"],
                        hidden=config["hidden"], top_k=config["top_k"],
                        fp32_weights=config["fp32_weights"],
                        include_shared_expert=config["include_shared_expert"],
                        pdl=artifact.metadata["pdl"], epilogue=config["epilogue"],
                    )
            self._loaded.add(key)

    # Lifetime and health.

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ValueError(f"mailbox={self!r} is closed: create a new Mailbox")

    def status(self) -> list[dict]:
        """Per device: rank, and the diagnostic of a timed-out wait (``code`` 0 = healthy)."""
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
        """Raise `MailboxStatusError` if any device recorded a timed-out wait."""
        message = self._timeout_message()
        if message is not None:
            raise MailboxStatusError(message)

    @contextlib.contextmanager
    def diagnose(self):
        """Turn a failed step into the mailbox's diagnostic, if a wait timed out.

        ``with mailbox.diagnose(): out = step(...); out.block_until_ready()``

        A timed-out wait aborts its kernel, so XLA raises a generic launch
        failure. If an exception escapes the block and a device of this mailbox
        recorded a timeout, `MailboxStatusError` is raised from it, naming the
        rank(s) that never arrived; any other exception passes through unchanged.
        The status blocks are host memory, still readable after the fault.
        """
        try:
            yield self
        except Exception as error:
            message = self._timeout_message()
            if message is None:
                raise
            raise MailboxStatusError(message) from error

    def _timeout_message(self) -> str | None:
        """The `MailboxStatusError` message for the devices that recorded a timeout; None if healthy."""
        failures = [s for s in self.status() if s["code"] != protocol.STATUS_OK]
        if not failures:
            return None
        lines = [
            f"device {s['device']} (rank {s['rank']}), after {s['call']} completed call(s), stage "
            f"{s['stage']}, token {s['token']}: no data from rank(s) {s['missing_ranks']}"
            for s in failures
        ]
        return (
            f"{self!r}: a mailbox wait timed out:\n  " + "\n  ".join(lines) + "\nLikely causes: the "
            "ranks called the op in a different order or a different number of times, or a peer "
            "process died."
        )

    def close(self) -> None:
        """Free the device memory; later calls on this mailbox raise. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._memories:
                from jax_moe_publish import native

                native.close_mailbox(self.id)
            for memory in self._memories:
                memory.free()
            self._memories = []

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
        state = "closed" if self._closed else ("cuda" if self.on_cuda else "reference")
        return (
            f"Mailbox(id={self.id}, axis={self.axis_name!r}, tp={self.tp}, hidden={self.hidden}, "
            f"capacity_m={self.capacity_m}, mode={self.mode!r}, {state})"
        )
