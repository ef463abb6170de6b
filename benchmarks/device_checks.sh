#!/usr/bin/env bash
# Every check that needs a GPU, in one run, each step under its own time limit
# and all of them under one deadline (a lent device machine is counted by the
# second). Run from the repository root on a machine with a CUDA GPU, torch,
# pybind11, scikit-build-core and pytest installed:
#
#   OUT=/some/folder DEADLINE_S=360 bash benchmarks/device_checks.sh [STEP ...]
#
# STEP: env install tests prefetch offload capped fp8 racecheck (default: all,
# in that order; tests runs the cuda-marked tests, then the native fp8 tests on
# the lent machine's own CPU, whose SIMD path (AVX-512 VBMI or the portable
# loop) may differ from CI's machines, naming the CPU and the path; racecheck last, in what time is left: compute-sanitizer's
# racecheck finds shared-memory hazards inside kernels, not missing
# cross-stream or host/device ordering, which tests/test_cuda_streams.py
# checks directly). Each step writes OUT/<step>.log (at most 8 files: the device
# tool returns no more); the benchmarks print their JSON in their log
# ("JSON {...}"). A step that runs out of time is killed and logged as such,
# and the next one still runs if time is left.
set -u
OUT=${OUT:-/tmp/mapoffload-device}
mkdir -p "$OUT"
REPO=$(pwd)
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-360}
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
PY=${PYTHON:-python3}

# A disk folder (not tmpfs) for the benchmarks' checkpoints.
BENCH_DIR=/var/tmp
for d in /var/tmp /root /tmp; do
    if [ -d "$d" ] && [ "$(stat -f -c %T "$d")" != tmpfs ]; then BENCH_DIR=$d; break; fi
done

step() {  # step NAME LIMIT_S command...
    local name=$1 limit=$2 left
    shift 2
    left=$((DEADLINE_S - ($(date +%s) - START)))
    if [ "$left" -lt 15 ]; then echo "=== $name: skipped, ${left}s left"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s, at +$(($(date +%s) - START))s)"
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 124 ] && echo "--- killed at its limit" >>"$OUT/$name.log"
    echo "=== $name rc=$rc at +$(($(date +%s) - START))s"
}

env_info() {
    date -u; uname -r; nproc; free -g; df -h "$BENCH_DIR"; stat -f -c %T "$BENCH_DIR"
    nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    $PY -c "import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
    $PY -c "import transformers; print('transformers', transformers.__version__)"
    cat /proc/self/cgroup; ls /sys/fs/cgroup | head -5
    cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null
}

run_tests() {
    cd /tmp && $PY -m pytest -p no:cacheprovider -m cuda -rA -v "$REPO/tests" -o addopts="" "$@"
    local rc=$?
    echo "=== the CPU's native fp8 paths: $(grep -m1 "model name" /proc/cpuinfo)"
    $PY -c "from mapoffload import _core; print('fp8 SIMD path:', _core.fp8_simd() or 'portable loop (no AVX-512 VBMI)')"
    $PY -m pytest -p no:cacheprovider -rs -q "$REPO/tests/test_fp8_native.py" -o addopts="" || rc=$?
    return $rc
}

export -f env_info run_tests  # timeout runs programs: the functions run in a bash of their own
export REPO PY BENCH_DIR
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env install tests prefetch offload capped fp8 racecheck)
for s in "${STEPS[@]}"; do
    case $s in
    env) step env 20 bash -c env_info ;;
    install) step install 180 $PY -m pip install --no-build-isolation --no-deps -v "$REPO" ;;
    tests) step tests 240 bash -c run_tests ;;
    prefetch) step prefetch 45 $PY "$REPO/benchmarks/prefetch_bw.py" --device cuda ;;
    offload) step offload 60 $PY "$REPO/benchmarks/offload_step.py" --device cuda ;;
    capped) step capped 200 $PY "$REPO/benchmarks/capped_forward.py" --dir "$BENCH_DIR" --caps 50,6 --forwards 3 \
        --contenders cuda-mapping,cuda-uncached --timeout 90 ;;
    fp8) step fp8 200 $PY "$REPO/benchmarks/capped_forward.py" --dir "$BENCH_DIR" --fp8 --caps none,50 \
        --contenders cuda-mapping,cuda-fp8 --timeout 120 ;;
    racecheck) step racecheck 150 compute-sanitizer --tool racecheck --error-exitcode 3 \
        $PY -m pytest -p no:cacheprovider -m cuda -q "$REPO/tests" -o addopts="" ;;
    *) echo "unknown step $s" ;;
    esac
done
for f in "$OUT"/*.log; do
    echo "##### $(basename "$f") (last lines)"
    grep -E "passed|skipped|failed|error|Error|rc=|RACE|Hazard|hazard|^\| |^[a-z].*\|" "$f" | tail -n 40
done
