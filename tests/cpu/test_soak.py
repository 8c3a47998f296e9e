"""`tools/soak.py` on virtual CPU devices with ``--impl reference``: its plumbing at tp = 2, 4
and 8, both second mailboxes, and the summary it writes (both sides are the reference here, so
the error check itself is exercised only on GPUs)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

SOAK = pathlib.Path(__file__).resolve().parents[2] / "tools" / "soak.py"


def run_soak(tmp_path, *args, devices=8):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    summary = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(SOAK), "--impl", "reference", "--json", str(summary), *args],
                         capture_output=True, text=True, timeout=600, env=env)
    return run, summary


@pytest.mark.parametrize("tp, second", [(2, "twoshot"), (4, "reduce_scatter"), (8, "twoshot")])
def test_soak_plumbing_at_every_tp(tmp_path, tp, second):
    run, summary = run_soak(tmp_path, "--tp", str(tp), "--calls", "12", "--capacity", "5", "--problem", "3",
                            "--second", second, "--second-fraction", "0.5")
    assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
    assert f"soak: PASS 12 calls at tp = {tp}" in run.stdout
    data = json.loads(summary.read_text())
    assert data["passed"] and data["tp"] == tp and data["calls"] == 12 and data["mailbox_b"] == second
    assert sum(data["calls_per_mailbox"].values()) == 12 and min(data["calls_per_mailbox"].values()) > 0


def test_soak_refuses_a_group_larger_than_the_devices(tmp_path):
    run, _ = run_soak(tmp_path, "--tp", "8", "--calls", "1", devices=4)
    assert run.returncode == 2 and "soak: needs 8 GPUs for impl='reference'" in run.stderr


def test_soak_refuses_tp_one(tmp_path):
    run, _ = run_soak(tmp_path, "--tp", "1", "--calls", "1")
    assert run.returncode == 2 and "--tp 1: expected at least 2 ranks" in run.stderr
