#!/usr/bin/env bash
# The one command that proves the CUDA path on a GPU machine, from a fresh clone, inside one 15-minute lease:
#
#     bash scripts/gpu_check.sh
#
# Steps, each under `timeout` with its own budget in seconds (they add up to 525, under the 9 minutes a lease's
# one call can spend after the machine's start); the fast ones come first so a short lease still answers:
#   install           scripts/setup.sh into .venv-gpu with a CUDA build of torch 2.13 (pip line below; pick
#                     the wheel index with TORCH_CUDA_INDEX, default cu128; TORCH_PIP_ARGS overrides it all).
#                     Offline, where the machine's python already holds a CUDA torch and no index can be
#                     reached: GPU_CHECK_PY=python3 installs elasticd into that python, taking what it lacks
#                     (pyzmq, say) from the wheels in GPU_CHECK_WHEELS;
#   smoke             torch sees the GPU; a `cpu:gloo,cuda:nccl` group reduces a CPU and a CUDA tensor;
#   syncs             scripts/gpu_syncs.py: host synchronisations per step the runtime adds to the plain loop;
#   pytest -m cuda    tests/agent/test_cuda.py (equivalence with the CPU run, deterministic bits, per-worker
#                     CUDA RNG, --device-memory swapping with and without a side stream, resize 2->1->2 on
#                     one GPU, the roll-back with --restore-epoch; peak device memory printed per run);
#   bench lm, cnn     multiplexing overhead on the models users judge by: a 110M-parameter transformer LM and
#                     a ResNet-50, N=8 on cuda:0 vs a gradient-accumulation loop (scripts/_benchmodels.py);
#   bench mlp         the same on the 0.66M-parameter MLP, freeing each outgoing worker's cuBLAS workspace at
#                     every hand-over (the default) and keeping every worker's (ELASTICD_KEEP_BLAS_WORKSPACES=1);
#   bench resize      live resize vs a torchrun-style restart, agents sharing cuda:0;
#   bench swap        private-state swap vs a plain copy with pinned buffers;
# then one summary table. GPU_CHECK_BUDGET_SCALE multiplies every budget; GPU_CHECK_PYTEST_ARGS adds to
# pytest's (default -n 4: the tests side by side). Logs go to $GPU_CHECK_LOGS (default gpu-check-logs/).
# Exit status: 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS="${GPU_CHECK_LOGS:-gpu-check-logs}"
SCALE="${GPU_CHECK_BUDGET_SCALE:-1}"
mkdir -p "$LOGS"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"   # the tests and benchmarks are for one GPU
export PYTHONUNBUFFERED=1

names=() results=() secs=() figures=()
step() {  # step NAME FIGURE_KEY BUDGET_S COMMAND...: run under timeout, log, remember status and the KEY=value
    local name=$1 key=$2 budget=$3; shift 3
    local log="$LOGS/${name// /_}.log" start=$SECONDS rc
    budget=$(awk -v b="$budget" -v s="$SCALE" 'BEGIN { printf "%d", b * s }')
    echo "== $name (budget ${budget}s): $*" >&2
    timeout -k 5 "$budget" "$@" >"$log" 2>&1
    rc=$?
    local figure="-"
    if [ -n "$key" ]; then
        figure=$(grep -o "^$key=[0-9.-]*" "$log" | tail -1)
        figure=${figure:-"-"}
    elif [ "$name" = "pytest -m cuda" ]; then
        figure=$(tail -1 "$log" | tr -d '=')   # pytest -q's last line: "7 passed in 123.45s"
    fi
    local result=ok
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && result="TIMEOUT"
    [ $rc -ne 0 ] && [ "$result" = ok ] && result="FAILED ($rc)"
    names+=("$name") results+=("$result") secs+=($((SECONDS - start))) figures+=("$figure")
    tail -3 "$log" >&2
    return $rc
}

if [ -n "${GPU_CHECK_PY:-}" ]; then
    PY=$GPU_CHECK_PY
    # shellcheck disable=SC2086  # the --find-links pair is wanted as two words, or none
    step "install (offline)" "" 30 "$PY" -m pip install --quiet --no-index --no-build-isolation \
        ${GPU_CHECK_WHEELS:+--find-links "$GPU_CHECK_WHEELS"} -e .
else
    export VENV=.venv-gpu
    export TORCH_PIP_ARGS="${TORCH_PIP_ARGS:-torch==2.13.0 --index-url https://download.pytorch.org/whl/${TORCH_CUDA_INDEX:-cu128}}"
    PY="$VENV/bin/python"
    step "setup (CUDA torch)" "" 600 bash scripts/setup.sh
fi
step "smoke" "" 20 "$PY" -c "
import sys, torch, torch.distributed as dist
ok = torch.cuda.is_available()
import zmq, elasticd
print(torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if ok else 'NO GPU VISIBLE',
      'pyzmq', zmq.__version__, 'elasticd', elasticd.__file__)
if not ok:
    sys.exit(1)
dist.init_process_group('cpu:gloo,cuda:nccl', store=dist.HashStore(), rank=0, world_size=1)
c, g = torch.ones(4), torch.ones(4, device='cuda')
dist.all_reduce(c), dist.all_reduce(g)
torch.cuda.synchronize()
print('cpu:gloo,cuda:nccl group reduced', c.sum().item(), g.sum().item())
dist.destroy_process_group()"
step "syncs" "runtime_syncs_per_step" 40 "$PY" scripts/gpu_syncs.py
# shellcheck disable=SC2086  # GPU_CHECK_PYTEST_ARGS is a list of pytest arguments
step "pytest -m cuda" "" 100 "$PY" -m pytest -m cuda -q -s -rs --timeout=95 ${GPU_CHECK_PYTEST_ARGS:--n 4} \
    tests/agent/test_cuda.py
MUX=("$PY" scripts/bench_multiplex.py --device cuda --threads 0 --cpu -1)
step "bench lm" "overhead_vs_ideal" 90 "${MUX[@]}" --model lm --batch 8 --steps 12 --warmup 3 --pairs 3
step "bench cnn" "overhead_vs_ideal" 60 "${MUX[@]}" --model cnn --batch 32 --steps 12 --warmup 3 --pairs 3
step "bench mlp" "overhead_vs_ideal" 35 "${MUX[@]}" --pairs 6
step "bench mlp kept" "overhead_vs_ideal" 35 env ELASTICD_KEEP_BLAS_WORKSPACES=1 "${MUX[@]}" --pairs 6
step "bench resize" "resize_seconds" 100 "$PY" scripts/bench_resize.py --device-type cuda --repeats 1
step "bench swap" "swap_vs_memcpy" 15 "$PY" scripts/bench_swap.py --device cuda --mb 512 --slots 32

echo
printf '%-22s %-12s %8s  %s\n' "step" "result" "seconds" "figure"
failed=0
for i in "${!names[@]}"; do
    printf '%-22s %-12s %8s  %s\n' "${names[$i]}" "${results[$i]}" "${secs[$i]}" "${figures[$i]}"
    [ "${results[$i]}" = ok ] || failed=1
done
echo "logs: $LOGS/ (peak device memory per run: grep 'peak device memory' '$LOGS/pytest_-m_cuda.log')"
exit $failed
