"""Check that two builds of the kernels hold the same device code, apart from entry names.

    python tools/compare_ptx.py BEFORE_DIR AFTER_DIR
    python tools/compare_ptx.py --base REV [--preset tests --preset deepseek-v3 ...]

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
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import pathlib
import re
import subprocess
import sys
import tempfile

ENTRY = re.compile(r"\.entry\s+(\w+)")
DEFAULT_PRESETS = ("tests", "deepseek-v3", "qwen3-moe")


def normalized(ptx: str) -> str:
    """``ptx`` with every entry name replaced by its position."""
    for index, name in enumerate(dict.fromkeys(ENTRY.findall(ptx))):
        ptx = re.sub(rf"\b{re.escape(name)}", f"ENTRY{index}", ptx)
    return ptx


def digests(folder: pathlib.Path) -> dict[str, list[str]]:
    """Normalized-PTX digest -> the files that have it."""
    found = collections.defaultdict(list)
    for path in sorted(folder.glob("*.ptx")):
        found[hashlib.sha256(normalized(path.read_text()).encode()).hexdigest()].append(path.name)
    return found


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
    old, new = digests(before), digests(after)
    counts = (sum(map(len, old.values())), sum(map(len, new.values())))
    problems = []
    for digest in sorted(set(old) | set(new)):
        a, b = old.get(digest, []), new.get(digest, [])
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="*", type=pathlib.Path, help="BEFORE_DIR AFTER_DIR")
    parser.add_argument("--base", help="build the presets at this git revision and at the working tree")
    parser.add_argument("--preset", action="append", help=f"with --base (default: {' '.join(DEFAULT_PRESETS)})")
    args = parser.parse_args()
    if args.base is None:
        if len(args.folders) != 2:
            parser.error("give BEFORE_DIR AFTER_DIR, or --base REV")
        return compare(*args.folders)
    if args.folders:
        parser.error("--base builds its own folders: give no folders with it")
    presets = args.preset or list(DEFAULT_PRESETS)
    repo = pathlib.Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="compare-ptx-") as tmp:
        tmp = pathlib.Path(tmp)
        worktree = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.base], cwd=repo, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            build(worktree, presets, tmp / "before")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=repo, check=True)
        build(repo, presets, tmp / "after")
        return compare(tmp / "before", tmp / "after")


if __name__ == "__main__":
    sys.exit(main())
