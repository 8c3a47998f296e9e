#!/usr/bin/env bash
# The runs on a machine of 2, 4 or 8 GPUs of one host, as named steps: each one is meant to fit
# one command of at most 10 minutes (the estimate below), and writes its logs and JSON to
# OUT_DIR (default $OUT, else multi-gpu-runs/).
#
# First, where CuTe DSL is (no GPU needed), the kernels of every step at that tp, without their
# PTX so that the folder can travel (51 MiB of files at tp = 8 on 2026-12-06; the limit is 64 MiB):
#   bash tools/multi_gpu_run.sh build TP
# and those of the bench-fp8 steps into a folder of their own (6 MiB at tp = 8), which the calls
# of those steps carry instead, with JAX_MOE_PUBLISH_KERNEL_DIR pointed at it:
#   JAX_MOE_PUBLISH_KERNEL_DIR=kernels-fp8 bash tools/multi_gpu_run.sh build-fp8 TP
# Then on the GPU machine, in the repository root, tp = every local GPU:
#   JMP_COMMIT=<the commit> bash tools/multi_gpu_run.sh STEP [STEP ...]
#
# Steps:
#   tests           tools/gpu_check.sh (the fault tests; at tp >= 4 the 2-D meshes): all of tests/,
#                   or $TESTS (paths, ids, -k ...): the whole tier took about 17 minutes on one
#                   H200, so split it over calls, e.g. TESTS=tests/gpu/test_epilogue_gpu.py.
#                   Its resource check reads the cubins, all that the built folder keeps.
#   sanitize        tools/sanitize.sh: memcheck and racecheck over every kernel role
#   soak            tools/soak.py --tp TP, 20000 calls with random m
#   pingpong        benchmarks/nvlink_pingpong.cu: one-way store-to-visible latency
#   sweep-tpN-mLO-HI
#                   benchmarks/tune_algorithms.py --measure at tp = N (at most TP), the m of
#                   SWEEP_M from LO to HI: one-shot, two-shot and XLA, with and without the
#                   epilogue, into OUT_DIR/STEP.json, one part of tp N's sweep. With all of a
#                   tp's parts back and copied under benchmarks/results/ (each entry's reason
#                   cites its part by the name given), on any machine (no GPU)
#                     python benchmarks/tune_algorithms.py --merge PART... \
#                         --table jax_moe_publish/algorithms.json
#                   rewrites tp N's entries; it refuses parts of another tp, device or commit,
#                   and names any m of SWEEP_M that they lack
#   bench-P-mLO-HI  benchmarks/bench_moe_publish.py, problem P (deepseek or qwen), the m of
#                   BENCH_M (below) from LO to HI (bench-P-mLO: LO alone): one-shot and two-shot,
#                   with and without the epilogue, both XLA columns, 2 rounds of 11 timed runs
#   bench-fp8-deepseek-mLO-HI
#                   the same for DeepSeek-V3 with the epilogue's FP8 out (FP8_PROBLEM) alone,
#                   beside our bf16 epilogue followed by the jnp quantizer (build-fp8's kernels)
#   block-P-mLO-HI  benchmarks/bench_moe_block.py, problem P, the m of BLOCK_M from LO to HI:
#                   its JSON and plot
#   multiprocess-mLO-HI
#                   benchmarks/bench_multiprocess.py (2 GPUs), the m of MULTIPROCESS_M from LO to HI
# The splits that fit, by the estimate below:
#   bench-deepseek-m1-2 bench-deepseek-m4-8 bench-deepseek-m16-32 bench-deepseek-m64-128
#   bench-deepseek-m256 bench-deepseek-m512 bench-deepseek-m1024
#   bench-qwen-m1-2 bench-qwen-m4-8 bench-qwen-m16-32 bench-qwen-m64-128
#   bench-qwen-m256 bench-qwen-m512 bench-qwen-m1024
#   bench-fp8-deepseek-m1-2 bench-fp8-deepseek-m4-8 bench-fp8-deepseek-m16-32
#   bench-fp8-deepseek-m64-128 bench-fp8-deepseek-m256 bench-fp8-deepseek-m512 bench-fp8-deepseek-m1024
#   block-qwen-m1-32 block-qwen-m64-128 block-deepseek-m1-8 block-deepseek-m32-64 block-deepseek-m128
#   multiprocess-m1-8 multiprocess-m64-256
#   sweep-tp1-m1-1024
#   sweep-tp2-m1-4 sweep-tp2-m8-32 sweep-tp2-m64-256 sweep-tp2-m512 sweep-tp2-m1024
#   sweep-tp4-m1-4 sweep-tp4-m8-32 sweep-tp4-m64-256 sweep-tp4-m512 sweep-tp4-m1024
#   sweep-tp8-m1-4 sweep-tp8-m8-32 sweep-tp8-m64-256 sweep-tp8-m512 sweep-tp8-m1024
#   (a tp's parts on a machine of that many GPUs; tp = 1 on any)
# DRY_RUN=1 prints each step's commands instead of running them (at $TP, default 2).
#
# The estimate (no step has been timed whole yet): a program compiles and first runs in about
# 2.5 s (the soak's 64 steps took 147 s: benchmarks/results/2026-11-30-h200x2-soak.json; the
# MoE block's about 3.8 s, its cut-short run in benchmarks/README.md); a timed run lasts its
# calls at the per-call times at tp = 2 of results/2026-11-30-h200x2-tp2-own-partial-cb-on.json
# and -qwen3-tp2-own-partial.json (none are recorded at tp = 4 or 8), plus the 1 to 3 ms per
# run of -iteration-counts.json; a command starts in about 90 s (pip install, JAX, the floors).
# - bench: a case compiles 15 programs (ours and 2 XLA columns; 3 each in the first round, 2 in
#   the second), about 38 s, and in each round times 12 runs each of 36 and 164 iterations of
#   32 calls per program pair: 7 s in all at m = 1 to 57 s at m = 1024 (DeepSeek-V3). An m is
#   4 cases, 180 to 380 s. One problem takes about 40 minutes (an hour at bench_moe_publish's 30 runs).
# - block: 23 programs per (problem, m), about 90 s, and 11 runs each of 36 and 164 steps per
#   timed pair: DeepSeek-V3's 3-layer step at tp = 2 is about 7.5 ms (ragged_dot) to 25 ms
#   (the decode path's gather at m = 8), up to 150 s of runs per m; Qwen3's under 15 s.
# - multiprocess: 2 phases of 8 cases, each 6 programs (15 s) and 4 to 12 s of runs: about
#   480 s in all, too near the limit, so two halves.
# - soak: 128 programs and 20 s of calls, about 400 s.
# - sweep: an (m, case, algorithm) compiles 9 programs (ours and 2 XLA columns, of 1, 36 and
#   164 iterations), about 23 s, and times 11 runs each of 36 and 164 iterations of 32 calls
#   per program (a warm-up and 10 repetitions), both XLA columns at the recorded xla's times
#   and two-shot with the epilogue (not recorded) at two-shot's plus one-shot's epilogue cost.
#   An m is 2 cases x 2 algorithms: 90 s of programs and, at tp = 2, 13 s of runs at m = 1 to
#   98 s at m = 1024. At tp = 4 and 8 ours adds the link model's time over tp = 2
#   (tuning.LinkModel at algorithms.json's constants) and XLA's psum its extra ring bytes
#   (2 (tp - 1) / tp rows per rank at 331 GB/s): up to 159 s of runs at tp = 8, m = 1024. So,
#   with its 90 s start, m1-4 takes about 400 s, m8-32 405, m64-256 440 (tp = 2) to 465
#   (tp = 8), m512 240 to 270 and m1024 280 to 340 (together 520 at tp = 8: too near the
#   limit). tp = 1 (direct against XLA, no epilogue: 6 programs, 15 s, per m, and under 11 s
#   of runs at the times of results/2026-11-30-h200x1-tp1.json) takes about 290 s for all 11
#   m. The whole sweep is 16 commands, about 95 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0  # never NVLink multicast
export JAX_MOE_PUBLISH_KERNEL_DIR=${JAX_MOE_PUBLISH_KERNEL_DIR:-$PWD/kernels-prebuilt}
export PYTHONUNBUFFERED=1
out=${OUT_DIR:-${OUT:-$PWD/multi-gpu-runs}}
# The m of each benchmark's steps; the build compiles the kernels of all of them.
BENCH_M="1 2 4 8 16 32 64 128 256 512 1024"
SWEEP_M="1 2 4 8 16 32 64 128 256 512 1024"  # tune_algorithms.py's default --m: what a merge needs
BLOCK_M="1 8 32 64 128"
MULTIPROCESS_M="1 8 64 256"
BENCH_ALGORITHMS=(--algorithms oneshot twoshot)
BENCH_CASES=("${BENCH_ALGORITHMS[@]}" --epilogue)
FP8_PROBLEM=+rmsnorm+fp8  # the epilogue's FP8 out, a scale per 128 columns (DeepSeek-V3's quantizer)
# 11 runs per program, as the two-round runs of results/2026-12-01-h200x2-tp2-cb-on.json.
BENCH_TIMING=(--xla-columns xla xla_nccl --rounds 2 --reps 11)

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

problem_of() {  # problem_of STEP: the benchmark's name of the step's problem
    case "$1" in
        *-deepseek-*) echo deepseek-v3 ;;
        *-qwen-*) echo qwen3-moe ;;
    esac
}

step_ms() {  # step_ms STEP: the m that a benchmark step runs; fails, saying why, for no step
    local list lo hi m picked=()
    case "$1" in
        bench-deepseek-m*|bench-qwen-m*|bench-fp8-deepseek-m*) list=$BENCH_M ;;
        sweep-tp[0-9]*-m*) list=$SWEEP_M ;;
        block-deepseek-m*|block-qwen-m*) list=$BLOCK_M ;;
        multiprocess-m*) list=$MULTIPROCESS_M ;;
        *) echo "unknown step: $1" >&2; return 1 ;;
    esac
    [[ $1 =~ -m([0-9]+)(-([0-9]+))?$ ]] || { echo "unknown step: $1 (expected ...-mLO or ...-mLO-HI)" >&2; return 1; }
    lo=${BASH_REMATCH[1]}
    hi=${BASH_REMATCH[3]:-$lo}
    for m in $list; do
        if [ "$m" -ge "$lo" ] && [ "$m" -le "$hi" ]; then picked+=("$m"); fi
    done
    [ ${#picked[@]} -gt 0 ] || { echo "$1: none of the m $list lies from $lo to $hi" >&2; return 1; }
    echo "${picked[*]}"
}

sweep_tp() {  # sweep_tp STEP: the tp of a sweep step; fails, saying why, for no such tp
    if [[ $1 =~ ^sweep-tp([1248])-m ]]; then echo "${BASH_REMATCH[1]}"; return; fi
    echo "unknown step: $1 (expected sweep-tpN-mLO or sweep-tpN-mLO-HI, N = 1, 2, 4 or 8)" >&2
    return 1
}

build() {
    local tp=$1 dir=$JAX_MOE_PUBLISH_KERNEL_DIR
    run "$PYTHON" -m jax_moe_publish.aot build --preset tests --preset deepseek-v3 --preset qwen3-moe --out "$dir"
    run "$PYTHON" benchmarks/bench_moe_publish.py --build-kernels "$dir" --problems deepseek-v3 qwen3-moe \
        --tp "$tp" --m $BENCH_M "${BENCH_CASES[@]}"
    run "$PYTHON" benchmarks/bench_moe_block.py --build-kernels "$dir" --tp "$tp" --m $BLOCK_M
    if [ "$tp" = 2 ]; then run "$PYTHON" benchmarks/bench_multiprocess.py --build-kernels "$dir" --m $MULTIPROCESS_M; fi
    without_ptx "$dir"
}

build_fp8() {  # the bench-fp8 steps' kernels: DeepSeek-V3's problem alone (its checkpoints are the FP8 ones)
    local tp=$1 dir=$JAX_MOE_PUBLISH_KERNEL_DIR
    run "$PYTHON" benchmarks/bench_moe_publish.py --build-kernels "$dir" --problems "deepseek-v3$FP8_PROBLEM" \
        --tp "$tp" --m $BENCH_M "${BENCH_ALGORITHMS[@]}"
    without_ptx "$dir"
}

without_ptx() {
    # The GPU machine loads cubins and sidecars only, and a carried folder must stay under 64 MiB:
    # the PTX (about two thirds of the bytes) stays out unless KEEP_PTX is set.
    if [ -z "${KEEP_PTX:-}" ]; then run find "$1" -name '*.ptx' -delete; fi
    [ -n "${DRY_RUN:-}" ] || du -sh "$1"
}

[ $# -gt 0 ] || usage
case "$1" in
    build|build-fp8)
        [ $# = 2 ] || usage
        case "$2" in 2|4|8) ;; *) echo "$1: TP=$2: expected 2, 4 or 8" >&2; exit 2 ;; esac
        if [ "$1" = build ]; then build "$2"; else build_fp8 "$2"; fi
        exit 0 ;;
esac

for step in "$@"; do
    case "$step" in
        tests|sanitize|soak|pingpong) ;;
        sweep-*) { sweep_tp "$step" && step_ms "$step"; } > /dev/null || usage ;;
        *) step_ms "$step" > /dev/null || usage ;;
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
fi
for step in "$@"; do
    if [[ $step == sweep-* ]] && [ "$(sweep_tp "$step")" -gt "$TP" ]; then
        echo "$step: needs $(sweep_tp "$step") GPUs, found $TP" >&2
        exit 2
    fi
done
if [ -z "${DRY_RUN:-}" ]; then
    [ -d "$JAX_MOE_PUBLISH_KERNEL_DIR" ] || { echo "no prebuilt kernels at $JAX_MOE_PUBLISH_KERNEL_DIR" >&2; exit 2; }
    mkdir -p "$out"
    nvidia-smi topo -m > "$out/topology.txt"
    "$PYTHON" -m pip install --quiet --no-build-isolation --no-deps .
fi

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
        sweep-*) logged "$step" "$PYTHON" benchmarks/tune_algorithms.py --measure --tp "$(sweep_tp "$step")" \
                     --m $(step_ms "$step") --out "$out/$step.json" || status=1 ;;
        bench-fp8-*) logged "$step-tp$TP" "$PYTHON" benchmarks/bench_moe_publish.py \
                         --problems "$(problem_of "$step")$FP8_PROBLEM" --tp "$TP" --m $(step_ms "$step") \
                         "${BENCH_ALGORITHMS[@]}" "${BENCH_TIMING[@]}" --out "$out/$step-tp$TP.json" || status=1 ;;
        bench-*) logged "$step-tp$TP" "$PYTHON" benchmarks/bench_moe_publish.py --problems "$(problem_of "$step")" \
                     --tp "$TP" --m $(step_ms "$step") "${BENCH_CASES[@]}" "${BENCH_TIMING[@]}" \
                     --out "$out/$step-tp$TP.json" || status=1 ;;
        block-*) logged "$step-tp$TP" "$PYTHON" benchmarks/bench_moe_block.py --problems "$(problem_of "$step")" \
                     --m $(step_ms "$step") --out "$out/$step-tp$TP.json" --plot "$out/$step-tp$TP.png" \
                     || status=1 ;;
        multiprocess-*) logged "$step" "$PYTHON" benchmarks/bench_multiprocess.py --m $(step_ms "$step") \
                            --out "$out/$step.json" || status=1 ;;
    esac
done
exit $status
