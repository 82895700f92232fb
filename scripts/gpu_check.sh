#!/usr/bin/env bash
# The one command that proves the CUDA path on a GPU machine, from a fresh clone:
#
#     bash scripts/gpu_check.sh
#
# 1. scripts/setup.sh into .venv-gpu with a CUDA build of torch 2.13 (pip line below; pick the wheel
#    index matching the driver with TORCH_CUDA_INDEX, default cu128; TORCH_PIP_ARGS overrides it all).
#    On a machine with no route to a package index whose python already holds a CUDA build of torch,
#    GPU_CHECK_PY=python3 installs elasticd into that python instead, offline, taking what it lacks
#    (pyzmq, say) from the wheels in GPU_CHECK_WHEELS;
# 2. `pytest -m cuda` (tests/agent/test_cuda.py: equivalence with the CPU run, deterministic bits, per-worker
#    CUDA RNG, --device-memory swapping with and without a side stream, resize 2->1->2 on one GPU, the
#    roll-back with --restore-epoch; peak device memory printed per run);
# 3. the benchmarks that take a device, on cuda:0: multiplexing overhead (with and without freeing each
#    outgoing worker's cuBLAS workspace), swap vs memcpy with pinned buffers, live resize;
# then one summary table. Every step runs under `timeout` (STEP_TIMEOUT, 10 minutes; BENCH_TIMEOUT for
# each benchmark); GPU_CHECK_PYTEST_ARGS adds to pytest's (-n 4 runs the tests side by side). Logs go to
# $GPU_CHECK_LOGS (default gpu-check-logs/). Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS="${GPU_CHECK_LOGS:-gpu-check-logs}"
STEP_TIMEOUT="${STEP_TIMEOUT:-600}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-$STEP_TIMEOUT}"
mkdir -p "$LOGS"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"   # the tests and benchmarks are for one GPU

names=() results=() secs=() figures=()
step() {  # step NAME FIGURE_KEY COMMAND...: run under timeout, log, remember status and the KEY=value figure
    local name=$1 key=$2; shift 2
    local log="$LOGS/${name// /_}.log" start=$SECONDS rc
    echo "== $name: $*" >&2
    timeout "$STEP_TIMEOUT" "$@" >"$log" 2>&1
    rc=$?
    local figure="-"
    if [ -n "$key" ]; then
        figure=$(grep -o "^$key=[0-9.]*" "$log" | tail -1)
        figure=${figure:-"-"}
    elif [ "$name" = "pytest -m cuda" ]; then
        figure=$(tail -1 "$log" | tr -d '=')   # pytest -q's last line: "7 passed in 123.45s"
    fi
    local result=ok
    [ $rc -eq 124 ] && result="TIMEOUT"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && result="FAILED ($rc)"
    names+=("$name") results+=("$result") secs+=($((SECONDS - start))) figures+=("$figure")
    tail -3 "$log" >&2
    return $rc
}

if [ -n "${GPU_CHECK_PY:-}" ]; then
    PY=$GPU_CHECK_PY
    # shellcheck disable=SC2086  # the --find-links pair is wanted as two words, or none
    step "install (offline)" "" "$PY" -m pip install --quiet --no-index --no-build-isolation \
        ${GPU_CHECK_WHEELS:+--find-links "$GPU_CHECK_WHEELS"} -e .
else
    export VENV=.venv-gpu
    export TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-torch==2.13.0 --index-url https://download.pytorch.org/whl/${TORCH_CUDA_INDEX:-cu128}}"
    PY="$VENV/bin/python"
    step "setup (CUDA torch)" "" bash scripts/setup.sh
fi
step "torch sees a GPU" "" "$PY" -c "
import torch, sys
ok = torch.cuda.is_available()
import zmq, elasticd
print(torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if ok else 'NO GPU VISIBLE',
      'pyzmq', zmq.__version__, 'elasticd', elasticd.__file__)
sys.exit(0 if ok else 1)"
# shellcheck disable=SC2086  # GPU_CHECK_PYTEST_ARGS is a list of pytest arguments
step "pytest -m cuda" "" "$PY" -m pytest -m cuda -q -s -rs --timeout=600 ${GPU_CHECK_PYTEST_ARGS:-} tests/agent/test_cuda.py
STEP_TIMEOUT=$BENCH_TIMEOUT
# Twice each way, alternating: freeing the outgoing worker's cuBLAS workspace at every hand-over (the
# default) against keeping every worker's (ELASTICD_KEEP_BLAS_WORKSPACES=1); one round each could not
# tell them apart from the noise.
for round in 1 2; do
    step "bench multiplex $round" "overhead_vs_ideal" "$PY" scripts/bench_multiplex.py --device cuda --threads 0 --cpu -1
    step "bench multiplex kept $round" "overhead_vs_ideal" env ELASTICD_KEEP_BLAS_WORKSPACES=1 \
        "$PY" scripts/bench_multiplex.py --device cuda --threads 0 --cpu -1
done
step "bench swap" "swap_vs_memcpy" "$PY" scripts/bench_swap.py --device cuda --mb 512 --slots 32
step "bench resize" "resize_seconds" "$PY" scripts/bench_resize.py --device-type cuda --repeats 2

echo
printf '%-22s %-12s %8s  %s\n' "step" "result" "seconds" "figure"
failed=0
for i in "${!names[@]}"; do
    printf '%-22s %-12s %8s  %s\n' "${names[$i]}" "${results[$i]}" "${secs[$i]}" "${figures[$i]}"
    [ "${results[$i]}" = ok ] || failed=1
done
echo "logs: $LOGS/ (peak device memory per run: grep 'peak device memory' '$LOGS/pytest_-m_cuda.log')"
exit $failed
