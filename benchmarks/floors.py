"""The limits that a benchmark case's floor is made of, measured once per run on the run's GPUs.

A case's *floor* (`report.case_floor`) is the slowest of its HBM bytes at the device copy
bandwidth, its NVLink bytes at the peer-to-peer copy bandwidth (`jax_moe_publish.traffic`
states the byte model) and one tiny dependent XLA kernel: the cost of any call at all.
`measure_floors` measures the three.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import timing

COPY_SHAPE = (2**15, 2**16)  # bf16: 4 GiB, far past any cache
P2P_SHAPE = (2**14, 2**15)  # bf16: 1 GiB
TINY_SHAPE = (8,)
EMPTY_CALL = "tiny dependent XLA kernel"


def make_tiny_chain(iterations):
    """``iterations`` passes over `timing.LAYERS` dependent one-op kernels on a tiny array: the cost of any call."""

    def body(_, y):
        for _ in range(timing.LAYERS):
            # The barrier keeps XLA from fusing the chain into one kernel.
            y = lax.optimization_barrier(y + 1.0)
        return y

    return jax.jit(lambda y: lax.fori_loop(0, iterations, body, y))


def transfer_seconds(op, big, tiny, reps):
    """Median time of ``op(big)`` less that of ``op(tiny)``: the transfer without host dispatch and wait."""
    return float(np.median(timing.time_runs(op, (big,), reps)) - np.median(timing.time_runs(op, (tiny,), reps)))


def driver_copy_bytes_per_s(ordinal, nbytes, reps):
    """Device-to-device ``cuMemcpyDtoDAsync`` of ``nbytes`` on one GPU, timed with CUDA events;
    bytes read + written per second (the median)."""
    from cuda.bindings import driver

    from jax_moe_publish.memory.driver import check, primary_context

    with primary_context(ordinal):
        source = check(driver.cuMemAlloc(nbytes), "cuMemAlloc")
        target = check(driver.cuMemAlloc(nbytes), "cuMemAlloc")
        stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
        start = check(driver.cuEventCreate(0), "cuEventCreate")
        stop = check(driver.cuEventCreate(0), "cuEventCreate")
        try:
            elapsed = []
            for _ in range(reps + 1):  # the first copy warms up
                check(driver.cuEventRecord(start, stream), "cuEventRecord")
                check(driver.cuMemcpyDtoDAsync(target, source, nbytes, stream), "cuMemcpyDtoDAsync")
                check(driver.cuEventRecord(stop, stream), "cuEventRecord")
                check(driver.cuEventSynchronize(stop), "cuEventSynchronize")
                elapsed.append(check(driver.cuEventElapsedTime(start, stop), "cuEventElapsedTime") / 1e3)
        finally:
            for event in (start, stop):
                check(driver.cuEventDestroy(event), "cuEventDestroy")
            check(driver.cuStreamDestroy(stream), "cuStreamDestroy")
            for address in (source, target):
                check(driver.cuMemFree(address), "cuMemFree")
    return 2 * nbytes / float(np.median(elapsed[1:]))


def xla_copy_bytes_per_s(device, reps):
    """Bytes read + written per second by a jitted ``x * 0.5`` of a 4 GiB bf16 array on
    ``device`` (a real multiply, so XLA must read and write every byte)."""
    tiny = jnp.zeros(TINY_SHAPE, jnp.bfloat16, device=device)
    big = jnp.ones(COPY_SHAPE, jnp.bfloat16, device=device)
    return 2 * big.nbytes / transfer_seconds(jax.jit(lambda x: x * 0.5), big, tiny, reps)


def copy_limit(device, reps):
    """The floor's copy rate on ``device``: the faster of a jitted ``x * 0.5`` of a 4 GiB bf16
    array and ``cuMemcpyDtoDAsync`` of as many bytes (a memory-bound kernel can reach either),
    bytes read + written per second, with both figures."""
    xla_copy = xla_copy_bytes_per_s(device, reps)
    copy_bytes = int(np.prod(COPY_SHAPE)) * 2
    memcpy = driver_copy_bytes_per_s(device.local_hardware_id, copy_bytes, reps)
    return {"bytes_per_s": max(xla_copy, memcpy), "xla_kernel_bytes_per_s": xla_copy,
            "memcpy_bytes_per_s": memcpy, "array_bytes": copy_bytes,
            "what": "faster of a jitted x * 0.5 and cuMemcpyDtoDAsync, bytes read + written"}


def measure_floors(gpus, reps, hlo=None):
    """The three limits every case's floor is made of, measured once on this run's GPUs.

    * ``copy``: `copy_limit` on GPU 0;
    * ``p2p``: ``jax.device_put`` of a 1 GiB array from GPU 0 to GPU 1 and
      back, bytes one way per second, the faster direction (None with one GPU);
    * ``empty_call``: per-call time of a chain of tiny dependent XLA kernels,
      timed like the cases.

    With ``hlo``, the empty-call chain's optimized HLO goes to ``<hlo>.empty_call.txt``.
    """
    first = gpus[0]
    tiny = jnp.zeros(TINY_SHAPE, jnp.bfloat16, device=first)
    floors = {"copy": copy_limit(first, reps), "p2p": None}
    if len(gpus) > 1:
        second = gpus[1]
        forward_big = jnp.ones(P2P_SHAPE, jnp.bfloat16, device=first)
        backward_big = jnp.ones(P2P_SHAPE, jnp.bfloat16, device=second)
        forward = transfer_seconds(lambda x: jax.device_put(x, second), forward_big, tiny, reps)
        backward = transfer_seconds(lambda x: jax.device_put(x, first), backward_big,
                                    jax.device_put(tiny, second), reps)
        size = forward_big.nbytes
        floors["p2p"] = {"bytes_per_s": size / min(forward, backward), "forward_bytes_per_s": size / forward,
                         "backward_bytes_per_s": size / backward, "array_bytes": size,
                         "what": "jax.device_put GPU 0 -> GPU 1 and back, bytes one way, the faster"}
        del forward_big, backward_big
    programs = {n: make_tiny_chain(n) for n in (timing.SHORT, timing.LONG)}
    carry = jnp.zeros(TINY_SHAPE, jnp.float32, device=first)
    floors["empty_call"] = {**timing.per_call_us(programs, (carry,), reps), "what": EMPTY_CALL}
    if hlo:
        # To confirm that the chain stayed timing.LAYERS separate kernels per iteration.
        with open(f"{hlo}.empty_call.txt", "w") as f:
            f.write(programs[timing.SHORT].lower(carry).compile().as_text())
    return floors
