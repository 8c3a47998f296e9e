"""Resource report of prebuilt kernels: registers and spills (ptxas), access widths (SASS).

    python tools/kernel_resources.py kernels-prebuilt [--json report.json] [--filter deepseek]

For every ``*.ptx`` of the folder, ``ptxas -v`` for the sidecar's arch gives
registers, stack frame and spill bytes per kernel. Where ``cuobjdump`` exists
(the CUDA toolkit of the GPU machine), the cubin's SASS is scanned for global
loads and stores by width (``.128`` = 16 bytes) and for local-memory
instructions (``LDL``/``STL``: spills or stack arrays). Exits 1 if any kernel
spills or touches local memory.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

ENTRY = re.compile(r"Compiling entry function '(\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")
SASS_FUNCTION = re.compile(r"Function : (\w+)")
SASS_MEMORY = re.compile(r"\b(LDG|STG|LD|ST|LDL|STL)\.E?[\w.]*")


def role(symbol: str) -> str:
    """The role in a CuTe DSL entry name, ``kernel_cutlass_<role>_jax_moe_publish...``."""
    match = re.match(r"kernel_cutlass_(\w+?)_jax_moe_publish", symbol)
    return match.group(1) if match else symbol


def ptxas_report(ptx: pathlib.Path, arch: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        text = subprocess.run(["ptxas", "-v", "--gpu-name", arch, "-o", f"{tmp}/out.cubin", str(ptx)],
                              capture_output=True, text=True, check=True).stderr
    kernels, current = {}, None
    for line in text.splitlines():
        if match := ENTRY.search(line):
            current = kernels.setdefault(role(match.group(1)), {})
        elif current is not None and (match := FRAME.search(line)):
            current.update(stack=int(match.group(1)), spill_stores=int(match.group(2)),
                           spill_loads=int(match.group(3)))
        elif current is not None and (match := REGISTERS.search(line)):
            current["registers"] = int(match.group(1))
    return kernels


def sass_report(cubin: pathlib.Path) -> dict:
    text = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    kernels, current = {}, None
    for line in text.splitlines():
        if match := SASS_FUNCTION.search(line):
            current = kernels.setdefault(role(match.group(1)), collections.Counter())
        elif current is not None and "/*" in line:
            for match in SASS_MEMORY.finditer(line.split(";")[0]):
                opcode = match.group(0)
                width = re.search(r"\.(64|128)\b", opcode)
                current[f"{match.group(1)}.{width.group(1) if width else '32-'}"] += 1
    return {name: dict(counts) for name, counts in kernels.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--filter", default="", help="only kernel sets whose name contains this")
    args = parser.parse_args()
    has_cuobjdump = shutil.which("cuobjdump") is not None
    report, bad = {}, []
    for sidecar in sorted(p for p in args.folder.glob("*.json") if args.filter in p.name):
        arch = json.loads(sidecar.read_text())["arch"]
        entry = {"ptxas": ptxas_report(sidecar.with_suffix(".ptx"), arch)}
        if has_cuobjdump:
            entry["sass"] = sass_report(sidecar.with_suffix(".cubin"))
        report[sidecar.stem] = entry
        for kernel, usage in entry["ptxas"].items():
            local = sum(n for op, n in entry.get("sass", {}).get(kernel, {}).items() if op[:3] in ("LDL", "STL"))
            if usage.get("spill_stores") or usage.get("spill_loads") or usage.get("stack") or local:
                bad.append(f"{sidecar.stem} {kernel}: {usage}, local-memory instructions {local}")
            print(f"{sidecar.stem:60} {kernel:11} regs {usage.get('registers', '?'):>3} "
                  f"stack {usage.get('stack', '?')} spills {usage.get('spill_stores', '?')}/"
                  f"{usage.get('spill_loads', '?')} {entry.get('sass', {}).get(kernel, '')}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if not has_cuobjdump:
        print("cuobjdump not found: SASS access widths not checked")
    for line in bad:
        print("SPILLS OR LOCAL MEMORY:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
