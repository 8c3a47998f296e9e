"""CPU tests of the native layer: the extension builds, imports and registers
without a GPU or libcuda, and both validation layers (the Python glue and the
C++ registry) refuse bad arguments with messages that name them.

Nothing here launches a kernel; the registry checks run before any CUDA call.
"""

import ctypes
import itertools
import types

import pytest

from jax_moe_publish import native

PUBLISH_ABI = ["u64"] * 6 + ["u32"] * 4
WAIT_ABI = ["u64"] * 6 + ["u32"] * 3
WAIT_NORM_ABI = WAIT_ABI + ["u64"] * 3 + ["f32"]
PUBLISH_REDUCE_ABI = ["u64"] * 10 + ["u32"] * 4
PUBLISH_REDUCE_NORM_ABI = PUBLISH_REDUCE_ABI + ["u64"] * 3 + ["f32"]

# Mailbox ids are process-wide and closed ids stay closed, so every test takes fresh ones.
_mailbox_ids = itertools.count(1_000_001)


def _libcuda_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _kernel(role: str, **changes) -> dict:
    record = {
        "role": role,
        "symbol": f"kernel_{role}",
        "block": 128,
        "smem": 0,
        "ctas_per_row": 7,
        "rows": "m",
        "waves": 1,
        "params": {"publish": PUBLISH_ABI, "reduce_norm": WAIT_NORM_ABI,
                   "publish_reduce": PUBLISH_REDUCE_ABI,
                   "publish_reduce_norm": PUBLISH_REDUCE_NORM_ABI}.get(role, WAIT_ABI),
    }
    record.update(changes)
    return record


def _load_args(**changes) -> dict:
    args = {
        "kernel_set_id": 1,
        "device_ordinal": 0,
        "cubin": b"\x7fELF not a real cubin",
        "kernels": [_kernel("publish"), _kernel("reduce")],
        "mode": "oneshot",
        "tp": 2,
        "hidden": 7168,
        "top_k": 8,
        "fp32_weights": False,
        "include_shared_expert": True,
        "pdl": True,
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
    assert native.is_available(), native._IMPORT_ERROR
    assert isinstance(native._ffi, types.ModuleType)
    assert type(native._ffi.handler_capsule()).__name__ == "PyCapsule"


@pytest.mark.parametrize("target", [native.TARGET_NAME, native.RMSNORM_TARGET_NAME])
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
        native.load_kernel_set(**_load_args())


@pytest.mark.skipif(_libcuda_loadable(), reason="libcuda.so.1 is present on this machine")
@pytest.mark.parametrize(
    "mode, tp, roles",
    [
        ("direct", 1, ["publish"]),
        ("oneshot", 4, ["publish", "reduce"]),
        ("reduce_scatter", 4, ["publish", "reduce"]),
        ("twoshot", 8, ["publish", "reduce", "gather"]),
        ("oneshot-rmsnorm", 2, ["publish", "reduce_norm"]),
        ("reduce_scatter-rmsnorm", 8, ["publish", "reduce_norm"]),
        ("oneshot-fused", 2, ["publish_reduce"]),
        ("oneshot-rmsnorm-fused", 4, ["publish_reduce_norm"]),
    ],
)
def test_valid_kernel_sets_reach_the_driver(mode, tp, roles):
    mode, *variants = mode.split("-")
    kernels = [_kernel(role) for role in roles]
    epilogue = "rmsnorm" if "rmsnorm" in variants else "none"
    with pytest.raises(RuntimeError, match="libcuda"):
        native.load_kernel_set(**_load_args(kernels=kernels, mode=mode, tp=tp, epilogue=epilogue,
                                            fuse_reduce="fused" in variants))


@pytest.mark.parametrize("role, given", [("publish", WAIT_ABI), ("reduce", PUBLISH_ABI)])
def test_load_kernel_set_refuses_wrong_abi(role, given):
    kernels = [_kernel("publish"), _kernel("reduce")]
    kernels[0 if role == "publish" else 1]["params"] = given
    expected = PUBLISH_ABI if role == "publish" else WAIT_ABI
    with pytest.raises(ValueError) as info:
        native.load_kernel_set(**_load_args(kernels=kernels))
    message = str(info.value)
    assert f"the {role} kernel" in message
    assert f"has params {given!r}" in message
    assert f"the {role} ABI is {expected!r}" in message


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"kernels": [_kernel("publish")]}, r"mode 'oneshot' expects \['publish', 'reduce'\]"),
        ({"kernels": [_kernel("reduce"), _kernel("publish")]}, r"role='reduce'"),
        ({"kernels": [_kernel("publish"), _kernel("reduce"), _kernel("gather")]}, "expects"),
        ({"mode": "twoshot"}, r"mode 'twoshot' expects \['publish', 'reduce', 'gather'\]"),
        ({"mode": "direct"}, "expected mode 'direct' exactly when tp == 1"),
        ({"mode": "allreduce"}, r"mode='allreduce': expected one of"),
        ({"kernels": [_kernel("publish", rows="all"), _kernel("reduce")]}, r"rows='all'"),
        ({"kernels": [_kernel("publish", block=0), _kernel("reduce")]}, r"block=0"),
        ({"kernels": [_kernel("publish", block=2048), _kernel("reduce")]}, r"block=2048"),
        ({"kernels": [_kernel("publish", ctas_per_row=0), _kernel("reduce")]}, r"ctas_per_row=0"),
        ({"kernels": [_kernel("publish", smem=-1), _kernel("reduce")]}, r"smem=-1"),
        ({"fuse_reduce": True, "kernels": [_kernel("publish_reduce", waves=0)]}, r"waves=0: expected >= 1"),
        # Only a persistent grid makes several passes.
        ({"kernels": [_kernel("publish", waves=2), _kernel("reduce")]},
         r"kernels\[0\]: waves=2: expected 1 for the publish kernel"),
        ({"kernels": [_kernel("publish", symbol=""), _kernel("reduce")]}, "symbol is empty"),
        ({"kernels": [{"role": "publish"}, _kernel("reduce")]}, r"kernels\[0\]: missing key 'symbol'"),
        ({"cubin": b""}, "cubin"),
        ({"device_ordinal": -1}, "device_ordinal=-1"),
        ({"tp": 0}, "tp=0"),
        ({"hidden": 0}, "hidden=0"),
        ({"top_k": 0}, "top_k=0"),
        ({"epilogue": "layernorm"}, r"epilogue='layernorm': expected one of 'none', 'rmsnorm'"),
        ({"epilogue": "rmsnorm"},
         r"role='reduce': mode 'oneshot' with epilogue 'rmsnorm' expects roles \['publish', 'reduce_norm'\]"),
        ({"epilogue": "rmsnorm", "mode": "twoshot", "tp": 2},
         r"epilogue='rmsnorm' with mode='twoshot': expected mode 'oneshot' or 'reduce_scatter'"),
        ({"kernels": [_kernel("publish"), _kernel("reduce_norm")]},
         r"role='reduce_norm': mode 'oneshot' expects roles \['publish', 'reduce'\]"),
        ({"epilogue": "rmsnorm", "kernels": [_kernel("publish"), _kernel("reduce_norm", params=WAIT_ABI)]},
         r"the reduce_norm ABI is \['u64'.*'f32'\]"),
        ({"fuse_reduce": True},
         r"roles \['publish', 'reduce'\]: mode 'oneshot' with fuse_reduce expects \['publish_reduce'\]"),
        ({"fuse_reduce": True, "kernels": [_kernel("publish_reduce", params=PUBLISH_ABI)]},
         r"the publish_reduce ABI is \['u64'.*'u32'\]"),
        ({"fuse_reduce": True, "mode": "twoshot", "kernels": [_kernel("publish_reduce")]},
         r"fuse_reduce=true with mode='twoshot': expected mode 'oneshot'"),
        ({"fuse_reduce": True, "epilogue": "rmsnorm", "kernels": [_kernel("publish_reduce")]},
         r"role='publish_reduce': mode 'oneshot' with epilogue 'rmsnorm' with fuse_reduce expects roles "
         r"\['publish_reduce_norm'\]"),
        ({"fuse_reduce": True, "epilogue": "rmsnorm",
          "kernels": [_kernel("publish_reduce_norm", params=PUBLISH_REDUCE_ABI)]},
         r"the publish_reduce_norm ABI is \['u64'.*'f32'\]"),
        ({"kernels": [_kernel("publish_reduce")]},
         r"mode 'oneshot' expects \['publish', 'reduce'\]"),
        # The fused epilogue's CTAs of a row form one cluster: at most Hopper's 16.
        ({"fuse_reduce": True, "epilogue": "rmsnorm", "kernels": [_kernel("publish_reduce_norm", ctas_per_row=17)]},
         r"ctas_per_row=17: the publish_reduce_norm kernel's CTAs of a row form one cluster, expected at most 16"),
    ],
)
def test_load_kernel_set_value_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        native.load_kernel_set(**_load_args(**changes))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"kernel_set_id": "1"}, "kernel_set_id='1': expected an int"),
        ({"kernel_set_id": 1.0}, "kernel_set_id=1.0: expected an int"),
        ({"tp": True}, "tp=True: expected an int"),
        ({"cubin": "cubin"}, "cubin: expected bytes"),
        ({"kernels": _kernel("publish")}, "kernels=.*: expected a sequence of mappings"),
        ({"kernels": ["publish"]}, r"kernels\[0\]='publish': expected a mapping"),
        ({"kernels": [_kernel("publish", block=128.0), _kernel("reduce")]}, r"\['block'\]=128.0"),
        ({"kernels": [_kernel("publish", waves=None), _kernel("reduce")]}, r"\['waves'\]=None: expected an int"),
        ({"kernels": [_kernel("publish", params="u64"), _kernel("reduce")]}, r"\['params'\]"),
        ({"mode": None}, "mode=None: expected a str"),
        ({"pdl": 1}, "pdl=1: expected a bool"),
        ({"epilogue": None}, "epilogue=None: expected a str"),
        ({"fuse_reduce": 1}, "fuse_reduce=1: expected a bool"),
    ],
)
def test_load_kernel_set_type_errors(changes, match):
    with pytest.raises(TypeError, match=match):
        native.load_kernel_set(**_load_args(**changes))


def test_register_and_close_mailbox():
    args = _mailbox_args()
    native.register_mailbox_device(**args)
    native.register_mailbox_device(**args)  # Re-registering replaces.
    native.register_mailbox_device(**dict(args, device_ordinal=1, rank=0))
    native.close_mailbox(args["mailbox_id"])
    native.close_mailbox(args["mailbox_id"])  # Closing twice is harmless.
    with pytest.raises(ValueError, match=rf"mailbox {args['mailbox_id']} is closed"):
        native.register_mailbox_device(**args)


def test_close_unregistered_mailbox_refuses_it_later():
    args = _mailbox_args()
    native.close_mailbox(args["mailbox_id"])
    with pytest.raises(ValueError, match="is closed"):
        native.register_mailbox_device(**args)


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
        ({"mailbox": 0}, ValueError, "mailbox=0: expected a non-null device address"),
        ({"peer_table": -5}, ValueError, "peer_table=-5"),
        ({"stage_state": 2**64}, ValueError, "stage_state=18446744073709551616"),
        ({"status": None}, TypeError, "status=None: expected an int"),
        ({"timeout_ns": -1}, ValueError, "timeout_ns=-1"),
    ],
)
def test_register_mailbox_device_errors(changes, error, match):
    with pytest.raises(error, match=match):
        native.register_mailbox_device(**_mailbox_args(**changes))


def test_registry_checks_mailbox_id_behind_the_glue():
    # The C++ layer refuses what the glue would have caught, for direct callers.
    with pytest.raises(ValueError, match="mailbox_id 0 is reserved"):
        native._ffi.register_mailbox_device(**_mailbox_args(mailbox_id=0))
    with pytest.raises(ValueError, match="expected 0 <= rank < tp=2"):
        native._ffi.register_mailbox_device(**_mailbox_args(rank=2))
    with pytest.raises(ValueError, match="status is a null device pointer"):
        native._ffi.register_mailbox_device(**_mailbox_args(status=0))


def test_execute_counts_start_at_zero_without_calls():
    captured, direct = native.execute_counts()
    assert (captured, direct) == (0, 0)
