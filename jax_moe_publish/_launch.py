"""The FFI glue of the ops: kernel-set ids, loading kernel sets and mailboxes onto devices, the call.

Everything here happens at trace time, outside any CUDA graph capture, so that the
handler itself only checks and launches (`_extension`).
"""

from __future__ import annotations

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe_publish import _extension
from jax_moe_publish.aot.store import default_store

_set_ids: dict[str, int] = {}
_targets: dict[int, str] = {}  # kernel set id -> the FFI target its sidecar names
_next_set_id = itertools.count(1)
_loaded: set[tuple[str, int]] = set()  # (kernel set key, device ordinal)
_lock = threading.Lock()


def load(config, ordinals: list[int]) -> int:
    """Load the kernel set of ``config`` (a `KernelConfig` or an `ExpertsConfig`, from the kernel
    store) on the devices ``ordinals`` of this process (once each); returns the process-wide id
    of the set, shared by every call that uses it."""
    artifact = default_store().get(config)
    key = artifact.metadata["key"]
    with _lock:
        if key not in _set_ids:
            _set_ids[key] = next(_next_set_id)
            _targets[_set_ids[key]] = artifact.metadata["call"]["target"]
        set_id = _set_ids[key]
        for ordinal in ordinals:
            if (key, ordinal) not in _loaded:
                _extension.load_kernel_set(set_id, ordinal, artifact.cubin, artifact.metadata["kernels"],
                                           artifact.metadata["call"])
                _loaded.add((key, ordinal))
    return set_id


def register_group(mailbox_id: int, memory, tp: int, hidden: int, capacity_m: int, timeout_ns: int) -> None:
    """Tell the FFI handler where the local ranks of ``memory`` (a `memory.group.GroupMemory`)
    find their part of mailbox ``mailbox_id``."""
    for rank_memory in memory.ranks:
        _extension.register_mailbox_device(
            mailbox_id, rank_memory.ordinal, rank_memory.rank, tp, hidden, capacity_m, rank_memory.mailbox,
            rank_memory.peer_table, rank_memory.stage_state, rank_memory.status, timeout_ns,
        )


def forget_mailbox(mailbox_id: int) -> None:
    """Refuse later calls on ``mailbox_id`` (before its memory is freed)."""
    _extension.close_mailbox(mailbox_id)


def call(set_id: int, mailbox_id: int, result_type, routed, weights, indices, shared, hidden: int,
         epilogue: dict, out_scale=None):
    """The FFI call of a loaded kernel set on one shard, through the target its sidecar names,
    with the operands in `_abi.OPERANDS` order. ``result_type`` is the reference's
    (varying-axes marking included); ``epilogue`` holds residual, norm_weight and norm_eps,
    or is empty; ``out_scale``: a static FP8 out's scale, as float32 [1]."""
    if shared is None:
        # Not read by kernels built without the shared expert; the handler checks its shape.
        shared = jnp.zeros((0, hidden), jnp.bfloat16)
    attributes = dict(mailbox_id=np.int64(mailbox_id))
    operands = [routed, weights, indices, shared]
    if epilogue:
        operands += [epilogue["residual"], epilogue["norm_weight"]]
        attributes["norm_eps"] = np.float32(epilogue["norm_eps"])
    if out_scale is not None:
        operands.append(jnp.reshape(out_scale, (1,)).astype(jnp.float32))
    # The mailbox is state outside XLA: identical calls must not merge, nor move out of a loop.
    return ffi_call(set_id, result_type, operands, side_effects=True, **attributes)


def ffi_call(set_id: int, result_type, operands: list, *, side_effects: bool, **attributes):
    """The FFI call of a loaded kernel set, through the target its sidecar names: ``operands`` in
    its call record's order, ``result_type`` its rets' types, ``attributes`` the target's beyond
    ``kernel_set_id``; ``side_effects``: the call touches state outside XLA."""
    return jax.ffi.ffi_call(_targets[set_id], result_type, has_side_effect=side_effects)(
        *operands, kernel_set_id=np.int64(set_id), **attributes)
