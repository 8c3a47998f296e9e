"""Rewrite ``jax_moe_publish/experts_table.json`` (which route ``impl="auto"`` runs the
experts op on: the kernels, the gather route or the reference) from ``bench_moe_experts.py``
runs on a GPU:

    python benchmarks/experts_table.py benchmarks/results/RUN.json ...

The checkout's table, not an installed copy's: the file is committed with the runs it names.
Its ``runs`` lists them in the order given (where two runs measured the same case, the later
one's figures count: `experts_tuning.measured_entries`), so that a test can check that the
table is what they give.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jax_moe_publish import experts_tuning  # noqa: E402

TABLE = REPO / "jax_moe_publish" / "experts_table.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=pathlib.Path, help="result JSONs under benchmarks/results")
    parser.add_argument("--table", type=pathlib.Path, default=TABLE, help=f"default: {TABLE}")
    args = parser.parse_args(argv)
    table = json.loads(args.table.read_text())
    table["runs"] = [_repo_path(run) for run in args.runs]
    table["entries"] = [dataclasses.asdict(entry) for entry in experts_tuning.measured_entries(args.runs)]
    args.table.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {len(table['entries'])} entries to {args.table}")
    return 0


def _repo_path(path: pathlib.Path) -> str:
    """``path`` relative to the checkout where it lies in it, else as given."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


if __name__ == "__main__":
    sys.exit(main())
