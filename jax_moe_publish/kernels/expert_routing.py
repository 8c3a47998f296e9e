"""Which token-expert pairs each expert serves, found by every CTA in its own shared memory: a
device piece of the experts' kernels (`ExpertGateUpKernel`, `ExpertDownKernel`).

From ``expert_ids`` (int32 ``[m, top_k]``, pair ``p = t * top_k + k``), a CTA counts the pairs of
each expert with shared-memory atomics, scans the counts (one warp), and places every pair in
its expert's segment of ``pairs``; the pairs whose id lies outside ``[0, experts)`` have no
place. No CTA waits for another and nothing goes through global memory: the tables cost a read
of the ids (8 KiB at m = 256, top-8) and two atomics per pair.

With the shared expert (`ExpertsConfig.shared_expert`) a token has ``top_k + 1`` pairs, ``p = t *
(top_k + 1) + k``, its last one the shared expert's: group ``experts``, every token's. Its group
comes first among the active ones, so that its items (the most pairs) start first. Its count is
``m`` and its segment token order, known without reading an id: only the routed ids go through
the atomics, so holding it adds no span of id loads (`ROUTING_PAIRS_PER_THREAD`; at m = 256,
top-8 and 1024 ids per span, ``m * (top_k + 1)`` pairs would take 3 spans where the routed ids
take 2).

The order of the pairs inside an expert's segment is the atomics': it differs between runs and
between the CTAs of one run, so a slot names the same pair only within one CTA, and an
expert's work is split between CTAs by expert, never by slot; the CTAs of a cluster, which add
their sums by slot, take the order of its CTA 0 (`share_order`). The shared expert's segment
alone is in token order in every CTA: its items split it by slot, one pass each (`work_item`).
The order never reaches a result, since each pair's sums are computed apart from every other
pair's (a pair is one column of an mma's B, whatever column that is).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from jax_moe_publish.experts_config import MAX_PAIRS, ROUTING_PAIRS_PER_THREAD, SMEM_ALIGNMENT, ExpertsConfig
from jax_moe_publish.kernels import ptx

WARP = 32

ACTIVE = 0
"""Totals: groups with at least one pair."""
VALID = 1
"""Totals: pairs with a valid expert id (the segments' total)."""

class ExpertRouting:
    """The routing tables of one call, in shared memory: per group (expert, then the shared
    expert) its pair count (``count``), its segment's first slot (``start``) and a fill
    counter; the active groups (the shared expert, then the experts in increasing order); the
    totals; and the pairs in group order (``pairs``)."""

    def __init__(self, config: ExpertsConfig, threads: int) -> None:
        self.experts = config.experts
        self.top_k = config.top_k
        self.shared = config.shared_expert
        self.groups = config.groups
        self.pairs_per_token = config.pairs_per_token
        self.threads = threads
        self.experts_per_lane = -(-config.experts // WARP)

    def allocate(self):
        """(count, start, fill, active, totals, pairs), int32 tensors in shared memory."""
        smem = cutlass.memory.SmemAllocator()
        per_expert = [smem.allocate_tensor(Int32, cute.make_layout(self.groups), byte_alignment=SMEM_ALIGNMENT)
                      for _ in range(4)]
        totals = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=SMEM_ALIGNMENT)
        pairs = smem.allocate_tensor(Int32, cute.make_layout(MAX_PAIRS), byte_alignment=SMEM_ALIGNMENT)
        return (*per_expert, totals, pairs)

    @cute.jit
    def build(self, tables, expert_ids: Int64, m: Int32, tidx) -> None:
        """Fill ``tables`` for the call's ``m`` tokens; every thread of the CTA takes part, and
        the tables are complete for all of them on return."""
        sCount, sStart, sFill, sActive, sTotals, sPairs = tables
        routed = m * self.top_k
        for e in cutlass.range(tidx, self.groups, self.threads):
            # The shared expert's group (``experts``, where held) has a pair per token.
            sCount[e] = cutlass.select_(e == self.experts, m, Int32(0))
            sFill[e] = Int32(0)
        cute.arch.barrier()
        self._each_span(lambda span: self._count(sCount, span), expert_ids, routed, tidx)
        cute.arch.barrier()
        if tidx < WARP:
            self._scan(sCount, sStart, sActive, sTotals, tidx)
        cute.arch.barrier()
        # The ids again (an L1 hit), not kept in registers across the scan: the kernels' register
        # budgets leave no room for them.
        self._each_span(lambda span: self._place(sStart, sFill, sPairs, span), expert_ids, routed, tidx)
        if cutlass.const_expr(self.shared):
            # Token t's shared pair at slot t of its segment, the same in every CTA (`work_item`).
            shared_start = sStart[self.experts]
            for t in cutlass.range(tidx, m, self.threads):
                sPairs[shared_start + t] = t * self.pairs_per_token + self.top_k
        cute.arch.barrier()

    @cute.jit
    def _each_span(self, action, expert_ids: Int64, ids, tidx) -> None:
        """``action`` of each span of this thread's routed ids: one id per thread where the call
        has no more ids than threads (decode), else `ROUTING_PAIRS_PER_THREAD` per span."""
        if ids <= self.threads:
            action(self._span(expert_ids, Int32(0), ids, tidx, 1))
        else:
            span = self.threads * ROUTING_PAIRS_PER_THREAD
            for begin in cutlass.range(0, ids, span):
                action(self._span(expert_ids, begin, ids, tidx, ROUTING_PAIRS_PER_THREAD))

    def _span(self, expert_ids: Int64, begin, ids, tidx, width: int) -> list:
        """``(pair, group, valid)`` of this thread's ``width`` ids of the span at ``begin``, every
        id loaded before any is used (the loads in flight together); an index past the call's
        loads nothing and is not valid."""
        span = []
        for i in range(width):
            index = begin + i * self.threads + tidx
            in_call = index < ids
            expert = ptx.load_s32(expert_ids + Int64(index) * 4, predicate=Int32(in_call))
            valid = in_call & (expert >= 0) & (expert < self.experts)
            span.append((self._pair(index), expert, valid))
        return span

    def _pair(self, index):
        """The pair of routed id ``index = t * top_k + k``: ``t * pairs_per_token + k``."""
        if not self.shared:
            return index
        return index + index // self.top_k

    def _count(self, sCount, span: list) -> None:
        # Predicated atomics, no branches: the span's ids stay one straight run of instructions.
        for _, group, valid in span:
            ptx.shared_fetch_add_s32((sCount.iterator + group).toint(), 1, predicate=Int32(valid))

    def _place(self, sStart, sFill, sPairs, span: list) -> None:
        """Each valid pair at the next free slot of its group's segment (the atomics' order)."""
        for p, group, valid in span:
            start = sStart[cutlass.select_(valid, group, Int32(0))]
            slot = ptx.shared_fetch_add_s32((sFill.iterator + group).toint(), 1, predicate=Int32(valid))
            ptx.store_shared_s32((sPairs.iterator + start + slot).toint(), p, predicate=Int32(valid))

    @cute.jit
    def _scan(self, sCount, sStart, sActive, sTotals, lane) -> None:
        """One warp: each segment's start and the active groups (the shared expert's first, it
        has a pair per token), from the counts. Lane ``l`` takes experts ``[l * n, (l + 1) * n)``."""
        first = lane * self.experts_per_lane
        pairs_here = Int32(0)
        active_here = Int32(0)
        for i in cutlass.range_constexpr(self.experts_per_lane):
            e = first + i
            if e < self.experts:
                pairs_here = pairs_here + sCount[e]
                active_here = active_here + Int32(sCount[e] > 0)
        pairs_before, pairs_total = ptx.warp_exclusive_sum(pairs_here, lane)
        active_before, active_total = ptx.warp_exclusive_sum(active_here, lane)
        if cutlass.const_expr(self.shared):
            # Its segment after the experts', its item first.
            active_before = active_before + 1
            if lane == 0:
                sStart[self.experts] = pairs_total
                sActive[0] = Int32(self.experts)
            pairs_total = pairs_total + sCount[self.experts]
            active_total = active_total + 1
        for i in cutlass.range_constexpr(self.experts_per_lane):
            e = first + i
            if e < self.experts:
                count = sCount[e]
                sStart[e] = pairs_before
                pairs_before = pairs_before + count
                if count > 0:
                    sActive[active_before] = e
                    active_before = active_before + 1
        if lane == 0:
            sTotals[ACTIVE] = active_total
            sTotals[VALID] = pairs_total

    def items(self, tables, items_per_expert: int, tokens_per_pass: int):
        """How many work items the call has (`work_item`)."""
        sCount, _, _, _, sTotals, _ = tables
        if not self.shared:
            return sTotals[ACTIVE] * items_per_expert
        return (sTotals[ACTIVE] - 1 + self._shared_passes(sCount, tokens_per_pass)) * items_per_expert

    def work_item(self, tables, item, items_per_expert: int, tokens_per_pass: int) -> tuple:
        """``(group, column block)`` of work item ``item`` (its pairs: `item_pairs`). The active
        groups take ``items_per_expert`` items each, in order, each of all its group's pairs.
        The shared group (first; with ``m`` pairs, more than any expert) takes one item per
        block and pass instead, pass by pass, each of that pass's pairs: its passes run side by
        side on as many CTAs rather than one after the other on one, and the CTAs of one block
        read it at about the same time."""
        _, _, _, sActive, _, _ = tables
        if not self.shared:
            return sActive[item // items_per_expert], item % items_per_expert
        is_shared, routed = self._split(tables, item, items_per_expert, tokens_per_pass)
        # sActive[0] is the shared group.
        group = sActive[cutlass.select_(is_shared, Int32(0), 1 + routed // items_per_expert)]
        return group, cutlass.select_(is_shared, item, routed) % items_per_expert

    def item_pairs(self, tables, item, group, items_per_expert: int, tokens_per_pass: int) -> tuple:
        """``(start, count)``: work item ``item`` of ``group`` (`work_item`) computes the pairs
        ``sPairs[start:start + count]``, in passes of ``tokens_per_pass``."""
        sCount, sStart, _, _, _, _ = tables
        if not self.shared:
            return sStart[group], sCount[group]
        is_shared, _ = self._split(tables, item, items_per_expert, tokens_per_pass)
        first = cutlass.select_(is_shared, item // items_per_expert * tokens_per_pass, Int32(0))
        count = cutlass.select_(is_shared, cutlass.min(sCount[group] - first, Int32(tokens_per_pass)), sCount[group])
        return sStart[group] + first, count

    def _split(self, tables, item, items_per_expert: int, tokens_per_pass: int) -> tuple:
        """Whether ``item`` is one of the shared group's items, and its index among the routed ones'."""
        shared_items = self._shared_passes(tables[0], tokens_per_pass) * items_per_expert
        return item < shared_items, item - shared_items

    def _shared_passes(self, sCount, tokens_per_pass: int):
        return (sCount[self.experts] + tokens_per_pass - 1) // tokens_per_pass

    @cute.jit
    def share_order(self, tables, tidx, cluster_rank) -> None:
        """Give every CTA of the cluster the pair order of its CTA 0, after `build` (the counts,
        starts and active experts are the same in all: they do not depend on the atomics). Every
        thread of every CTA of the cluster must call it; CTA 0 must not exit before the others
        have read it (a cluster barrier before the kernel ends)."""
        _, _, _, _, sTotals, sPairs = tables
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if cluster_rank != 0:
            first = ptx.cluster_address(sPairs.iterator.toint(), 0)
            for slot in cutlass.range(tidx, sTotals[VALID], self.threads):
                sPairs[slot] = ptx.load_cluster_s32(first + slot * 4)
        cute.arch.barrier()
