"""docs/design.md restates no contract by hand: its table of algorithms is rendered from
`_abi.ALGORITHMS` here, and must equal it."""

from __future__ import annotations

import pathlib

from jax_moe_publish import _abi

DESIGN = pathlib.Path(__file__).resolve().parents[2] / "docs" / "design.md"
FORMS = ((False, "none"), (False, "rmsnorm"), (True, "none"), (True, "rmsnorm"))


def algorithms_table() -> str:
    """The markdown table of every algorithm's facts and kernels by form."""
    header = ("| algorithm | result | reduce rows | out rows | fans out | exchanges | kernels | with the epilogue "
              "| fused | fused, with the epilogue |")
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for name, spec in _abi.ALGORITHMS.items():
        kernels = [", ".join(f"`{role}`" for role in spec.roles[form]) if form in spec.roles else "none"
                   for form in FORMS]
        lines.append(f"| `{name}` | {spec.result} | {spec.reduce_rows} | {spec.out_rows} | "
                     f"{'yes' if spec.fans_out else 'no'} | {spec.exchanges} | " + " | ".join(kernels) + " |")
    return "\n".join(lines)


def test_the_design_doc_shows_the_algorithms_table():
    expected = algorithms_table()
    assert expected in DESIGN.read_text(), (
        f"docs/design.md must hold the table of `_abi.ALGORITHMS`, rendered by {__file__}:\n\n{expected}")
