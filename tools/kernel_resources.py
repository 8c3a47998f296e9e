"""Resource check of prebuilt kernels, read from their cubins: registers, stack frame and local
memory per kernel (``cuobjdump -res-usage``), and global access widths and local-memory
instructions (``cuobjdump -sass``).

    python tools/kernel_resources.py kernels-prebuilt [--json report.json] [--filter deepseek]

The cubin is what the GPU loads, and all that a folder carried to the GPU machine keeps of a
kernel (``tools/multi_gpu_run.sh build`` deletes the PTX). A spill lives in the stack frame,
so a kernel fails the check when it has a stack frame, local memory, or any ``LDL``/``STL``
instruction; the SASS also gives its global loads and stores by width (``.128`` = 16 bytes).

Exit status: 0 when every kernel of every set is clean; 1 when some kernel spills or uses
local memory; 2 when something could not be checked (no cuobjdump, a sidecar without its
cubin, cuobjdump failing on a cubin, no kernel set at all), each said on a ``CANNOT CHECK``
line. cuobjdump, and the nvdisasm that its ``-sass`` runs, come with the CUDA toolkit or in
the ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig

SPILLS, CANNOT_CHECK = 1, 2
RES_FUNCTION = re.compile(r"^\s*Function (\S+):\s*$")
RES_FIELD = re.compile(r"\b(REG|STACK|SHARED|LOCAL):(\d+)")
RES_NAMES = {"REG": "registers", "STACK": "stack", "SHARED": "shared", "LOCAL": "local"}
SASS_FUNCTION = re.compile(r"Function : (\w+)")
# An opcode and its modifiers, if any (a plain ``STL`` has none): ``LDG.E.128.CONSTANT``.
SASS_MEMORY = re.compile(r"\b(LDG|STG|LDL|STL|LD|ST)(?:\.[\w.]+)?(?=\s)")


class CannotCheck(Exception):
    """A cubin whose resources could not be read: not a finding about its kernels."""


def role(symbol: str) -> str:
    """The role in a CuTe DSL entry name, ``kernel_cutlass_<role>_jax_moe_publish...``."""
    match = re.match(r"kernel_cutlass_(\w+?)_jax_moe_publish", symbol)
    return match.group(1) if match else symbol


def cuda_tool(name: str) -> str | None:
    """``name`` on PATH, else from the CUDA wheels installed in this Python (``nvidia/cu*/bin``)."""
    found = shutil.which(name)
    if found:
        return found
    wheels = pathlib.Path(sysconfig.get_paths()["purelib"]) / "nvidia"
    return next((str(path) for path in sorted(wheels.glob(f"cu*/bin/{name}"))), None)


def cuobjdump(tool: str, option: str, cubin: pathlib.Path) -> str:
    run = subprocess.run([tool, option, str(cubin)], capture_output=True, text=True)
    if run.returncode != 0:
        raise CannotCheck(f"cuobjdump {option} {cubin.name} failed (exit {run.returncode}): {run.stderr.strip()}")
    return run.stdout


def resource_report(tool: str, cubin: pathlib.Path) -> dict:
    """Registers, stack frame, shared and local memory (bytes) of each kernel of ``cubin``."""
    kernels, current = {}, None
    for line in cuobjdump(tool, "-res-usage", cubin).splitlines():
        if match := RES_FUNCTION.match(line):
            current = kernels.setdefault(role(match.group(1)), {})
        elif current is not None and (fields := RES_FIELD.findall(line)):
            current.update({RES_NAMES[name]: int(value) for name, value in fields})
    if not kernels:
        raise CannotCheck(f"cuobjdump -res-usage listed no kernel in {cubin.name}")
    if missing := [kernel for kernel, usage in kernels.items() if set(usage) != set(RES_NAMES.values())]:
        raise CannotCheck(f"cuobjdump -res-usage gave no full resource line for {missing} in {cubin.name}")
    return kernels


def sass_report(tool: str, cubin: pathlib.Path) -> dict:
    """Global and local loads and stores of each kernel of ``cubin``, counted by opcode and width."""
    kernels, current = {}, None
    for line in cuobjdump(tool, "-sass", cubin).splitlines():
        if match := SASS_FUNCTION.search(line):
            current = kernels.setdefault(role(match.group(1)), collections.Counter())
        elif current is not None and "/*" in line:
            for match in SASS_MEMORY.finditer(line.split(";")[0]):
                opcode = match.group(0)
                width = re.search(r"\.(64|128)\b", opcode)
                current[f"{match.group(1)}.{width.group(1) if width else '32-'}"] += 1
    return {name: dict(counts) for name, counts in kernels.items()}


def check_set(tool: str, sidecar: pathlib.Path) -> dict | str:
    """The resources and SASS counts of one kernel set's kernels, or why they cannot be read."""
    cubin = sidecar.with_suffix(".cubin")
    if not cubin.is_file():
        return f"{sidecar.name} has no {cubin.name}"
    try:
        resources, sass = resource_report(tool, cubin), sass_report(tool, cubin)
    except CannotCheck as error:
        return str(error)
    if missing := sorted(set(resources) - set(sass)):
        return f"cuobjdump -sass listed no code for {missing} in {cubin.name}"
    return {"resources": resources, "sass": sass}


def local_memory(entry: dict, kernel: str) -> int:
    """Stack frame and local bytes, and local-memory instructions, of one kernel: 0 when clean."""
    usage, sass = entry["resources"][kernel], entry["sass"][kernel]
    return usage["stack"] + usage["local"] + sum(n for op, n in sass.items() if op[:3] in ("LDL", "STL"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("--filter", default="", help="only kernel sets whose name contains this")
    args = parser.parse_args()
    tool = cuda_tool("cuobjdump")
    if tool is None:
        print("CANNOT CHECK: cuobjdump not found (on PATH or in this Python's CUDA wheels): no kernel was checked")
        return CANNOT_CHECK
    sidecars = sorted(p for p in args.folder.glob("*.json") if args.filter in p.name)
    if not sidecars:
        print(f"CANNOT CHECK: no kernel set (*.json sidecar) in {args.folder} matches {args.filter!r}")
        return CANNOT_CHECK
    report, bad, unchecked = {}, [], []
    # cuobjdump -sass takes about a second a cubin: the sets run side by side.
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        for sidecar, entry in zip(sidecars, pool.map(lambda sidecar: check_set(tool, sidecar), sidecars)):
            if isinstance(entry, str):
                unchecked.append(entry)
                continue
            report[sidecar.stem] = entry
            for kernel, usage in entry["resources"].items():
                if local_memory(entry, kernel):
                    bad.append(f"{sidecar.stem} {kernel}: {usage}, SASS {entry['sass'][kernel]}")
                print(f"{sidecar.stem:60} {kernel:11} regs {usage['registers']:>3} stack {usage['stack']} "
                      f"local {usage['local']} {entry['sass'][kernel]}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"checked {len(report)} of {len(sidecars)} kernel sets")
    for line in unchecked:
        print("CANNOT CHECK:", line)
    for line in bad:
        print("SPILLS OR LOCAL MEMORY:", line)
    return SPILLS if bad else CANNOT_CHECK if unchecked else 0


if __name__ == "__main__":
    sys.exit(main())
