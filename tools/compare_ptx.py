"""Check that two builds of the kernels hold the same device code, apart from entry names, and
keep the manifest of what every preset compiles to.

    python tools/compare_ptx.py BEFORE_DIR AFTER_DIR
    python tools/compare_ptx.py --base REV [--preset tests --preset deepseek-v3 ...]
    python tools/compare_ptx.py manifest [--write] [--kernels DIR ...]

The first form compares two folders written by ``python -m jax_moe_publish.aot build``.
The second builds the presets (default: tests, deepseek-v3, qwen3-moe) at git revision
``REV`` (in a temporary worktree) and at the working tree, then compares them; it
needs CuTe DSL, not a GPU.

Every ``.ptx`` is normalized: its ``.entry`` names (which follow the Python module
and class that define a kernel) become ``ENTRY0``, ``ENTRY1``, ... in order of
appearance. The check passes when both folders hold the same number of kernel sets
and the same multiset of normalized PTX texts: a refactoring that moves device code
between modules must leave every kernel's instructions and parameter list unchanged.
Configs are matched by their PTX, not by their keys, since renaming a config field
changes every key. Exits 1 on any difference and names the unmatched files.

The third form checks the working tree against the committed manifest,
``tests/compile/ptx_manifest.json``, or rewrites it (``--write``). The manifest lists the
kernel sets of every preset (as ``python -m jax_moe_publish.aot build --preset`` builds
them, for sm_90a) and records of each set the digest of its normalized PTX, the call's shape
checks and, for each kernel in launch order, the digest of its normalized ``.entry`` and its
launch plan and parameters as the sidecar states them (all but the entry name); and the CuTe
DSL version, since another DSL version compiles other PTX. A change to device code or to a
launch plan is a diff of the manifest, committed with it; a refactoring that only moves code
leaves the manifest as it is. (Sets are named by their config keys: a change to the config's
fields renames them all, and the first two forms, which match sets by their PTX, show whether
the code stayed the same.) The sets come from the kernel store: the ``--kernels`` folders
(default: ``$JAX_MOE_PUBLISH_KERNEL_DIR``), then the disk cache, else CuTe DSL compiles them
(all of them: about 4 minutes on two CPU cores); a prebuilt set counts only if it was built
from the working tree's kernel sources. Exits 1 on any difference and names each value.
``tests/compile/test_ptx_manifest.py`` runs the check on the compile tier's builds.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
# The working tree's package, which an installed copy must not shadow: the manifest describes
# this checkout.
sys.path.insert(0, str(REPO))

from jax_moe_publish.aot import artifact, store  # noqa: E402
from jax_moe_publish.aot.__main__ import PRESETS  # noqa: E402

ENTRY = re.compile(r"^[ \t]*(?:\.visible[ \t]+)?\.entry[ \t]+(\w+)", re.M)
MANIFEST = REPO / "tests" / "compile" / "ptx_manifest.json"
WRITE_COMMAND = "python tools/compare_ptx.py manifest --write"
# What a sidecar says about where a set came from or what it is named, not how it runs.
PROVENANCE = ("sidecar_version", "key", "config", "arch", "dsl_version", "source_fingerprint")
SHOWN_DIFFERENCES = 40


def normalized(ptx: str) -> str:
    """``ptx`` with every entry name replaced by its position."""
    for index, name in enumerate(dict.fromkeys(ENTRY.findall(ptx))):
        ptx = re.sub(rf"\b{re.escape(name)}", f"ENTRY{index}", ptx)
    return ptx


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry_digests(ptx: str) -> dict[str, str]:
    """Digest of each ``.entry``'s normalized text (from its line to the next entry's), by entry name."""
    names = list(dict.fromkeys(ENTRY.findall(ptx)))
    text = normalized(ptx)
    starts = [match.start() for match in ENTRY.finditer(text)]
    return {name: digest(text[start:end]) for name, start, end in zip(names, starts, starts[1:] + [len(text)])}


def digests(folder: pathlib.Path) -> dict[str, list[str]]:
    """Normalized-PTX digest -> the files that have it."""
    found = collections.defaultdict(list)
    for path in sorted(folder.glob("*.ptx")):
        found[digest(normalized(path.read_text()))].append(path.name)
    return found


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
    old, new = digests(before), digests(after)
    counts = (sum(map(len, old.values())), sum(map(len, new.values())))
    problems = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, []), new.get(key, [])
        if len(a) != len(b):
            problems.append(f"{len(a)} in {before} ({', '.join(a) or '-'}) against {len(b)} in {after} "
                            f"({', '.join(b) or '-'})")
    print(f"{counts[0]} kernel sets in {before}, {counts[1]} in {after}, "
          f"{len(old)} and {len(new)} distinct normalized PTX texts")
    for line in problems:
        print("DIFFERS:", line)
    if not counts[0]:
        print(f"no .ptx files in {before}")
        return 1
    print("identical apart from entry names" if not problems else f"{len(problems)} PTX texts differ")
    return 1 if problems else 0


def build(source: pathlib.Path, presets: list[str], out: pathlib.Path) -> None:
    """Build ``presets`` from the package in ``source`` (run from there, so that it shadows an
    installed copy; an editable install would not be shadowed, and is refused)."""
    imported = subprocess.run([sys.executable, "-c", "import jax_moe_publish; print(jax_moe_publish.__file__)"],
                              cwd=source, check=True, capture_output=True, text=True).stdout.strip()
    if not pathlib.Path(imported).resolve().is_relative_to(source.resolve()):
        raise SystemExit(f"building in {source} imports {imported}: an editable install shadows the "
                         "source folder; use a regular install (pip install .) to run --base")
    flags = [arg for preset in presets for arg in ("--preset", preset)]
    subprocess.run([sys.executable, "-m", "jax_moe_publish.aot", "build", *flags, "--out", str(out)],
                   cwd=source, check=True, stdout=subprocess.DEVNULL)


# The manifest.


def set_record(built: artifact.KernelArtifact) -> dict:
    """What the manifest records of one kernel set."""
    entries = entry_digests(built.ptx)
    record = {name: value for name, value in built.metadata.items() if name not in PROVENANCE}
    record["kernels"] = [{**{name: value for name, value in kernel.items() if name != "symbol"},
                          "ptx": entries[kernel["symbol"]]} for kernel in built.metadata["kernels"]]
    record["ptx"] = digest(normalized(built.ptx))
    return record


def preset_manifest(kernels: store.KernelStore) -> dict:
    """The manifest of every preset, its sets taken from ``kernels``."""
    presets = {name: make() for name, make in PRESETS.items()}
    configs = list(dict.fromkeys(config for configs in presets.values() for config in configs))
    sets = {}
    for index, config in enumerate(configs, 1):
        compiles = kernels.stats.compiles
        sets[config.key] = set_record(kernels.get(config))
        if kernels.stats.compiles > compiles:
            print(f"[{index}/{len(configs)}] compiled {config.key}", flush=True)
    return {
        "dsl_version": artifact.dsl_version(),
        "presets": {name: sorted({config.key for config in configs}) for name, configs in presets.items()},
        "sets": sets,
    }


def dumps(value, depth: int = 0) -> str:
    """JSON with sorted keys and every object below a set (its call, each kernel) on one line, so that
    a diff names the set and the kernel that changed."""
    if not isinstance(value, (dict, list)) or not value or (isinstance(value, dict) and depth >= 3):
        return json.dumps(value, sort_keys=True)
    pad = " " * (depth + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(key)}: {dumps(value[key], depth + 1)}" for key in sorted(value)]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    return "[\n" + ",\n".join(pad + dumps(item, depth + 1) for item in value) + "\n" + " " * depth + "]"


def differences(recorded: dict, built: dict) -> list[str]:
    """Each value that ``built`` changes in the manifest ``recorded``, as ``where: old -> new``."""
    lines = []
    if recorded.get("dsl_version") != built["dsl_version"]:
        lines.append(f"CuTe DSL version: {recorded.get('dsl_version')} -> {built['dsl_version']}")
    recorded_presets, recorded_sets = recorded.get("presets", {}), recorded.get("sets", {})
    for name in sorted(recorded_presets.keys() | built["presets"].keys()):
        old, new = set(recorded_presets.get(name, ())), set(built["presets"].get(name, ()))
        lines += [f"preset {name} gains {key}" for key in sorted(new - old)]
        lines += [f"preset {name} loses {key}" for key in sorted(old - new)]
    for key in sorted(recorded_sets.keys() & built["sets"].keys()):
        old, new = recorded_sets[key], built["sets"][key]
        roles = [[kernel.get("role") for kernel in record.get("kernels", [])] for record in (old, new)]
        if roles[0] != roles[1]:
            lines.append(f"{key}: kernels {roles[0]} -> {roles[1]}")
            continue
        pairs = [(key, old, new)] + [(f"{key} {b['role']}", a, b) for a, b in zip(old["kernels"], new["kernels"])]
        for where, a, b in pairs:
            lines += [f"{where}: {name} {a.get(name)} -> {b.get(name)}" for name in sorted(a.keys() | b.keys())
                      if name != "kernels" and a.get(name) != b.get(name)]
    return lines


def manifest_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python tools/compare_ptx.py manifest",
                                     description="check the working tree against the PTX manifest, or rewrite it")
    parser.add_argument("--write", action="store_true", help="rewrite the manifest instead of checking it")
    parser.add_argument("--kernels", action="append", type=pathlib.Path,
                        help=f"a folder of built sets to use where current (default: ${store.KERNEL_DIR_ENV})")
    parser.add_argument("--manifest", type=pathlib.Path, default=MANIFEST, help=f"default: {MANIFEST}")
    args = parser.parse_args(argv)
    kernels = store.KernelStore(prebuilt_dirs=args.kernels)
    built = preset_manifest(kernels)
    text = dumps(built) + "\n"
    stats = kernels.stats
    print(f"{len(built['sets'])} kernel sets of {len(built['presets'])} presets ({stats.prebuilt_hits} prebuilt, "
          f"{stats.disk_hits} cached, {stats.compiles} compiled)")
    recorded = json.loads(args.manifest.read_text()) if args.manifest.exists() else {}
    changes = differences(recorded, built)
    if args.write:
        args.manifest.write_text(text)
        print(f"wrote {args.manifest}: {len(changes)} values changed")
        return 0
    if not args.manifest.exists():
        print(f"no manifest at {args.manifest}: write it with {WRITE_COMMAND}")
        return 1
    if args.manifest.read_text() == text:
        print(f"the presets compile to what {args.manifest} records")
        return 0
    changes = changes or [f"the values are the same, but {args.manifest} is not in the layout that --write writes"]
    print(f"{len(changes)} differences from {args.manifest} (the manifest's value -> this build's):")
    for line in changes[:SHOWN_DIFFERENCES]:
        print("  " + line)
    if len(changes) > SHOWN_DIFFERENCES:
        print(f"  ... and {len(changes) - SHOWN_DIFFERENCES} more")
    print("The kernels no longer compile to what the manifest records. A change to device code or to a launch "
          f"plan must update the manifest in the same commit: run\n  {WRITE_COMMAND}\nand commit the manifest "
          "with the change. A refactoring that only moves device code must leave it as it is.")
    return 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["manifest"]:
        return manifest_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="*", type=pathlib.Path, help="BEFORE_DIR AFTER_DIR")
    parser.add_argument("--base", help="build the presets at this git revision and at the working tree")
    parser.add_argument("--preset", action="append", help=f"with --base (default: {' '.join(PRESETS)})")
    args = parser.parse_args(argv)
    if args.base is None:
        if len(args.folders) != 2:
            parser.error("give BEFORE_DIR AFTER_DIR, --base REV, or manifest")
        return compare(*args.folders)
    if args.folders:
        parser.error("--base builds its own folders: give no folders with it")
    presets = args.preset or list(PRESETS)
    with tempfile.TemporaryDirectory(prefix="compare-ptx-") as tmp:
        tmp = pathlib.Path(tmp)
        worktree = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.base], cwd=REPO, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            build(worktree, presets, tmp / "before")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=True)
        build(REPO, presets, tmp / "after")
        return compare(tmp / "before", tmp / "after")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
