"""Readers of a kernel set's PTX for the compile tier's checks: the text of each kernel's
``.entry``, and the instructions in it."""

from __future__ import annotations

import re

from jax_moe_publish.aot import artifact

_ENTRY_START = re.compile(r"^[ \t]*(?:\.visible[ \t]+)?\.entry[ \t]+(\w+)", re.M)


def kernel_bodies(ptx: str) -> dict[str, str]:
    """The text of each ``.entry``, by symbol: from its ``.entry`` line to the next one."""
    starts = list(_ENTRY_START.finditer(ptx))
    ends = [match.start() for match in starts[1:]] + [len(ptx)]
    return {match.group(1): ptx[match.start():end] for match, end in zip(starts, ends)}


def kernels_by_role(built: artifact.KernelArtifact) -> dict[str, str]:
    bodies = kernel_bodies(built.ptx)
    return {kernel["role"]: bodies[kernel["symbol"]] for kernel in built.metadata["kernels"]}


def opcodes(body: str, prefix: str) -> list[str]:
    """Full opcodes (``ld.global.nc.v4.u32``) of the instructions that start with ``prefix``,
    predicated or not, in text order."""
    return re.findall(rf"^[ \t]*(?:@!?%?\w+[ \t]+)?({re.escape(prefix)}[\w.:]*)", body, re.M)


def first(body: str, text: str) -> int:
    """Offset of the first occurrence of ``text`` (len(body) when absent)."""
    index = body.find(text)
    return len(body) if index < 0 else index
