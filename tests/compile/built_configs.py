"""The configs whose builds the compile tier checks: every preset's, and one for sm_100a; their
pytest ids and the roles each launches. `ALL_CONFIGS` are the publish op's, `EXPERTS_CONFIGS` the
experts op's."""

from __future__ import annotations

from jax_moe_publish import _abi, tuning
from jax_moe_publish.aot.__main__ import PRESETS
from jax_moe_publish.config import KernelConfig

PRESET_CONFIGS = list(dict.fromkeys(c for build in PRESETS.values() for c in build()))
SM100_CONFIG = tuning.kernel_config(tuning.Problem(2048, 8), tp=2, m=None, algorithm="twoshot", arch="sm_100a")
ALL_CONFIGS = [c for c in PRESET_CONFIGS if c.op == "publish"] + [SM100_CONFIG]
EXPERTS_CONFIGS = [c for c in PRESET_CONFIGS if c.op == "experts"]


def expected_roles(config: KernelConfig) -> list[str]:
    return list(_abi.call_roles(config))


def config_ids(configs) -> list[str]:
    return [c.key for c in configs]
