"""The kernel path on CPU devices for tests that only trace or lower it: the kernels' FFI call
stood in for by a side-effecting custom call of a target that no handler serves and no vmap
rule batches, with the same operands; no cubins are looked up or loaded (`_launch.load` takes the
config). A Mailbox then says
it is on CUDA with ``monkeypatch.setattr(mailbox, "on_cuda", True)``."""

from __future__ import annotations

import jax
import numpy as np

from jax_moe_publish import op as op_module

TARGET = "jax_moe_publish_stand_in"


def install(monkeypatch) -> list:
    """Stand the kernels in for the rest of the test; returns the (config, ordinals) of every
    kernel set the op loads, in order. Each call passes its set's number as ``set_id``, so
    that a traced program names the kernels it would launch."""
    loads = []

    def load(config, ordinals):
        loads.append((config, list(ordinals)))
        return [c for c, _ in loads].index(config)

    def ffi_call(set_id, mailbox_id, result_type, routed, weights, indices, shared, hidden, epilogue, out_scale=None):
        operands = [x for x in (routed, weights, indices, shared, epilogue.get("residual"),
                                epilogue.get("norm_weight"), out_scale) if x is not None]
        return jax.ffi.ffi_call(TARGET, result_type, has_side_effect=True)(*operands, set_id=np.int32(set_id))

    monkeypatch.setattr(op_module._launch, "load", load)
    monkeypatch.setattr(op_module._launch, "call", ffi_call)
    return loads
