"""Inline-PTX memory, bit and tensor-core helpers for the mailbox and experts kernels.

Addresses are raw 64-bit device addresses (``Int64``): the kernels receive
every buffer as one address parameter, so the parameter ABI stays a flat list
of ``u64``/``u32`` that the C++ launcher can fill without knowing CuTe layouts.
Packed bf16 data travels as ``Uint32`` words, two bf16 lanes per word, the
lower-addressed element in the low half.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(result_type, operands, text, constraints, *, side_effects, loc, ip):
    return llvm.inline_asm(
        result_type,
        operands,
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _scalar_at(address, instruction, result_type, register, side_effects, loc, ip, operands="", shared=False):
    """``instruction result, [address]<operands>;`` for one scalar result; ``shared``: a 32-bit
    shared-memory address, else a 64-bit one."""
    address = Int32(address) if shared else Int64(address)
    return _asm(
        result_type, [address.ir_value(loc=loc, ip=ip)],
        f"{instruction} $0, [$1]{operands};", f"={register},{'r' if shared else 'l'}",
        side_effects=side_effects, loc=loc, ip=ip,
    )


def _load_32_where(address, instruction, predicate, loc, ip):
    """``instruction`` (a 32-bit global load) at ``address`` where ``predicate`` (an Int32) is
    nonzero; 0 without access (and without a branch) elsewhere."""
    text = f"{{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\nmov.b32 $0, 0;\n@p {instruction} $0, [$1];\n}}"
    return _asm(T.i32(), [Int64(address).ir_value(loc=loc, ip=ip), Int32(predicate).ir_value(loc=loc, ip=ip)], text,
                "=&r,l,r", side_effects=False, loc=loc, ip=ip)


def _words_out(result, words, loc, ip):
    return [
        Uint32(llvm.extractvalue(T.i32(), result, [i], loc=loc, ip=ip)) for i in range(words)
    ]


def _vector_suffix(words: int) -> str:
    return {2: "v2", 4: "v4"}[words]


def _braced(first: int, count: int) -> str:
    return "{" + ",".join(f"${first + i}" for i in range(count)) + "}"


@dsl_user_op
def load_words(address: Int64, words: int, *, predicate=None, loc=None, ip=None) -> list:
    """Non-coherent vector load of ``words`` u32 (8 or 16 bytes) of read-only input.

    With ``predicate`` (an Int32, nonzero = load) the load is skipped and zeros
    are returned when it is zero: no branch, and no access to ``address``.
    """
    vec = _vector_suffix(words)
    outs = _braced(0, words)
    struct = llvm.StructType.get_literal([T.i32()] * words)
    if predicate is None:
        text = f"ld.global.nc.L1::no_allocate.{vec}.u32 {outs}, [${words}];"
        result = _asm(
            struct, [Int64(address).ir_value(loc=loc, ip=ip)],
            text, ",".join(["=r"] * words + ["l"]), side_effects=False, loc=loc, ip=ip,
        )
        return _words_out(result, words, loc, ip)
    zero = "\n".join(f"mov.b32 ${i}, 0;" for i in range(words))
    text = (
        "{\n.reg .pred p;\n"
        f"setp.ne.s32 p, ${words + 1}, 0;\n{zero}\n"
        f"@p ld.global.nc.L1::no_allocate.{vec}.u32 {outs}, [${words}];\n}}"
    )
    result = _asm(
        struct,
        [Int64(address).ir_value(loc=loc, ip=ip), Int32(predicate).ir_value(loc=loc, ip=ip)],
        text, ",".join(["=&r"] * words + ["l", "r"]), side_effects=False, loc=loc, ip=ip,
    )
    return _words_out(result, words, loc, ip)


@dsl_user_op
def load_volatile_words(address: Int64, words: int, *, predicate=None, loc=None, ip=None) -> list:
    """Volatile vector load of ``words`` u32: always re-reads memory (mailbox polling).

    With ``predicate`` (an Int32, nonzero = load) the load is skipped and zeros
    are returned when it is zero, without access to ``address``.
    """
    struct = llvm.StructType.get_literal([T.i32()] * words)
    load = f"ld.volatile.global.{_vector_suffix(words)}.u32 {_braced(0, words)}, [${words}];"
    if predicate is None:
        result = _asm(
            struct, [Int64(address).ir_value(loc=loc, ip=ip)],
            load, ",".join(["=r"] * words + ["l"]), side_effects=True, loc=loc, ip=ip,
        )
        return _words_out(result, words, loc, ip)
    zero = "\n".join(f"mov.b32 ${i}, 0;" for i in range(words))
    text = f"{{\n.reg .pred p;\nsetp.ne.s32 p, ${words + 1}, 0;\n{zero}\n@p {load}\n}}"
    result = _asm(
        struct,
        [Int64(address).ir_value(loc=loc, ip=ip), Int32(predicate).ir_value(loc=loc, ip=ip)],
        text, ",".join(["=&r"] * words + ["l", "r"]), side_effects=True, loc=loc, ip=ip,
    )
    return _words_out(result, words, loc, ip)


@dsl_user_op
def store_words(address: Int64, values: list, *, predicate=None, loc=None, ip=None) -> None:
    """Vector store of 2 or 4 u32 words (local or peer memory); with ``predicate`` (an Int32)
    only where it is nonzero."""
    words = len(values)
    text = f"st.global.{_vector_suffix(words)}.u32 [$0], {_braced(1, words)};"
    operands = [Int64(address).ir_value(loc=loc, ip=ip)] + [Uint32(v).ir_value(loc=loc, ip=ip) for v in values]
    constraints = ["l"] + ["r"] * words
    if predicate is not None:
        text = f"{{\n.reg .pred p;\nsetp.ne.s32 p, ${words + 1}, 0;\n@p {text}\n}}"
        operands.append(Int32(predicate).ir_value(loc=loc, ip=ip))
        constraints.append("r")
    _asm(None, operands, text, ",".join(constraints), side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_async_cluster_f32(address, value, barrier, *, loc=None, ip=None) -> None:
    """Store one float at a 32-bit ``shared::cluster`` address (a CTA of the cluster) and
    count its 4 bytes as complete on that CTA's mbarrier at ``barrier`` (same addressing)."""
    _asm(
        None, [Int32(address).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip),
               Int32(barrier).ir_value(loc=loc, ip=ip)],
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [$0], $1, [$2];", "r,f,r",
        side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def copy_async(shared, address: Int64, nbytes: int, *, predicate=None, loc=None, ip=None) -> None:
    """``cp.async`` of ``nbytes`` (4, 8 or 16) from global ``address`` to the 32-bit shared
    address ``shared``, through L2 only where 16 bytes. With ``predicate`` (an Int32) 0, no byte
    is read and the destination is zero-filled. Complete after `wait_async_groups`."""
    kind = "cg" if nbytes == 16 else "ca"
    operands = [Int32(shared).ir_value(loc=loc, ip=ip), Int64(address).ir_value(loc=loc, ip=ip)]
    if predicate is None:
        text, constraints = f"cp.async.{kind}.shared.global [$0], [$1], {nbytes};", "r,l"
    else:
        text = ("{\n.reg .pred p;\n.reg .b32 n;\nsetp.ne.s32 p, $2, 0;\n"
                f"selp.b32 n, {nbytes}, 0, p;\ncp.async.{kind}.shared.global [$0], [$1], {nbytes}, n;\n}}")
        operands.append(Int32(predicate).ir_value(loc=loc, ip=ip))
        constraints = "r,l,r"
    _asm(None, operands, text, constraints, side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def commit_async_group(*, loc=None, ip=None) -> None:
    """Close this thread's group of `copy_async` copies issued since the last one."""
    _asm(None, [], "cp.async.commit_group;", "", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def wait_async_groups(pending: int, *, loc=None, ip=None) -> None:
    """Wait until at most ``pending`` of this thread's committed copy groups are incomplete."""
    _asm(None, [], f"cp.async.wait_group {pending};", "", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def load_shared_words(address, words: int, *, loc=None, ip=None) -> list:
    """Vector load of ``words`` u32 (2 or 4) at the 32-bit shared ``address``."""
    struct = llvm.StructType.get_literal([T.i32()] * words)
    result = _asm(struct, [Int32(address).ir_value(loc=loc, ip=ip)],
                  f"ld.shared.{_vector_suffix(words)}.u32 {_braced(0, words)}, [${words}];",
                  ",".join(["=r"] * words + ["r"]), side_effects=True, loc=loc, ip=ip)
    return _words_out(result, words, loc, ip)


@dsl_user_op
def load_shared_u32(address, *, loc=None, ip=None) -> Uint32:
    """Load of one u32 at the 32-bit shared ``address``."""
    return Uint32(_scalar_at(address, "ld.shared.u32", T.i32(), "r", True, loc, ip, shared=True))


@dsl_user_op
def load_shared_f32(address, *, loc=None, ip=None) -> Float32:
    """Load of one float32 at the 32-bit shared ``address``."""
    return Float32(_scalar_at(address, "ld.shared.f32", T.f32(), "f", True, loc, ip, shared=True))


@dsl_user_op
def cluster_address(address, cta, *, loc=None, ip=None) -> Int32:
    """The 32-bit ``shared::cluster`` address of this CTA's shared ``address`` in CTA ``cta``
    of the cluster (``mapa``; kept in place, so that a loop over CTAs holds one at a time)."""
    return Int32(_asm(T.i32(), [Int32(address).ir_value(loc=loc, ip=ip), Int32(cta).ir_value(loc=loc, ip=ip)],
                      "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r", side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def load_cluster_f32(address, *, loc=None, ip=None) -> Float32:
    """Load of one float at a 32-bit ``shared::cluster`` address (a CTA of the cluster)."""
    return Float32(_scalar_at(address, "ld.shared::cluster.f32", T.f32(), "f", True, loc, ip, shared=True))


@dsl_user_op
def load_s32(address: Int64, *, predicate=None, loc=None, ip=None) -> Int32:
    """Non-coherent load of one int32 of read-only input; 0 without access where ``predicate``
    (an Int32) is 0."""
    if predicate is None:
        return Int32(_scalar_at(address, "ld.global.nc.s32", T.i32(), "r", False, loc, ip))
    return Int32(_load_32_where(address, "ld.global.nc.s32", predicate, loc, ip))


@dsl_user_op
def load_f32(address: Int64, *, loc=None, ip=None) -> Float32:
    """Non-coherent load of one float32 of read-only input."""
    return Float32(_scalar_at(address, "ld.global.nc.f32", T.f32(), "f", False, loc, ip))


@dsl_user_op
def load_bf16_as_f32(address: Int64, *, loc=None, ip=None) -> Float32:
    """Non-coherent load of one bf16, widened exactly to float32."""
    return Float32(
        _asm(
            T.f32(), [Int64(address).ir_value(loc=loc, ip=ip)],
            "{\n.reg .b32 h;\nld.global.nc.u16 h, [$1];\nshl.b32 $0, h, 16;\n}",
            "=f,l", side_effects=False, loc=loc, ip=ip,
        )
    )


@dsl_user_op
def load_u64(address: Int64, *, loc=None, ip=None) -> Int64:
    """Non-coherent load of one 64-bit word (peer tables)."""
    return Int64(_scalar_at(address, "ld.global.nc.u64", T.i64(), "l", False, loc, ip))


@dsl_user_op
def load_volatile_s32(address: Int64, *, loc=None, ip=None) -> Int32:
    """Volatile load of one int32 (stage words)."""
    return Int32(_scalar_at(address, "ld.volatile.global.s32", T.i32(), "r", True, loc, ip))


@dsl_user_op
def store_volatile_s32(address: Int64, value, *, loc=None, ip=None) -> None:
    """Volatile store of one int32 (stage and status words)."""
    _asm(
        None, [Int64(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
        "st.volatile.global.s32 [$0], $1;", "l,r", side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def fetch_add_s32(address: Int64, value, *, loc=None, ip=None) -> Int32:
    """Atomically add ``value`` to the int32 at ``address``; returns the old value."""
    return Int32(
        _asm(T.i32(), [Int64(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
             "atom.global.add.s32 $0, [$1], $2;", "=r,l,r", side_effects=True, loc=loc, ip=ip)
    )


@dsl_user_op
def increment_wrapping_u32(address: Int64, last, *, loc=None, ip=None) -> None:
    """Atomically increment the uint32 at ``address``, from ``last`` back to 0, without
    waiting for the result."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Uint32(last).ir_value(loc=loc, ip=ip)],
         "red.global.inc.u32 [$0], $1;", "l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def claim_s32(address: Int64, *, loc=None, ip=None) -> Int32:
    """Atomically set the int32 at ``address`` from 0 to 1; returns the old value (0: claimed)."""
    return Int32(_scalar_at(address, "atom.global.cas.b32", T.i32(), "r", True, loc, ip, operands=", 0, 1"))


@dsl_user_op
def fence_system(*, loc=None, ip=None) -> None:
    """Make this thread's earlier stores visible to the host and to peers."""
    _asm(None, [], "fence.sc.sys;", "~{memory}", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """Abort the kernel: the launch fails, so the host sees an error instead of a hang."""
    _asm(None, [], "trap;", "~{memory}", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def global_timer_ns(*, loc=None, ip=None) -> Int64:
    """The GPU's global nanosecond timer."""
    return Int64(
        _asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", side_effects=True, loc=loc, ip=ip)
    )


@dsl_user_op
def bf16x2_to_f32(word, *, loc=None, ip=None) -> tuple:
    """Widen the two bf16 lanes of a word to float32 (exact): (low lane, high lane)."""
    w = Uint32(word).ir_value(loc=loc, ip=ip)
    low = _asm(T.f32(), [w], "shl.b32 $0, $1, 16;", "=f,r", side_effects=False, loc=loc, ip=ip)
    high = _asm(
        T.f32(), [w], "and.b32 $0, $1, 0xffff0000;", "=f,r", side_effects=False, loc=loc, ip=ip
    )
    return Float32(low), Float32(high)


@dsl_user_op
def f32x2_to_bf16x2(low, high, *, loc=None, ip=None) -> Uint32:
    """Round two float32 to bf16 (round to nearest even) and pack them: low lane first."""
    return Uint32(
        _asm(
            T.i32(),
            [Float32(high).ir_value(loc=loc, ip=ip), Float32(low).ir_value(loc=loc, ip=ip)],
            "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", side_effects=False, loc=loc, ip=ip,
        )
    )


@dsl_user_op
def positive_zero_bf16x2(word, *, loc=None, ip=None) -> Uint32:
    """Turn each bf16 lane equal to -0.0 (the mailbox sentinel) into +0.0."""
    text = (
        "{\n.reg .pred p;\n.reg .b32 t;\nmov.b32 $0, $1;\n"
        "and.b32 t, $0, 0xffff;\nsetp.eq.u32 p, t, 0x8000;\n@p and.b32 $0, $0, 0xffff0000;\n"
        "and.b32 t, $0, 0xffff0000;\nsetp.eq.u32 p, t, 0x80000000;\n@p and.b32 $0, $0, 0xffff;\n}"
    )
    return Uint32(
        _asm(T.i32(), [Uint32(word).ir_value(loc=loc, ip=ip)], text, "=r,r",
             side_effects=False, loc=loc, ip=ip)
    )


def has_empty_lane(words: list) -> Uint32:
    """Nonzero when any bf16 lane of ``words`` equals the empty sentinel 0x8000.

    A lane is empty when ``lane ^ 0x8000 == 0``; the zero-halfword test
    ``(v - 0x00010001) & ~v & 0x80008000`` is exact for *any* zero lane.
    """
    flags = Uint32(0)
    for word in words:
        v = Uint32(word) ^ Uint32(0x80008000)
        flags = flags | ((v - Uint32(0x00010001)) & ~v & Uint32(0x80008000))
    return flags


@dsl_user_op
def shuffle_xor_f32(value, lane_mask: int, *, loc=None, ip=None) -> Float32:
    """``value`` of lane ``lane ^ lane_mask`` of this warp; every lane must take part."""
    return Float32(
        _asm(
            T.f32(), [Float32(value).ir_value(loc=loc, ip=ip)],
            f"shfl.sync.bfly.b32 $0, $1, {lane_mask}, 0x1f, 0xffffffff;", "=f,f",
            side_effects=True, loc=loc, ip=ip,
        )
    )


@dsl_user_op
def max_abs_nan_f32(maximum, value, *, loc=None, ip=None) -> Float32:
    """``max(maximum, |value|)``, NaN if either is NaN (``max.NaN``)."""
    return Float32(
        _asm(
            T.f32(), [Float32(maximum).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
            "{\n.reg .f32 a;\nabs.f32 a, $2;\nmax.NaN.f32 $0, $1, a;\n}", "=f,f,f",
            side_effects=False, loc=loc, ip=ip,
        )
    )


def _binary_f32(opcode: str, a, b, loc, ip) -> Float32:
    """``opcode $0, $1, $2;`` on two float32."""
    return Float32(
        _asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
             f"{opcode} $0, $1, $2;", "=f,f,f", side_effects=False, loc=loc, ip=ip)
    )


@dsl_user_op
def max_nan_f32(a, b, *, loc=None, ip=None) -> Float32:
    """``max(a, b)``, NaN if either is NaN (``max.NaN``)."""
    return _binary_f32("max.NaN.f32", a, b, loc, ip)


@dsl_user_op
def div_rn_f32(numerator, denominator, *, loc=None, ip=None) -> Float32:
    """``numerator / denominator``, IEEE-rounded to nearest even (``div.rn``)."""
    return _binary_f32("div.rn.f32", numerator, denominator, loc, ip)


@dsl_user_op
def f32x4_to_e4m3x4(v0, v1, v2, v3, *, loc=None, ip=None) -> Uint32:
    """Round four float32 to float8_e4m3fn (nearest even, saturating to +-448, NaN kept) and
    pack them: ``v0`` in the lowest byte."""
    operands = [Float32(v).ir_value(loc=loc, ip=ip) for v in (v0, v1, v2, v3)]
    text = ("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\nmov.b32 $0, {lo, hi};\n}")
    return Uint32(_asm(T.i32(), operands, text, "=r,f,f,f,f", side_effects=False, loc=loc, ip=ip))


def _widen_e4m3x2(source: str, out: str, tag: str = "") -> tuple[str, str]:
    """PTX that widens the two float8_e4m3fn in the b16 register ``source`` (byte 0 low) to a
    bf16x2 word in ``out``: exact, since every e4m3 value is a bf16 value, through float16 and
    float32 (both exact for e4m3; a NaN stays a NaN). ``(declarations, instructions)``, its
    registers named with ``tag``."""
    h0, h1, p, f0, f1 = (f"{name}{tag}" for name in ("h0", "h1", "p", "f0", "f1"))
    return (f".reg .b16 {h0}, {h1};\n.reg .b32 {p};\n.reg .f32 {f0}, {f1};\n",
            f"cvt.rn.f16x2.e4m3x2 {p}, {source};\nmov.b32 {{{h0}, {h1}}}, {p};\n"
            f"cvt.f32.f16 {f0}, {h0};\ncvt.f32.f16 {f1}, {h1};\ncvt.rn.bf16x2.f32 {out}, {f1}, {f0};\n")


def _shift_widen_e4m3x2(source: str, out: str, tag: str = "") -> tuple[str, str]:
    """`_widen_e4m3x2` with one conversion: e4m3 to float16 (every e4m3 value a normal float16
    or zero), then each half's sign kept and its exponent and mantissa shifted right by 3 into
    bf16's fields, which reads as the value times 2**-112 (a normal bf16, or zero), and an exact
    bf16 multiply by 2**112. A NaN comes out finite."""
    p, t, mask, scale = (f"{name}{tag}" for name in ("p", "t", "mask", "scale"))
    return (f".reg .b32 {p}, {t}, {mask}, {scale};\n",
            f"cvt.rn.f16x2.e4m3x2 {p}, {source};\nshr.u32 {t}, {p}, 3;\nand.b32 {t}, {t}, 0x0FFF0FFF;\n"
            f"mov.b32 {mask}, 0x80008000;\nlop3.b32 {p}, {p}, {t}, {mask}, 0xEC;\n"  # (p & mask) | t
            f"mov.b32 {scale}, 0x77807780;\nmul.rn.bf16x2 {out}, {p}, {scale};\n")  # 2**112 in each half


def _e4m3x2_widening(shift: bool):
    """`_shift_widen_e4m3x2` with ``shift``, else `_widen_e4m3x2`."""
    return _shift_widen_e4m3x2 if shift else _widen_e4m3x2


@dsl_user_op
def e4m3x4_to_bf16x4(word, *, shift: bool = False, loc=None, ip=None) -> list:
    """The four float8_e4m3fn of a word widened to bf16 (`_widen_e4m3x2`, or with ``shift``
    `_shift_widen_e4m3x2`) and packed as two words: bytes 0 and 1 in the first (byte 0 in its
    low half), 2 and 3 in the second."""
    widen = _e4m3x2_widening(shift)
    (low_declared, low), (high_declared, high) = widen("lo", "$0", "a"), widen("hi", "$1", "b")
    text = "{\n.reg .b16 lo, hi;\n" + low_declared + high_declared + "mov.b32 {lo, hi}, $2;\n" + low + high + "}"
    struct = llvm.StructType.get_literal([T.i32()] * 2)
    result = _asm(struct, [Uint32(word).ir_value(loc=loc, ip=ip)], text, "=r,=r,r", side_effects=False, loc=loc,
                  ip=ip)
    return _words_out(result, 2, loc, ip)


@dsl_user_op
def prefetch_l2(address: Int64, nbytes, *, loc=None, ip=None) -> None:
    """Have ``nbytes`` (a multiple of 16) from the 16-byte aligned global ``address`` brought
    into L2 (``cp.async.bulk.prefetch``): one instruction, no register, nothing to wait for."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Int32(nbytes).ir_value(loc=loc, ip=ip)],
         "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def copy_bulk(shared, address: Int64, nbytes, barrier, *, loc=None, ip=None) -> None:
    """``cp.async.bulk`` of ``nbytes`` (a multiple of 16) from the 16-byte aligned global
    ``address`` to the 16-byte aligned 32-bit shared address ``shared``: its bytes count
    towards the transaction of the mbarrier at the shared address ``barrier``."""
    _asm(None, [Int32(shared).ir_value(loc=loc, ip=ip), Int64(address).ir_value(loc=loc, ip=ip),
                Int32(nbytes).ir_value(loc=loc, ip=ip), Int32(barrier).ir_value(loc=loc, ip=ip)],
         "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];", "r,l,r,r",
         side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def store_f32(address: Int64, value, *, loc=None, ip=None) -> None:
    """Store of one float32."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
         "st.global.f32 [$0], $1;", "l,f", side_effects=True, loc=loc, ip=ip)


def warp_sum_f32(value) -> Float32:
    """Sum of ``value`` over the 32 lanes of the warp, in every lane.

    A butterfly: at each step lanes ``i`` and ``i ^ k`` add the same two
    numbers (in swapped order, which float addition ignores), so every lane
    ends with the same bits.
    """
    total = Float32(value)
    for lane_mask in (16, 8, 4, 2, 1):
        total = total + shuffle_xor_f32(total, lane_mask)
    return total


@dsl_user_op
def rsqrt_f32(value, *, loc=None, ip=None) -> Float32:
    """``1 / sqrt(value)`` (``rsqrt.approx``: at most about 2**-22.9 relative error)."""
    return Float32(
        _asm(
            T.f32(), [Float32(value).ir_value(loc=loc, ip=ip)],
            "rsqrt.approx.f32 $0, $1;", "=f,f", side_effects=False, loc=loc, ip=ip,
        )
    )


# --- the experts' GEMM ---------------------------------------------------------------------


@dsl_user_op
def load_u32(address: Int64, *, predicate=None, cached: bool = False, loc=None, ip=None) -> Uint32:
    """Load of one u32 (two bf16 lanes), 0 without access where ``predicate`` (an Int32) is 0.
    ``cached``: through L2 only (``.cg``), for data a kernel earlier in the call wrote;
    otherwise non-coherent, for read-only input."""
    kind = "ld.global.cg.u32" if cached else "ld.global.nc.u32"
    return Uint32(_load_32_where(address, kind, Int32(1) if predicate is None else predicate, loc, ip))


@dsl_user_op
def load_e4m3x2_as_bf16x2(address: Int64, *, predicate=None, shift: bool = False, loc=None, ip=None) -> Uint32:
    """Non-coherent load of two e4m3 (2 bytes) of read-only input, widened to a bf16x2 word
    (the first in its low half; with ``shift`` by `_shift_widen_e4m3x2`); 0 without access where
    ``predicate`` (an Int32) is 0."""
    declared, widen = _e4m3x2_widening(shift)("h", "$0")
    text = ("{\n.reg .pred q;\n.reg .b16 h;\n" + declared + "setp.ne.s32 q, $2, 0;\nmov.b16 h, 0;\n"
            "@q ld.global.nc.u16 h, [$1];\n" + widen + "}")
    one = Int32(1) if predicate is None else Int32(predicate)
    return Uint32(
        _asm(T.i32(), [Int64(address).ir_value(loc=loc, ip=ip), one.ir_value(loc=loc, ip=ip)], text, "=r,l,r",
             side_effects=False, loc=loc, ip=ip)
    )


@dsl_user_op
def load_shared_e4m3x2_as_bf16x2(address, *, shift: bool = False, loc=None, ip=None) -> Uint32:
    """Load of two e4m3 (2 bytes) at the 32-bit shared ``address``, widened to a bf16x2 word
    (with ``shift`` by `_shift_widen_e4m3x2`)."""
    declared, widen = _e4m3x2_widening(shift)("h", "$0")
    text = "{\n.reg .b16 h;\n" + declared + "ld.shared.u16 h, [$1];\n" + widen + "}"
    return Uint32(_asm(T.i32(), [Int32(address).ir_value(loc=loc, ip=ip)], text, "=r,r", side_effects=True,
                       loc=loc, ip=ip))


@dsl_user_op
def store_u32(address: Int64, value, *, loc=None, ip=None) -> None:
    """Store of one u32 (two bf16 lanes)."""
    _asm(None, [Int64(address).ir_value(loc=loc, ip=ip), Uint32(value).ir_value(loc=loc, ip=ip)],
         "st.global.u32 [$0], $1;", "l,r", side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def pair_halves(low_source, high_source, high: bool, *, loc=None, ip=None) -> Uint32:
    """The low (``high`` False) or high bf16 lanes of two words, packed: the lane of
    ``low_source`` in the low half (``prmt`` 0x5410 or 0x7632)."""
    selector = "0x7632" if high else "0x5410"
    return Uint32(
        _asm(T.i32(), [Uint32(low_source).ir_value(loc=loc, ip=ip), Uint32(high_source).ir_value(loc=loc, ip=ip)],
             f"prmt.b32 $0, $1, $2, {selector};", "=r,r,r", side_effects=False, loc=loc, ip=ip)
    )


@dsl_user_op
def mma_bf16_16x8x16(a: list, b: list, c: list, *, loc=None, ip=None) -> list:
    """``D = A B + C`` on the tensor cores: ``mma.sync.aligned.m16n8k16.row.col`` with bf16 A
    (16 x 16, four words per lane) and B (16 x 8, two words), float32 C and D (four per lane),
    in the PTX ISA's fragment layouts (lane ``l``: group ``l // 4``, ``l % 4`` within it)."""
    struct = llvm.StructType.get_literal([T.f32()] * 4)
    operands = ([Uint32(x).ir_value(loc=loc, ip=ip) for x in a] + [Uint32(x).ir_value(loc=loc, ip=ip) for x in b]
                + [Float32(x).ir_value(loc=loc, ip=ip) for x in c])
    text = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")
    result = _asm(struct, operands, text, ",".join(["=f"] * 4 + ["r"] * 6 + ["f"] * 4),
                  side_effects=False, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), result, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def exp2_f32(value, *, loc=None, ip=None) -> Float32:
    """``2 ** value`` (``ex2.approx.ftz``: at most 2 ulp from the exact result)."""
    return Float32(
        _asm(T.f32(), [Float32(value).ir_value(loc=loc, ip=ip)], "ex2.approx.ftz.f32 $0, $1;", "=f,f",
             side_effects=False, loc=loc, ip=ip)
    )


@dsl_user_op
def shared_fetch_add_s32(address, value, *, predicate=None, loc=None, ip=None) -> Int32:
    """Atomically add ``value`` to the int32 at the 32-bit shared-memory ``address``; the old
    value. Where ``predicate`` (an Int32) is 0: no access, and 0 (no branch)."""
    operands = [Int32(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)]
    if predicate is None:
        return Int32(_asm(T.i32(), operands, "atom.shared.add.u32 $0, [$1], $2;", "=r,r,r", side_effects=True,
                          loc=loc, ip=ip))
    text = "{\n.reg .pred p;\nsetp.ne.s32 p, $3, 0;\nmov.b32 $0, 0;\n@p atom.shared.add.u32 $0, [$1], $2;\n}"
    return Int32(_asm(T.i32(), operands + [Int32(predicate).ir_value(loc=loc, ip=ip)], text, "=&r,r,r,r",
                      side_effects=True, loc=loc, ip=ip))


@dsl_user_op
def store_shared_s32(address, value, *, predicate, loc=None, ip=None) -> None:
    """Store of one int32 at the 32-bit shared-memory ``address`` where ``predicate`` (an Int32)
    is nonzero; no access (and no branch) elsewhere."""
    _asm(None, [Int32(address).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip),
                Int32(predicate).ir_value(loc=loc, ip=ip)],
         "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\n@p st.shared.b32 [$0], $1;\n}", "r,r,r", side_effects=True,
         loc=loc, ip=ip)


@dsl_user_op
def shuffle_up_s32(value, delta: int, *, loc=None, ip=None) -> Int32:
    """``value`` of lane ``lane - delta`` (this lane's own below ``delta``); every lane takes part."""
    return Int32(
        _asm(T.i32(), [Int32(value).ir_value(loc=loc, ip=ip)],
             f"shfl.sync.up.b32 $0, $1, {delta}, 0x0, 0xffffffff;", "=r,r", side_effects=True, loc=loc, ip=ip)
    )


def warp_exclusive_sum(value, lane) -> tuple:
    """(sum of ``value`` over the lanes below this one, sum over the whole warp): a scan of
    shuffles, every lane taking part."""
    inclusive = Int32(value)
    for delta in (1, 2, 4, 8, 16):
        below = shuffle_up_s32(inclusive, delta)
        inclusive = inclusive + cutlass.select_(lane >= delta, below, Int32(0))
    total = shuffle_index_s32(inclusive, 31)
    return inclusive - Int32(value), total


@dsl_user_op
def shuffle_index_s32(value, lane: int, *, loc=None, ip=None) -> Int32:
    """``value`` of lane ``lane``, in every lane; every lane takes part."""
    return Int32(
        _asm(T.i32(), [Int32(value).ir_value(loc=loc, ip=ip)],
             f"shfl.sync.idx.b32 $0, $1, {lane}, 0x1f, 0xffffffff;", "=r,r", side_effects=True, loc=loc, ip=ip)
    )
