"""Rewrite ``jax_moe_publish/experts_table.json`` (where ``impl="auto"`` runs the experts
kernels) from ``bench_moe_experts.py`` runs on a GPU:

    python benchmarks/experts_table.py benchmarks/results/RUN.json ...

The checkout's table, not an installed copy's: the file is committed with the runs it names.
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
    table["entries"] = [dataclasses.asdict(entry) for entry in experts_tuning.measured_entries(args.runs)]
    args.table.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {len(table['entries'])} entries to {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
