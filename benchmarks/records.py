"""What a benchmark run records beside its figures: the machine it ran on, and its JSON file,
written whole after every case so that a run cut short keeps what it measured."""

from __future__ import annotations

import datetime
import json
import os
import subprocess

import jax


def machine_environment():
    """Date, device kind, ``nvidia-smi``'s name and driver of each GPU (none without it), jax
    version and commit (``$JMP_COMMIT``, else git's HEAD)."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()
    except FileNotFoundError:
        smi = []
    git = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    # The device machines get a copy of the tree without git history: pass JMP_COMMIT there.
    commit = os.environ.get("JMP_COMMIT") or (git.stdout.strip() if git.returncode == 0 else "")
    return {"date": datetime.date.today().isoformat(), "gpu": jax.devices()[0].device_kind, "gpus": smi,
            "jax": jax.__version__, "commit": commit or "unknown"}


def write_json(data, path):
    """Write ``data`` to ``path`` through a ``.partial`` file, so that no reader sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".partial", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".partial", path)
