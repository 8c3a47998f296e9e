#!/usr/bin/env bash
# The GPU test path, run on an NVIDIA machine in the repository root:
#   bash tools/gpu_check.sh [pytest args...] [test paths...]
# Paths or test ids (relative to the repository root) choose the tests; without any, all of tests/.
# Installs the package offline into the machine's Python (build tools already
# present), points the kernel store at the prebuilt folder, checks the prebuilt kernels
# for spills and local memory (tools/kernel_resources.py: the cubins, with this machine's cuobjdump),
# and runs the GPU tests. It fails if either fails, and if no GPU test ran: CUDA found no GPU,
# the selection holds none, or every one skipped (JAX_MOE_PUBLISH_REQUIRE_GPU, tests/conftest.py).
# JAX_MOE_PUBLISH_INSTALLED=1 skips the install, for checks run side by side on one machine
# after one install (several pip installs of one package at once can corrupt it).
# Build the folder first where CuTe DSL is installed:
#   python -m jax_moe_publish.aot build --preset tests --out kernels-prebuilt
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export JAX_MOE_PUBLISH_KERNEL_DIR=${JAX_MOE_PUBLISH_KERNEL_DIR:-$PWD/kernels-prebuilt}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export JAX_MOE_PUBLISH_REQUIRE_GPU=1
# Ranks run as processes that share the GPUs where a test needs more (tests/support/rank_runs.py):
# none may take most of a GPU's memory up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d "$JAX_MOE_PUBLISH_KERNEL_DIR" ] || { echo "no prebuilt kernels at $JAX_MOE_PUBLISH_KERNEL_DIR" >&2; exit 2; }
[ "${JAX_MOE_PUBLISH_INSTALLED:-0}" = 1 ] || "$PYTHON" -m pip install --quiet --no-build-isolation --no-deps .
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
# The resource check needs no GPU: it runs beside the tests.
report=$(mktemp)
"$PYTHON" tools/kernel_resources.py "$JAX_MOE_PUBLISH_KERNEL_DIR" > "$report" &
resources_pid=$!
# Run from outside the checkout so that the installed package (with its
# compiled extension) is imported, not the source folder.
repo=$PWD
options=()
paths=()
for arg in "$@"; do
    # A path under tests/, or a test id in one (tests/gpu/test_op_gpu.py::test_name).
    if [ -e "$repo/${arg%%::*}" ] && [[ "$arg" == tests* ]]; then paths+=("$repo/$arg"); else options+=("$arg"); fi
done
[ ${#paths[@]} -gt 0 ] || paths=("$repo/tests")
cd "$(mktemp -d)"
tests=0
"$PYTHON" -m pytest -c "$repo/pyproject.toml" --rootdir "$repo" -m gpu -rs ${options[@]+"${options[@]}"} \
    "${paths[@]}" || tests=$?
resources=0
wait "$resources_pid" || resources=$?
grep -v " regs " "$report" || true
if [ "$tests" = 0 ] && [ "$resources" != 0 ]; then
    if [ "$resources" = 1 ]; then
        echo "the tests passed, but some kernels spill or use local memory: see above" >&2
    else
        echo "the tests passed, but the resource check could not check every kernel (exit $resources): see the CANNOT CHECK lines above" >&2
    fi
    exit "$resources"
fi
exit "$tests"
