#!/usr/bin/env bash
# The whole tests/gpu tier on one GPU, in five parts (1 to 4 of at most 10 minutes each), at one commit
# (docs/testing.md, "On the GPU machine"):
#   bash tools/gpu_tier.sh 1|2|3|4|5 [LOG_DIR]  run one part, each step's output in LOG_DIR/STEP.log
#   bash tools/gpu_tier.sh STEP[,STEP...] [LOG_DIR]  run the named steps one after the other
#   bash tools/gpu_tier.sh --list               the steps, one per line: part, name, gpu_check.sh arguments
# 1: the kernel harness (virtual ranks) in four pytest processes side by side, and determinism;
# 2: the op and mesh tests as rank processes; 3: the tp = 8 epilogue harness alone (beside
# part 1's four it ran past 10 minutes; alone it takes about 6.5), derivatives, multi-process; 4: the kernel and
# epilogue files' JAX-level tests as rank processes, then faults, the harness's and the public API's; 5: the
# experts op, its eight steps one after the other; whole it outgrows a call, so run its steps by name, a few per
# call. Side by side (as until 2026-12-05) none of its five steps then finished in 520 s on one H200, while alone one of
# its DeepSeek-V3-shard configs took 25-63 s per test.
# Rank-process tests never run beside other processes: their kernels starved the harness's
# (docs/testing.md). Each step is stopped after STEP_TIMEOUT_S (570) seconds; the part fails if a step does.
set -euo pipefail
cd "$(dirname "$0")/.."
HARNESS="tests/gpu/test_kernels_gpu.py tests/gpu/test_epilogue_gpu.py"
NOT_RANKS="gpu and not rank_processes"
API_FAULTS="(api_timeout or close_after_a_fault or two_mailboxes or closed_mailbox)"
STEPS=(
    "1|harness-tp1-tp2-oneshot|-m|$NOT_RANKS|-k|not tp4 and not tp8 and oneshot|$HARNESS"
    "1|harness-tp1-tp2-others|-m|$NOT_RANKS|-k|not tp4 and not tp8 and not oneshot|$HARNESS"
    "1|harness-tp4|-m|$NOT_RANKS|-k|tp4|$HARNESS"
    "1|harness-tp8-kernels|-m|$NOT_RANKS|-k|tp8|tests/gpu/test_kernels_gpu.py"
    "1|determinism|tests/gpu/test_determinism_gpu.py"
    "2|op-mesh|tests/gpu/test_op_gpu.py tests/gpu/test_mesh_gpu.py"
    "3|harness-tp8-epilogue|-m|$NOT_RANKS|-k|tp8|tests/gpu/test_epilogue_gpu.py"
    "3|derivatives-processes|tests/gpu/test_derivatives_gpu.py tests/gpu/test_multiprocess_gpu.py"
    "4|harness-files-rank-processes|-m|gpu and rank_processes|$HARNESS"
    "4|faults-harness|-k|not $API_FAULTS|tests/gpu/test_faults_gpu.py"
    "4|faults-api|-k|$API_FAULTS|tests/gpu/test_faults_gpu.py"
    "5|experts-model|-k|test_kernels_match_the_model and not bulk|tests/gpu/test_experts_gpu.py"
    "5|experts-edges-bits|-k|(test_routing_edges or test_the_same_bits) and not bulk|tests/gpu/test_experts_gpu.py"
    "5|experts-jax-gather|-k|not (test_kernels_match_the_model or test_routing_edges or test_the_same_bits or e4m3 or shared_expert or bulk)|tests/gpu/test_experts_gpu.py"
    "5|experts-e4m3-rows|-k|e4m3 and not tiled|tests/gpu/test_experts_gpu.py"
    "5|experts-e4m3-tiled|-k|e4m3 and tiled and not bulk|tests/gpu/test_experts_gpu.py"
    "5|experts-shared|-k|shared_expert and not bulk|tests/gpu/test_experts_gpu.py"
    "5|experts-bulk|-k|bulk|tests/gpu/test_experts_gpu.py"
    "5|experts-tokamax|tests/gpu/test_experts_tokamax_gpu.py"
)
# Parts whose steps run side by side; the others run their steps one after the other.
SIDE_BY_SIDE=" 1 "

arguments() {  # the gpu_check.sh arguments of a step: fields 3.. split on |, paths split on spaces
    local IFS='|'
    read -r -a fields <<< "$1"
    args=()
    for field in "${fields[@]:2}"; do
        if [[ "$field" == tests/* ]]; then read -r -a paths <<< "${field// /|}"; args+=("${paths[@]}"); else args+=("$field"); fi
    done
}

if [ "${1:-}" = "--list" ]; then
    for step in "${STEPS[@]}"; do
        arguments "$step"
        printf '%s\t%s' "${step%%|*}" "$(cut -d'|' -f2 <<< "$step")"
        printf '\t%s' "${args[@]}"
        printf '\n'
    done
    exit 0
fi
part=${1:?usage: bash tools/gpu_tier.sh 1|2|3|4|5|STEP[,STEP...] [LOG_DIR], or --list}
if ! [[ "$part" =~ ^[12345]$ ]]; then
    known=$(for step in "${STEPS[@]}"; do cut -d'|' -f2 <<< "$step"; done)
    for name in ${part//,/ }; do
        grep -qx -- "$name" <<< "$known" || { echo "$name: expected a part (1 to 5) or a step: $(echo $known)" >&2; exit 2; }
    done
fi
logs=${2:-gpu-tier-logs}
mkdir -p "$logs"
"${PYTHON:-python3}" -m pip install --quiet --no-build-isolation --no-deps .
export JAX_MOE_PUBLISH_INSTALLED=1

run_step() {  # name, then gpu_check.sh arguments; prints one summary line
    local name=$1 start status=0
    shift
    start=$(date +%s)
    timeout "${STEP_TIMEOUT_S:-570}" bash tools/gpu_check.sh -v "$@" > "$logs/$name.log" 2>&1 || status=$?
    echo "$name: exit $status after $(( $(date +%s) - start )) s: $(grep -E '^=+ .* in [0-9.]+s' "$logs/$name.log" | tail -1)"
    return "$status"
}

pids=()
failed=0
for step in "${STEPS[@]}"; do
    name=$(cut -d'|' -f2 <<< "$step")
    [ "${step%%|*}" = "$part" ] || [[ ",$part," == *",$name,"* ]] || continue
    arguments "$step"
    if [[ "$SIDE_BY_SIDE" == *" $part "* ]]; then
        run_step "$name" "${args[@]}" & pids+=($!)
    else
        run_step "$name" "${args[@]}" || failed=1
    fi
done
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
exit "$failed"
