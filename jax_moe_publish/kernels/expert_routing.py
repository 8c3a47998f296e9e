"""Which token-expert pairs each expert serves, found by every CTA in its own shared memory: a
device piece of the experts' kernels (`ExpertGateUpKernel`, `ExpertDownKernel`).

From ``expert_ids`` (int32 ``[m, top_k]``, pair ``p = t * top_k + k``), a CTA places every pair in
its expert's segment of ``pairs``, in pair order; the pairs whose id lies outside ``[0,
experts)`` have no place. Warp ``w`` reads the ``w``-th run of consecutive ids. It counts each
expert's ids of its run (`_count`); then each expert's total and its offset of each warp follow
from those counts (`_offsets`), one warp scans the totals into segment starts (`_scan`), and
each warp places its run's pairs row by row, ranking equal ids within a row by lane
(`_place`). No CTA waits for another and nothing goes through global memory: the tables cost
two reads of the ids (8 KiB at m = 256, top-8; the second an L1 hit) and an atomic per pair.

With the shared expert (`ExpertsConfig.shared_expert`) a token has ``top_k + 1`` pairs, ``p = t *
(top_k + 1) + k``, its last one the shared expert's: group ``experts``, every token's. Its group
comes first among the active ones, so that its items (the most pairs) start first. Its count is
``m`` and its segment token order, known without reading an id: only the routed ids go through
the counts (`ROUTING_PAIRS_PER_THREAD`; at m = 256, top-8 and 1024 ids per span, ``m * (top_k +
1)`` pairs would take 3 spans where the routed ids take 2).

So every CTA of a call holds the same tables, and a slot of a segment names the same pair in
all of them. A group's work is one item per column block and pass of its pairs (`work_item`,
with ``pass_items``): the passes of one block run side by side on as many CTAs, at about the
same time, rather than one after the other on one CTA, and the grid's CTAs get even shares.
The order never reaches a result, since each pair's sums are computed apart from every other
pair's (a pair is one column of an mma's B, whatever column that is).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from jax_moe_publish.experts_config import (MAX_PAIRS, ROUTING_PAIRS_PER_THREAD, SMEM_ALIGNMENT, WARP_ROUTING_IDS,
                                            ExpertsConfig, GemmShape)
from jax_moe_publish.kernels import ptx

WARP = 32

ACTIVE = 0
"""Totals: groups with at least one pair."""
VALID = 1
"""Totals: pairs with a valid expert id (the segments' total)."""
PASSES = 2
"""Totals: the groups' passes (`work_item`)."""


class ExpertRouting:
    """The routing tables of one call, in shared memory: per group (expert, then the shared
    expert) its pair count (``count``) and its segment's first slot (``start``); per warp and
    expert, the warp's offset within the segment (``offsets``); the active groups (the shared
    expert, then the experts in increasing order) and the passes before each (``pass_starts``,
    by active index); the totals; and the pairs in group order (``pairs``). ``shape`` is the
    kernel's work item: its threads, items per group and pass, and tokens per pass."""

    def __init__(self, config: ExpertsConfig, shape: GemmShape) -> None:
        self.experts = config.experts
        self.top_k = config.top_k
        self.shared = config.shared_expert
        self.groups = config.groups
        self.pairs_per_token = config.pairs_per_token
        self.threads = shape.threads
        self.warps = shape.threads // WARP
        self.items_per_pass = shape.items_per_expert
        self.tokens_per_pass = shape.tokens_per_pass
        self.pass_items = config.pass_items
        self.experts_per_lane = -(-config.experts // WARP)
        # Steps of the search for an item's group over the active ones (`work_item`).
        self.search_steps = max(self.groups - 1, 1).bit_length()
        # Bits of a valid routed id (`_equal_and_lower`).
        self.id_bits = max(self.experts - 1, 1).bit_length()
        self.warp_routing = config.warp_routing

    def allocate(self):
        """(count, start, pass_starts, active, totals, offsets, pairs), int32 tensors in shared memory."""
        smem = cutlass.memory.SmemAllocator()
        per_group = [smem.allocate_tensor(Int32, cute.make_layout(self.groups), byte_alignment=SMEM_ALIGNMENT)
                     for _ in range(4)]
        totals = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=SMEM_ALIGNMENT)
        offsets = smem.allocate_tensor(Int32, cute.make_layout((self.experts, self.warps)),
                                       byte_alignment=SMEM_ALIGNMENT)
        pairs = smem.allocate_tensor(Int32, cute.make_layout(MAX_PAIRS), byte_alignment=SMEM_ALIGNMENT)
        return (*per_group, totals, offsets, pairs)

    @cute.jit
    def build(self, tables, expert_ids: Int64, m: Int32, tidx) -> None:
        """Fill ``tables`` for the call's ``m`` tokens; every thread of the CTA takes part, and
        the tables are complete for all of them on return."""
        if cutlass.const_expr(self.warp_routing):
            if m * self.top_k <= WARP_ROUTING_IDS:
                if tidx < WARP:
                    self._build_in_warp(tables, expert_ids, m, tidx)
                cute.arch.barrier()
            else:
                self._build_in_cta(tables, expert_ids, m, tidx)
        else:
            self._build_in_cta(tables, expert_ids, m, tidx)

    @cute.jit
    def _build_in_warp(self, tables, expert_ids: Int64, m: Int32, lane) -> None:
        """The tables of a call of at most `WARP_ROUTING_IDS` routed ids, by one warp, lane ``l``
        holding id ``l`` (`ExpertsConfig.warp_routing`). A pair's slot is the number of valid
        ids below its own plus that of its equals in lower lanes (`_equal_and_lower`); its
        group's lowest lane writes the group's count, start and active entry, and the passes
        before each active group are a scan in group order."""
        sCount, sStart, sPassStart, sActive, sTotals, _, sPairs = tables
        shared = 1 if self.shared else 0
        pair, group, valid = self._span(expert_ids, Int32(0), Int32(1), m * self.top_k, lane, 1)[0]
        lanes_below = Int32(cute.arch.lanemask_lt())
        equal, lower = self._equal_and_lower(group, valid)
        start = cute.arch.popc(lower)
        ptx.store_shared_s32((sPairs.iterator + start + cute.arch.popc(equal & lanes_below)).toint(), pair,
                             predicate=Int32(valid))
        first = valid & ((equal & lanes_below) == 0)
        firsts = cute.arch.vote_ballot_sync(first)
        routed_active = cute.arch.popc(firsts)
        valid_total = cute.arch.popc(cute.arch.vote_ballot_sync(valid))
        # The shared group, if held, is active entry 0; the routed groups follow in id order.
        active = cute.arch.popc(firsts & lower) + shared
        written = cutlass.select_(first, group, Int32(0))
        count = cute.arch.popc(equal)
        ptx.store_shared_s32((sCount.iterator + written).toint(), count, predicate=Int32(first))
        ptx.store_shared_s32((sStart.iterator + written).toint(), start, predicate=Int32(first))
        ptx.store_shared_s32((sActive.iterator + active).toint(), group, predicate=Int32(first))
        ptx.store_shared_s32((sPassStart.iterator + active).toint(), self._passes(count), predicate=Int32(first))
        shared_passes = Int32(0)
        if cutlass.const_expr(self.shared):
            shared_passes = self._passes(m)
            if lane == 0:
                sActive[0] = Int32(self.experts)
                sCount[self.experts] = m
                sStart[self.experts] = valid_total
                sPassStart[0] = Int32(0)
            if lane < m:
                sPairs[valid_total + lane] = lane * self.pairs_per_token + self.top_k
        cute.arch.sync_warp()
        inside = lane < routed_active
        passes = sPassStart[cutlass.select_(inside, lane + shared, Int32(0))]
        passes_before, passes_total = ptx.warp_exclusive_sum(cutlass.select_(inside, passes, Int32(0)), lane)
        cute.arch.sync_warp()
        if inside:
            sPassStart[lane + shared] = passes_before + shared_passes
        if lane == 0:
            sTotals[ACTIVE] = routed_active + shared
            sTotals[VALID] = valid_total + m * shared
            sTotals[PASSES] = passes_total + shared_passes

    @cute.jit
    def _build_in_cta(self, tables, expert_ids: Int64, m: Int32, tidx) -> None:
        """`build` by the whole CTA: counts per warp, offsets, a scan, then each warp's pairs."""
        sCount, sStart, sPassStart, sActive, sTotals, sOffsets, sPairs = tables
        routed = m * self.top_k
        warp, lane = tidx // WARP, tidx % WARP
        for i in cutlass.range(tidx, self.experts * self.warps, self.threads):
            sOffsets[i % self.experts, i // self.experts] = Int32(0)
        cute.arch.barrier()
        self._each_span(lambda span: self._count(sOffsets, span, warp), expert_ids, routed, warp, lane)
        cute.arch.barrier()
        self._offsets(sCount, sOffsets, m, tidx)
        cute.arch.barrier()
        if tidx < WARP:
            self._scan(sCount, sStart, sPassStart, sActive, sTotals, tidx)
        cute.arch.barrier()
        self._each_span(lambda span: self._place(sStart, sOffsets, sPairs, span, warp, lane), expert_ids, routed,
                        warp, lane)
        if cutlass.const_expr(self.shared):
            # Token t's shared pair at slot t of its segment.
            shared_start = sStart[self.experts]
            for t in cutlass.range(tidx, m, self.threads):
                sPairs[shared_start + t] = t * self.pairs_per_token + self.top_k
        cute.arch.barrier()

    @cute.jit
    def _each_span(self, action, expert_ids: Int64, ids, warp, lane) -> None:
        """``action`` of each span of this lane's ids in its warp's run, in order. The runs are of
        whole rows of 32 ids (row ``r``: ids ``32 r`` to ``32 r + 31``, one per lane), warp ``w``'s
        the ``w``-th ``rows_per_warp``; a span is one row where the call has no more ids than
        threads (decode: warp ``w`` takes row ``w``), else `ROUTING_PAIRS_PER_THREAD` rows."""
        rows = (ids + WARP - 1) // WARP
        if ids <= self.threads:
            action(self._span(expert_ids, warp, warp + 1, ids, lane, 1))
        else:
            rows_per_warp = (rows + self.warps - 1) // self.warps
            first = warp * rows_per_warp
            end = cutlass.min(first + rows_per_warp, rows)
            for row in cutlass.range(first, end, ROUTING_PAIRS_PER_THREAD):
                action(self._span(expert_ids, row, end, ids, lane, ROUTING_PAIRS_PER_THREAD))

    def _span(self, expert_ids: Int64, row, end, ids, lane, width: int) -> list:
        """``(pair, group, valid)`` of this lane's id in each of the ``width`` rows from ``row``,
        every id loaded before any is used (the loads in flight together); an index past the
        call's, or a row from ``end`` on, loads nothing and is not valid."""
        span = []
        for i in range(width):
            index = (row + i) * WARP + lane
            in_run = (index < ids) & (row + i < end)
            expert = ptx.load_s32(expert_ids + Int64(index) * 4, predicate=Int32(in_run))
            valid = in_run & (expert >= 0) & (expert < self.experts)
            span.append((self._pair(index), expert, valid))
        return span

    def _pair(self, index):
        """The pair of routed id ``index = t * top_k + k``: ``t * pairs_per_token + k``."""
        if not self.shared:
            return index
        return index + index // self.top_k

    def _count(self, sOffsets, span: list, warp) -> None:
        # Predicated atomics, no branches: the span's ids stay one straight run of instructions.
        for _, group, valid in span:
            address = (sOffsets.iterator + cute.crd2idx((group, warp), sOffsets.layout)).toint()
            ptx.shared_fetch_add_s32(address, 1, predicate=Int32(valid))

    @cute.jit
    def _offsets(self, sCount, sOffsets, m, tidx) -> None:
        """Each expert's count, and its warps' counts turned into their offsets in its segment:
        warp ``w``'s pairs follow those of warps ``0`` to ``w - 1`` (the earlier ids)."""
        for e in cutlass.range(tidx, self.experts, self.threads):
            total = Int32(0)
            for w in cutlass.range_constexpr(self.warps):
                count = sOffsets[e, w]
                sOffsets[e, w] = total
                total = total + count
            sCount[e] = total
        if cutlass.const_expr(self.shared):
            if tidx == 0:
                # The shared expert's group (``experts``) has a pair per token.
                sCount[self.experts] = m

    def _place(self, sStart, sOffsets, sPairs, span: list, warp, lane) -> None:
        """Each valid pair of the span at its slot, row by row: after the warp's earlier pairs of
        its group, and in a row after the lanes below it with the same group. Every row's lanes of
        the same group are found first, so that their ballots overlap; only the offsets chain."""
        lanes_below = Int32(cute.arch.lanemask_lt())
        sames = [self._equal_and_lower(group, valid)[0] for _, group, valid in span]
        for (p, group, valid), same in zip(span, sames):
            below = cute.arch.popc(same & lanes_below)
            offset = sOffsets[cutlass.select_(valid, group, Int32(0)), warp]
            start = sStart[cutlass.select_(valid, group, Int32(0))]
            ptx.store_shared_s32((sPairs.iterator + start + offset + Int32(below)).toint(), p, predicate=Int32(valid))
            # Every lane has read the offset before the group's lowest lane moves it on.
            cute.arch.sync_warp()
            moved = (sOffsets.iterator + cute.crd2idx((group, warp), sOffsets.layout)).toint()
            ptx.store_shared_s32(moved, offset + Int32(cute.arch.popc(same)), predicate=Int32(valid & (below == 0)))
            cute.arch.sync_warp()

    def _equal_and_lower(self, group, valid) -> tuple:
        """``(equal, lower)``: the lanes of the row whose valid id equals this lane's, and those
        whose valid id is lower, from one ballot of the valid lanes and one per bit of an id
        (valid ids lie in ``[0, experts)``), high bit first. Where a caller uses only ``equal``,
        the compiler drops ``lower``. `match.any` finds ``equal`` in one instruction, but over
        rows of mostly distinct ids the tables took 1.1-1.2 µs more at m = 256 at one CTA per SM,
        2.0-2.1 µs more at two (one H100, `routing_time.cu`, 2026-12-06)."""
        equal = cute.arch.vote_ballot_sync(valid)
        lower = Int32(0)
        for bit in reversed(range(self.id_bits)):
            set_here = ((group >> bit) & 1) != 0
            ones = cute.arch.vote_ballot_sync(set_here)
            lower = lower | cutlass.select_(set_here, equal & ~ones, Int32(0))
            equal = equal & cutlass.select_(set_here, ones, ~ones)
        return equal, lower

    @cute.jit
    def _scan(self, sCount, sStart, sPassStart, sActive, sTotals, lane) -> None:
        """One warp: each segment's start, the active groups (the shared expert's first, it has a
        pair per token) and the passes before each, from the counts. Lane ``l`` takes experts
        ``[l * n, (l + 1) * n)``."""
        first = lane * self.experts_per_lane
        pairs_here = Int32(0)
        active_here = Int32(0)
        passes_here = Int32(0)
        for i in cutlass.range_constexpr(self.experts_per_lane):
            e = first + i
            if e < self.experts:
                pairs_here = pairs_here + sCount[e]
                active_here = active_here + Int32(sCount[e] > 0)
                passes_here = passes_here + self._passes(sCount[e])
        pairs_before, pairs_total = ptx.warp_exclusive_sum(pairs_here, lane)
        active_before, active_total = ptx.warp_exclusive_sum(active_here, lane)
        passes_before, passes_total = ptx.warp_exclusive_sum(passes_here, lane)
        if cutlass.const_expr(self.shared):
            # Its segment after the experts', its items first.
            shared_passes = self._passes(sCount[self.experts])
            active_before = active_before + 1
            passes_before = passes_before + shared_passes
            if lane == 0:
                sStart[self.experts] = pairs_total
                sActive[0] = Int32(self.experts)
                sPassStart[0] = Int32(0)
            pairs_total = pairs_total + sCount[self.experts]
            active_total = active_total + 1
            passes_total = passes_total + shared_passes
        for i in cutlass.range_constexpr(self.experts_per_lane):
            e = first + i
            if e < self.experts:
                count = sCount[e]
                sStart[e] = pairs_before
                pairs_before = pairs_before + count
                if count > 0:
                    sActive[active_before] = e
                    sPassStart[active_before] = passes_before
                    active_before = active_before + 1
                    passes_before = passes_before + self._passes(count)
        if lane == 0:
            sTotals[ACTIVE] = active_total
            sTotals[VALID] = pairs_total
            sTotals[PASSES] = passes_total

    def _passes(self, count):
        """A group's passes as `work_item` numbers them: without ``pass_items`` one for all its pairs."""
        if not self.pass_items:
            return Int32(count > 0)
        return (count + self.tokens_per_pass - 1) // self.tokens_per_pass

    def items(self, tables):
        """How many work items the call has (`work_item`)."""
        _, _, _, _, sTotals, _, _ = tables
        return sTotals[PASSES] * self.items_per_pass

    def work_item(self, tables, item) -> tuple:
        """``(group, column block, start, count)`` of work item ``item``: it computes that block
        for the pairs ``sPairs[start:start + count]``, one pass of them (without
        ``pass_items``: all, in passes). The active groups' passes are numbered in order
        (`_scan`), and item ``n * items_per_pass + j`` is block ``j`` of pass ``n``: the passes
        of a block are ``items_per_pass`` items apart, so that they run at about the same time."""
        sCount, sStart, sPassStart, sActive, sTotals, _, _ = tables
        pass_index = item // self.items_per_pass
        # The last active group whose passes start at or before this one (sPassStart[0] = 0).
        active = sTotals[ACTIVE]
        found = Int32(0)
        for step in reversed(range(self.search_steps)):
            probe = found + (1 << step)
            inside = probe < active
            later = sPassStart[cutlass.select_(inside, probe, Int32(0))] <= pass_index
            found = cutlass.select_(inside & later, probe, found)
        group = sActive[found]
        if not self.pass_items:
            return group, item % self.items_per_pass, sStart[group], sCount[group]
        first = (pass_index - sPassStart[found]) * self.tokens_per_pass
        count = cutlass.min(sCount[group] - first, Int32(self.tokens_per_pass))
        return group, item % self.items_per_pass, sStart[group] + first, count
