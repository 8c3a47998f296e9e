"""Compile tier (CPU, CI): the sidecar of every preset's kernel set passes the C++ extension's
load-time validation (`_extension.validate_kernel_set`, the code that `load_kernel_set` runs
before any CUDA call), and a tampered copy is refused with a message that names the change.

``tests/cpu/test_extension.py`` feeds the validation hand-written records; here it reads the
records that the compile step writes (the session's builds, `builds`).
"""

from __future__ import annotations

import copy
import re

import pytest

pytest.importorskip("cutlass")

from built_configs import PRESET_CONFIGS, config_ids  # noqa: E402
from jax_moe_publish import _abi, _extension  # noqa: E402

if not _extension.is_available():
    pytest.skip(f"the C++ extension is not built ({_extension._IMPORT_ERROR})", allow_module_level=True)


@pytest.mark.parametrize("config", PRESET_CONFIGS, ids=config_ids(PRESET_CONFIGS))
def test_the_sidecar_passes_the_cpp_validation(builds, config):
    metadata = builds(config).metadata
    _extension.validate_kernel_set(metadata["kernels"], metadata["call"])


def _operand_dtype(metadata):
    operand = metadata["call"]["operands"][0]
    operand["dtype"] = "f16"
    return re.escape(f"call: operands[0] ({operand['name']}): dtype='f16': expected one of {list(_abi.DTYPES)}")


def _operand_rows(metadata):
    operand = metadata["call"]["operands"][0]
    operand["rows"] = "owned"
    return rf"operands\[0\] \({operand['name']}\): rows='owned' before any operand with rows 'm'"


def _operand_dropped(metadata):
    operands = metadata["call"]["operands"]
    last_arg = max(i for i, operand in enumerate(operands) if operand["io"] == "arg")
    dropped = operands.pop(last_arg)
    return rf"parameter '{dropped['name']}' is the address of an operand, but the call has no operand"


def _param_renamed(metadata):
    kernel = metadata["kernels"][-1]
    kernel["params"][0] = "routed_rows"
    return (rf"kernels\[{len(metadata['kernels']) - 1}\] \({re.escape(kernel['role'])}\): parameter 'routed_rows' "
            "is not a value of the launch contract")


def _param_type(metadata):
    kernel = metadata["kernels"][0]
    name = kernel["params"][0]
    kernel["param_types"][0] = "u32"
    return rf"parameter 0 \({name}\) of '{re.escape(kernel['symbol'])}' has type 'u32'"


TAMPERS = [_operand_dtype, _operand_rows, _operand_dropped, _param_renamed, _param_type]


@pytest.mark.parametrize("tamper", TAMPERS, ids=[tamper.__name__.lstrip("_") for tamper in TAMPERS])
@pytest.mark.parametrize("config", PRESET_CONFIGS, ids=config_ids(PRESET_CONFIGS))
def test_a_tampered_sidecar_is_refused(builds, config, tamper):
    metadata = copy.deepcopy(builds(config).metadata)
    match = tamper(metadata)
    with pytest.raises(ValueError, match=match):
        _extension.validate_kernel_set(metadata["kernels"], metadata["call"])
