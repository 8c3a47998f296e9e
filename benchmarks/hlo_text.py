"""Readers of XLA's optimized HLO text: how a module's all-reduces run, and what the loop body of
a benchmark chain (`chains.make_chain`) holds.

The benchmarks record both beside each XLA column's times (`chains.time_ours_and_xla`), and
``tests/cpu/test_bench_moe_publish.py`` reads a chain's loop body with them to show that no
layer's finalize left the timed loop.
"""

from __future__ import annotations

import re

_ALL_REDUCE = re.compile(r"\s(all-reduce(?:-start)?)\(")
_STRATEGY = re.compile(r'"kernel_strategy":\s*"(\w+)"')
_OPCODE = re.compile(r"=\s*\S+\s+([\w-]+)\(")


def all_reduce_implementations(hlo_text):
    """How the all-reduces of an optimized HLO module run: a count per ``opcode: strategy``.

    The strategy is the ``kernel_strategy`` of the instruction's collective backend config
    (XLA's one-shot or two-shot kernel), ``default`` where it sets none: the collectives
    library (NCCL on GPUs). Any other instruction that carries a strategy (a fusion) counts
    under its own opcode.
    """
    counts = {}
    for line in hlo_text.splitlines():
        all_reduce, strategy = _ALL_REDUCE.search(line), _STRATEGY.search(line)
        if not all_reduce and not strategy:
            continue
        if all_reduce:
            opcode = all_reduce.group(1)
        else:
            match = _OPCODE.search(line)
            opcode = match.group(1) if match else "?"
        name = strategy.group(1) if strategy and strategy.group(1) != "KERNEL_STRATEGY_DEFAULT" else "default"
        key = f"{opcode}: {name}"
        counts[key] = counts.get(key, 0) + 1
    return counts


# A computation opens on an unindented line ending in "{"; an instruction is "name = shape opcode(...)",
# where a tuple shape holds no "word(" and a "/*index=5*/" comment comes after the first "=".
_COMPUTATION = re.compile(r"^(?!HloModule\b)(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\b([a-z][\w\-]*)\(")
_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")


def hlo_computations(hlo_text):
    """The computations of an HLO module's text: ``({name: [(opcode, line), ...]}, entry name)``."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instruction = _INSTRUCTION.match(line)
            if instruction:
                current.append((instruction.group(1), line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _called(line, computations):
    """The computations an instruction calls (fusion, reducer, loop body, branch...): every
    ``%name`` on its line that names a computation (instruction and computation names are
    distinct in a module)."""
    return [name for name in re.findall(r"%([\w.\-]+)", line) if name in computations]


def _instructions(computations, name, *, into_fusions=True, skip=None):
    """``(opcode, line)`` of every instruction of computation ``name`` and, once per call, of
    every computation it calls; with ``into_fusions`` False not those inside a fusion (its fused
    computation is one kernel), and nothing that the instruction line ``skip`` calls."""
    for opcode, line in computations[name]:
        yield opcode, line
        if line is skip or (opcode == "fusion" and not into_fusions):
            continue
        for callee in _called(line, computations):
            yield from _instructions(computations, callee, into_fusions=into_fusions, skip=skip)


def _opcode_counts(instructions):
    counts = {}
    for opcode, _ in instructions:
        counts[opcode] = counts.get(opcode, 0) + 1
    return counts


def _chain_loop(computations, entry):
    """The one ``while`` instruction of a module outside fusions (the chain's ``fori_loop``):
    ``(its line, its body's name)``, or None where there is not exactly one."""
    loops = [line for opcode, line in _instructions(computations, entry, into_fusions=False) if opcode == "while"]
    return (loops[0], _WHILE_BODY.search(loops[0]).group(1)) if len(loops) == 1 else None


def loop_body_opcodes(hlo_text):
    """Opcode counts of an optimized HLO module with one ``while`` loop (the chain's
    ``fori_loop``): ``(in the loop body, outside the loop)``, each with the computations called
    from there once per call, fusions included; the loop's condition counts in neither.
    Raises ValueError without exactly one loop."""
    computations, entry = hlo_computations(hlo_text)
    loop = _chain_loop(computations, entry)
    if loop is None:
        raise ValueError("expected exactly one while loop in the HLO module")
    line, body = loop
    return (_opcode_counts(_instructions(computations, body)),
            _opcode_counts(_instructions(computations, entry, skip=line)))


def loop_body_fusions(hlo_text):
    """The fusion kernels in the loop body of an optimized HLO module (as `loop_body_opcodes`),
    counted through calls (command buffers) but not inside fusions; None without exactly one
    ``while`` loop (XLA may unroll a short one)."""
    computations, entry = hlo_computations(hlo_text)
    loop = _chain_loop(computations, entry)
    if loop is None:
        return None
    return _opcode_counts(_instructions(computations, loop[1], into_fusions=False)).get("fusion", 0)
