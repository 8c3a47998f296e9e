"""The launch contracts (`jax_moe_publish._abi`) against the kernels that implement them (no GPU):
each op's roles against its kernel classes, and its values against its program's parameters.

The C++ list of values is checked against them in ``test_extension.py``; the compiled PTX
parameter types in ``tests/compile``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from jax_moe_publish import _abi, tuning
from jax_moe_publish.experts_config import ExpertsConfig

pytest.importorskip("cutlass")

from jax_moe_publish.kernels import experts_program, program  # noqa: E402

PROGRAMS = {"publish": (program.MoePublishProgram, program.KERNELS, "_abi.VALUES"),
            "experts": (experts_program.ExpertsProgram, experts_program.KERNELS, "_abi.EXPERTS.values")}
"""Each op's program class, its kernel class by role, and how its ``__call__`` names its values."""
KERNELS = {role: cls for _, kernels, _ in PROGRAMS.values() for role, cls in kernels.items()}

DSL_TYPES = {"Int64": "u64", "Int32": "u32", "Float32": "f32"}


def _parameters(function) -> list[tuple[str, str]]:
    """(name, contract type) of a kernel or host function's parameters after ``self``."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, DSL_TYPES.get(p.annotation, p.annotation)) for p in parameters]


@pytest.mark.parametrize("op", PROGRAMS)
def test_every_role_has_a_kernel_and_every_kernel_a_role(op):
    assert set(PROGRAMS[op][1]) == set(_abi.CONTRACTS[op].roles)


@pytest.mark.parametrize("role", _abi.ALL_ROLES)
def test_kernel_signature_is_its_role(role):
    kernel = getattr(KERNELS[role], role)  # the method named after the role is the kernel
    assert _parameters(kernel) == [(name, _abi.ALL_VALUES[name]) for name in _abi.ALL_ROLES[role].params]


@pytest.mark.parametrize("op", PROGRAMS)
def test_the_program_takes_every_value_in_order(op):
    values = _abi.CONTRACTS[op].values
    assert _parameters(PROGRAMS[op][0].__call__) == [*values.items(), ("stream", "cuda.CUstream")]


@pytest.mark.parametrize("result", tuning.RESULTS)
@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("epilogue", ["none", "rmsnorm"])
@pytest.mark.parametrize("fuse_reduce", [None, False])
def test_every_call_launches_roles_of_the_contract(result, tp, epilogue, fuse_reduce):
    if tp == 1 and epilogue != "none":
        pytest.skip("tp = 1 runs the epilogue in jnp")
    config = tuning.kernel_config(tuning.Problem(7168, 8), tp=tp, m=16, result=result, epilogue=epilogue,
                                  fuse_reduce=fuse_reduce)
    plan = program.launch_plan(config)
    assert [launch.role for launch in plan] == list(_abi.call_roles(config))
    for launch in plan:
        role = _abi.ROLES[launch.role]
        assert launch.persistent == role.persistent
        assert (launch.cluster > 1) == (role.clustered and config.ctas_per_row > 1)
        assert launch.cluster <= _abi.MAX_CLUSTER_CTAS and launch.block <= _abi.MAX_THREADS
        assert launch.waves == 1 or role.persistent


@pytest.mark.parametrize("op", PROGRAMS)
def test_the_program_passes_every_value_under_its_own_name(op):
    """The ``dict(zip(<the op's values>, (...)))`` of ``__call__`` lists its parameters in
    contract order: two swapped values of one type would pass every type check and every other
    test on CPU."""
    cls, _, named = PROGRAMS[op]
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__call__)))
    zipped = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "zip"]
    assert len(zipped) == 1, f"expected one zip of the contract's values in {cls.__name__}.__call__"
    names, values = zipped[0].args
    assert ast.unparse(names) == named
    assert [element.id for element in values.elts] == list(_abi.CONTRACTS[op].values)


@pytest.mark.parametrize("fused", [True, False])
def test_an_experts_call_launches_its_roles_on_resident_grids(fused):
    config = ExpertsConfig.for_shape(hidden=7168, intermediate=256, experts=256, top_k=8, fused_gate_up=fused)
    plan = experts_program.launch_plan(config)
    assert [launch.role for launch in plan] == list(_abi.call_roles(config))
    for launch, shape in zip(plan, ("gate_up", "down")):
        assert launch.persistent and launch.rows == "resident" and launch.cluster == 1
        assert launch.block == config.gemm(shape).threads and launch.smem == config.shared_bytes(shape)
