"""The bytes one rank moves in one call, in HBM and over NVLink: the byte model behind the
benchmarks' floors and of the link model of `jax_moe_publish.tuning`.
"""

from __future__ import annotations

from jax_moe_publish import _abi

BF16_BYTES = _abi.DTYPES["bf16"]
INDEX_BYTES = _abi.DTYPES["s32"]  # int32 permuted indices
ALGORITHMS = tuple(_abi.ALGORITHMS)


def bytes_per_rank(*, algorithm: str, tp: int, m: int, hidden: int, top_k: int, shared_expert: bool,
                   weight_bytes: int = 4, epilogue: str = "none", own_slot: bool = True) -> dict[str, float]:
    """HBM and NVLink bytes that one rank moves in one call of the op.

    With ``row = m * hidden * 2`` (one bf16 [m, hidden] array), every algorithm
    first reads its inputs once::

        inputs = m * top_k * hidden * 2            (routed rows, all indices valid)
               + row                               (shared expert, if any)
               + m * top_k * (4 + weight_bytes)    (int32 indices, weights)

    and writes ``outputs`` arrays of ``row`` bytes: 1 (``out``), or 2 with the
    residual add + RMSNorm epilogue (``out`` and ``residual_out``), which also
    reads the norm weight (``hidden * 2``) and the residual of the rows the rank
    normalizes (``row``; in twoshot its owned ``row / tp``), added to ``inputs``.

    A write into a peer's mailbox is counted in the peer's HBM. The ranks are
    symmetric, so each rank's HBM receives as much as it sends.

    * ``direct`` (tp = 1): ``hbm = inputs + outputs * row``; no NVLink.
    * ``oneshot``: each rank's mailbox receives ``tp * row`` (its own slot
      locally, the peers' over NVLink); the reduce reads ``tp * row``, writes
      the outputs and re-arms ``tp * row``::

          hbm = inputs + 3 * tp * row + outputs * row,    nvlink = (tp - 1) * row

      Without ``own_slot`` (a fused kernel that keeps its own partial in
      shared memory) the own slot's write, read and re-arm drop out:
      ``3 * (tp - 1) * row`` instead of ``3 * tp * row``. A CTA keeps only
      its first tiles there, so this is a lower bound at large ``m``.

    * ``twoshot``: token ``t`` is reduced by rank ``t % tp``. Per rank, as the
      mean over the group (a lower bound on the slowest rank when ``tp`` does
      not divide ``m``): the owner's slots receive ``row`` of contributions,
      of which ``others = (tp - 1) / tp * row`` come over NVLink, and it reads
      and re-arms them; it writes its ``row / tp`` of each output and stores
      each output of its rows into every peer's gather area (with the
      epilogue ``reduce_norm`` fans out both, into gather areas 0 and 1). So
      each rank's gather areas receive ``others`` of each output over NVLink,
      which the gather reads, copies to the output and re-arms::

          hbm = inputs + 3 * row + outputs * (row / tp + 4 * others)
          nvlink = others + outputs * others    (publish, then fan-out)

    * ``reduce_scatter``: the same owners and slots, without the fan-out: each
      rank writes only its ``row / tp`` of each output::

          hbm = inputs + 3 * row + outputs * row / tp,    nvlink = others

    The algorithm's facts (`_abi.ALGORITHMS`) choose the formula: a group or
    not, the reduce over every row or the owned ones, a fan-out or not.

    Parameters
    ----------
    algorithm : {"direct", "oneshot", "twoshot", "reduce_scatter"}
    tp, m, hidden, top_k : int
    shared_expert : bool
    weight_bytes : int
        Bytes per router weight: 4 (float32) or 2 (bf16).
    epilogue : {"none", "rmsnorm"}
        ``rmsnorm``: the call has the residual add + RMSNorm epilogue (with any algorithm).
    own_slot : bool
        Oneshot: this rank's own contribution goes through its mailbox slot.

    Returns
    -------
    dict with ``hbm`` and ``nvlink`` (bytes, one way for NVLink).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}: expected one of {ALGORITHMS}")
    spec = _abi.ALGORITHMS[algorithm]
    if (tp > 1) != spec.group:
        raise ValueError(f"algorithm={algorithm!r} with tp={tp}: expected a group algorithm exactly when tp > 1")
    if weight_bytes not in (2, 4):
        raise ValueError(f"weight_bytes={weight_bytes!r}: expected 2 (bf16) or 4 (float32)")
    row = m * hidden * BF16_BYTES
    inputs = m * top_k * hidden * BF16_BYTES + m * top_k * (INDEX_BYTES + weight_bytes)
    if shared_expert:
        inputs += row
    if epilogue not in _abi.EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r}: expected one of {_abi.EPILOGUES}")
    outputs = 1 if epilogue == "none" else 2
    if epilogue != "none":
        inputs += hidden * BF16_BYTES + (row / tp if spec.owned_rows else row)
    if not spec.group:
        return {"hbm": float(inputs + outputs * row), "nvlink": 0.0}
    if not spec.owned_rows:
        slots = tp if own_slot else tp - 1
        return {"hbm": float(inputs + 3 * slots * row + outputs * row), "nvlink": float((tp - 1) * row)}
    others = (tp - 1) / tp * row
    if not spec.fans_out:
        return {"hbm": inputs + 3 * row + outputs * row / tp, "nvlink": others}
    return {"hbm": inputs + 3 * row + outputs * (row / tp + 4 * others), "nvlink": others + outputs * others}
