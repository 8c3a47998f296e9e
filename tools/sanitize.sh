#!/usr/bin/env bash
# compute-sanitizer over every kernel role on two GPUs:
#   bash tools/sanitize.sh [REPORT_DIR]
# The workload is `tests/programs/fault_programs.py sanitize`: healthy calls with m = 1, 5 and 16 of
# each of its configs through the kernel harness (no JAX on the GPUs), every output checked.
# It runs once per tool (SANITIZE_TOOLS, default "memcheck racecheck"; synccheck and
# initcheck also work), saves each tool's report, the program's stdout and stderr in
# REPORT_DIR (default sanitize-reports/), and prints one summary line per tool.
# racecheck looks at shared memory only: the RMSNorm epilogue's warp sums.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=${1:-$repo/sanitize-reports}
mkdir -p "$out"
PYTHON=${PYTHON:-python3}
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
[ -x "$SANITIZER" ] || { echo "compute-sanitizer not found: set SANITIZER" >&2; exit 2; }
export JAX_MOE_PUBLISH_KERNEL_DIR=${JAX_MOE_PUBLISH_KERNEL_DIR:-$repo/kernels-prebuilt}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export JAX_PLATFORMS=cpu  # the harness drives the GPUs through the driver API; JAX keeps off them
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH}
[ -d "$JAX_MOE_PUBLISH_KERNEL_DIR" ] || { echo "no prebuilt kernels at $JAX_MOE_PUBLISH_KERNEL_DIR" >&2; exit 2; }

status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    # Instrumented kernels are slow; the workload's own waits time out after 120 s.
    timeout "${SANITIZE_TIMEOUT_S:-1800}" "$SANITIZER" --tool "$tool" --error-exitcode 3 \
        --print-limit 200 --log-file "$out/$tool.log" \
        "$PYTHON" tests/programs/fault_programs.py sanitize >"$out/$tool.stdout" 2>"$out/$tool.stderr"
    rc=$?
    summary=$(grep -hE "(ERROR|RACECHECK|SYNCCHECK|INITCHECK) SUMMARY" "$out/$tool.log" 2>/dev/null \
        | sed 's/^=* *//' | paste -sd ';' -)
    verdict=$("$PYTHON" - "$out/$tool.stdout" <<'EOF'
import sys
from jax_moe_publish.testing.local_processes import read_result
result = read_result(open(sys.argv[1]).read())
if result is None:
    print("the workload printed no result")
else:
    wrong = {mode: r["failures"] for mode, r in result.items() if r["failures"]}
    print(f"wrong outputs: {wrong}" if wrong else "outputs correct")
EOF
)
    echo "$tool: exit $rc; ${summary:-no summary in $out/$tool.log}; $verdict"
    [ "$rc" -eq 0 ] && [ "$verdict" = "outputs correct" ] || status=1
done
echo "reports in $out"
exit $status
