#!/usr/bin/env bash
# The one command that proves the CUDA path on a GPU machine, from a fresh clone:
#
#     bash scripts/gpu_check.sh
#
# 1. scripts/setup.sh into .venv-gpu with a CUDA build of torch 2.13 (pip line below; pick the wheel
#    index matching the driver with TORCH_CUDA_INDEX, default cu128; TORCH_PIP_ARGS overrides it all);
# 2. `pytest -m cuda` (tests/test_cuda.py: equivalence with the CPU run, deterministic bits, per-worker
#    CUDA RNG, --device-memory swapping with and without a side stream, resize 2->1->2 on one GPU, the
#    roll-back with --restore-epoch; peak device memory printed per run);
# 3. the benchmarks that take a device, on cuda:0: multiplexing overhead, swap vs memcpy with pinned
#    buffers, live resize;
# then one summary table. Every step runs under `timeout` (10 minutes); logs go to $GPU_CHECK_LOGS
# (default gpu-check-logs/). Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS="${GPU_CHECK_LOGS:-gpu-check-logs}"
STEP_TIMEOUT="${STEP_TIMEOUT:-600}"
mkdir -p "$LOGS"
export VENV=.venv-gpu
export TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-torch==2.13.0 --index-url https://download.pytorch.org/whl/${TORCH_CUDA_INDEX:-cu128}}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"   # the tests and benchmarks are for one GPU
PY="$VENV/bin/python"

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

step "setup (CUDA torch)" "" bash scripts/setup.sh
step "torch sees a GPU" "" "$PY" -c "
import torch, sys
ok = torch.cuda.is_available()
print(torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if ok else 'NO GPU VISIBLE')
sys.exit(0 if ok else 1)"
step "pytest -m cuda" "" "$PY" -m pytest -m cuda -q -s -rs --timeout=600 tests/test_cuda.py
step "bench multiplex" "overhead_vs_ideal" "$PY" scripts/bench_multiplex.py --device cuda --threads 0 --cpu -1
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
