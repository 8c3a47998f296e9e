"""The kernels of one call, launched in order: the unit that is compiled to one cubin.

`launch_plan` says how each kernel of a call is launched; `MoePublishProgram.__call__` is
the host side that CuTe DSL traces, with every value of the launch contract as a
parameter (`_abi.VALUES`, in that order): each kernel receives the values its role names
(`_abi.ROLES`). The C++ launcher and the test harness replay the same launches from the
plan and the parameter names that the compile step writes into the sidecar.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_moe_publish import _abi
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels.finalize import FinalizeKernel
from jax_moe_publish.kernels.gather import GatherKernel
from jax_moe_publish.kernels.gather_norm import GatherNormKernel
from jax_moe_publish.kernels.own_partials import OwnPartials
from jax_moe_publish.kernels.publish import PublishKernel
from jax_moe_publish.kernels.publish_reduce import PublishReduceKernel
from jax_moe_publish.kernels.publish_reduce_gather import PublishReduceGatherKernel
from jax_moe_publish.kernels.publish_reduce_norm import PublishReduceNormKernel
from jax_moe_publish.kernels.reduce import ReduceKernel
from jax_moe_publish.kernels.reduce_norm import ReduceNormKernel
from jax_moe_publish.kernels.row_norm import RowSums, cluster_ctas

KERNELS = {
    "finalize": FinalizeKernel,
    "publish": PublishKernel,
    "reduce": ReduceKernel,
    "gather": GatherKernel,
    "gather_norm": GatherNormKernel,
    "reduce_norm": ReduceNormKernel,
    "publish_reduce": PublishReduceKernel,
    "publish_reduce_gather": PublishReduceGatherKernel,
    "publish_reduce_norm": PublishReduceNormKernel,
}
KERNELS.update({fp8: KERNELS[base] for fp8, base in _abi.FP8_BASES.items()})
"""The class of each role; its method named after the role is the kernel."""

ROW_IN_REGISTERS = tuple(role for role in KERNELS
                         if _abi.FP8_BASES.get(role, role) in ("reduce_norm", "gather_norm"))
"""Roles whose CTA holds a whole row in registers, one CTA per row. They are compiled for one
resident CTA per SM (``.minnctapersm 1``): without it ptxas kept them under a register budget
for more CTAs than a decode call has rows, and spilled at hidden 5120 to 16384."""
ONE_CTA_BUDGET = (*ROW_IN_REGISTERS, *(roles["publish_reduce_norm"] for roles in _abi.FP8_ROLES.values()))
"""Roles compiled for one resident CTA per SM: `ROW_IN_REGISTERS`, and the fused epilogue with
an FP8 out, which at 64 registers spilled 8 bytes in its wait loop (hidden 2048, tp = 4, 8-byte
fragments); its persistent grid takes the CTAs that fit at the registers it uses."""


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """How to launch one kernel of the call: a 1-D grid of ``rows * ctas_per_row`` CTAs
    (rows: ``m``, or ``owned`` = ceil(m / tp)); a persistent one of
    ``ceil(rows / waves) * ctas_per_row``, capped at the CTAs the GPU holds at once, or with
    rows ``resident`` exactly that many; with ``cluster`` > 1 consecutive CTAs form clusters of
    that many."""

    role: str
    block: int
    smem: int
    ctas_per_row: int
    rows: str
    waves: int = 1
    cluster: int = 1

    @property
    def persistent(self) -> bool:
        return _abi.ALL_ROLES[self.role].persistent


def launch_plan(config: KernelConfig) -> list[KernelLaunch]:
    """The launches of one call of ``config``, in order (`_abi.call_roles`)."""
    cfg = config
    owner_rows = _abi.ALGORITHMS[cfg.algorithm].reduce_rows
    own_bytes = OwnPartials.shared_bytes(cfg)
    plans = {
        "finalize": lambda: KernelLaunch("finalize", cfg.threads, 0, cfg.ctas_per_row, "m"),
        "publish": lambda: KernelLaunch("publish", cfg.threads, 0, cfg.ctas_per_row, "m"),
        "reduce": lambda: KernelLaunch("reduce", cfg.reduce_threads, 0, cfg.reduce_ctas_per_row, owner_rows),
        "reduce_norm": lambda: KernelLaunch("reduce_norm", cfg.reduce_threads, RowSums.shared_bytes(cfg) + own_bytes,
                                            cfg.reduce_ctas_per_row, owner_rows),
        "gather": lambda: KernelLaunch("gather", cfg.reduce_threads, 0, cfg.reduce_ctas_per_row, "m"),
        "gather_norm": lambda: KernelLaunch("gather_norm", cfg.reduce_threads, 0, cfg.reduce_ctas_per_row, "m"),
        "publish_reduce": lambda: KernelLaunch("publish_reduce", cfg.threads, own_bytes, cfg.ctas_per_row, "m",
                                               cfg.waves),
        "publish_reduce_gather": lambda: KernelLaunch("publish_reduce_gather", cfg.threads, 0, cfg.ctas_per_row,
                                                      "m", cfg.waves),
        # A row's CTAs form one thread block cluster.
        "publish_reduce_norm": lambda: KernelLaunch("publish_reduce_norm", cfg.threads,
                                                    RowSums.shared_bytes(cfg) + own_bytes, cfg.ctas_per_row, "m",
                                                    cfg.waves, cluster_ctas(cfg)),
    }
    # An FP8 out's kernel launches as its bf16 role does.
    return [dataclasses.replace(plans[_abi.FP8_BASES.get(role, role)](), role=role) for role in _abi.call_roles(cfg)]


class MoePublishProgram:
    """The kernels of one call of ``config``, as CuTe DSL compiles them into one module."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.plan = launch_plan(config)
        self.kernels = [getattr(KERNELS[launch.role](config), launch.role) for launch in self.plan]

    @cute.jit
    def __call__(
        self,
        routed: Int64,
        weights: Int64,
        indices: Int64,
        shared: Int64,
        mailbox: Int64,
        peer_table: Int64,
        stage_state: Int64,
        status: Int64,
        out: Int64,
        residual: Int64,
        norm_weight: Int64,
        residual_out: Int64,
        timeout_ns: Int64,
        num_rows: Int32,
        m: Int32,
        capacity_m: Int32,
        rank: Int32,
        eps: Float32,
        out_scales: Int64,
        out_scale: Int64,
        stream: cuda.CUstream,
    ) -> None:
        """Launch the call's kernels: the parameters are `_abi.VALUES`, in order, then the stream.
        (``tests/compile/test_abi.py`` checks that the tuple below names them in that order.)"""
        values = dict(zip(_abi.VALUES, (routed, weights, indices, shared, mailbox, peer_table, stage_state, status,
                                        out, residual, norm_weight, residual_out, timeout_ns, num_rows, m,
                                        capacity_m, rank, eps, out_scales, out_scale)))
        for index in cutlass.range_constexpr(len(self.plan)):
            launch = self.plan[index]
            rows = m if cutlass.const_expr(launch.rows == "m") else (m + self.config.tp - 1) // self.config.tp
            self.kernels[index](*[values[name] for name in _abi.ROLES[launch.role].params]).launch(
                grid=(rows * launch.ctas_per_row, 1, 1),
                block=(launch.block, 1, 1),
                cluster=(launch.cluster, 1, 1),
                smem=launch.smem,
                stream=stream,
                use_pdl=self.config.enable_pdl,
                min_blocks_per_mp=1 if launch.role in ONE_CTA_BUDGET else 0,
            )
