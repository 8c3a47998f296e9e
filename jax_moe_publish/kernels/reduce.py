"""The reduce kernel of the unfused algorithms (role ``reduce``), after a `PublishKernel`.

Each thread owns one 16-byte fragment of one row (`Lamport`):

* ``oneshot``: token ``t < m`` from slots ``[stage][src][t]``;
* the owner algorithms (``twoshot``, ``reduce_scatter``): owned row ``i`` (token
  ``t = i * tp + rank``) from slots ``[stage][src][i]``. Twoshot fans the sum out to every
  peer's gather slot ``[stage][t]`` (a `GatherKernel` ends the call); reduce_scatter writes
  row ``i`` of its output and zeros for rows past ``m``.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx
from jax_moe_publish.kernels.lamport import FRAGMENT_BYTES, WORDS, Lamport


class ReduceKernel:
    """``reduce_ctas_per_row`` CTAs per row of ``reduce_threads`` threads."""

    def __init__(self, config: KernelConfig) -> None:
        self.config = config
        self.lamport = Lamport(config)

    # The method name is the role: CuTe DSL names the entry kernel_cutlass_reduce_..., and
    # the compile step finds the kernel by it. The parameters are `_abi.ROLES["reduce"]`'s.
    @cute.kernel
    def reduce(
        self,
        mailbox: Int64,  # this device's mailbox, bf16
        peer_table: Int64,  # (tp,) u64: every rank's mailbox base, by rank
        stage_state: Int64,  # (STAGE_STATE_WORDS,) int32
        status: Int64,  # (STATUS_WORDS,) int32, host-visible diagnostics
        out: Int64,  # (m, hidden) or, for reduce_scatter, (ceil(m/tp), hidden) bf16
        timeout_ns: Int64,
        m: Int32,
        capacity_m: Int32,
        rank: Int32,
    ) -> None:
        cfg = self.config
        row, fragment = self.lamport.reduce_position()
        stage, halt = self.lamport.start_call(stage_state)
        fragment_offset = Int64(fragment) * FRAGMENT_BYTES
        if fragment < cfg.reduce_fragments:
            if cutlass.const_expr(not cfg.owned_rows):
                token = row
                slot = row
            else:
                token = row * cfg.tp + rank
                slot = row
            if cutlass.const_expr(cfg.out_owned):
                destination = out + Int64(row) * self.lamport.row_bytes + fragment_offset
            else:
                destination = out + Int64(token) * self.lamport.row_bytes + fragment_offset
            if token < m and halt != protocol.HALT_RUNNING:
                self.lamport.halted(destination, halt, stage, token, stage_state, status)
            if token < m and halt == protocol.HALT_RUNNING:
                slots, sources, skipped = self.lamport.wait_contributions(
                    mailbox, stage, slot, fragment_offset, capacity_m, token, stage_state, status, timeout_ns
                )
                total = self.lamport.sum_sources(sources)
                if cutlass.const_expr(cfg.fans_out):
                    # The owner's row and the peers' gathered copies must carry the same bits.
                    total = [ptx.positive_zero_bf16x2(word) for word in total]
                ptx.store_words(destination, total)
                if cutlass.const_expr(cfg.fans_out):
                    gather_slot = self.lamport.gather_offset(stage, token, capacity_m) + fragment_offset
                    for step in cutlass.range_constexpr(cfg.tp - 1):
                        peer = (rank + (step + 1)) % cfg.tp
                        ptx.store_words(
                            ptx.load_u64(peer_table + Int64(peer) * 8) + gather_slot, total
                        )
                self.lamport.rearm(slots, skipped)
            if cutlass.const_expr(cfg.out_owned):
                if token >= m:
                    ptx.store_words(destination, [Uint32(0)] * WORDS)
        # Where the owners fan out, the gather ends the call and advances the stage.
        self.lamport.finish_call(stage, stage_state, advance=not cfg.fans_out, waited=False)
