"""``tools/gpu_tier.sh``: its steps, collected on CPU, hold every GPU test of ``tests/gpu``
exactly once, so that its five parts are the whole tier."""

from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _steps() -> list[tuple[str, str, list[str]]]:
    listing = subprocess.run(["bash", str(REPO / "tools" / "gpu_tier.sh"), "--list"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    return [(part, name, args) for part, name, *args in (line.split("\t") for line in listing.splitlines())]


def _collected(*args: str) -> list[str]:
    """The test ids ``pytest --co -m gpu ARGS`` selects (a later -m replaces gpu_check.sh's)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "-m", "gpu", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_the_parts_hold_every_gpu_test_once():
    steps = _steps()
    assert {part for part, _, _ in steps} == {"1", "2", "3", "4", "5"}
    by_step = {name: _collected(*args) for _, name, args in steps}
    everything = _collected("tests/gpu")
    seen: dict[str, str] = {}
    for name, ids in by_step.items():
        assert ids, f"step {name} selects no test"
        for test in ids:
            assert test not in seen, f"{test} runs in steps {seen[test]} and {name}"
            seen[test] = name
    missing = sorted(set(everything) - set(seen))
    assert not missing, f"{len(missing)} GPU tests in no step, e.g. {missing[:5]}"
    assert set(seen) <= set(everything)


def test_an_unknown_step_is_refused_before_anything_runs():
    run = subprocess.run(["bash", str(REPO / "tools" / "gpu_tier.sh"), "faults-api,no-such-step"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run
    assert "no-such-step: expected a part (1 to 5) or a step" in run.stderr and "faults-api" in run.stderr
