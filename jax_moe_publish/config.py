"""`KernelConfig`: every compile-time choice of one specialization of the op.

A config names one cubin. It holds the problem constants that the kernels are
specialized on (hidden, top-k, tp, scale, ...), the algorithm and the launch shapes.
Runtime values (m, rank, capacity, addresses) are kernel parameters and are not here.
Which config a call gets is the tuning table's choice (`jax_moe_publish.tuning`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers

from jax_moe_publish import _abi, protocol

ALGORITHMS = tuple(_abi.ALGORITHMS)
EPILOGUES = _abi.EPILOGUES
EPILOGUE_ALGORITHMS = tuple(name for name, spec in _abi.ALGORITHMS.items() if spec.has_epilogue("rmsnorm"))
"""Algorithms with the residual + RMSNorm epilogue (twoshot's owner fans both outputs out)."""
FUSED_ALGORITHMS = tuple(name for name, spec in _abi.ALGORITHMS.items() if spec.fuses)
"""Algorithms with a one-kernel form (``fuse_reduce``)."""
GROUP_ALGORITHMS = tuple(name for name, spec in _abi.ALGORITHMS.items() if spec.group)
"""The algorithms of a group (tp > 1)."""
SINGLE_ALGORITHMS = tuple(name for name, spec in _abi.ALGORITHMS.items() if not spec.group)
"""The algorithms of tp = 1."""
_OWN_PARTIAL_ALGORITHMS = tuple(name for name, spec in _abi.ALGORITHMS.items() if spec.own_partial)


def result_of(algorithm: str) -> str:
    """The mailbox result layout an algorithm serves."""
    return _abi.ALGORITHMS[algorithm].result


MAX_NORM_FRAGMENTS_PER_THREAD = 8
"""Register budget of the fused epilogue: 16-byte fragments of a row per reduce thread."""
OWN_PARTIAL_BYTES = 16 * 1024
"""Shared memory per CTA of a fused kernel for this rank's own partials (`KernelConfig.keep_own_partial`).
At 16 KiB (plus 1 KiB reserved per CTA) 13 CTAs fit in an H100/H200 SM's 228 KiB. The fused
sets of the presets use 40 to 96 registers per thread (``tools/kernel_resources.py``), which
allow at most 12 CTAs of 128 threads: the buffer does not lower their occupancy."""
ARCHS = ("sm_90a", "sm_100a")
MAX_TOP_K = 64
_INT_FIELDS = ("hidden", "top_k", "tp", "elements_per_thread", "threads", "prefetch_group", "reduce_threads",
               "waves")
_BOOL_FIELDS = ("include_shared_expert", "fp32_weights", "load_shared_expert_before_pdl", "enable_pdl",
                "fuse_reduce", "keep_own_partial")


def _require(condition: bool, field: str, value, expected: str) -> None:
    if not condition:
        raise ValueError(f"KernelConfig.{field}={value!r}: expected {expected}")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Compile-time specialization of the finalize-publish and reduce kernels.

    Parameters
    ----------
    hidden : int
        Row width in bf16 elements.
    top_k : int
        Routed experts per token.
    tp : int
        Size of the tensor-parallel group, 1 to 8.
    algorithm : {"direct", "oneshot", "twoshot", "reduce_scatter"}
        ``oneshot``: every rank publishes every token to every peer (``tp``
        stores through a table of peer addresses) and reduces all of them.
        ``twoshot``: token ``t`` is reduced by its owner, rank ``t % tp``, which
        fans the sum out to every rank. ``reduce_scatter``: the owners keep their
        sums. ``direct``: tp = 1, the finalize writes the output.
    routed_scaling_factor : float
        Multiplies every routed weight; 1.0 compiles the multiply away.
    include_shared_expert : bool
        Add the shared expert row.
    fp32_weights : bool
        Router weights are float32 (else bf16).
    elements_per_thread : {4, 8}
        bf16 values per publish thread: 8- or 16-byte accesses.
    threads : int
        Publish threads per CTA.
    prefetch_group : int
        Routed rows loaded before the first of them is used (1: one at a time).
    load_shared_expert_before_pdl : bool
        Load the shared expert row before ``griddepcontrol.wait``: only valid
        when the shared expert output is not written by the preceding kernel.
    enable_pdl : bool
        Programmatic dependent launch between the kernels of a call.
    reduce_threads : int
        Reduce threads per CTA; each moves 8 bf16 values per source (per
        fragment it holds, with the epilogue).
    fuse_reduce : bool
        One kernel per call (``oneshot`` or ``twoshot``). Oneshot: each publish
        thread then waits for its own fragment from every peer, sums and
        re-arms, saving the reduce launch. Twoshot: each CTA publishes its
        tiles to their owners, reduces and fans out the rows this rank owns,
        then gathers the others. The grid is persistent, capped at the CTAs the
        GPU holds at once: each CTA publishes all of its tiles before it waits.
        With the epilogue a row's ``ctas_per_row`` CTAs (at most 16) form a
        thread block cluster: each thread publishes and then reduces one
        fragment (``threads == reduce_threads``), and the cluster sums the
        row's squares through distributed shared memory.
    keep_own_partial : bool or None
        Fused only: a CTA keeps this rank's own partial of its first
        ``own_partial_tiles`` tiles (rows, with the epilogue) in shared memory
        instead of its own mailbox slot, which saves writing, polling and
        re-arming that slot: ``3 * row`` of the ``3 * tp * row`` bytes that the
        mailbox moves per rank. Later tiles of a CTA use the slot. Oneshot only;
        None (the default) means ``fuse_reduce`` for oneshot.
    waves : int
        Fused only: passes of the persistent grid over a call's rows. The grid
        takes the CTAs of ``ceil(m / waves)`` rows (at most what the GPU holds
        at once), so each CTA finalizes up to ``waves`` tiles in turn and the
        NVLink stores of one overlap the HBM loads of the next. With 1, a call
        that fits on the GPU loads all of its rows before it stores any.
    epilogue : {"none", "rmsnorm"}
        ``rmsnorm``: the reduce also adds the residual and applies RMSNorm (every
        group algorithm; a twoshot one unfused). Its CTA holds a whole row,
        ``norm_fragments_per_thread`` 16-byte fragments per thread.
    fp8_out : {"none", "group", "static"}
        With the epilogue, ``out`` in float8_e4m3fn, quantized where the
        epilogue makes it (`reference.quantize_fp8`): ``group``, with a float32
        scale per row and 128 columns (``out_scales``, hidden a multiple of
        128); ``static``, with the caller's one scale (``out_scale``).
    arch : {"sm_90a", "sm_100a"}
        Target of the cubin.
    """

    hidden: int
    top_k: int
    tp: int
    algorithm: str = "oneshot"
    routed_scaling_factor: float = 1.0
    include_shared_expert: bool = True
    fp32_weights: bool = False
    elements_per_thread: int = 8
    threads: int = 128
    prefetch_group: int = 4
    load_shared_expert_before_pdl: bool = False
    enable_pdl: bool = True
    reduce_threads: int = 128
    fuse_reduce: bool = False
    keep_own_partial: bool | None = None
    waves: int = 1
    epilogue: str = "none"
    fp8_out: str = "none"
    arch: str = "sm_90a"

    op = "publish"
    """The contract this config compiles (`_abi.CONTRACTS`)."""

    def __post_init__(self) -> None:
        # Normalize types first, so that equal configs have equal keys.
        if self.keep_own_partial is None:
            object.__setattr__(self, "keep_own_partial",
                               self.fuse_reduce is True and self.algorithm in _OWN_PARTIAL_ALGORITHMS)
        for field in _INT_FIELDS:
            value = getattr(self, field)
            _require(
                isinstance(value, numbers.Integral) and not isinstance(value, bool),
                field, value, "an int",
            )
            object.__setattr__(self, field, int(value))
        for field in _BOOL_FIELDS:
            value = getattr(self, field)
            _require(isinstance(value, bool), field, value, "a bool")
        scale = self.routed_scaling_factor
        _require(
            isinstance(scale, numbers.Real) and not isinstance(scale, bool) and math.isfinite(scale),
            "routed_scaling_factor", scale, "a finite float",
        )
        object.__setattr__(self, "routed_scaling_factor", float(scale) + 0.0)  # -0.0 -> 0.0
        _require(self.hidden > 0, "hidden", self.hidden, "a positive int")
        _require(1 <= self.top_k <= MAX_TOP_K, "top_k", self.top_k, f"an int in [1, {MAX_TOP_K}]")
        _require(1 <= self.tp <= protocol.MAX_TP, "tp", self.tp, f"an int in [1, {protocol.MAX_TP}]")
        _require(self.algorithm in ALGORITHMS, "algorithm", self.algorithm, f"one of {ALGORITHMS}")
        spec = _abi.ALGORITHMS[self.algorithm]
        if self.tp == 1:
            _require(not spec.group, "algorithm", self.algorithm, f"one of {SINGLE_ALGORITHMS} when tp == 1")
        else:
            _require(spec.group, "algorithm", self.algorithm, f"not one of {SINGLE_ALGORITHMS} when tp > 1")
        _require(
            self.elements_per_thread in (4, 8),
            "elements_per_thread", self.elements_per_thread, "4 or 8",
        )
        _require(
            self.hidden % self.elements_per_thread == 0,
            "hidden", self.hidden, f"a multiple of elements_per_thread={self.elements_per_thread}",
        )
        if self.tp > 1:
            _require(
                self.hidden % protocol.REDUCE_ELEMENTS == 0,
                "hidden", self.hidden,
                f"a multiple of {protocol.REDUCE_ELEMENTS} (16-byte mailbox lanes) when tp > 1",
            )
        for field in ("threads", "reduce_threads"):
            value = getattr(self, field)
            _require(
                32 <= value <= _abi.MAX_THREADS and value % 32 == 0,
                field, value, f"a multiple of 32 in [32, {_abi.MAX_THREADS}]",
            )
        _require(self.epilogue in EPILOGUES, "epilogue", self.epilogue, f"one of {EPILOGUES}")
        if self.epilogue != "none":
            _require(
                self.algorithm in EPILOGUE_ALGORITHMS,
                "algorithm", self.algorithm, f"one of {EPILOGUE_ALGORITHMS} with epilogue={self.epilogue!r}",
            )
            _require(
                self.norm_fragments_per_thread <= MAX_NORM_FRAGMENTS_PER_THREAD,
                "reduce_threads", self.reduce_threads,
                f"at least {-(-self.reduce_fragments // MAX_NORM_FRAGMENTS_PER_THREAD)} with "
                f"epilogue={self.epilogue!r} (at most {MAX_NORM_FRAGMENTS_PER_THREAD} fragments of "
                f"the {self.reduce_fragments} of a row per thread)",
            )
        _require(self.fp8_out in _abi.FP8_OUTS, "fp8_out", self.fp8_out, f"one of {_abi.FP8_OUTS}")
        if self.fp8_out != "none":
            _require(self.epilogue != "none", "fp8_out", self.fp8_out, "'none' without an epilogue")
        if self.fp8_out == "group":
            _require(self.hidden % _abi.FP8_GROUP == 0, "hidden", self.hidden,
                     f"a multiple of {_abi.FP8_GROUP} with fp8_out='group' (a scale per {_abi.FP8_GROUP} columns)")
        if self.fuse_reduce:
            _require(spec.fuses, "algorithm", self.algorithm, f"one of {FUSED_ALGORITHMS} with fuse_reduce=True")
            fused_epilogues = tuple(e for fused, e in spec.roles if fused)
            _require(self.epilogue in fused_epilogues, "epilogue", self.epilogue,
                     f"{' or '.join(map(repr, fused_epilogues))} with a fused {self.algorithm}")
            if self.epilogue != "none":
                # Each thread publishes the one fragment of the row that it then normalizes,
                # and a row's CTAs form one cluster. The reduce thread's limit of
                # MAX_NORM_FRAGMENTS_PER_THREAD 16-byte fragments (above) keeps that cluster
                # within _abi.MAX_CLUSTER_CTAS at either fragment width.
                _require(self.threads == self.reduce_threads, "threads", self.threads,
                         f"reduce_threads={self.reduce_threads} with fuse_reduce and "
                         f"epilogue={self.epilogue!r}")
        if self.keep_own_partial:
            _require(self.fuse_reduce and self.algorithm in _OWN_PARTIAL_ALGORITHMS, "keep_own_partial", True,
                     f"False unless fuse_reduce is True and the algorithm one of {_OWN_PARTIAL_ALGORITHMS}")
        _require(self.waves >= 1, "waves", self.waves, "an int >= 1")
        if self.waves > 1:
            _require(self.fuse_reduce, "waves", self.waves, "1 unless fuse_reduce is True")
        _require(
            1 <= self.prefetch_group <= self.top_k,
            "prefetch_group", self.prefetch_group, f"an int in [1, top_k={self.top_k}]",
        )
        if self.load_shared_expert_before_pdl:
            _require(
                self.include_shared_expert and self.enable_pdl,
                "load_shared_expert_before_pdl", True,
                "False unless include_shared_expert and enable_pdl are both True",
            )
        _require(self.arch in ARCHS, "arch", self.arch, f"one of {ARCHS}")

    # What the kernels branch on: the algorithm's facts (`_abi.ALGORITHMS`), never its name.

    @property
    def owned_rows(self) -> bool:
        """The reduce covers only the rows this rank owns (token ``t`` is rank ``t % tp``'s)."""
        return _abi.ALGORITHMS[self.algorithm].owned_rows

    @property
    def out_owned(self) -> bool:
        """The result holds only this rank's owned rows."""
        return _abi.ALGORITHMS[self.algorithm].out_owned

    @property
    def fans_out(self) -> bool:
        """An owner stores its rows' sums into every peer's gather area; the gather ends the call."""
        return _abi.ALGORITHMS[self.algorithm].fans_out

    # What a call's operands are (`_abi.call_operands`).

    max_m = 2**31 - 1
    """The most tokens of a call that the kernels take (they count in int32); a mailbox's
    ``capacity_m`` bounds a call further."""

    def operand_rows(self) -> dict:
        """The rows rules `_abi.OPERANDS` names that resolve per config."""
        return {"out_rows": _abi.ALGORITHMS[self.algorithm].out_rows,
                "shared": "m" if self.include_shared_expert else "zero"}

    def dimensions(self) -> dict:
        """The sizes `_abi.OPERANDS` names."""
        return {"hidden": self.hidden, "top_k": self.top_k, "fp8_groups": self.hidden // _abi.FP8_GROUP, "single": 1}

    def conditions(self) -> set:
        """The ``when`` words of the operands this config's calls take."""
        words = {"epilogue"} if self.epilogue != "none" else set()
        return words | ({f"fp8_{self.fp8_out}"} if self.fp8_out != "none" else set())

    def operand_dtypes(self) -> dict:
        """The dtypes of `_abi.OPERANDS`' per-config rules: the router weights' and out's."""
        return {"weights": "f32" if self.fp32_weights else "bf16", "out": "bf16" if self.fp8_out == "none" else "e4m3"}

    # Derived launch geometry: the single place it is computed.

    @property
    def fragments(self) -> int:
        """Publish fragments of ``elements_per_thread`` values per token."""
        return self.hidden // self.elements_per_thread

    @property
    def ctas_per_row(self) -> int:
        """Publish CTAs per token."""
        return -(-self.fragments // self.threads)

    @property
    def reduce_fragments(self) -> int:
        """16-byte reduce fragments per token."""
        return self.hidden // protocol.REDUCE_ELEMENTS

    @property
    def reduce_ctas_per_row(self) -> int:
        """Reduce CTAs per token: one with the epilogue, which needs the whole row."""
        if self.epilogue != "none":
            return 1
        return -(-self.reduce_fragments // self.reduce_threads)

    @property
    def norm_fragments_per_thread(self) -> int:
        """16-byte fragments of a row that each thread of the fused epilogue holds."""
        return -(-self.reduce_fragments // self.reduce_threads)

    @property
    def own_partial_tiles(self) -> int:
        """Tiles per CTA of a fused kernel whose own partial stays in shared memory (0 unless
        ``keep_own_partial``): as many fragments per thread as fit in ``OWN_PARTIAL_BYTES``."""
        if not self.keep_own_partial:
            return 0
        return max(1, OWN_PARTIAL_BYTES // (self.threads * self.elements_per_thread * 2))

    @property
    def key(self) -> str:
        """Stable name of this specialization; it names the cubin."""
        fields = self.to_dict()
        text = ",".join(f"{name}={fields[name]!r}" for name in sorted(fields))
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        kind = self.algorithm if self.epilogue == "none" else f"{self.algorithm}-{self.epilogue}"
        kind += "-fused" if self.fuse_reduce else ""
        kind += "" if self.fp8_out == "none" else f"-fp8{self.fp8_out}"
        return f"{kind}-h{self.hidden}-k{self.top_k}-tp{self.tp}-{self.arch}-{digest}"

    def to_dict(self) -> dict:
        """Field values, JSON-ready; ``fp8_out`` only where it is not "none", so that the
        bf16 configs keep the keys they had before it existed."""
        fields = dataclasses.asdict(self)
        if fields["fp8_out"] == "none":
            del fields["fp8_out"]
        return fields

    @classmethod
    def from_dict(cls, fields: dict) -> "KernelConfig":
        """The config whose `to_dict` is ``fields`` (validated)."""
        return cls(**fields)

    def replace(self, **changes) -> "KernelConfig":
        """A copy with ``changes`` applied (and validated); ``keep_own_partial``, unless given,
        follows a change of ``fuse_reduce``."""
        if "fuse_reduce" in changes:
            changes.setdefault("keep_own_partial", None)
        return dataclasses.replace(self, **changes)


def fp8_twins(configs: list[KernelConfig]) -> list[KernelConfig]:
    """Each epilogue config of a group among ``configs`` with an FP8 out: with a scale per 128
    columns where hidden allows it, and with a static scale. None at tp = 1, whose epilogue
    runs in XLA and quantizes there."""
    return list(dict.fromkeys(
        config.replace(fp8_out=mode) for config in configs if config.epilogue != "none" and config.tp > 1
        for mode in ("group", "static") if mode == "static" or config.hidden % _abi.FP8_GROUP == 0))
