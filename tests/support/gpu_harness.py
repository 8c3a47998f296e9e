"""Runs a `KernelArtifact` on GPUs through the CUDA driver API, the way the C++ launcher does.

The kernel tests use it to exercise the cubins without JAX or the FFI library. It replays
the launcher's contract from the artifact's sidecar:

* each kernel of ``metadata["kernels"]`` is launched in the listed order with grid =
  rows * ctas_per_row (rows: ``m``, or ``ceil(m / tp)`` for ``owned``; a persistent
  kernel's ``ceil(rows / waves) * ctas_per_row``, capped at the CTAs the GPU holds at
  once), its block, dynamic shared memory and cluster, and the PDL attribute
  (``PROGRAMMATIC_STREAM_SERIALIZATION = 1``) on every launch when ``call["pdl"]``;
* its parameters are the values its ``params`` name (`_abi.VALUES`), of its
  ``param_types``; without a mailbox (tp = 1) the mailbox values are 0.

A group call launches every rank's first kernel, then every rank's second, ..., all
asynchronously on per-rank streams: a reduce spins until its peers' publishes land, so
the host never waits between ranks' launches. Only then does it wait for all devices,
with a host-side deadline.

*Virtual ranks*: a group of ``tp`` ranks runs on fewer GPUs (`DevicePool`): rank ``r`` on
GPU ``r % count``, each rank with its own stream. A persistent kernel's grid is then capped
at the GPU's resident CTAs divided by the ranks on that GPU, in whole clusters, so that
every rank's CTAs run at once. This tests the protocol's logic and state, not cross-GPU
memory ordering or NVLink.
"""

from __future__ import annotations

import contextlib
import ctypes
import time

import numpy as np
from cuda.bindings import driver

import numerics
from jax_moe_publish import _abi, experts_layout, protocol
from jax_moe_publish.aot.artifact import KernelArtifact
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.memory.driver import CudaError, check, init, primary_context
from jax_moe_publish.memory.group import GroupMemory

PROGRAMMATIC_STREAM_SERIALIZATION = (
    driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
)
CTYPES = {"u64": ctypes.c_uint64, "u32": ctypes.c_uint32, "f32": ctypes.c_float}
MAX_DYNAMIC_SMEM = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
NON_PORTABLE_CLUSTER = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
POLL_S = 50e-6


def _launch_config(kernel: dict, ctas: int):
    """A 1-D launch of ``kernel`` over ``ctas`` CTAs (the caller adds stream and attributes)."""
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = ctas, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = kernel["block"], 1, 1
    config.sharedMemBytes = kernel["smem"]
    return config


def _cluster_attribute(cluster: int):
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attribute.value.clusterDim.x = cluster
    attribute.value.clusterDim.y = 1
    attribute.value.clusterDim.z = 1
    return attribute


def device_count() -> int:
    """CUDA devices visible to this process."""
    init()
    return check(driver.cuDeviceGetCount(), "cuDeviceGetCount")


class Device:
    """One GPU: a reference on its primary context, a stream and the kernels loaded into it.

    The reference keeps the primary context, and every allocation made in it
    (`GroupMemory`'s included), alive between the scoped pushes of
    `primary_context`: the driver resets a primary context when its last
    reference is released.

    A device whose kernels outlive a host deadline is *wedged*: it refuses all
    further work and is never freed, since every free would wait for them.
    """

    wedged = False

    def __init__(self, ordinal: int) -> None:
        init()
        self.ordinal = ordinal
        self._handle = check(driver.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        check(driver.cuDevicePrimaryCtxRetain(self._handle), f"cuDevicePrimaryCtxRetain({ordinal})")
        self._modules: dict[str, tuple[object, list]] = {}
        with self.current():
            # Non-blocking, like XLA's streams: nothing on the legacy stream orders our work.
            flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self.stream = check(driver.cuStreamCreate(flags), "cuStreamCreate")

    def current(self):
        """Context manager: this device's primary context is current."""
        if self.wedged:
            raise RuntimeError(f"device {self.ordinal} still runs kernels that outlived a host deadline")
        return primary_context(self.ordinal)

    def functions(self, artifact: KernelArtifact) -> list:
        """The artifact's kernels on this device, in metadata order (loaded once)."""
        key = artifact.metadata["key"]
        if key not in self._modules:
            image = np.frombuffer(artifact.cubin, np.uint8)
            with self.current():
                module = check(driver.cuModuleLoadData(image.ctypes.data), f"cuModuleLoadData({key})")
                functions = []
                for kernel in artifact.metadata["kernels"]:
                    symbol = kernel["symbol"]
                    function = check(
                        driver.cuModuleGetFunction(module, symbol.encode()),
                        f"cuModuleGetFunction({symbol})",
                    )
                    if kernel["smem"] > _abi.DEFAULT_SMEM_BYTES:
                        check(
                            driver.cuFuncSetAttribute(function, MAX_DYNAMIC_SMEM, kernel["smem"]),
                            f"cuFuncSetAttribute({symbol})",
                        )
                    if kernel["cluster"] > _abi.PORTABLE_CLUSTER_CTAS:
                        check(
                            driver.cuFuncSetAttribute(function, NON_PORTABLE_CLUSTER, 1),
                            f"cuFuncSetAttribute({symbol}, NON_PORTABLE_CLUSTER_SIZE_ALLOWED)",
                        )
                    functions.append(function)
            self._modules[key] = (module, functions)
        return self._modules[key][1]

    def resident_ctas(self, function, kernel: dict) -> int:
        """CTAs of ``function`` the GPU holds at once, as the C++ launcher computes it: for a
        cluster kernel its resident clusters times the cluster size."""
        cluster = kernel["cluster"]
        with self.current():
            if cluster > 1:
                config = _launch_config(kernel, cluster)
                config.attrs = [_cluster_attribute(cluster)]
                config.numAttrs = 1
                clusters = check(driver.cuOccupancyMaxActiveClusters(function, config),
                                 f"cuOccupancyMaxActiveClusters({kernel['role']})")
                return clusters * cluster
            per_sm = check(
                driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, kernel["block"], kernel["smem"]),
                f"cuOccupancyMaxActiveBlocksPerMultiprocessor({kernel['role']})",
            )
            sms = check(
                driver.cuDeviceGetAttribute(
                    driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self._handle
                ),
                "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)",
            )
        return per_sm * sms

    def launch(self, function, kernel: dict, rows: int, values: dict, pdl: bool, max_ctas: int | None = None) -> None:
        """Enqueue one kernel of the artifact with the ``values`` its ``params`` name: grid =
        ceil(rows / waves) * ctas_per_row, at most ``max_ctas``."""
        types = tuple(CTYPES[t] for t in kernel["param_types"])
        params = tuple(t(values[name]).value for name, t in zip(kernel["params"], types))
        ctas = -(-rows // kernel["waves"]) * kernel["ctas_per_row"]
        config = _launch_config(kernel, ctas if max_ctas is None else min(ctas, max_ctas))
        config.hStream = self.stream
        attributes = []
        if pdl:
            attribute = driver.CUlaunchAttribute()
            attribute.id = PROGRAMMATIC_STREAM_SERIALIZATION
            attribute.value.programmaticStreamSerializationAllowed = 1
            attributes.append(attribute)
        if kernel["cluster"] > 1:
            attributes.append(_cluster_attribute(kernel["cluster"]))
        if attributes:
            config.attrs = attributes
        config.numAttrs = len(attributes)
        with self.current():
            check(
                driver.cuLaunchKernelEx(config, function, (params, types), 0),
                f"cuLaunchKernelEx({kernel['role']}, device {self.ordinal})",
            )

    def wait(self, deadline: float) -> None:
        """Wait for the stream, polling, until ``deadline`` (time.monotonic()); a kernel error raises."""
        with self.current():
            while True:
                result = driver.cuStreamQuery(self.stream)
                if result[0] != driver.CUresult.CUDA_ERROR_NOT_READY:
                    check(result, f"cuStreamQuery(device {self.ordinal})")
                    return
                if time.monotonic() > deadline:
                    self.wedged = True
                    raise TimeoutError(
                        f"device {self.ordinal}: kernels still running at the host deadline; "
                        "the device is left running and refuses further work"
                    )
                time.sleep(POLL_S)

    def upload(self, address: int, array: np.ndarray) -> None:
        """Copy ``array`` to ``address`` in stream order; returns once the copy is done."""
        array = np.ascontiguousarray(array)
        with self.current():
            check(
                driver.cuMemcpyHtoDAsync(address, array.ctypes.data, array.nbytes, self.stream),
                "cuMemcpyHtoDAsync",
            )
            check(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def download(self, address: int, dtype, shape) -> np.ndarray:
        """A copy of device memory at ``address``, read in stream order."""
        out = np.empty(shape, dtype)
        with self.current():
            check(
                driver.cuMemcpyDtoHAsync(out.ctypes.data, address, out.nbytes, self.stream),
                "cuMemcpyDtoHAsync",
            )
            check(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        return out

    def fill16(self, address: int, value: int, count: int) -> None:
        """Set ``count`` 16-bit words at ``address`` to ``value``, in stream order."""
        with self.current():
            check(driver.cuMemsetD16Async(address, int(value), count, self.stream), "cuMemsetD16Async")

    def close(self) -> None:
        if self.wedged:
            return
        with self.current():
            check(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
            check(driver.cuStreamDestroy(self.stream), "cuStreamDestroy")
            for module, _ in self._modules.values():
                check(driver.cuModuleUnload(module), "cuModuleUnload")
        self._modules = {}
        check(driver.cuDevicePrimaryCtxRelease(self._handle), f"cuDevicePrimaryCtxRelease({self.ordinal})")


class DevicePool:
    """The GPUs of this process for groups of any size: rank ``r`` of a group runs on GPU
    ``r % count``, with a `Device` (a stream) of its own; ranks that share a GPU are virtual
    ranks. Devices are opened on first use and kept until `close`."""

    def __init__(self) -> None:
        self.count = device_count()
        if self.count == 0:
            raise RuntimeError("no CUDA device")
        self._opened: dict[tuple[int, int], Device] = {}

    def group(self, tp: int) -> list[Device]:
        """One `Device` per rank of a group of ``tp``: real GPUs where there are enough."""
        devices = []
        for rank in range(tp):
            slot = (rank % self.count, rank // self.count)
            if slot not in self._opened:
                self._opened[slot] = Device(slot[0])
            devices.append(self._opened[slot])
        return devices

    def close(self) -> None:
        for device in self._opened.values():
            device.close()
        self._opened = {}


class Buffer:
    """``nbytes`` of device memory on one device."""

    def __init__(self, device: Device, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        with device.current():
            self.address = int(check(driver.cuMemAlloc(nbytes), f"cuMemAlloc({nbytes})"))

    def upload(self, array: np.ndarray) -> None:
        """Write ``array``'s bytes at the start of the buffer."""
        if array.nbytes > self.nbytes:
            raise ValueError(f"array of {array.nbytes} B does not fit a buffer of {self.nbytes} B")
        self.device.upload(self.address, array)

    def download(self, dtype, shape) -> np.ndarray:
        """The start of the buffer as an array of ``dtype`` and ``shape``."""
        return self.device.download(self.address, dtype, shape)

    def poison(self) -> None:
        """Fill the whole buffer with `numerics.POISON_BF16`, so that unwritten elements show."""
        self.device.fill16(self.address, numerics.POISON_BF16, self.nbytes // 2)

    def free(self) -> None:
        with self.device.current():
            check(driver.cuMemFree(self.address), "cuMemFree")


def operand_bytes(operand: dict, rows: dict) -> int:
    """Bytes of a call record's ``operand`` (`_abi.call_operands`) for the largest call: ``rows``
    maps its rows word (None: no leading rows) to the count."""
    return rows[operand["rows"]] * int(np.prod(operand["shape"])) * _abi.DTYPES[operand["dtype"]]


class RankBuffers:
    """One rank's inputs and output, for calls of up to ``max_m`` tokens and ``max_rows`` routed rows.

    Allocated once and reused: `upload` writes a problem at the start of each
    buffer and remembers its number of routed rows.
    """

    def __init__(self, device: Device, config: KernelConfig, max_m: int, max_rows: int) -> None:
        self.config = config
        self.max_m = max_m
        self.max_rows = max_rows
        # One buffer per operand of the call, as the sidecar's call record lists them
        # (`_abi.call_operands`): None where the config has none (shared without a shared
        # expert, the epilogue's without the epilogue). Owned rows fit in max_m.
        rows = {"num_rows": max_rows, "m": max_m, "owned": max_m, None: 1}
        present = {operand["name"]: Buffer(device, operand_bytes(operand, rows))
                   for operand in _abi.call_operands(config) if operand["rows"] != "zero"}
        for operand in _abi.OPERANDS:
            setattr(self, operand.name, present.get(operand.name))
        self.epilogue = config.epilogue != "none"
        self.eps = 0.0
        self.num_rows = 0

    def upload(self, problem: numerics.RankInputs) -> None:
        weights_dtype = np.float32 if self.config.fp32_weights else numerics.BF16
        if problem.weights.dtype != weights_dtype:
            raise TypeError(
                f"problem.weights is {problem.weights.dtype}, the config expects {weights_dtype}"
            )
        if (problem.shared is None) == self.config.include_shared_expert:
            raise ValueError(
                f"problem.shared is {'absent' if problem.shared is None else 'present'}, but "
                f"include_shared_expert={self.config.include_shared_expert}"
            )
        self.routed.upload(problem.routed)
        self.weights.upload(problem.weights)
        self.indices.upload(problem.indices.astype(np.int32))
        if self.shared is not None:
            self.shared.upload(problem.shared)
        self.num_rows = problem.routed.shape[0]

    def upload_epilogue(self, residual: np.ndarray, norm_weight: np.ndarray, eps: float) -> None:
        """The epilogue's inputs: bf16 residual rows (the layout of out) and weight [hidden]."""
        self.residual.upload(residual)
        self.norm_weight.upload(norm_weight)
        self.eps = eps

    def upload_out_scale(self, scale: np.float32) -> None:
        """A static FP8 out's scale (``KernelConfig.fp8_out == "static"``)."""
        self.out_scale.upload(np.asarray([scale], np.float32))

    def fp8_output(self) -> np.ndarray:
        """The whole FP8 out buffer as raw bytes: uint8 ``[max_m, hidden]``."""
        return self.out.download(np.uint8, (self.max_m, self.config.hidden))

    def scales_output(self) -> np.ndarray:
        """The whole buffer of an FP8 out's scales: float32 ``[max_m, hidden / 128]``."""
        return self.out_scales.download(np.float32, (self.max_m, self.config.hidden // _abi.FP8_GROUP))

    def output(self) -> np.ndarray:
        """The whole output buffer as raw bf16 bits: uint16 ``[max_m, hidden]``."""
        return self.out.download(np.uint16, (self.max_m, self.config.hidden))

    def residual_output(self) -> np.ndarray:
        """The whole residual_out buffer as raw bf16 bits: uint16 ``[max_m, hidden]``."""
        return self.residual_out.download(np.uint16, (self.max_m, self.config.hidden))

    def free(self) -> None:
        for operand in _abi.OPERANDS:
            buffer = getattr(self, operand.name)
            if buffer is not None:
                buffer.free()


class GroupLauncher:
    """One artifact loaded on the devices of a group (rank r on ``devices[r]``, which several
    ranks may share: virtual ranks), with its mailbox memory.

    ``memory`` is None for ``direct`` (tp = 1), which has no mailbox.
    """

    def __init__(self, artifact: KernelArtifact, devices: list[Device], memory: GroupMemory | None,
                 timeout_ns: int, grid_limits: list[int] | None = None) -> None:
        self.config = KernelConfig.from_dict(artifact.metadata["config"])
        if (memory is None) != (self.config.algorithm == "direct"):
            raise ValueError(
                f"algorithm {self.config.algorithm!r} with memory={memory!r}: a mailbox is needed exactly when tp > 1"
            )
        if len(devices) != self.config.tp:
            raise ValueError(f"{artifact.metadata['key']} needs {self.config.tp} devices, got {len(devices)}")
        self.devices = devices
        self.memory = memory
        self.timeout_ns = timeout_ns
        self.kernels = artifact.metadata["kernels"]
        self.roles = tuple(kernel["role"] for kernel in self.kernels)
        self.pdl = bool(artifact.metadata["call"]["pdl"])
        self.functions = [device.functions(artifact) for device in self.devices]
        # Persistent kernels' grids: capped like the C++ launcher's, shared among the ranks on
        # one GPU, and at rank r's ``grid_limits[r]`` CTAs (tests: several rows per CTA at small
        # m, grids that differ by rank); always whole clusters, at least one.
        self.max_ctas = []
        for rank, (device, functions) in enumerate(zip(self.devices, self.functions)):
            sharing = sum(other.ordinal == device.ordinal for other in self.devices)
            limits = []
            for function, kernel in zip(functions, self.kernels):
                limit = None
                if kernel["persistent"]:
                    cluster = kernel["cluster"]
                    limit = device.resident_ctas(function, kernel) // sharing
                    if grid_limits is not None:
                        limit = min(limit, grid_limits[rank])
                    limit = max(cluster, limit // cluster * cluster)
                limits.append(limit)
            self.max_ctas.append(limits)
        self._buffers: list[RankBuffers] = []

    def allocate(self, max_m: int, max_rows: int) -> list[RankBuffers]:
        """Buffers for every rank, freed by `close`."""
        buffers = [RankBuffers(device, self.config, max_m, max_rows) for device in self.devices]
        self._buffers += buffers
        return buffers

    def launch(self, buffers: list[RankBuffers], m: int, roles: tuple[str, ...] | None = None) -> None:
        """Enqueue the kernels of one call for every rank, role by role; ``roles`` limits which."""
        if self.memory is not None and m > self.memory.capacity_m:
            raise ValueError(f"m={m} exceeds the mailbox's capacity_m={self.memory.capacity_m}")
        for index, kernel in enumerate(self.kernels):
            if roles is not None and kernel["role"] not in roles:
                continue
            rows = m if kernel["rows"] == "m" else protocol.owned_rows(m, self.config.tp)
            for rank, device in enumerate(self.devices):
                device.launch(self.functions[rank][index], kernel, rows, self.values(rank, buffers[rank], m),
                              self.pdl, self.max_ctas[rank][index])

    def values(self, rank: int, buffers: RankBuffers, m: int) -> dict:
        """Every value of the launch contract (`_abi.VALUES`) for ``rank``'s call of ``m`` tokens;
        the kernels take the ones they name."""
        def address(buffer):
            return 0 if buffer is None else buffer.address

        values = {operand.name: address(getattr(buffers, operand.name)) for operand in _abi.OPERANDS}
        values.update(num_rows=buffers.num_rows, m=m, eps=buffers.eps, mailbox=0, peer_table=0, stage_state=0,
                      status=0, timeout_ns=0, capacity_m=0, rank=0)
        if self.memory is not None:
            memory = self.memory.ranks[rank]
            values.update(mailbox=memory.mailbox, peer_table=memory.peer_table, stage_state=memory.stage_state,
                          status=memory.status, timeout_ns=self.timeout_ns, capacity_m=self.memory.capacity_m,
                          rank=rank)
        missing, unknown = _abi.VALUES.keys() - values.keys(), values.keys() - _abi.VALUES.keys()
        assert not missing and not unknown, f"the harness fills no {sorted(missing)}, and unknown {sorted(unknown)}"
        return values

    def synchronize(self) -> None:
        """Wait for every rank's device. The host deadline comes after any kernel wait would
        have timed out, so a lost contribution is reported by the kernel with its status words."""
        deadline = time.monotonic() + 3 * self.timeout_ns / 1e9
        try:
            for device in self.devices:
                device.wait(deadline)
        except (CudaError, TimeoutError) as error:
            if self.memory is None:
                raise
            statuses = [self.status(rank) for rank in range(self.config.tp)]
            raise type(error)(f"{error}; status words by rank: {statuses}") from error

    def run(self, buffers: list[RankBuffers], m: int) -> None:
        """One whole call on every rank, then wait for all of them."""
        self.launch(buffers, m)
        self.synchronize()

    def mailbox(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Rank's mailbox as raw bf16 bits: (contributions ``[STAGES][tp][capacity_m][hidden]``,
        gather areas ``[GATHER_AREAS][STAGES][capacity_m][hidden]``)."""
        memory = self.memory
        words = self.devices[rank].download(memory.ranks[rank].mailbox, np.uint16, memory.elements)
        split = protocol.contribution_elements(memory.tp, memory.capacity_m, memory.hidden)
        contributions = words[:split].reshape(
            protocol.STAGES, memory.tp, memory.capacity_m, memory.hidden
        )
        gather = words[split:].reshape(protocol.GATHER_AREAS, protocol.STAGES, memory.capacity_m, memory.hidden)
        return contributions, gather

    def stage_state(self, rank: int) -> np.ndarray:
        """Rank's stage-state words (int32), indexed by `protocol.NEXT_STAGE` etc."""
        return self.devices[rank].download(
            self.memory.ranks[rank].stage_state, np.int32, protocol.STAGE_STATE_WORDS
        )

    def set_stage_words(self, words: dict[int, int]) -> None:
        """Write ``{word index: value}`` into every rank's stage words (`protocol.NEXT_STAGE` etc.)."""
        for rank, device in enumerate(self.devices):
            state = self.stage_state(rank)
            for index, value in words.items():
                state[index] = value
            device.upload(self.memory.ranks[rank].stage_state, state)

    def start_at_call(self, call: int) -> None:
        """Make the group's next call number ``call`` (below `protocol.CALL_COUNT_PERIOD`): set
        every rank's stage words as that many calls would have left them."""
        self.set_stage_words({protocol.NEXT_STAGE: call % protocol.STAGES, protocol.CALL_COUNT: call})

    def status(self, rank: int) -> list[int]:
        """Rank's status words, read from host memory (valid even after a kernel trap)."""
        return self.memory.status(rank)

    def close(self) -> None:
        for buffers in self._buffers:
            buffers.free()
        self._buffers = []


@contextlib.contextmanager
def open_group(artifact: KernelArtifact, pool: DevicePool, *, capacity_m: int, timeout_ns: int,
               on_timeout: int = protocol.ON_TIMEOUT_ABORT, grid_limits: list[int] | None = None):
    """A `GroupLauncher` on the pool's devices for the config's tp (`DevicePool.group`) with fresh
    mailbox memory (none for tp = 1), freed at exit; ``grid_limits`` caps each rank's
    persistent grids (`GroupLauncher`)."""
    config = KernelConfig.from_dict(artifact.metadata["config"])
    group = pool.group(config.tp)
    memory = None
    if config.tp > 1:
        memory = GroupMemory([d.ordinal for d in group], hidden=config.hidden, capacity_m=capacity_m,
                             on_timeout=on_timeout)
    launcher = None
    try:
        # GroupMemory writes the peer tables with copies from pageable memory, which
        # can still be in flight when they return; our streams do not wait for them.
        for device in group:
            with device.current():
                check(driver.cuCtxSynchronize(), "cuCtxSynchronize")
        launcher = GroupLauncher(artifact, group, memory, timeout_ns, grid_limits)
        yield launcher
    finally:
        # A wedged device would make every free wait forever.
        if not any(device.wedged for device in group):
            if launcher is not None:
                launcher.close()
            if memory is not None:
                memory.free()


class ExpertsLauncher:
    """An experts kernel set (`ExpertsConfig`) on one GPU with buffers for calls of up to ``max_m``
    tokens: the launches the C++ launcher makes (each kernel on the CTAs the GPU holds at once,
    rows ``"resident"``), its outputs poisoned before each call; the weights in the tiled order
    (`experts_layout`) where the config reads them so."""

    def __init__(self, artifact: KernelArtifact, device: Device, max_m: int) -> None:
        from jax_moe_publish.aot.artifact import CONFIGS

        self.config = CONFIGS[artifact.metadata["op"]].from_dict(artifact.metadata["config"])
        self.device = device
        self.max_m = max_m
        self.kernels = artifact.metadata["kernels"]
        self.pdl = bool(artifact.metadata["call"]["pdl"])
        self.functions = device.functions(artifact)
        self.grids = [device.resident_ctas(function, kernel) for function, kernel in zip(self.functions, self.kernels)]
        rows = {"m": max_m, "pairs": max_m * self.config.top_k, None: 1}
        self.operands = _abi.call_operands(self.config)
        self.buffers = {operand["name"]: Buffer(device, operand_bytes(operand, rows)) for operand in self.operands}

    def run(self, inputs: numerics.ExpertsInputs, timeout_s: float = 30.0):
        """One call on ``inputs`` into poisoned outputs: (rows, activations) as bf16
        ``[m * top_k, hidden]`` and ``[m * top_k, intermediate]``."""
        arrays = {"x": inputs.x, "expert_ids": inputs.expert_ids, "gate_up": inputs.gate_up, "gate": inputs.gate,
                  "up": inputs.up, "down": inputs.down}
        if self.config.tiled_weights:
            tiled = experts_layout.tile(inputs.gate_up, inputs.down, experts_layout.Tiling.of(self.config))
            arrays.update(gate_up=tiled.gate_up, down=tiled.down)
        return self.run_arrays(arrays, timeout_s)

    def run_arrays(self, arrays: dict, timeout_s: float = 30.0):
        """`run` on the call's args by name (`_abi.call_operands`), as NumPy arrays: e4m3 weights
        and their scales for an ``fp8_weights`` config. With ``shared_expert`` (the weights' last
        expert the shared one): (rows, activations, shared rows [m, hidden], its activations
        [m, intermediate])."""
        m = arrays["x"].shape[0]
        if m > self.max_m:
            raise ValueError(f"m={m} exceeds the buffers' max_m={self.max_m}")
        arrays = {**arrays, "expert_ids": np.asarray(arrays["expert_ids"]).astype(np.int32)}
        for operand in self.operands:
            buffer = self.buffers[operand["name"]]
            if operand["io"] == "arg":
                buffer.upload(arrays[operand["name"]])
            else:
                buffer.poison()
        values = {name: buffer.address for name, buffer in self.buffers.items()}
        values["m"] = m
        for function, kernel, grid in zip(self.functions, self.kernels, self.grids):
            self.device.launch(function, kernel, grid, values, self.pdl)
        self.device.wait(time.monotonic() + timeout_s)
        config = self.config
        pairs = m * config.top_k
        out = self.buffers["out"].download(numerics.BF16, (pairs, config.hidden))
        activations = self.buffers["activations"].download(numerics.BF16, (m, config.pairs_per_token,
                                                                          config.intermediate))
        routed = activations[:, :config.top_k].reshape(pairs, config.intermediate)
        if not config.shared_expert:
            return out, routed
        return out, routed, self.buffers["shared"].download(numerics.BF16, (m, config.hidden)), activations[:, -1]

    def close(self) -> None:
        for buffer in self.buffers.values():
            buffer.free()
        self.buffers = {}
