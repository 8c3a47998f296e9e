"""The C++ extension ``jax_moe_publish._ffi``: its FFI targets, registered with JAX at import, and
checked wrappers of its setup calls.

The extension holds the XLA FFI handlers of the targets `_abi.ALL_TARGETS` (:data:`TARGET_NAME`,
:data:`RMSNORM_TARGET_NAME` and :data:`EXPERTS_TARGET_NAME`) and the per-device state that they read:

* *kernel sets*: one cubin's kernels, loaded into a device's primary CUDA context
  with the launch plan and parameter names of its sidecar (`aot.artifact`);
* *mailbox registrations*: the device addresses of one device's part of a
  mailbox (see :mod:`jax_moe_publish.protocol`).

Both must be in place on a device before the first call there, and both are
filled here, at trace time and outside any CUDA graph capture: the handler
itself only checks its arguments and launches, so that XLA can capture it in a
command buffer. Every target of the extension's ``registrations()`` is registered with JAX once,
at import.

A call of any target passes the operands of its kernel set's call record
(`_abi.call_operands`), in that order, and the ``np.int64`` attribute ``kernel_set_id``; the
publish targets also take ``mailbox_id`` (0 for tp = 1, which has no mailbox). The handler
checks every operand against its record.

The extension resolves the CUDA driver at run time, so this module imports and
registers on machines without a GPU or ``libcuda``; only the functions that
need the driver fail there, with a ``RuntimeError`` that says so.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence

import jax

from jax_moe_publish import _abi
from jax_moe_publish.aot.artifact import cubin_problem

TARGET_NAME = _abi.TARGETS["none"]
"""Name of the FFI target of kernel sets without an epilogue (platform CUDA, API version 1)."""

RMSNORM_TARGET_NAME = _abi.TARGETS["rmsnorm"]
"""Name of the FFI target of kernel sets with ``epilogue="rmsnorm"`` (platform CUDA, API version 1),
whose call also has the attribute ``norm_eps`` (``np.float32``)."""

EXPERTS_TARGET_NAME = _abi.EXPERTS.targets["none"]
"""Name of the FFI target of the experts op's kernel sets (platform CUDA, API version 1), whose
call has no mailbox."""

try:
    from jax_moe_publish import _ffi
except ImportError as error:  # Not built: the pure-Python modules stay usable.
    _ffi = None
    _IMPORT_ERROR: ImportError | None = error
else:
    _IMPORT_ERROR = None
    for _target, _capsule in _ffi.registrations().items():
        jax.ffi.register_ffi_target(_target, _capsule, platform="CUDA", api_version=1)

_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1
_DEVICE_ORDINAL_MAX = 2**31 - 1


def is_available() -> bool:
    """Whether the extension is built and its FFI target registered.

    It says nothing about GPUs: on a machine without ``libcuda`` it is still
    True, and the functions that need the driver raise ``RuntimeError``.
    """
    return _ffi is not None


def _extension():
    if _ffi is None:
        raise RuntimeError(
            f"jax_moe_publish._ffi is not built ({_IMPORT_ERROR}); install the package with "
            "`pip install .` to build it"
        ) from _IMPORT_ERROR
    return _ffi


def _int(name: str, value, low: int, high: int, expected: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r}: expected an int, got {type(value).__name__}")
    value = int(value)
    if not low <= value <= high:
        raise ValueError(f"{name}={value}: expected {expected or f'an int in [{low}, {high}]'}")
    return value


def _address(name: str, value) -> int:
    return _int(name, value, 1, _UINT64_MAX, "a non-null device address in [1, 2**64)")


def _records(name: str, records) -> list[dict]:
    """``records``, a sequence of mappings, as the list of dicts that the extension takes."""
    if isinstance(records, (str, bytes, Mapping)) or not isinstance(records, Sequence):
        raise TypeError(f"{name}={records!r}: expected a sequence of mappings")
    dicts = []
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise TypeError(f"{name}[{i}]={record!r}: expected a mapping")
        dicts.append(dict(record))
    return dicts


def _sidecar_records(kernels: Sequence[Mapping], call: Mapping) -> tuple[list[dict], dict]:
    """A sidecar's ``kernels`` and ``call`` as the extension takes them; it checks their fields."""
    kernels = _records("kernels", kernels)
    if not isinstance(call, Mapping):
        raise TypeError(f"call={call!r}: expected a mapping")
    call = dict(call)
    if "operands" in call:
        call["operands"] = _records("call['operands']", call["operands"])
    return kernels, call


def validate_kernel_set(kernels: Sequence[Mapping], call: Mapping) -> None:
    """Check a kernel set's sidecar records as `load_kernel_set` does, without a cubin or CUDA.

    It runs the extension's whole load-time validation, the same code as `load_kernel_set`'s,
    so that a machine without a GPU can tell whether a sidecar would load. Beyond each field's
    type and range, the records must fit the launch contract of the target's op
    (`_abi.CONTRACTS`):

    * each kernel's ``params`` are values of that op (`_abi.ALL_VALUES` names, each once, with
      their ``param_types``); a kernel that takes the mailbox exists exactly when ``tp > 1``; a
      grid of rows ``"resident"`` is a persistent kernel's;
    * ``call["target"]`` is an `_abi.ALL_TARGETS` name; each operand's ``name`` is a value that
      an operand of its op carries, each once; ``io`` is ``"arg"`` or ``"ret"``, every arg before
      every ret, at least one of each; ``dtype`` is an `_abi.DTYPES` name; ``rows`` is
      ``"num_rows"``, ``"m"``, ``"owned"``, ``"pairs"``, ``"zero"`` or None; ``shape`` a list of
      counts >= 1 (not empty without rows); ``top_k >= 1``; ``1 <= max_m < 2**31``;
    * at most one operand has rows ``"num_rows"`` (a kernel that takes num_rows needs it), at
      least one ``"m"``, the first of which comes before any ``"owned"`` or ``"pairs"`` one;
    * every operand value a kernel takes is an operand of the call, every operand is taken by
      some kernel, a kernel takes ``eps`` only through a target with ``norm_eps`` and a mailbox
      value only through a target with a mailbox.

    Parameters
    ----------
    kernels, call : as for `load_kernel_set`.

    Raises
    ------
    TypeError, ValueError
        For records that do not fit the contract; the message names the field, its value and
        what was expected.
    """
    _extension().validate_kernel_set(*_sidecar_records(kernels, call))


def load_kernel_set(kernel_set_id: int, device_ordinal: int, cubin: bytes, kernels: Sequence[Mapping],
                    call: Mapping) -> None:
    """Load a kernel set's cubin on one device, for the FFI targets to launch.

    The records are checked first, with no CUDA call (`validate_kernel_set`). The cubin is
    loaded with ``cuModuleLoadData`` in the device's primary context, which stays retained;
    kernels that use more than 48 KiB of dynamic shared memory, or clusters of more than 8
    CTAs, are opted in to them. Loading an id that is already loaded on the device does
    nothing. Thread-safe. Call it before the first call of the op on the device, outside any
    CUDA graph capture.

    A call launches the kernels in the order given, each with the values its
    ``params`` name (`_abi.ALL_VALUES`), on a 1-D grid of ``rows(m) * ctas_per_row``
    CTAs, where ``rows`` is ``m`` or ``ceil(m / tp)``, with programmatic
    dependent launch when ``call["pdl"]``. A persistent kernel gets
    ``ceil(rows(m) / waves) * ctas_per_row`` CTAs, at most as many as the device
    holds at once (from the kernel's occupancy), and loops over the rest; with rows
    ``"resident"`` it gets exactly as many as the device holds.

    Parameters
    ----------
    kernel_set_id : int
        Id that calls pass as their ``kernel_set_id`` attribute (int64).
    device_ordinal : int
        CUDA device ordinal in this process (``jax.Device.local_hardware_id``).
    cubin : bytes
        The compiled module (sm_90a), not PTX: a little-endian ELF64 file of machine
        ``EM_CUDA``, checked before ``cuModuleLoadData`` sees it (`aot.artifact.cubin_problem`).
    kernels : sequence of mappings
        The sidecar's kernel records, in launch order: ``role`` (for messages),
        ``symbol`` (entry name), ``params`` and ``param_types`` (the values it
        takes and their PTX types, which must be the contract's), ``block``,
        ``smem`` (dynamic shared memory bytes), ``ctas_per_row``, ``rows``
        (``"m"``, ``"owned"`` or ``"resident"``), ``waves``, ``persistent`` and
        ``cluster`` (CTAs per thread block cluster, 1 for none).
    call : mapping
        The sidecar's call record (`aot.compile.call_record`): ``target`` (the
        `_abi.ALL_TARGETS` name that calls of the set must use), ``tp``, ``hidden``, ``top_k``,
        ``max_m``, ``pdl`` and ``operands``, the set's operand records (`_abi.call_operands`)
        in FFI order: ``name``, ``io``, ``dtype``, ``rows`` and ``shape``. Each call's operands
        are checked against them: ``rows`` ``"num_rows"`` takes any count (the kernels'
        num_rows), the first ``"m"`` fixes m (1 to ``max_m``) and later ones equal it,
        ``"owned"`` is ``ceil(m / tp)``, ``"pairs"`` is ``m * top_k``, ``"zero"`` is 0, None
        has no leading dimension; the dimensions after it are ``shape``.

    Raises
    ------
    TypeError, ValueError
        For arguments that do not fit the contract.
    RuntimeError
        When the CUDA driver is missing or a CUDA call fails (the message
        names the call).
    """
    ffi = _extension()
    if not isinstance(cubin, bytes):
        raise TypeError(f"cubin: expected bytes, got {type(cubin).__name__}")
    problem = cubin_problem(cubin)
    if problem is not None:
        raise ValueError(f"cubin of {len(cubin)} bytes: expected a CUDA cubin, but {problem}")
    kernels, call = _sidecar_records(kernels, call)
    ffi.load_kernel_set(
        _int("kernel_set_id", kernel_set_id, -_INT64_MAX - 1, _INT64_MAX),
        _int("device_ordinal", device_ordinal, 0, _DEVICE_ORDINAL_MAX),
        cubin,
        kernels,
        call,
    )


def register_mailbox_device(
    mailbox_id: int,
    device_ordinal: int,
    rank: int,
    tp: int,
    hidden: int,
    capacity_m: int,
    mailbox: int,
    peer_table: int,
    stage_state: int,
    status: int,
    timeout_ns: int,
) -> None:
    """Register one device's part of a mailbox for the FFI target.

    Calls with this ``mailbox_id`` on this device read these addresses. A
    second registration of the same (mailbox, device) replaces the first. The
    call copies no device memory and needs no CUDA driver.

    Parameters
    ----------
    mailbox_id : int
        Id that calls pass as their ``mailbox_id`` attribute; >= 1, as 0 means
        "no mailbox" (tp = 1). Ids of closed mailboxes are refused.
    device_ordinal : int
        CUDA device ordinal in this process (``jax.Device.local_hardware_id``).
    rank : int
        Position of the device along the TP axis, ``0 <= rank < tp``; not the
        device ordinal.
    tp, hidden, capacity_m : int
        Layout of the mailbox: ``[STAGES][tp][capacity_m][hidden]`` bf16
        contributions, then the gather area. A call's ``m`` must be at most
        ``capacity_m``, which the kernels take as a signed 32-bit int.
    mailbox, peer_table, stage_state, status : int
        Device addresses: this device's mailbox, its table of the ``tp`` peer
        mailbox addresses, its stage words and its status block.
    timeout_ns : int
        How long a reduce waits for a peer before it records a timeout in the
        status block.
    """
    ffi = _extension()
    tp = _int("tp", tp, 1, _INT64_MAX)
    ffi.register_mailbox_device(
        _int("mailbox_id", mailbox_id, 1, _INT64_MAX, "an int in [1, 2**63), 0 means no mailbox"),
        _int("device_ordinal", device_ordinal, 0, _DEVICE_ORDINAL_MAX),
        _int("rank", rank, 0, tp - 1, f"an int in [0, tp={tp})"),
        tp,
        _int("hidden", hidden, 1, _INT64_MAX),
        _int("capacity_m", capacity_m, 1, _INT32_MAX, "an int in [1, 2**31 - 1] (the kernels' m is an int32)"),
        _address("mailbox", mailbox),
        _address("peer_table", peer_table),
        _address("stage_state", stage_state),
        _address("status", status),
        _int("timeout_ns", timeout_ns, 0, _UINT64_MAX),
    )


def close_mailbox(mailbox_id: int) -> None:
    """Forget a mailbox on every device, before its memory is freed.

    Later calls of the op with this ``mailbox_id`` fail with a
    ``FAILED_PRECONDITION`` error instead of writing to freed memory, and the
    id cannot be registered again.
    """
    _extension().close_mailbox(_int("mailbox_id", mailbox_id, -_INT64_MAX - 1, _INT64_MAX))


def execute_counts() -> tuple[int, int]:
    """(captured, direct): calls of the op that launched inside a CUDA graph capture
    (an XLA command buffer) and on a live stream, since the process started."""
    return tuple(_extension().execute_counts())


def launch_values() -> list[tuple[str, str, str, list[str]]]:
    """Every op's launch values as the C++ launcher lists them, in order: (name, PTX type, source,
    ops), the source being where the handler takes the value from: ``"operand"`` (the address
    of the call's operand of that name), ``"rows"``, ``"mailbox"`` or ``"attribute"``; ops the
    names of the ops (`_abi.CONTRACTS`) whose kernels can take it."""
    return [(name, ptx_type, source, list(ops)) for name, ptx_type, source, ops in _extension().launch_values()]


def launch_limits() -> dict[str, int]:
    """The launch limits as the C++ launcher holds them (`_abi`'s names)."""
    return dict(_extension().launch_limits())


def operand_dtypes() -> dict[str, int]:
    """The operand dtypes as the C++ handler knows them: name -> bytes per element (`_abi.DTYPES`)."""
    return dict(_extension().operand_dtypes())
