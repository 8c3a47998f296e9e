"""CPU tests of the C++ extension: it builds, imports and registers without a GPU or libcuda, its
list of launch values is the contract's, and both validation layers (the Python wrappers and
the C++ registry) refuse bad arguments with messages that name them.

Nothing here launches a kernel; the registry checks run before any CUDA call.
"""

import ctypes
import itertools
import types

import pytest

from jax_moe_publish import _abi, _extension

# Mailbox ids are process-wide and closed ids stay closed, so every test takes fresh ones.
_mailbox_ids = itertools.count(1_000_001)


def _elf_header(elf_class=2, data=1, machine=190) -> bytes:
    """The 64-byte header of an ELF64 file: a cubin's (EM_CUDA = 190) unless told otherwise."""
    ident = b"\x7fELF" + bytes([elf_class, data, 1]) + bytes(9)
    return ident + (2).to_bytes(2, "little") + machine.to_bytes(2, "little") + bytes(44)


FAKE_CUBIN = _elf_header() + b"not a real cubin"
"""Passes the Python check of a cubin (its ELF header); the driver would refuse the rest."""


def _libcuda_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _kernel(role: str, **changes) -> dict:
    """A sidecar record of a ``role`` kernel, as the compile step writes it."""
    contract = _abi.ROLES[role]
    record = {
        "role": role,
        "symbol": f"kernel_{role}",
        "params": list(contract.params),
        "param_types": [_abi.VALUES[name] for name in contract.params],
        "block": 128,
        "smem": 0,
        "ctas_per_row": 7,
        "rows": "m",
        "waves": 1,
        "persistent": contract.persistent,
        "cluster": 7 if contract.cluster else 1,
    }
    record.update(changes)
    return record


def _call(**changes) -> dict:
    call = {"tp": 2, "hidden": 7168, "top_k": 8, "weights": "bf16", "shared_expert": True, "out_rows": "m",
            "pdl": True}
    call.update(changes)
    return call


def _load_args(**changes) -> dict:
    args = {
        "kernel_set_id": 1,
        "device_ordinal": 0,
        "cubin": FAKE_CUBIN,
        "kernels": [_kernel("publish"), _kernel("reduce")],
        "call": _call(),
    }
    args.update(changes)
    return args


def _mailbox_args(**changes) -> dict:
    args = {
        "mailbox_id": next(_mailbox_ids),
        "device_ordinal": 0,
        "rank": 1,
        "tp": 2,
        "hidden": 7168,
        "capacity_m": 256,
        "mailbox": 0x7F00_0000_0000,
        "peer_table": 0x7F00_1000_0000,
        "stage_state": 0x7F00_2000_0000,
        "status": 0x7F00_3000_0000,
        "timeout_ns": 10**9,
    }
    args.update(changes)
    return args


def test_extension_imports():
    # Fails when the source tree shadows the installed package (pytest run from the repo root
    # after a non-editable install): the source tree has no built _ffi.
    assert _extension.is_available(), _extension._IMPORT_ERROR
    assert isinstance(_extension._ffi, types.ModuleType)
    assert type(_extension._ffi.handler_capsule()).__name__ == "PyCapsule"


def test_the_cpp_launch_values_are_the_contract():
    assert _extension.launch_values() == list(_abi.VALUES.items())


def test_the_cpp_launch_limits_are_the_contract():
    names = ("MAX_THREADS", "PORTABLE_CLUSTER_CTAS", "MAX_CLUSTER_CTAS", "DEFAULT_SMEM_BYTES")
    assert _extension.launch_limits() == {name: getattr(_abi, name) for name in names}


@pytest.mark.parametrize("target", [_extension.TARGET_NAME, _extension.RMSNORM_TARGET_NAME])
def test_target_registered(target):
    # On a jaxlib without a CUDA backend, registrations for CUDA wait in a
    # queue until a CUDA plugin appears; with one, they go straight to XLA.
    from jax._src.lib import xla_client

    pending = [entry[0] for entry in getattr(xla_client, "_custom_callback", {}).get("CUDA", [])]
    if target in pending:
        return
    try:
        registered = xla_client.custom_call_targets("CUDA")
    except Exception as error:  # No CUDA backend and no queue entry: not registered.
        pytest.fail(f"{target} is neither queued nor registered for CUDA: {error}")
    assert target in registered


@pytest.mark.skipif(_libcuda_loadable(), reason="libcuda.so.1 is present on this machine")
def test_load_kernel_set_without_libcuda_raises():
    with pytest.raises(RuntimeError, match=r"libcuda\.so\.1 could not be loaded: "):
        _extension.load_kernel_set(**_load_args())


@pytest.mark.skipif(_libcuda_loadable(), reason="libcuda.so.1 is present on this machine")
@pytest.mark.parametrize(
    "tp, roles, call",
    [
        (1, ["finalize"], {}),
        (4, ["publish", "reduce"], {}),
        (4, ["publish", "reduce"], dict(out_rows="owned")),
        (8, ["publish", "reduce", "gather"], {}),
        (2, ["publish", "reduce_norm"], dict(weights="f32")),
        (8, ["publish", "reduce_norm"], dict(out_rows="owned", shared_expert=False)),
        (2, ["publish_reduce"], {}),
        (4, ["publish_reduce_norm"], dict(pdl=False)),
    ],
)
def test_valid_kernel_sets_reach_the_driver(tp, roles, call):
    with pytest.raises(RuntimeError, match="libcuda"):
        _extension.load_kernel_set(**_load_args(kernels=[_kernel(role) for role in roles], call=_call(tp=tp, **call)))


@pytest.mark.parametrize(
    "changes, match",
    [
        # Parameters that are not values of the contract, or of the wrong type.
        ({"kernels": [_kernel("publish", params=["routed", "destination"], param_types=["u64", "u64"]),
                      _kernel("reduce")]},
         r"kernels\[0\] \(publish\): parameter 'destination' is not a value of the launch contract \['routed'"),
        ({"kernels": [_kernel("publish", param_types=["u64"] * 10), _kernel("reduce")]},
         r"parameter 6 \(num_rows\) of 'kernel_publish' has type 'u64', but the launch contract's num_rows is 'u32'"),
        ({"kernels": [_kernel("publish", param_types=["u64"]), _kernel("reduce")]}, "10 params but 1 param_types"),
        ({"kernels": [_kernel("publish", params=["m", "m"], param_types=["u32", "u32"]), _kernel("reduce")]},
         "parameter 'm' twice"),
        # The set against its call.
        ({"kernels": []}, "kernels is empty"),
        ({"call": _call(tp=1)}, "tp=1 with a kernel that takes the mailbox: expected one exactly when tp > 1"),
        ({"kernels": [_kernel("finalize")]}, "tp=2 without a kernel that takes the mailbox"),
        ({"kernels": [_kernel("publish"), _kernel("reduce", params=["residual", "eps"],
                                                     param_types=["u64", "f32"])]},
         "the reduce kernel takes some of residual, norm_weight, residual_out and eps: expected all four or none"),
        ({"call": _call(weights="fp8")}, r"weights='fp8': expected 'bf16' or 'f32'"),
        ({"call": _call(out_rows="all")}, r"out_rows='all': expected 'm' or 'owned'"),
        ({"call": _call(tp=0)}, "tp=0"),
        ({"call": _call(hidden=0)}, "hidden=0"),
        ({"call": _call(top_k=0)}, "top_k=0"),
        # A kernel's launch plan.
        ({"kernels": [_kernel("publish", rows="all"), _kernel("reduce")]}, r"rows='all'"),
        ({"kernels": [_kernel("publish", block=0), _kernel("reduce")]}, r"block=0"),
        ({"kernels": [_kernel("publish", block=2048), _kernel("reduce")]}, r"block=2048"),
        ({"kernels": [_kernel("publish", ctas_per_row=0), _kernel("reduce")]}, r"ctas_per_row=0"),
        ({"kernels": [_kernel("publish", smem=-1), _kernel("reduce")]}, r"smem=-1"),
        ({"kernels": [_kernel("publish_reduce", waves=0)]}, r"waves=0: expected >= 1"),
        # Only a persistent grid makes several passes.
        ({"kernels": [_kernel("publish", waves=2), _kernel("reduce")]},
         r"kernels\[0\] \(publish\): waves=2: expected 1 for a kernel that is not persistent"),
        # A cluster: at most Hopper's 16 CTAs, a whole number of them per row.
        ({"kernels": [_kernel("publish_reduce_norm", ctas_per_row=17, cluster=17)]},
         r"cluster=17: expected 1 to 16 CTAs"),
        ({"kernels": [_kernel("publish_reduce_norm", ctas_per_row=14, cluster=4)]},
         r"cluster=4 does not divide ctas_per_row=14"),
        ({"kernels": [_kernel("publish", symbol=""), _kernel("reduce")]}, "symbol is empty"),
        ({"kernels": [{"role": "publish"}, _kernel("reduce")]}, r"kernels\[0\]: missing key 'symbol'"),
        ({"call": {"tp": 2}}, r"call: missing key 'hidden'"),
        ({"cubin": b""}, "cubin of 0 bytes: expected a CUDA cubin, but it is empty"),
        # PTX text, a file cut inside its header, a 32-bit ELF and an x86-64 object: refused
        # before cuModuleLoadData sees them.
        ({"cubin": b"//\n// Generated by NVIDIA NVVM Compiler\n.version 8.7"}, r"not with the ELF magic"),
        ({"cubin": FAKE_CUBIN[:40]}, "cubin of 40 bytes: .* fewer than an ELF64 header's 64: it is truncated"),
        ({"cubin": _elf_header(elf_class=1)}, "ELF class and data bytes are 1 and 1, not 2 and 1"),
        ({"cubin": _elf_header(machine=62)}, r"its ELF machine is 62, not EM_CUDA \(190\)"),
        ({"device_ordinal": -1}, "device_ordinal=-1"),
    ],
)
def test_load_kernel_set_value_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        _extension.load_kernel_set(**_load_args(**changes))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"kernel_set_id": "1"}, "kernel_set_id='1': expected an int"),
        ({"kernel_set_id": 1.0}, "kernel_set_id=1.0: expected an int"),
        ({"cubin": "cubin"}, "cubin: expected bytes"),
        ({"kernels": _kernel("publish")}, "kernels=.*: expected a sequence of mappings"),
        ({"kernels": ["publish"]}, r"kernels\[0\]='publish': expected a mapping"),
        ({"kernels": [_kernel("publish", block=128.0), _kernel("reduce")]}, r"\['block'\]=128.0"),
        ({"kernels": [_kernel("publish", waves=None), _kernel("reduce")]}, r"\['waves'\]=None: expected an int"),
        ({"kernels": [_kernel("publish", params="u64"), _kernel("reduce")]}, r"\['params'\]"),
        ({"kernels": [_kernel("publish", persistent=1), _kernel("reduce")]}, r"\['persistent'\]=1: expected a bool"),
        ({"call": "oneshot"}, "call='oneshot': expected a mapping"),
        ({"call": _call(pdl=1)}, r"call\['pdl'\]=1: expected a bool"),
        ({"call": _call(tp=True)}, r"call\['tp'\]=True: expected an int"),
    ],
)
def test_load_kernel_set_type_errors(changes, match):
    with pytest.raises(TypeError, match=match):
        _extension.load_kernel_set(**_load_args(**changes))


def test_register_and_close_mailbox():
    args = _mailbox_args()
    _extension.register_mailbox_device(**args)
    _extension.register_mailbox_device(**args)  # Re-registering replaces.
    _extension.register_mailbox_device(**dict(args, device_ordinal=1, rank=0))
    _extension.close_mailbox(args["mailbox_id"])
    _extension.close_mailbox(args["mailbox_id"])  # Closing twice is harmless.
    with pytest.raises(ValueError, match=rf"mailbox {args['mailbox_id']} is closed"):
        _extension.register_mailbox_device(**args)


def test_close_unregistered_mailbox_refuses_it_later():
    args = _mailbox_args()
    _extension.close_mailbox(args["mailbox_id"])
    with pytest.raises(ValueError, match="is closed"):
        _extension.register_mailbox_device(**args)


@pytest.mark.parametrize(
    "changes, error, match",
    [
        ({"mailbox_id": 0}, ValueError, "mailbox_id=0: expected an int in \\[1, 2\\*\\*63\\)"),
        ({"mailbox_id": "7"}, TypeError, "mailbox_id='7': expected an int"),
        ({"device_ordinal": -1}, ValueError, "device_ordinal=-1"),
        ({"rank": 2}, ValueError, r"rank=2: expected an int in \[0, tp=2\)"),
        ({"rank": -1}, ValueError, "rank=-1"),
        ({"tp": 0}, ValueError, "tp=0"),
        ({"hidden": 0}, ValueError, "hidden=0"),
        ({"capacity_m": 0}, ValueError, "capacity_m=0"),
        ({"capacity_m": 2**32}, ValueError, "capacity_m=4294967296"),
        # The kernels read capacity_m as an int32: 2**31 would be negative there.
        ({"capacity_m": 2**31}, ValueError, r"capacity_m=2147483648: expected an int in \[1, 2\*\*31 - 1\]"),
        ({"mailbox": 0}, ValueError, "mailbox=0: expected a non-null device address"),
        ({"peer_table": -5}, ValueError, "peer_table=-5"),
        ({"stage_state": 2**64}, ValueError, "stage_state=18446744073709551616"),
        ({"status": None}, TypeError, "status=None: expected an int"),
        ({"timeout_ns": -1}, ValueError, "timeout_ns=-1"),
    ],
)
def test_register_mailbox_device_errors(changes, error, match):
    with pytest.raises(error, match=match):
        _extension.register_mailbox_device(**_mailbox_args(**changes))


def test_registry_checks_mailbox_id_behind_the_glue():
    # The C++ layer refuses what the glue would have caught, for direct callers.
    with pytest.raises(ValueError, match="mailbox_id 0 is reserved"):
        _extension._ffi.register_mailbox_device(**_mailbox_args(mailbox_id=0))
    with pytest.raises(ValueError, match="expected 0 <= rank < tp=2"):
        _extension._ffi.register_mailbox_device(**_mailbox_args(rank=2))
    with pytest.raises(ValueError, match="status is a null device pointer"):
        _extension._ffi.register_mailbox_device(**_mailbox_args(status=0))


def test_execute_counts_start_at_zero_without_calls():
    captured, direct = _extension.execute_counts()
    assert (captured, direct) == (0, 0)
