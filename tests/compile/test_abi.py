"""The launch contract (`jax_moe_publish._abi`) against the kernels that implement it (no GPU).

The C++ list of values is checked against it in ``test_extension.py``; the compiled PTX
parameter types in ``tests/compile``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from jax_moe_publish import _abi, tuning

pytest.importorskip("cutlass")

from jax_moe_publish.kernels import program  # noqa: E402

DSL_TYPES = {"Int64": "u64", "Int32": "u32", "Float32": "f32"}


def _parameters(function) -> list[tuple[str, str]]:
    """(name, contract type) of a kernel or host function's parameters after ``self``."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, DSL_TYPES.get(p.annotation, p.annotation)) for p in parameters]


def test_every_role_has_a_kernel_and_every_kernel_a_role():
    assert set(program.KERNELS) == set(_abi.ROLES)


@pytest.mark.parametrize("role", _abi.ROLES)
def test_kernel_signature_is_its_role(role):
    kernel = getattr(program.KERNELS[role], role)  # the method named after the role is the kernel
    assert _parameters(kernel) == [(name, _abi.VALUES[name]) for name in _abi.ROLES[role].params]


def test_the_program_takes_every_value_in_order():
    assert _parameters(program.MoePublishProgram.__call__) == [*_abi.VALUES.items(), ("stream", "cuda.CUstream")]


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


def test_the_program_passes_every_value_under_its_own_name():
    """The ``dict(zip(_abi.VALUES, (...)))`` of ``__call__`` lists its parameters in contract order:
    two swapped values of one type would pass every type check and every other test on CPU."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(program.MoePublishProgram.__call__)))
    zipped = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "zip"]
    assert len(zipped) == 1, "expected one zip of the contract's values in MoePublishProgram.__call__"
    names, values = zipped[0].args
    assert ast.unparse(names) == "_abi.VALUES"
    assert [element.id for element in values.elts] == list(_abi.VALUES)
