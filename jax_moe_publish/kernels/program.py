"""The kernels of one call, launched in order: the unit that is compiled to one cubin.

``MoePublishProgram.__call__`` is the host side that CuTe DSL traces: it fixes
each kernel's parameter list (compile with fake scalars of these types) and its
launch shape. The C++ launcher replays the same launches from the metadata
that ``launches()`` describes.
"""

from __future__ import annotations

import dataclasses

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels.fused import FusedPublishReduceKernel, OwnPartials
from jax_moe_publish.kernels.publish import FinalizePublishKernel
from jax_moe_publish.kernels.reduce import LamportReduceKernel
from jax_moe_publish.kernels.reduce_norm import LamportReduceNormKernel, shared_bytes


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """How to launch one kernel of the call: grid = rows(m) * ctas_per_row; for
    `artifact.PERSISTENT_ROLES`, ceil(rows(m) / waves) * ctas_per_row, capped at the CTAs
    the GPU holds at once."""

    role: str  # "publish", "reduce", "reduce_norm", "gather", "publish_reduce", "publish_reduce_norm"
    block: int
    smem: int
    ctas_per_row: int
    rows: str  # "m" or "owned" (ceil(m / tp))
    waves: int = 1  # `KernelConfig.waves`: persistent roles only


class MoePublishProgram:
    """Publish, then (for tp > 1) reduce, or reduce_norm with the epilogue, then (twoshot) gather;
    with ``fuse_reduce``, the one publish_reduce (or publish_reduce_norm) kernel."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.fused = FusedPublishReduceKernel(config)
        self.publisher = FinalizePublishKernel(config)
        if config.epilogue == "none":
            self.reducer = LamportReduceKernel(config)
        else:
            self.reducer = LamportReduceNormKernel(config)

    def launches(self) -> list[KernelLaunch]:
        cfg = self.config
        if cfg.fuse_reduce and cfg.epilogue == "none":
            return [KernelLaunch("publish_reduce", cfg.threads, OwnPartials.shared_bytes(cfg), cfg.ctas_per_token,
                                 "m", cfg.waves)]
        if cfg.fuse_reduce:
            # A row's CTAs form one thread block cluster (`artifact.CLUSTER_ROLES`).
            return [KernelLaunch("publish_reduce_norm", cfg.threads, shared_bytes(cfg), cfg.ctas_per_token, "m",
                                 cfg.waves)]
        result = [KernelLaunch("publish", cfg.threads, 0, cfg.ctas_per_token, "m")]
        if cfg.algorithm != "direct":
            rows = "m" if cfg.algorithm == "oneshot" else "owned"
            if cfg.epilogue == "none":
                launch = KernelLaunch("reduce", cfg.reduce_threads, 0, cfg.reduce_ctas_per_token, rows)
            else:
                launch = KernelLaunch(
                    "reduce_norm", cfg.reduce_threads, shared_bytes(cfg), cfg.reduce_ctas_per_token, rows
                )
            result.append(launch)
        if cfg.algorithm == "twoshot":
            result.append(KernelLaunch("gather", cfg.reduce_threads, 0, cfg.reduce_ctas_per_token, "m"))
        return result

    @cute.jit
    def __call__(
        self,
        routed: Int64,
        weights: Int64,
        indices: Int64,
        shared: Int64,
        stage_state: Int64,
        destination: Int64,
        mailbox: Int64,
        peer_table: Int64,
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
        stream: cuda.CUstream,
    ) -> None:
        """Launch the call's kernels; ``residual``, ``norm_weight``, ``residual_out`` and
        ``eps`` are parameters of reduce_norm alone (``KernelConfig.epilogue``)."""
        cfg = self.config
        launches = self.launches()
        if cutlass.const_expr(cfg.fuse_reduce):
            call = (routed, weights, indices, shared, mailbox, peer_table, stage_state, status, out, timeout_ns,
                    num_rows, m, capacity_m, rank)
            cluster = (1, 1, 1)
            if cutlass.const_expr(cfg.epilogue == "none"):
                kernel = self.fused.publish_reduce(*call)
            else:
                kernel = self.reducer.publish_reduce_norm(*call, residual, norm_weight, residual_out, eps)
                cluster = (launches[0].ctas_per_row, 1, 1)
            kernel.launch(
                grid=(m * launches[0].ctas_per_row, 1, 1),
                block=(launches[0].block, 1, 1),
                cluster=cluster,
                smem=launches[0].smem,
                stream=stream,
                use_pdl=cfg.enable_pdl,
            )
        else:
            publish = launches[0]
            self.publisher.publish(
                routed, weights, indices, shared, stage_state, destination, num_rows, m, capacity_m, rank
            ).launch(
                grid=(m * publish.ctas_per_row, 1, 1),
                block=(publish.block, 1, 1),
                smem=publish.smem,
                stream=stream,
                use_pdl=cfg.enable_pdl,
            )
            reduce_args = (mailbox, peer_table, stage_state, status, out, timeout_ns, m, capacity_m, rank)
            if cutlass.const_expr(cfg.algorithm != "direct"):
                reduce = launches[1]
                rows = m if cutlass.const_expr(reduce.rows == "m") else (m + cfg.tp - 1) // cfg.tp
                if cutlass.const_expr(cfg.epilogue == "none"):
                    kernel = self.reducer.reduce(*reduce_args)
                else:
                    kernel = self.reducer.reduce_norm(*reduce_args, residual, norm_weight, residual_out, eps)
                kernel.launch(
                    grid=(rows * reduce.ctas_per_row, 1, 1),
                    block=(reduce.block, 1, 1),
                    smem=reduce.smem,
                    stream=stream,
                    use_pdl=cfg.enable_pdl,
                )
            if cutlass.const_expr(cfg.algorithm == "twoshot"):
                gather = launches[2]
                self.reducer.gather(*reduce_args).launch(
                    grid=(m * gather.ctas_per_row, 1, 1),
                    block=(gather.block, 1, 1),
                    stream=stream,
                    use_pdl=cfg.enable_pdl,
                )
