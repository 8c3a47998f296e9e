"""The gather kernel of twoshot (role ``gather``): every token not owned here, from its gather slot.

The owner's `ReduceKernel` stored the token's sum into gather slot ``[stage][t]`` of every
peer; this kernel waits for it (`Lamport`), writes the output row, re-arms the slot and
ends the call.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, Int64

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.lamport import EMPTY, FRAGMENT_BYTES, Lamport


class GatherKernel:
    """``reduce_ctas_per_row`` CTAs per token of ``reduce_threads`` threads."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.lamport = Lamport(config)

    # The method name is the role: CuTe DSL names the entry kernel_cutlass_gather_..., and
    # the compile step finds the kernel by it. The parameters are `_abi.ROLES["gather"]`'s.
    @cute.kernel
    def gather(
        self,
        mailbox: Int64,
        peer_table: Int64,
        stage_state: Int64,
        status: Int64,
        out: Int64,  # (m, hidden) bf16
        timeout_ns: Int64,
        m: Int32,
        capacity_m: Int32,
        rank: Int32,
    ) -> None:
        cfg = self.config
        token, fragment = self.lamport.reduce_position()
        stage, halt = self.lamport.start_call(stage_state)
        fragment_offset = Int64(fragment) * FRAGMENT_BYTES
        destination = out + Int64(token) * self.lamport.row_bytes + fragment_offset
        owner = token % cfg.tp
        if fragment < cfg.reduce_fragments and owner != rank and token < m:
            if halt != protocol.HALT_RUNNING:
                self.lamport.halted(destination, halt, stage, token, stage_state, status)
            else:
                slot = mailbox + self.lamport.gather_offset(stage, token, capacity_m) + fragment_offset
                sources = self.lamport.wait(
                    [slot], [owner], stage, token, stage_state, status, timeout_ns
                )
                ptx.store_words(destination, sources[0])
                ptx.store_words(slot, EMPTY)
        self.lamport.finish_call(stage, stage_state, advance=True, waited=False)
