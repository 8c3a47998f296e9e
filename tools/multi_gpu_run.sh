#!/usr/bin/env bash
# The runs on a machine of 2, 4 or 8 GPUs of one host, as named steps: each one is meant to fit
# one command of at most 10 minutes (`tests` split by $TESTS), and writes its logs and JSON to
# OUT_DIR (default $OUT, else multi-gpu-runs/).
#
# First, where CuTe DSL is (no GPU needed), the kernels of every step at that tp, without their
# PTX so that the folder can travel (30 MB at tp = 2, 35 MB at tp = 8; the limit is 64 MiB):
#   bash tools/multi_gpu_run.sh build TP
# Then on the GPU machine, in the repository root, tp = every local GPU:
#   JMP_COMMIT=<the commit> bash tools/multi_gpu_run.sh STEP [STEP ...]
#
# Steps:
#   tests           tools/gpu_check.sh (the fault tests; at tp >= 4 the 2-D meshes): all of tests/,
#                   or $TESTS (paths, ids, -k ...): the whole tier took about 17 minutes on one
#                   H200, so split it over calls, e.g. TESTS=tests/gpu/test_epilogue_gpu.py
#   sanitize        tools/sanitize.sh: memcheck and racecheck over every kernel role
#   soak            tools/soak.py --tp TP, 20000 calls with random m
#   pingpong        benchmarks/nvlink_pingpong.cu: one-way store-to-visible latency
#   sweep           benchmarks/tune_algorithms.py --measure: rewrites jax_moe_publish/algorithms.json
#                   for this tp (a copy of the new table lands in OUT_DIR)
#   bench-deepseek, bench-qwen
#                   benchmarks/bench_moe_publish.py: m 1 to 1024, one-shot and two-shot, with and
#                   without the epilogue, both XLA columns, 2 rounds
#   multiprocess    benchmarks/bench_multiprocess.py (2 GPUs)
#   block           benchmarks/bench_moe_block.py, its JSON and plot
# DRY_RUN=1 prints each step's commands instead of running them (at $TP, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0  # never NVLink multicast
export JAX_MOE_PUBLISH_KERNEL_DIR=${JAX_MOE_PUBLISH_KERNEL_DIR:-$PWD/kernels-prebuilt}
export PYTHONUNBUFFERED=1
out=${OUT_DIR:-${OUT:-$PWD/multi-gpu-runs}}
ALL_M="1 2 4 8 16 32 64 128 256 512 1024"
BENCH=(--tp "${TP:-0}" --m $ALL_M --algorithms oneshot twoshot --epilogue --xla-columns xla xla_nccl --rounds 2)

run() {
    if [ -n "${DRY_RUN:-}" ]; then echo "$*"; else "$@"; fi
}

logged() {  # logged NAME COMMAND...: the command's output also in OUT_DIR/NAME.log
    local name=$1
    shift
    if [ -n "${DRY_RUN:-}" ]; then echo "$*"; return; fi
    "$@" 2>&1 | tee "$out/$name.log"
}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2
    exit 2
}

build() {
    local tp=$1 dir=$JAX_MOE_PUBLISH_KERNEL_DIR
    case "$tp" in 2|4|8) ;; *) echo "build: TP=$tp: expected 2, 4 or 8" >&2; exit 2 ;; esac
    BENCH[1]=$tp
    run "$PYTHON" -m jax_moe_publish.aot build --preset tests --preset deepseek-v3 --preset qwen3-moe --out "$dir"
    run "$PYTHON" benchmarks/bench_moe_publish.py --build-kernels "$dir" --problems deepseek-v3 qwen3-moe "${BENCH[@]}"
    run "$PYTHON" benchmarks/bench_moe_block.py --build-kernels "$dir" --tp "$tp"
    if [ "$tp" = 2 ]; then run "$PYTHON" benchmarks/bench_multiprocess.py --build-kernels "$dir"; fi
    # The GPU machine loads cubins and sidecars only, and a carried folder must stay under 64 MiB:
    # the PTX (about two thirds of the bytes) stays out unless KEEP_PTX is set.
    if [ -z "${KEEP_PTX:-}" ]; then run find "$dir" -name '*.ptx' -delete; fi
    [ -n "${DRY_RUN:-}" ] || du -sh "$dir"
}

[ $# -gt 0 ] || usage
if [ "$1" = build ]; then
    [ $# = 2 ] || usage
    build "$2"
    exit 0
fi

for step in "$@"; do
    case "$step" in
        tests|sanitize|soak|pingpong|sweep|bench-deepseek|bench-qwen|multiprocess|block) ;;
        *) echo "unknown step: $step" >&2; usage ;;
    esac
done
# A run records its commit: the GPU machine's copy of the tree may carry a stale git HEAD.
[ -n "${JMP_COMMIT:-}" ] || { echo "set JMP_COMMIT to the commit of this tree (git rev-parse HEAD where it came from)" >&2; exit 2; }
export JMP_COMMIT
if [ -n "${DRY_RUN:-}" ]; then
    TP=${TP:-2}
else
    TP=$(nvidia-smi --list-gpus | wc -l)
    [ "$TP" -ge 2 ] || { echo "found $TP GPU(s): these runs need 2, 4 or 8" >&2; exit 2; }
    [ -d "$JAX_MOE_PUBLISH_KERNEL_DIR" ] || { echo "no prebuilt kernels at $JAX_MOE_PUBLISH_KERNEL_DIR" >&2; exit 2; }
    mkdir -p "$out"
    nvidia-smi topo -m > "$out/topology.txt"
    "$PYTHON" -m pip install --quiet --no-build-isolation --no-deps .
fi
BENCH[1]=$TP

status=0
for step in "$@"; do
    case "$step" in
        tests) logged tests bash tools/gpu_check.sh ${TESTS:-} || status=1 ;;  # word-split on purpose
        sanitize) run bash tools/sanitize.sh "$out/sanitize" || status=1 ;;
        soak) logged "soak-tp$TP" "$PYTHON" tools/soak.py --tp "$TP" --calls 20000 --json "$out/soak-tp$TP.json" \
                  || status=1 ;;
        pingpong)
            run nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/nvlink_pingpong.cu -o /tmp/nvlink_pingpong
            logged pingpong /tmp/nvlink_pingpong "$out/nvlink-pingpong.json" || status=1 ;;
        sweep)
            logged "sweep-tp$TP" "$PYTHON" benchmarks/tune_algorithms.py --measure \
                --out "$out/algorithm-sweep-tp$TP.json" || status=1
            run cp jax_moe_publish/algorithms.json "$out/algorithms-tp$TP.json" ;;
        bench-deepseek|bench-qwen)
            problem=$([ "$step" = bench-deepseek ] && echo deepseek-v3 || echo qwen3-moe)
            logged "$step-tp$TP" "$PYTHON" benchmarks/bench_moe_publish.py --problems "$problem" "${BENCH[@]}" \
                --out "$out/bench-$problem-tp$TP.json" || status=1 ;;
        multiprocess) logged multiprocess "$PYTHON" benchmarks/bench_multiprocess.py --out "$out/multiprocess.json" \
                          || status=1 ;;
        block) logged "block-tp$TP" "$PYTHON" benchmarks/bench_moe_block.py --out "$out/block-tp$TP.json" \
                   --plot "$out/block-tp$TP.png" || status=1 ;;
    esac
done
exit $status
