"""The Lamport side of the mailbox: a device piece of every kernel that waits for the peers.

A thread polls the mailbox slots of its fragment with volatile loads until no bf16
lane holds the empty sentinel, sums the sources in float32 in rank order 0..tp-1 (so
every rank computes the same bits), rounds once to bf16, and stores the sentinel back
into exactly the slots it consumed. Every kernel reads the call's stage from
``NEXT_STAGE``; the last CTA to arrive of the kernel that ends the call advances it and
``CALL_COUNT``.

A wait that outlasts ``timeout_ns`` (0 waits forever) records the stage, token, missing
ranks and call number in the status block; then, by the mailbox's ``ON_TIMEOUT`` word,
it traps or halts the mailbox and returns NaN. A kernel that finds the mailbox halted
never touches the mailbox (``docs/design.md``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_moe_publish import protocol
from jax_moe_publish.config import KernelConfig
from jax_moe_publish.kernels import ptx

BF16_BYTES = 2
FRAGMENT_BYTES = protocol.REDUCE_ELEMENTS * BF16_BYTES
WORDS = protocol.REDUCE_ELEMENTS // 2
EMPTY = [Uint32(protocol.EMPTY_U32)] * WORDS
NAN_BF16X2 = 0x7FC07FC0
DIAGNOSTIC_WAIT_NS = 100 * 10**6


class Lamport:
    """Waits, sums, re-arms and the stage protocol; every compile-time choice comes from
    ``config``. ``fragment_words`` is the u32 words per mailbox poll: 4, or 2 where a fused
    kernel publishes 4 elements per thread."""

    def __init__(self, config: KernelConfig, fragment_words: int = WORDS) -> None:
        self.config = config
        self.row_bytes = config.hidden * BF16_BYTES
        self.fragment_words = fragment_words

    def reduce_position(self):
        """(row, 16-byte fragment) of this thread in an unfused reduce or gather kernel."""
        cfg = self.config
        block, _, _ = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        row = block // cfg.reduce_ctas_per_row
        fragment = (block % cfg.reduce_ctas_per_row) * cfg.reduce_threads + tidx
        return row, fragment

    def contribution_offset(self, stage, src, slot, capacity_m) -> Int64:
        """Byte offset of contribution slot ``[stage][src][slot]``."""
        return (
            (Int64(stage) * self.config.tp + src) * Int64(capacity_m) + Int64(slot)
        ) * self.row_bytes

    def gather_offset(self, stage, token, capacity_m, area: int = 0) -> Int64:
        """Byte offset of slot ``[stage][token]`` of gather area ``area`` (`protocol.GATHER_AREAS`),
        after all contribution stages."""
        first = protocol.STAGES * self.config.tp
        if area:
            first += area * protocol.STAGES
        return (Int64(first) * Int64(capacity_m) + Int64(stage) * Int64(capacity_m) + Int64(token)) * self.row_bytes

    def wait_contributions(self, mailbox, stage, slot, fragment_offset, capacity_m, token, stage_state,
                            status, timeout_ns, own=None) -> tuple[list, list, Int32 | None]:
        """(addresses, words, skipped) of every rank's contribution to one fragment of slot
        ``[stage][*][slot]``, once all of them have arrived.

        ``own`` is None, or (rank, kept, read) from a fused kernel: where ``kept``
        (an Int32) is nonzero, this rank's contribution is ``read()`` (called once
        the others have arrived, so that its words are not live while polling) and
        its own slot, never written, is neither polled nor (`rearm`) re-armed.
        ``skipped`` is then the Int32 bit mask of the slots not polled (one
        register, not one per rank), else None.
        """
        slots = [
            mailbox + self.contribution_offset(stage, src, slot, capacity_m) + fragment_offset
            for src in range(self.config.tp)
        ]
        if own is None:
            sources = self.wait(slots, list(range(self.config.tp)), stage, token, stage_state, status, timeout_ns)
            return slots, sources, None
        rank, kept, read = own
        skipped = kept << rank  # kept is 0 or 1
        sources = self.wait(slots, list(range(self.config.tp)), stage, token, stage_state, status, timeout_ns,
                             skipped)
        held = read()
        sources = [[cutlass.select_(_polled(skipped, src) != 0, word, held[w]) for w, word in enumerate(words)]
                   for src, words in enumerate(sources)]
        return slots, sources, skipped

    def rearm(self, slots: list, skipped) -> None:
        """Store the empty sentinel back into the slots that `wait_contributions` polled."""
        for i, address in enumerate(slots):
            ptx.store_words(address, [Uint32(protocol.EMPTY_U32)] * self.fragment_words,
                            predicate=None if skipped is None else _polled(skipped, i))

    @cute.jit
    def wait(self, slots, ranks, stage, token, stage_state, status, timeout_ns, skipped=None) -> list:
        """Poll ``slots`` until every bf16 lane is filled; return their words.

        ``ranks[i]`` is the rank that fills ``slots[i]`` (for diagnostics). Slot
        ``i`` with bit ``i`` of ``skipped`` (an Int32) set is not read: its words
        are zeros, which count as filled.
        """
        words_per_slot = self.fragment_words
        rValues = cute.make_rmem_tensor(cute.make_layout((len(slots), words_per_slot)), Uint32)
        missing = Int32(0)
        for i in cutlass.range_constexpr(len(slots)):
            words = self._poll(slots, i, skipped)
            for w in cutlass.range_constexpr(words_per_slot):
                rValues[i, w] = words[w]
            if ptx.has_empty_lane(words) != Uint32(0):
                missing = missing | (Int32(1) << ranks[i])
        if missing != 0:
            start = ptx.global_timer_ns()
            timed_out = Int32(0)
            while missing != 0:
                missing = Int32(0)
                for i in cutlass.range_constexpr(len(slots)):
                    words = self._poll(slots, i, skipped)
                    for w in cutlass.range_constexpr(words_per_slot):
                        rValues[i, w] = words[w]
                    if ptx.has_empty_lane(words) != Uint32(0):
                        missing = missing | (Int32(1) << ranks[i])
                if missing != 0 and timeout_ns > 0:
                    if ptx.global_timer_ns() - start > timeout_ns:
                        # Returns only under ON_TIMEOUT_FLAG, with the mailbox halted.
                        self._record(protocol.STATUS_TIMEOUT, stage, token, missing, stage_state, status)
                        ptx.store_volatile_s32(stage_state + protocol.HALT * 4, protocol.HALT_FAILED)
                        timed_out = Int32(1)
                        missing = Int32(0)
            if timed_out != 0:
                for i in cutlass.range_constexpr(len(slots)):
                    for w in cutlass.range_constexpr(words_per_slot):
                        rValues[i, w] = Uint32(NAN_BF16X2)
        return [[rValues[i, w] for w in range(words_per_slot)] for i in range(len(slots))]

    def _poll(self, slots, i, skipped) -> list:
        return ptx.load_volatile_words(slots[i], self.fragment_words,
                                       predicate=None if skipped is None else _polled(skipped, i))

    @cute.jit
    def halted(self, destination, halt, stage, token, stage_state, status) -> None:
        """A call on a halted mailbox: never touch the mailbox (a closed one is freed).
        On a closed one record that and trap (unless flagged); otherwise return NaN."""
        if halt == protocol.HALT_CLOSED:
            self._record(protocol.STATUS_CLOSED, stage, token, 0, stage_state, status)
        ptx.store_words(destination, [Uint32(NAN_BF16X2)] * self.fragment_words)

    @cute.jit
    def _record(self, code, stage, token, missing, stage_state, status) -> None:
        """The first thread to fail writes the diagnostic (code last, after a fence).
        Then every failing thread traps, unless the mailbox asks for a flag instead."""
        if ptx.claim_s32(stage_state + protocol.DIAGNOSTIC_CLAIM * 4) == 0:
            count = ptx.load_volatile_s32(stage_state + protocol.CALL_COUNT * 4)
            # The calls before this one, unless this call's last CTA to arrive has counted it
            # already (a fused CTA arrives before its waits): call c has stage c % STAGES,
            # also across the count's wrap.
            call = count - Int32(count % protocol.STAGES != stage)
            call = cutlass.select_(call < 0, call + protocol.CALL_COUNT_PERIOD, call)
            ptx.store_volatile_s32(status + protocol.STATUS_STAGE * 4, stage)
            ptx.store_volatile_s32(status + protocol.STATUS_TOKEN * 4, token)
            ptx.store_volatile_s32(status + protocol.STATUS_MISSING_RANKS * 4, missing)
            ptx.store_volatile_s32(status + protocol.STATUS_CALL * 4, call)
            ptx.fence_system()
            ptx.store_volatile_s32(status + protocol.STATUS_CODE * 4, code)
            ptx.fence_system()
        if ptx.load_volatile_s32(stage_state + protocol.ON_TIMEOUT * 4) == protocol.ON_TIMEOUT_ABORT:
            # A trap aborts the whole grid, the claimer's stores in flight included: trap
            # only once the code is visible in host memory (bounded, should the claimer
            # itself have been stopped).
            start = ptx.global_timer_ns()
            waiting = Int32(1)
            while waiting != 0:
                if ptx.load_volatile_s32(status + protocol.STATUS_CODE * 4) != protocol.STATUS_OK:
                    waiting = Int32(0)
                if ptx.global_timer_ns() - start > DIAGNOSTIC_WAIT_NS:
                    waiting = Int32(0)
            ptx.trap()

    def sum_sources(self, sources: list) -> list:
        """bf16 words of the float32 sum of ``sources``, in source order."""
        count = len(sources[0])
        low = [Float32(0.0)] * count
        high = [Float32(0.0)] * count
        for words in sources:
            for w in range(count):
                a, b = ptx.bf16x2_to_f32(words[w])
                low[w] = low[w] + a
                high[w] = high[w] + b
        return [ptx.f32x2_to_bf16x2(low[w], high[w]) for w in range(count)]

    def start_call(self, stage_state) -> tuple:
        """Read the call's stage and the mailbox's HALT word, then let the next kernel launch.

        No ``griddepcontrol.wait`` first: this kernel reads only the mailbox
        (guarded by the sentinel) and the stage word, which only the last kernel
        of the previous call wrote, and that call finished before the publish of
        this one passed its own wait. So the wait loops start while the publish
        is still running.
        """
        stage = ptx.load_volatile_s32(stage_state + protocol.NEXT_STAGE * 4)
        halt = ptx.load_volatile_s32(stage_state + protocol.HALT * 4)
        if cutlass.const_expr(self.config.enable_pdl):
            cute.arch.griddepcontrol_launch_dependents()
        return stage, halt

    @cute.jit
    def arrive(self, stage_state, tidx) -> Int32:
        """Count this CTA in ``ARRIVALS`` once all of its threads have read the stage; returns,
        in thread 0, how many CTAs arrived before it (0 elsewhere), for `finish_call`. A fused
        kernel arrives once it has published, so that the atomic's round trip overlaps its
        waits instead of ending the CTA."""
        cute.arch.barrier()
        arrived = Int32(0)
        if tidx == 0:
            arrived = ptx.fetch_add_s32(stage_state + protocol.ARRIVALS * 4, 1)
        return arrived

    @cute.jit
    def finish_call(self, stage, stage_state, advance: cutlass.Constexpr[bool],
                    waited: cutlass.Constexpr[bool], arrived=None) -> None:
        """Wait for the predecessor grid (so that the call ends after its publish) unless this
        kernel ``waited`` already, and with ``advance`` let the last CTA to arrive move the
        stage and count the call. ``arrived`` is `arrive`'s count where the CTA has arrived
        already, else None: it arrives now."""
        if cutlass.const_expr(self.config.enable_pdl and not waited):
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(advance):
            tidx, _, _ = cute.arch.thread_idx()
            grid, _, _ = cute.arch.grid_dim()
            if cutlass.const_expr(arrived is None):
                arrived = self.arrive(stage_state, tidx)
            if tidx == 0:
                if arrived == grid - 1:
                    self._advance_stage(stage, stage_state)

    def _advance_stage(self, stage, stage_state) -> None:
        """The last CTA to arrive: reset the arrivals, move the stage and count the call."""
        ptx.store_volatile_s32(stage_state + protocol.ARRIVALS * 4, 0)
        ptx.store_volatile_s32(stage_state + protocol.NEXT_STAGE * 4, (stage + 1) % protocol.STAGES)
        # No round trip: this may be the call's last CTA to finish.
        ptx.increment_wrapping_u32(stage_state + protocol.CALL_COUNT * 4, protocol.CALL_COUNT_PERIOD - 1)


def _polled(skipped, i: int) -> Int32:
    """Int32 1 if slot ``i`` is polled: bit ``i`` of ``skipped`` is clear."""
    return Int32(((skipped >> i) & 1) == 0)
