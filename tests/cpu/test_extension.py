"""CPU tests of the C++ extension: it builds, imports and registers every target without a GPU or
libcuda, its tables (launch values, limits, operand dtypes, targets) are the contract's, and both
validation layers (the Python wrappers and the C++ registry) refuse bad arguments with messages
that name them.

Nothing here launches a kernel; the registry checks run before any CUDA call, the same code in
`validate_kernel_set` and `load_kernel_set`.
"""

import ctypes
import itertools
import re
import types

import pytest

from jax_moe_publish import _abi, _extension
from jax_moe_publish.aot.compile import call_record
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.experts_config import ExpertsConfig

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
    """A sidecar record of a ``role`` kernel (of either op), as the compile step writes it."""
    contract = _abi.ALL_ROLES[role]
    record = {
        "role": role,
        "symbol": f"kernel_{role}",
        "params": list(contract.params),
        "param_types": [_abi.ALL_VALUES[name] for name in contract.params],
        "block": 128,
        "smem": 0,
        "ctas_per_row": 7,
        "rows": "resident" if role in _abi.EXPERTS.roles else "m",
        "waves": 1,
        "persistent": contract.persistent,
        "cluster": 7 if contract.clustered else 1,
    }
    record.update(changes)
    return record


HIDDEN, TOP_K = 7168, 8
EXPERTS, INTERMEDIATE = 256, 256


def _operand(name: str, io: str, dtype: str, rows: str | None, *shape: int) -> dict:
    return {"name": name, "io": io, "dtype": dtype, "rows": rows, "shape": list(shape)}


def _call(epilogue=False, weights="bf16", shared="m", out_rows="m", **changes) -> dict:
    """A sidecar's call record, written out by hand: ``shared`` is "m" or "zero" (no shared
    expert), ``out_rows`` "m" or "owned" (a reduce-scatter)."""
    operands = [
        _operand("routed", "arg", "bf16", "num_rows", HIDDEN),
        _operand("weights", "arg", weights, "m", TOP_K),
        _operand("indices", "arg", "s32", "m", TOP_K),
        _operand("shared", "arg", "bf16", shared, HIDDEN),
    ]
    if epilogue:
        operands += [_operand("residual", "arg", "bf16", out_rows, HIDDEN),
                     _operand("norm_weight", "arg", "bf16", None, HIDDEN)]
    operands.append(_operand("out", "ret", "bf16", out_rows, HIDDEN))
    if epilogue:
        operands.append(_operand("residual_out", "ret", "bf16", out_rows, HIDDEN))
    call = {"target": "jax_moe_publish_rmsnorm" if epilogue else "jax_moe_publish", "tp": 2, "hidden": HIDDEN,
            "top_k": TOP_K, "max_m": 2**31 - 1, "pdl": True, "operands": operands}
    call.update(changes)
    return call


def _experts_call(fused=True, shared=False, **changes) -> dict:
    """An experts set's call record, written out by hand; ``shared``: its weights hold the shared
    expert after the routed ones."""
    count = EXPERTS + int(shared)
    weights = ([_operand("gate_up", "arg", "bf16", None, count, HIDDEN, 2 * INTERMEDIATE)] if fused else
               [_operand(name, "arg", "bf16", None, count, HIDDEN, INTERMEDIATE) for name in ("gate", "up")])
    operands = [_operand("x", "arg", "bf16", "m", HIDDEN), _operand("expert_ids", "arg", "s32", "m", TOP_K),
                *weights, _operand("down", "arg", "bf16", None, count, INTERMEDIATE, HIDDEN),
                _operand("out", "ret", "bf16", "pairs", HIDDEN),
                *([_operand("shared", "ret", "bf16", "m", HIDDEN)] if shared else []),
                _operand("activations", "ret", "bf16", "m", TOP_K + int(shared), INTERMEDIATE)]
    call = {"target": "jax_moe_publish_experts", "tp": 1, "hidden": HIDDEN, "top_k": TOP_K, "max_m": 1024,
            "pdl": True, "operands": operands}
    call.update(changes)
    return call


def _experts_kernels(fused=True) -> list[dict]:
    return [_kernel("expert_gate_up" if fused else "expert_gate_up_split"), _kernel("expert_down")]


EXPERTS_KERNELS = _experts_kernels()


def _with_operand(index: int, **changes) -> dict:
    """The default call record with ``changes`` to its operand ``index``."""
    call = _call()
    call["operands"][index].update(changes)
    return call


def _with_operands(change) -> dict:
    """The default call record with its operand list replaced by ``change(operands)``."""
    call = _call()
    call["operands"] = change(call["operands"])
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
    registrations = _extension._ffi.registrations()
    assert all(type(capsule).__name__ == "PyCapsule" for capsule in registrations.values())


def test_the_cpp_targets_are_the_contract():
    assert sorted(_extension._ffi.registrations()) == sorted(_abi.ALL_TARGETS)
    assert (_extension.TARGET_NAME, _extension.RMSNORM_TARGET_NAME) == (_abi.TARGETS["none"], _abi.TARGETS["rmsnorm"])
    assert _extension.EXPERTS_TARGET_NAME == _abi.EXPERTS.targets["none"]


def test_the_cpp_launch_values_are_the_contract():
    values = _extension.launch_values()
    assert [(name, ptx_type) for name, ptx_type, _, _ in values] == list(_abi.ALL_VALUES.items())
    # Each value belongs to the ops whose contract lists it.
    assert {name: sorted(ops) for name, _, _, ops in values} == {
        name: sorted(op for op, contract in _abi.CONTRACTS.items() if name in contract.values)
        for name in _abi.ALL_VALUES}
    # The handler takes the address of each of these from the call's operand of that name.
    assert {name for name, _, source, _ in values if source == "operand"} == {
        o.name for contract in _abi.CONTRACTS.values() for o in contract.operands}


def test_the_cpp_operand_dtypes_are_the_contract():
    assert _extension.operand_dtypes() == _abi.DTYPES


def test_the_cpp_launch_limits_are_the_contract():
    names = ("MAX_THREADS", "PORTABLE_CLUSTER_CTAS", "MAX_CLUSTER_CTAS", "DEFAULT_SMEM_BYTES")
    assert _extension.launch_limits() == {name: getattr(_abi, name) for name in names}


@pytest.mark.parametrize("target", _abi.ALL_TARGETS)
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


VALID_SETS = [
    (1, ["finalize"], {}),
    (4, ["publish", "reduce"], {}),
    (4, ["publish", "reduce"], dict(out_rows="owned")),
    (8, ["publish", "reduce", "gather"], {}),
    (2, ["publish", "reduce_norm"], dict(epilogue=True, weights="f32")),
    (8, ["publish", "reduce_norm"], dict(epilogue=True, out_rows="owned", shared="zero")),
    (2, ["publish_reduce"], {}),
    (4, ["publish_reduce_norm"], dict(epilogue=True, pdl=False)),
]


@pytest.mark.parametrize("tp, roles, call", VALID_SETS)
def test_valid_kernel_sets_validate(tp, roles, call):
    _extension.validate_kernel_set([_kernel(role) for role in roles], _call(tp=tp, **call))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "split"])
def test_valid_experts_sets_validate(fused):
    _extension.validate_kernel_set(_experts_kernels(fused), _experts_call(fused=fused))


def test_a_shared_expert_set_validates():
    """Down's shared role takes the shared rows, a result of the call."""
    _extension.validate_kernel_set([_kernel("expert_gate_up"), _kernel("expert_down_shared")],
                                   _experts_call(shared=True))


@pytest.mark.skipif(_libcuda_loadable(), reason="libcuda.so.1 is present on this machine")
@pytest.mark.parametrize("tp, roles, call", VALID_SETS)
def test_valid_kernel_sets_reach_the_driver(tp, roles, call):
    with pytest.raises(RuntimeError, match="libcuda"):
        _extension.load_kernel_set(**_load_args(kernels=[_kernel(role) for role in roles], call=_call(tp=tp, **call)))


CALL_FORMS = [(algorithm, fused, epilogue) for algorithm, record in _abi.ALGORITHMS.items()
              for fused, epilogue in record.roles]


@pytest.mark.parametrize("algorithm, fused, epilogue", CALL_FORMS)
def test_the_call_record_of_every_algorithm_validates(algorithm, fused, epilogue):
    # The call record as the compile step writes it (_abi.call_operands), of every kernel form;
    # the shared expert and the weight dtype vary with `fused`, so that both of each are seen.
    config = KernelConfig(hidden=HIDDEN, top_k=TOP_K, tp=1 if algorithm == "direct" else 4, algorithm=algorithm,
                          fuse_reduce=fused, epilogue=epilogue, include_shared_expert=fused,
                          fp32_weights=not fused)
    _extension.validate_kernel_set([_kernel(role) for role in _abi.call_roles(config)], call_record(config))


def test_the_hand_written_call_records_are_the_compile_step_s():
    config = KernelConfig(hidden=HIDDEN, top_k=TOP_K, tp=2, algorithm="reduce_scatter", epilogue="rmsnorm",
                          include_shared_expert=False, fp32_weights=True)
    assert _call(epilogue=True, weights="f32", shared="zero", out_rows="owned")["operands"] == _abi.call_operands(config)
    assert _call()["operands"] == _abi.call_operands(config.replace(algorithm="oneshot", epilogue="none",
                                                                    include_shared_expert=True, fp32_weights=False))
    for fused, shared in ((True, False), (False, False), (True, True)):
        experts = ExpertsConfig.for_shape(hidden=HIDDEN, intermediate=INTERMEDIATE, experts=EXPERTS, top_k=TOP_K,
                                          fused_gate_up=fused, shared_expert=shared)
        assert _experts_call(fused=fused, shared=shared, max_m=experts.max_m) == call_record(experts)


def _validate(kernels, call):
    _extension.validate_kernel_set(kernels, call)


def _load(kernels, call):
    _extension.load_kernel_set(**_load_args(kernels=kernels, call=call))


# Both run the same checks, before any CUDA call.
CHECKS = pytest.mark.parametrize("check", [_validate, _load], ids=["validate_kernel_set", "load_kernel_set"])

DEFAULT_KERNELS = [_kernel("publish"), _kernel("reduce")]


@CHECKS
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
        ({"kernels": [_kernel("publish"), _kernel("reduce_norm")]},
         r"kernels\[1\] \(reduce_norm\): parameter 'residual' is the address of an operand, but the call has no "
         r"operand 'residual'"),
        ({"kernels": [_kernel("publish"), _kernel("reduce", params=[*_abi.ROLES["reduce"].params, "eps"],
                                                     param_types=[*_kernel("reduce")["param_types"], "f32"])]},
         r"kernels\[1\] \(reduce\): parameter 'eps' comes from the attribute norm_eps, which target "
         r"'jax_moe_publish' does not take"),
        # The call record.
        ({"call": _call(target="jax_moe_publish_layernorm")},
         r"call: target='jax_moe_publish_layernorm': expected one of \['jax_moe_publish', 'jax_moe_publish_rmsnorm', "
         r"'jax_moe_publish_experts'\]"),
        ({"call": _call(tp=0)}, "call: tp=0: expected >= 1"),
        ({"call": _call(hidden=0)}, "call: hidden=0: expected >= 1"),
        ({"call": _call(top_k=0)}, "call: top_k=0: expected >= 1"),
        ({"call": _call(max_m=2**31)}, r"call: max_m=2147483648: expected 1 to 2\*\*31 - 1"),
        ({"call": _with_operand(1, name="gates")},
         r"call: operands\[1\]: name='gates': expected one of the op's operands \['routed', 'weights'"),
        # An operand of the other op.
        ({"call": _with_operand(1, name="expert_ids")}, r"operands\[1\]: name='expert_ids': expected one of"),
        # A value of the contract, but not one an operand carries.
        ({"call": _with_operand(3, name="mailbox")}, r"operands\[3\]: name='mailbox': expected one of"),
        ({"call": _with_operand(2, name="weights")}, r"operands\[2\] \(weights\): a second operand 'weights'"),
        ({"call": _with_operand(0, io="in")}, r"operands\[0\] \(routed\): io='in': expected 'arg' or 'ret'"),
        ({"call": _with_operand(1, dtype="f16")},
         re.escape(f"operands[1] (weights): dtype='f16': expected one of {list(_abi.DTYPES)}")),
        ({"call": _with_operand(3, rows="all")},
         r"operands\[3\] \(shared\): rows='all': expected 'num_rows', 'm', 'owned', 'pairs', 'zero' or None"),
        ({"call": _with_operand(3, rows="resident")}, r"operands\[3\] \(shared\): rows='resident': expected"),
        ({"call": _with_operand(0, shape=[0])}, r"operands\[0\] \(routed\): shape\[0\]=0: expected >= 1"),
        ({"call": _with_operand(4, rows=None, shape=[])},
         r"operands\[4\] \(out\): no rows and an empty shape: expected an array of at least one dimension"),
        # The kernels take num_rows, which the operand with rows 'num_rows' gives.
        ({"call": _with_operand(0, rows="m")},
         "parameter 'num_rows' is the rows of the operand with rows 'num_rows', but the call has none"),
        ({"call": _with_operand(1, rows="num_rows")},
         "call: 2 operands with rows 'num_rows': expected at most one"),
        ({"call": _with_operands(lambda ops: [ops[0]] + [dict(op, rows="zero") for op in ops[1:]])},
         "call: no operand with rows 'm': expected at least one"),
        # ceil(m / tp) needs m, which the first operand with rows m fixes.
        ({"call": _with_operand(1, rows="owned")},
         r"operands\[1\] \(weights\): rows='owned' before any operand with rows 'm'"),
        ({"call": _with_operand(1, rows="pairs")},
         r"operands\[1\] \(weights\): rows='pairs' before any operand with rows 'm'"),
        # The FFI order: every arg, then every ret.
        ({"call": _with_operands(lambda ops: [ops[-1], *ops[:-1]])},
         r"operands\[1\] \(routed\): io='arg' after a 'ret': expected every arg before every ret"),
        ({"call": _with_operands(lambda ops: ops[:3] + ops[4:])},
         r"kernels\[0\] \(publish\): parameter 'shared' is the address of an operand, but the call has no operand"),
        ({"call": _with_operands(lambda ops: ops[:-1])}, "operands lists 4 args and 0 rets: expected at least one"),
        ({"call": _call(epilogue=True, target="jax_moe_publish")},
         "call: operand 'residual' is taken by no kernel of the set"),
        ({"call": {"target": "jax_moe_publish", "tp": 2}}, r"call: missing key 'hidden'"),
        ({"call": _call(operands=[{"name": "routed"}])}, r"call\['operands'\]\[0\]: missing key 'io'"),
        # A kernel's launch plan.
        ({"kernels": [_kernel("publish", rows="all"), _kernel("reduce")]},
         r"rows='all': expected 'm', 'owned' or 'resident'"),
        ({"kernels": [_kernel("publish", rows="resident"), _kernel("reduce")]},
         r"kernels\[0\] \(publish\): rows='resident' for a kernel that is not persistent"),
        ({"kernels": [_kernel("publish", rows="num_rows"), _kernel("reduce")]}, r"rows='num_rows'"),
        ({"kernels": [_kernel("publish", block=0), _kernel("reduce")]}, r"block=0"),
        ({"kernels": [_kernel("publish", block=2048), _kernel("reduce")]}, r"block=2048"),
        ({"kernels": [_kernel("publish", ctas_per_row=0), _kernel("reduce")]}, r"ctas_per_row=0"),
        ({"kernels": [_kernel("publish", smem=-1), _kernel("reduce")]}, r"smem=-1"),
        ({"kernels": [_kernel("publish_reduce", waves=0)]}, r"waves=0: expected >= 1"),
        # Only a persistent grid makes several passes.
        ({"kernels": [_kernel("publish", waves=2), _kernel("reduce")]},
         r"kernels\[0\] \(publish\): waves=2: expected 1 for a kernel that is not persistent"),
        # A cluster: at most Hopper's 16 CTAs, a whole number of them per row.
        ({"kernels": [_kernel("publish_reduce_norm", ctas_per_row=17, cluster=17)], "call": _call(epilogue=True)},
         r"cluster=17: expected 1 to 16 CTAs"),
        ({"kernels": [_kernel("publish_reduce_norm", ctas_per_row=14, cluster=4)], "call": _call(epilogue=True)},
         r"cluster=4 does not divide ctas_per_row=14"),
        ({"kernels": [_kernel("publish", symbol=""), _kernel("reduce")]}, "symbol is empty"),
        ({"kernels": [{"role": "publish"}, _kernel("reduce")]}, r"kernels\[0\]: missing key 'symbol'"),
    ],
)
def test_kernel_set_record_value_errors(check, changes, match):
    with pytest.raises(ValueError, match=match):
        check(changes.get("kernels", DEFAULT_KERNELS), changes.get("call", _call()))


@CHECKS
@pytest.mark.parametrize(
    "kernels, call, match",
    [
        # A kernel of the other op, and a target of the other op.
        ([_kernel("expert_gate_up"), _kernel("reduce")], _call(),
         r"kernels\[0\] \(expert_gate_up\): parameter 'x' is not a value of the op of target 'jax_moe_publish'"),
        (EXPERTS_KERNELS, _experts_call(target="jax_moe_publish"), r"operands\[0\]: name='x': expected one of the op's"),
        # The split layout's operands with the fused layout's kernel, and a call without down.
        (EXPERTS_KERNELS, _experts_call(fused=False),
         r"kernels\[0\] \(expert_gate_up\): parameter 'gate_up' is the address of an operand, but the call has no"),
        (EXPERTS_KERNELS, _experts_call(operands=[o for o in _experts_call()["operands"] if o["name"] != "down"]),
         r"kernels\[1\] \(expert_down\): parameter 'down' is the address of an operand, but the call has no "
         r"operand 'down'"),
        (EXPERTS_KERNELS, _experts_call(tp=2), "tp=2 without a kernel that takes the mailbox"),
        ([_kernel("expert_gate_up", persistent=False), _kernel("expert_down")], _experts_call(),
         r"kernels\[0\] \(expert_gate_up\): rows='resident' for a kernel that is not persistent"),
    ],
)
def test_experts_set_record_value_errors(check, kernels, call, match):
    with pytest.raises(ValueError, match=match):
        check(kernels, call)


@pytest.mark.parametrize(
    "changes, match",
    [
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
    ],
)
def test_load_kernel_set_type_errors(changes, match):
    with pytest.raises(TypeError, match=match):
        _extension.load_kernel_set(**_load_args(**changes))


@CHECKS
@pytest.mark.parametrize(
    "changes, match",
    [
        ({"kernels": _kernel("publish")}, "kernels=.*: expected a sequence of mappings"),
        ({"kernels": ["publish"]}, r"kernels\[0\]='publish': expected a mapping"),
        ({"kernels": [_kernel("publish", block=128.0), _kernel("reduce")]}, r"\['block'\]=128.0"),
        ({"kernels": [_kernel("publish", waves=None), _kernel("reduce")]}, r"\['waves'\]=None: expected an int"),
        ({"kernels": [_kernel("publish", params="u64"), _kernel("reduce")]}, r"\['params'\]"),
        ({"kernels": [_kernel("publish", persistent=1), _kernel("reduce")]}, r"\['persistent'\]=1: expected a bool"),
        ({"call": "oneshot"}, "call='oneshot': expected a mapping"),
        ({"call": _call(pdl=1)}, r"call\['pdl'\]=1: expected a bool"),
        ({"call": _call(tp=True)}, r"call\['tp'\]=True: expected an int"),
        ({"call": _call(target=None)}, r"call\['target'\]=None: expected a str"),
        ({"call": _call(operands={"name": "routed"})}, r"call\['operands'\]=.*: expected a sequence of mappings"),
        ({"call": _call(operands=["routed"])}, r"call\['operands'\]\[0\]='routed': expected a mapping"),
        ({"call": _with_operand(0, rows=7)}, r"call\['operands'\]\[0\]\['rows'\]=7: expected a str or None"),
        ({"call": _with_operand(0, shape=7168)}, r"call\['operands'\]\[0\]\['shape'\]=7168: expected a list of ints"),
        ({"call": _with_operand(0, shape=["7168"])}, r"call\['operands'\]\[0\]\['shape'\]=\['7168'\]"),
    ],
)
def test_kernel_set_record_type_errors(check, changes, match):
    with pytest.raises(TypeError, match=match):
        check(changes.get("kernels", DEFAULT_KERNELS), changes.get("call", _call()))


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


def test_registry_checks_records_behind_the_glue():
    # The C++ layer refuses what the glue would have caught, for direct callers.
    with pytest.raises(TypeError, match=r"call\['operands'\]\[0\]: expected a dict"):
        _extension._ffi.validate_kernel_set(DEFAULT_KERNELS, _call(operands=["routed"]))
    with pytest.raises(TypeError, match=r"call\['operands'\]=.*: expected a list of dicts"):
        _extension._ffi.validate_kernel_set(DEFAULT_KERNELS, _call(operands=("routed",)))
    with pytest.raises(TypeError, match=r"kernels\[1\]: expected a dict"):
        _extension._ffi.validate_kernel_set([_kernel("publish"), "reduce"], _call())


def test_execute_counts_start_at_zero_without_calls():
    captured, direct = _extension.execute_counts()
    assert (captured, direct) == (0, 0)
