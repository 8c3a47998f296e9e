"""The examples on CPU: each runs the reference path, says so and passes its check against the
float64 model (`examples/model.py`), whose bound is tested here against a float32 evaluation.
A flag out of its range is a usage error (exit 2) that names it, before anything runs."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import model  # noqa: E402

CHECK = "against the float64 model: ‖out−ref‖/‖ref‖ = "


def run_example(*args):
    run = subprocess.run([sys.executable, str(EXAMPLES / args[0]), *args[1:]], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-4000:]}\nstderr:\n{run.stderr[-4000:]}"
    return run.stdout


USAGE_ERRORS = [
    ("moe_block_decode.py", ["--check-layers", "-1"], "argument --check-layers: expected an int >= 1, got -1"),
    ("moe_block_decode.py", ["--check-layers", "0"], "argument --check-layers: expected an int >= 1, got 0"),
    ("moe_block_decode.py", ["--layers", "2", "--check-layers", "3"],
     "argument --check-layers: expected at most --layers 2, got 3"),
    ("moe_block_decode.py", ["--experts", "0"], "argument --experts: expected an int >= 1, got 0"),
    ("moe_block_decode.py", ["--problems", "deepseek-v3", "--experts", "4"],
     "argument --experts: expected at least deepseek-v3's top-k 8, got 4"),
    ("moe_block_decode.py", ["--tokens", "0"], "argument --tokens: expected an int >= 1, got 0"),
    ("moe_block_decode.py", ["--steps", "-1"], "argument --steps: expected an int >= 0, got -1"),
    ("moe_block_decode.py", ["--rank-processes", "0"], "argument --rank-processes: expected an int >= 1, got 0"),
    ("tp_moe_decode.py", ["--steps", "-3"], "argument --steps: expected an int >= 0, got -3"),
    ("tp_moe_decode.py", ["--tokens", "0"], "argument --tokens: expected an int >= 1, got 0"),
    ("tp_moe_decode.py", ["--tokens", "many"], "argument --tokens: expected an int, got 'many'"),
    ("multiprocess_decode.py", ["--steps", "-3"], "argument --steps: expected an int >= 0, got -3"),
    ("multiprocess_decode.py", ["--processes", "-2"], "argument --processes: expected an int >= 0, got -2"),
    ("multiprocess_decode.py", ["--layers", "0"], "argument --layers: expected an int >= 1, got 0"),
    ("multiprocess_decode.py", ["--deadline", "0"], "argument --deadline: expected a finite number > 0, got 0"),
    ("multiprocess_decode.py", ["--deadline", "nan"], "argument --deadline: expected a finite number > 0, got nan"),
]


@pytest.mark.parametrize("script,args,message", USAGE_ERRORS, ids=[f"{s} {' '.join(a)}" for s, a, _ in USAGE_ERRORS])
def test_flags_out_of_range_are_usage_errors(script, args, message):
    run = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, f"stdout:\n{run.stdout[-2000:]}\nstderr:\n{run.stderr[-2000:]}"
    assert message in run.stderr, run.stderr
    assert "checks passed" not in run.stdout and CHECK not in run.stdout


def test_tp_moe_decode_with_no_steps_checks_and_times_nothing():
    out = run_example("tp_moe_decode.py", "--steps", "0")
    (line,) = [line for line in out.splitlines() if CHECK in line]
    assert line.endswith(": PASS"), line
    assert "per decode layer step" not in out


def test_tp_moe_decode_checks_the_reference_path():
    out = run_example("tp_moe_decode.py", "--steps", "2")
    assert "running the pure-JAX reference path on 4 virtual CPU devices, tp=4" in out
    (line,) = [line for line in out.splitlines() if CHECK in line]
    assert line.startswith("tokens=32 hidden=512 top_k=4 tp=4 ") and line.endswith(": PASS"), line


def test_tp_moe_decode_as_rank_processes_checks_every_rank():
    """``--rank-processes 3``: three processes of one CPU device each (the switch that runs a group
    on one GPU), each checking the group's result against the model."""
    out = run_example("tp_moe_decode.py", "--steps", "1", "--rank-processes", "3")
    lines = [line for line in out.splitlines() if CHECK in line]
    assert sorted(line.split("]")[0] for line in lines) == [f"[rank process {i}" for i in range(3)], out
    assert all("tp=3" in line and line.endswith(": PASS") for line in lines), lines
    assert "reference path on 3 CPU processes, tp=3" in out, out


def test_moe_block_decode_as_rank_processes_checks_every_rank():
    out = run_example("moe_block_decode.py", "--layers", "1", "--steps", "0", "--rank-processes", "2")
    assert "reference path on 2 CPU processes, tp=2" in out, out
    passed = [line.split("]")[0] for line in out.splitlines() if line.endswith(" all checks passed")]
    assert sorted(passed) == ["[rank process 0", "[rank process 1"], out


def test_multiprocess_decode_checks_every_process():
    out = run_example("multiprocess_decode.py", "--steps", "2")
    assert "2 CPU processes (gloo) on the pure-JAX reference path, tp=2" in out
    lines = [line for line in out.splitlines() if CHECK in line]
    assert sorted(line.split("]")[0] for line in lines) == ["[process 0", "[process 1"], out
    assert all(line.endswith(": PASS") for line in lines), lines


def float32_op(routed, weights, indices, shared, scale):
    """The op as the kernels evaluate it: float32 products and sums in expert order, each
    partial rounded to bf16, their float32 sum in rank order rounded to bf16."""
    f32 = np.float32
    total = np.zeros(shared.shape[1:], f32)
    for rank in range(routed.shape[0]):
        partial = np.zeros(shared.shape[1:], f32)
        for k in range(indices.shape[-1]):
            w = (weights[rank, :, k].astype(f32) * f32(scale))[:, None]
            partial = partial + w * routed[rank][indices[rank, :, k]].astype(f32)
        partial = (partial + shared[rank].astype(f32)).astype(ml_dtypes.bfloat16)
        total = total + partial.astype(f32)
    return total.astype(ml_dtypes.bfloat16).astype(np.float64)


def random_inputs(rng, tp, m=16, top_k=8, hidden=256):
    """bf16 inputs whose float32 sums round to bf16 otherwise than float64 ones in many elements:
    each token's experts are pairs of rows near +-1e3 that nearly cancel, and with an even tp
    the ranks' partials nearly cancel too (rank r's inputs carry the sign (-1)^r)."""
    pairs = top_k // 2
    big = 1e3 * rng.standard_normal((m * pairs, hidden))
    rest = rng.standard_normal((m * pairs, hidden))
    routed = np.empty((tp, 2 * m * pairs, hidden))
    shared = np.empty((tp, m, hidden))
    common_shared = rng.standard_normal((m, hidden))
    for rank in range(tp):
        sign = (-1) ** rank
        routed[rank, 0::2] = sign * big
        routed[rank, 1::2] = sign * (rest - big) + 1e-2 * rng.standard_normal(big.shape)
        shared[rank] = sign * common_shared + 1e-2 * rng.standard_normal((m, hidden))
    # Both rows of a pair get one weight; token t's pairs are rows 2 (t * pairs + j) and the next.
    weights = np.repeat(rng.uniform(0.1, 1.0, (tp, m, pairs)), 2, axis=-1).astype(np.float32)
    first = 2 * (np.arange(m)[:, None] * pairs + np.arange(pairs))
    indices = np.broadcast_to(np.stack([first, first + 1], -1).reshape(m, top_k), (tp, m, top_k))
    return routed.astype(ml_dtypes.bfloat16), weights, indices.astype(np.int32), shared.astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_model_bound_covers_float32_accumulation(tp, capsys):
    rng = np.random.default_rng(tp)
    for _ in range(5):
        inputs = random_inputs(rng, tp)
        reference, bound = model.finalize_publish(*inputs, 2.5)
        out = float32_op(*inputs, 2.5)
        assert np.sum(out != reference) > 10  # the bound is exercised, not only met by equality
        assert model.check(out, reference, bound, f"tp={tp}")
    assert capsys.readouterr().out.count(": PASS") == 5


def test_model_check_fails_beyond_the_bound(capsys):
    rng = np.random.default_rng(0)
    inputs = random_inputs(rng, 2)
    reference, bound = model.finalize_publish(*inputs, 2.5)
    out = reference.copy()
    out[3, 5] += 2 * bound[3, 5]
    assert not model.check(out, reference, bound, "moved")
    out[3, 5] = np.nan
    assert not model.check(out, reference, bound, "NaN")
    assert capsys.readouterr().out.count(": FAIL") == 2


def float32_add_rmsnorm(y, residual, norm_weight, eps):
    """The epilogue as the kernels evaluate it: float32 add rounded to bf16, float32 RMSNorm of
    that, rounded to bf16."""
    f32 = np.float32
    residual_out = (y.astype(f32) + residual.astype(f32)).astype(ml_dtypes.bfloat16)
    x = residual_out.astype(f32)
    inverse_rms = f32(1) / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=f32) + f32(eps))
    out = (x * inverse_rms * norm_weight.astype(f32)).astype(ml_dtypes.bfloat16)
    return out.astype(np.float64), residual_out.astype(np.float64)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_epilogue_bound_covers_float32_evaluation(tp):
    rng = np.random.default_rng(10 + tp)
    inputs = random_inputs(rng, tp)
    reference, bound = model.finalize_publish(*inputs, 2.5)
    y = float32_op(*inputs, 2.5).astype(ml_dtypes.bfloat16)
    residual = (1e3 * rng.standard_normal(reference.shape)).astype(ml_dtypes.bfloat16)
    norm_weight = (1 + 0.1 * rng.standard_normal(reference.shape[-1])).astype(ml_dtypes.bfloat16)
    out, residual_out = float32_add_rmsnorm(y, residual, norm_weight, 1e-6)
    expected = model.add_rmsnorm(reference, bound, residual, norm_weight, 1e-6, residual_out)
    for name, got, bound in (("residual_out", residual_out, "residual_bound"), ("out", out, "out_bound")):
        error = np.abs(got - expected[name])
        assert np.all(error <= expected[bound]), name
        assert np.any(error > 0), f"{name}: the bound is exercised, not only met by equality"
    # It has teeth: residual_out one bound away is outside.
    moved = residual_out + 2 * expected["residual_bound"]
    assert np.all(np.abs(moved - expected["residual_out"]) > expected["residual_bound"])
