"""The byte and latency model that writes the tuning table's entries marked ``model``
(``benchmarks/tune_algorithms.py --model``): not read when a call runs.
"""

from __future__ import annotations

import dataclasses
import json

from jax_moe_publish import _abi, traffic, tuning
from jax_moe_publish.tuning import Problem, kernel_config


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """The byte and latency model behind the algorithm entries marked ``model``.

    A call of ``algorithm`` costs its exchanges (`_abi.Algorithm.exchanges`: one-shot waits once, two-shot twice: for
    the owners' sums), the slower of its HBM and NVLink bytes (`traffic.bytes_per_rank`) at
    the measured bandwidths, and a launch per kernel beyond the first; the work both
    algorithms share (the finalize's compute, the first launch) is left out, so only the
    difference of two calls means something.

    The constants are algorithms.json's ``model`` section, each with its source there:
    the bandwidths and ``launch_s`` from one committed 2x H200 run; ``exchange_s`` is the
    fused tp = 2 call at m = 1 of that run less a tp = 1 direct call from a run whose JSON
    was not committed (one H200 at 88649f0), an upper bound of the exchange until
    ``benchmarks/nvlink_pingpong.cu`` measures it.
    """

    p2p_bytes_per_s: float
    hbm_bytes_per_s: float
    exchange_s: float
    launch_s: float

    MAX_M = 1 << 16
    """The largest m the crossover search considers."""

    def call_s(self, problem: Problem, algorithm: str, tp: int, m: int, epilogue: str = "none") -> float:
        config = kernel_config(problem, tp=tp, m=m, epilogue=epilogue, algorithm=algorithm)
        moved = traffic.bytes_per_rank(
            algorithm=algorithm, tp=tp, m=m, hidden=problem.hidden, top_k=problem.top_k,
            shared_expert=problem.include_shared_expert, weight_bytes=4 if problem.fp32_weights else 2,
            epilogue=epilogue, own_slot=not config.keep_own_partial)
        return (_abi.ALGORITHMS[algorithm].exchanges * self.exchange_s
                + max(moved["hbm"] / self.hbm_bytes_per_s, moved["nvlink"] / self.p2p_bytes_per_s)
                + (len(_abi.call_roles(config)) - 1) * self.launch_s)

    def crossover_m(self, problem: Problem, tp: int, epilogue: str = "none") -> int | None:
        """The largest m up to `MAX_M` at which one-shot is no slower than two-shot (None: every
        such m), by bisection: two-shot's saving grows with m."""
        def oneshot_wins(m):
            return self.call_s(problem, "oneshot", tp, m, epilogue) <= self.call_s(problem, "twoshot", tp, m, epilogue)

        if oneshot_wins(self.MAX_M):
            return None
        low, high = 0, self.MAX_M  # one-shot wins at low (or low = 0), loses at high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if oneshot_wins(middle) else (low, middle)
        return low


def _load_model() -> LinkModel:
    data = json.loads(tuning.TABLE_FILE.read_text())["model"]
    return LinkModel(**{field.name: data[field.name] for field in dataclasses.fields(LinkModel)})


MODEL = _load_model()
"""The model at algorithms.json's constants."""
