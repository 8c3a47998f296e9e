"""A Mailbox whose mesh spans processes: its collective setup and close (``docs/multiprocess.md``).

Every process of the mesh creates its Mailboxes in the same order, so the mailbox id is the
same everywhere and names its keys in JAX's distributed key-value store,
``jax_moe_publish/mailbox/<id>/...``. Setup: publish this process's host and signature and
check the others'; stop where a group spans hosts; allocate this process's ranks and export
those whose group reaches into other processes (`sharing`); import the others', write the
peer tables, register; barrier. A process whose setup fails publishes its error under every
key the others wait for. Close: unmap the imports, barrier, then close the local groups.
"""

from __future__ import annotations

import dataclasses
import json

from jax_moe_publish.memory import process_group, sharing
from jax_moe_publish.memory.driver import CudaError, primary_context
from jax_moe_publish.memory.group import GroupMemory
from jax_moe_publish.memory.vmm import VmmMapping


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where one rank of a group lives: its process, and its CUDA ordinal in that process
    (None off CUDA, where nothing is allocated)."""

    process: int
    ordinal: int | None


@dataclasses.dataclass(frozen=True)
class MailboxSpec:
    """One mailbox, as every process of its mesh describes it.

    ``groups[g][r]`` places rank ``r`` of TP group ``g``; ``signature`` (JSON-ready) is
    what the processes must agree on: the mailbox's parameters and its mesh.
    """

    mailbox_id: int
    groups: tuple[tuple[RankPlace, ...], ...]
    hidden: int
    capacity_m: int
    on_timeout: int  # protocol.ON_TIMEOUT_ABORT or ON_TIMEOUT_FLAG
    on_cuda: bool
    signature: dict

    @property
    def tp(self) -> int:
        return len(self.groups[0])

    @property
    def processes(self) -> list[int]:
        return sorted({place.process for group in self.groups for place in group})


def _differences(mine: dict, theirs: dict) -> str:
    keys = sorted(set(mine) | set(theirs))
    return ", ".join(f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} there"
                     for k in keys if mine.get(k) != theirs.get(k))


class ProcessMailboxMemory:
    """This process's part of a cross-process mailbox: its groups' memory and its imports.

    ``group_hosts[g][r]`` is the host of rank ``r`` of group ``g``; ``groups``
    holds the `GroupMemory` of every group with a device here (empty when
    nothing is allocated). ``register(memory)`` registers a group's local
    devices with the FFI handler. ``client`` is ``jax.distributed``'s, of a job of
    ``process_count`` processes.
    """

    def __init__(self, spec: MailboxSpec, *, process: int, timeout_s: float, register, client,
                 process_count: int) -> None:
        self.mailbox_id = spec.mailbox_id
        self.process = process
        self.processes = spec.processes
        self.groups: list[GroupMemory] = []
        self.group_hosts: list[list[str]] = []
        self._exports: list[sharing.Exported] = []
        self._imports: list[tuple[int, VmmMapping]] = []  # (device that maps it, mapping)
        self._timeout_s = timeout_s
        self._client = client
        self._process_count = process_count
        self._closed = False
        exchange = self._exchange("setup")
        owed = [exchange.key("process", process)] + [
            exchange.key("group", g, "rank", r) for g, r in self._exported_ranks(spec)
        ]
        try:
            self._setup(spec, exchange, register)
        except BaseException as error:
            # Keys stay in the store: a process may still be about to read them.
            exchange.abandon(f"{type(error).__name__}: {error}", owed)
            if not (isinstance(error, process_group.ProcessGroupError) and error.timed_out):
                self._barrier_quietly(exchange, "setup")
            self._release_local()  # its own errors would hide the one that matters
            raise
        try:
            exchange.barrier("setup")
            failures = exchange.failures()
            if failures:
                raise process_group.ProcessGroupError(
                    f"mailbox {spec.mailbox_id}: setup failed in another process:\n  " + "\n  ".join(failures))
        except BaseException:
            self._release_local()
            raise
        for exported in self._exports:
            exported.close()
        exchange.forget()

    @property
    def spans_hosts(self) -> bool:
        return any(len(set(hosts)) > 1 for hosts in self.group_hosts)

    def _exchange(self, step: str) -> process_group.Exchange:
        return process_group.Exchange(f"jax_moe_publish/mailbox/{self.mailbox_id}/{step}", self.processes,
                                      self.process, self._timeout_s, self._client, self._process_count)

    def _exported_ranks(self, spec: MailboxSpec) -> list[tuple[int, int]]:
        """(group, rank) of this process's devices in groups that reach into other processes."""
        ranks = []
        for g, group in enumerate(spec.groups):
            owners = [place.process for place in group]
            if len(set(owners)) > 1:
                ranks += [(g, r) for r, owner in enumerate(owners) if owner == self.process]
        return ranks

    def _setup(self, spec: MailboxSpec, exchange: process_group.Exchange, register) -> None:
        mine = {"host": process_group.host_identity(), "signature": spec.signature}
        exchange.publish(exchange.key("process", self.process), json.dumps(mine).encode())
        records = {self.process: mine}
        for other in self.processes:
            if other != self.process:
                what = f"its record of mailbox {spec.mailbox_id}"
                records[other] = json.loads(exchange.fetch(exchange.key("process", other), other, what))
                if records[other]["signature"] != mine["signature"]:
                    raise ValueError(
                        f"mailbox {spec.mailbox_id} differs between processes {self.process} and {other} "
                        f"({_differences(mine['signature'], records[other]['signature'])}): every "
                        "process must create the same Mailboxes in the same order")
        self.group_hosts = [[records[place.process]["host"] for place in group] for group in spec.groups]
        if not spec.on_cuda or self.spans_hosts:
            return
        exported = set(self._exported_ranks(spec))
        local_groups = []
        for g, group in enumerate(spec.groups):
            ordinals = [place.ordinal if place.process == self.process else None for place in group]
            if all(o is None for o in ordinals):
                continue
            memory = GroupMemory(ordinals, hidden=spec.hidden, capacity_m=spec.capacity_m,
                                 on_timeout=spec.on_timeout,
                                 shareable=any((g, r) in exported for r in range(spec.tp)))
            self.groups.append(memory)
            local_groups.append((g, group, memory))
            for rank_memory in memory.ranks:
                if (g, rank_memory.rank) in exported:
                    with primary_context(rank_memory.ordinal):
                        export = sharing.export(rank_memory.vmm.handle, rank_memory.vmm.size)
                    self._exports.append(export)
                    exchange.publish(exchange.key("group", g, "rank", rank_memory.rank), export.payload)
        for g, group, memory in local_groups:
            addresses = {m.rank: m.mailbox for m in memory.ranks}
            for rank, place in enumerate(group):
                if rank in addresses:
                    continue
                payload = exchange.fetch(exchange.key("group", g, "rank", rank), place.process,
                                         f"the mailbox handle of group {g} rank {rank} (process "
                                         f"{place.process}, device {place.ordinal})")
                ordinal = memory.local_ordinals[0]
                with primary_context(ordinal):
                    imported = sharing.import_mapping(payload, memory.local_ordinals)
                self._imports.append((ordinal, imported))
                addresses[rank] = imported.address
            memory.write_peer_tables([addresses[r] for r in range(spec.tp)])
            register(memory)

    @staticmethod
    def _barrier_quietly(exchange: process_group.Exchange, name: str) -> None:
        try:
            exchange.barrier(name)
        except process_group.ProcessGroupError:
            pass  # the error being raised says more

    def _release_imports(self) -> list[int]:
        """Unmap what this process imported; returns the devices whose context was lost to a
        fault (the driver can unmap nothing there; the mapping goes with the process)."""
        lost = []
        for ordinal, imported in self._imports:
            try:
                with primary_context(ordinal):
                    imported.release()
            except CudaError:
                lost.append(ordinal)
        self._imports = []
        return lost

    def _close_exports(self) -> None:
        for exported in self._exports:
            exported.close()
        self._exports = []

    def _release_local(self) -> None:
        """This process's side of a failed setup, as far as CUDA lets it (the setup's error is
        the one to raise): unmap imports, free local memory."""
        self._release_imports()
        self._close_exports()
        for memory in self.groups:
            try:
                memory.free()
            except CudaError:
                pass
        self.groups = []

    def close(self) -> list[int]:
        """Collective: unmap imports, wait for every process to do so, close the local groups.

        Returns the devices whose context was lost to an earlier fault, like
        `GroupMemory.close`. A peer that never reaches the barrier (a dead
        process) raises `process_group.ProcessGroupError`, after the local groups are
        closed all the same.
        """
        if self._closed:
            return []
        self._closed = True
        if not self.groups:
            return []
        lost = self._release_imports()
        try:
            self._exchange("close").barrier("unmapped")
        finally:
            self._close_exports()
            for memory in self.groups:
                lost += memory.close()
        return sorted(set(lost))
