"""Compile tier (CPU, CI): the PTX that widens e4m3 weights to bf16 (`ptx._widen_e4m3x2` and
`ptx._shift_widen_e4m3x2`), run instruction by instruction in NumPy over every pair of e4m3
codes and compared with the codes' values: the text the kernels hold, not a retelling of it."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("cutlass")

from jax_moe_publish.kernels import ptx  # noqa: E402

CODES = np.arange(1 << 16, dtype=np.uint32)  # every (high byte, low byte) pair of e4m3 codes


def _e4m3_to_f16_bits(code):
    """float16 bits of e4m3 codes (exact: every e4m3 value is a float16 value)."""
    values = code.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float16)
    return values.view(np.uint16).astype(np.uint32)


def _bf16_bits(values):
    """bf16 bits of float32 values (round to nearest even; exact for the values here)."""
    return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)


def _bf16x2(word):
    """The two bf16 halves of 32-bit words as float32: (low, high)."""
    halves = [(word >> shift) & 0xFFFF for shift in (0, 16)]
    return [half.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32) for half in halves]


def _run(text: str, source: np.ndarray) -> np.ndarray:
    """The 32-bit register ``out`` after ``text`` (the instructions of a widening, ``source``
    its b16 input), with only the instructions the widenings use."""
    regs = {"src": source}

    def value(operand):
        return np.uint32(int(operand, 16)) if operand.startswith("0x") else regs[operand]

    for line in filter(None, (line.strip().rstrip(";") for line in text.splitlines())):
        op, _, rest = line.partition(" ")
        args = [arg.strip() for arg in re.split(r",(?![^{]*})", rest)]
        if op == "cvt.rn.f16x2.e4m3x2":
            s = value(args[1])
            regs[args[0]] = _e4m3_to_f16_bits(s & 0xFF) | (_e4m3_to_f16_bits(s >> 8) << 16)
        elif op == "mov.b32" and args[0].startswith("{"):
            low, high = (name.strip() for name in args[0].strip("{}").split(","))
            regs[low], regs[high] = value(args[1]) & 0xFFFF, value(args[1]) >> 16
        elif op == "mov.b32":
            regs[args[0]] = np.broadcast_to(value(args[1]), source.shape)
        elif op == "cvt.f32.f16":
            regs[args[0]] = value(args[1]).astype(np.uint16).view(np.float16).astype(np.float32)
        elif op == "cvt.rn.bf16x2.f32":  # d = {a: high half, b: low half}
            regs[args[0]] = (_bf16_bits(value(args[1])) << 16) | _bf16_bits(value(args[2]))
        elif op == "shr.u32":
            regs[args[0]] = value(args[1]) >> np.uint32(int(args[2]))
        elif op == "and.b32":
            regs[args[0]] = value(args[1]) & value(args[2])
        elif op == "lop3.b32":
            a, b, c, lut = value(args[1]), value(args[2]), value(args[3]), int(args[4], 16)
            out = np.zeros_like(a)
            for index in range(8):  # the truth table's entry for each (a, b, c) bit triple
                if lut >> index & 1:
                    bits = [(x if index >> shift & 1 else ~x) for x, shift in ((a, 2), (b, 1), (c, 0))]
                    out |= bits[0] & bits[1] & bits[2]
            regs[args[0]] = out
        elif op == "mul.rn.bf16x2":
            (a_low, a_high), (b_low, b_high) = _bf16x2(value(args[1])), _bf16x2(value(args[2]))
            regs[args[0]] = (_bf16_bits(a_high * b_high) << 16) | _bf16_bits(a_low * b_low)
        else:
            raise AssertionError(f"an instruction this test does not run: {line}")
    return regs["out"]


@pytest.mark.parametrize("widen", [ptx._widen_e4m3x2, ptx._shift_widen_e4m3x2], ids=["three_conversions", "shift"])
def test_every_e4m3_pair_widens_to_its_value(widen):
    """Both halves of every pair of codes: the bf16 bits of the code's value (bf16 holds every
    e4m3 value), -0.0 kept; NaN codes NaN through the conversions, finite through the shift."""
    _, instructions = widen("src", "out")
    low, high = _bf16x2(_run(instructions, CODES))
    for got, codes in ((low, CODES & 0xFF), (high, CODES >> 8)):
        want = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        nan = np.isnan(want)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
        if widen is ptx._widen_e4m3x2:
            assert np.all(np.isnan(got[nan]))
        else:
            assert np.all(np.isfinite(got[nan]))
