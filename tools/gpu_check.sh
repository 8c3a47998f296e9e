#!/usr/bin/env bash
# The GPU test path, run on an NVIDIA machine in the repository root:
#   bash tools/gpu_check.sh [pytest args...]
# Installs the package offline into the machine's Python (build tools already
# present), points the kernel store at the prebuilt folder, and runs the GPU tests.
# Build the folder first where CuTe DSL is installed:
#   python -m jax_moe_publish.aot build --preset tests --out kernels-prebuilt
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export JAX_MOE_PUBLISH_KERNEL_DIR=${JAX_MOE_PUBLISH_KERNEL_DIR:-$PWD/kernels-prebuilt}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
[ -d "$JAX_MOE_PUBLISH_KERNEL_DIR" ] || { echo "no prebuilt kernels at $JAX_MOE_PUBLISH_KERNEL_DIR" >&2; exit 2; }
"$PYTHON" -m pip install --quiet --no-build-isolation --no-deps .
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
# Run from outside the checkout so that the installed package (with its
# compiled extension) is imported, not the source folder.
repo=$PWD
cd "$(mktemp -d)"
"$PYTHON" -m pytest -c "$repo/pyproject.toml" --rootdir "$repo" -m gpu -rs "$@" "$repo/tests"
