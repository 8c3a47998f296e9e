"""The kernels of one call of the experts op, launched in order: the unit compiled to one cubin.

`launch_plan` says how each kernel is launched; `ExpertsProgram.__call__` is the host side that
CuTe DSL traces, with every value of the experts' launch contract as a parameter
(`_abi.EXPERTS.values`, in that order): each kernel receives the values its role names. Both
grids are persistent at the CTAs the device holds at once (rows ``"resident"``): the work
depends on the routing, which only the device knows.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from jax_moe_publish import _abi
from jax_moe_publish.experts_config import ExpertsConfig
from jax_moe_publish.kernels.expert_down import ExpertDownKernel
from jax_moe_publish.kernels.expert_gate_up import ExpertGateUpKernel
from jax_moe_publish.kernels.program import KernelLaunch

KERNELS = {"expert_gate_up": ExpertGateUpKernel, "expert_gate_up_split": ExpertGateUpKernel,
           "expert_down": ExpertDownKernel, "expert_gate_up_fp8": ExpertGateUpKernel,
           "expert_gate_up_split_fp8": ExpertGateUpKernel, "expert_down_fp8": ExpertDownKernel,
           "expert_gate_up_fp8_tokens": ExpertGateUpKernel, "expert_gate_up_split_fp8_tokens": ExpertGateUpKernel,
           "expert_down_shared": ExpertDownKernel, "expert_down_fp8_shared": ExpertDownKernel}
"""The class of each role; its method named after the role is the kernel."""
TRACED_GRID = 1
"""The grid CuTe DSL's own launch is traced with; the launchers size the real one at load."""


def _gemm(role: str) -> str:
    """The `ExpertsConfig.gemm` of a role."""
    return "down" if role.startswith("expert_down") else "gate_up"


def launch_plan(config: ExpertsConfig) -> list[KernelLaunch]:
    """The launches of one call of ``config``, in order (`_abi.EXPERTS.call_roles`)."""
    def launch(role):
        gemm = _gemm(role)
        shape = config.gemm(gemm)
        # A gate/up item's split_k CTAs form one thread block cluster.
        return KernelLaunch(role, shape.threads, config.shared_bytes(gemm), shape.split_k, "resident",
                            cluster=shape.split_k)

    return [launch(role) for role in _abi.EXPERTS.call_roles(config)]


class ExpertsProgram:
    """The kernels of one call of ``config``, as CuTe DSL compiles them into one module."""

    def __init__(self, config: ExpertsConfig) -> None:
        self.config = config
        self.plan = launch_plan(config)
        self.kernels = [getattr(KERNELS[launch.role](config), launch.role) for launch in self.plan]
        self.gemms = [_gemm(launch.role) for launch in self.plan]

    @cute.jit
    def __call__(
        self,
        x: Int64,
        expert_ids: Int64,
        gate_up: Int64,
        gate: Int64,
        up: Int64,
        down: Int64,
        gate_up_scales: Int64,
        gate_scales: Int64,
        up_scales: Int64,
        down_scales: Int64,
        x_scales: Int64,
        activations: Int64,
        out: Int64,
        shared: Int64,
        m: Int32,
        stream: cuda.CUstream,
    ) -> None:
        """Launch the call's kernels: the parameters are `_abi.EXPERTS.values`, in order, then the
        stream (``tests/compile/test_abi.py`` checks that the tuple below names them in that order)."""
        values = dict(zip(_abi.EXPERTS.values, (x, expert_ids, gate_up, gate, up, down, gate_up_scales, gate_scales,
                                                up_scales, down_scales, x_scales, activations, out, shared, m)))
        for index in cutlass.range_constexpr(len(self.plan)):
            launch = self.plan[index]
            self.kernels[index](*[values[name] for name in _abi.EXPERTS.roles[launch.role].params]).launch(
                grid=(TRACED_GRID * launch.cluster, 1, 1),
                block=(launch.block, 1, 1),
                cluster=(launch.cluster, 1, 1),
                smem=launch.smem,
                stream=stream,
                use_pdl=self.config.enable_pdl,
                # A bulk ring's CTA takes most of an SM's shared memory: ptxas's register budget
                # for more CTAs per SM only spilled.
                min_blocks_per_mp=1 if self.config.gemm(self.gemms[index]).bulk_loads else 0,
            )
