#!/usr/bin/env bash
# elasticd end to end: a node daemon with its embedded scheduler (2 CPU devices, a throwaway state dir),
# examples/train_mlp.py (N=4 workers) submitted, shrunk live to 1 device, grown back to 2, finished.
# Exits 0 only if the job finished and both resizes are in its history. The daemon is always shut down.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
STATE=$(mktemp -d -t elasticd-demo.XXXXXX)
export ELASTICD_STATE_DIR=$STATE   # every elasticd command below talks to this daemon only
DAEMON=""

elasticd() { "$PY" -m elasticd "$@"; }

cleanup() {
    local code=$?
    if [[ -n $DAEMON ]] && kill -0 "$DAEMON" 2>/dev/null; then
        elasticd shutdown >/dev/null 2>&1 || kill "$DAEMON" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$DAEMON" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$DAEMON" 2>/dev/null || true
    fi
    if [[ $code -ne 0 && -f $STATE/daemon.out ]]; then
        echo "--- daemon log (last lines) ---" >&2
        tail -n 30 "$STATE/daemon.out" >&2 || true
    fi
    rm -rf "$STATE"
    exit "$code"
}
trap cleanup EXIT

# job FIELD-EXPRESSION: evaluate a Python expression over the job's `status --json` document `j`.
job() {
    # moves(j): the resizes that changed the device count; a re-layout (same devices, other blocks, when the
    # scheduler measures one device slower than the other) is in the history too, and changes nothing here.
    elasticd status "$JOB" --json | "$PY" -c 'import json, sys; j = json.load(sys.stdin)["jobs"][0]
def moves(j): return [r for r in j["resizes"] if r["from"] != r["to"]]
print(eval(sys.argv[1]))' "$1"
}

# wait_for DESCRIPTION TIMEOUT COMMAND...: poll COMMAND until it succeeds, or fail after TIMEOUT seconds.
wait_for() {
    local what=$1 timeout=$2 start=$SECONDS
    shift 2
    until "$@"; do
        if (( SECONDS - start > timeout )); then
            echo "demo: timed out after ${timeout}s waiting for $what" >&2
            return 1
        fi
        sleep 0.2
    done
}

is() { [[ $(job "$1") == True ]]; }

echo "== elasticd start --cpu-devices 2 (state dir $STATE)"
elasticd start --cpu-devices 2 --bind none --log-level INFO 2> "$STATE/daemon.out" &
DAEMON=$!
wait_for "the daemon to answer" 30 elasticd status >/dev/null 2>&1

echo "== elasticd submit examples/train_mlp.py"
# 3000 steps (the example's default is 600): time for both resizes before the job ends, however fast the machine.
JOB=$(elasticd submit examples/train_mlp.py --name demo-mlp --env TRAIN_STEPS=3000)
echo "job $JOB"
wait_for "$JOB to run" 120 is 'j["state"] == "running" and j["step"] > 0'
elasticd status

echo "== elasticd scale $JOB --devices 1"
elasticd scale "$JOB" --devices 1
wait_for "the shrink" 60 is 'len(moves(j)) >= 1 and j["resizing"] is None or j["state"] != "running"'

# The agent that left exits on its own after the hand-over; its device is free once it is gone.
wait_for "a free device" 60 bash -c '"$0" -m elasticd status --json | "$0" -c "import json, sys; sys.exit(not json.load(sys.stdin)[\"nodes\"][0][\"free\"])"' "$PY"

echo "== elasticd scale $JOB --devices 2"
elasticd scale "$JOB" --devices 2
wait_for "the grow" 120 is 'len(moves(j)) >= 2 and j["resizing"] is None or j["state"] not in ("running", "resizing")'
elasticd status

echo "== waiting for $JOB to finish"
wait_for "$JOB to finish" 300 is 'j["state"] in ("finished", "failed", "stopped")'
elasticd status "$JOB"
elasticd logs "$JOB" | grep "final loss" || true

if ! is 'j["state"] == "finished" and [(r["from"], r["to"], r["outcome"]) for r in moves(j)] == [(2, 1, "done"), (1, 2, "done")]'; then
    echo "demo: FAILED: the job did not finish with both resizes done" >&2
    exit 1
fi
echo "demo: OK: $JOB finished after resizing 2 -> 1 -> 2 devices live ($(job '", ".join("%s->%s in %.2fs" % (r["from"], r["to"], r["seconds"]) for r in moves(j))'))"
