#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv in .venv with the CPU torch wheel first (a bare `torch`
# requirement would pull a multi-GB CUDA build), then elasticd itself with its test and docs extras.
# VENV (default .venv) and TORCH_PIP_ARGS (default: torch==2.13.0 from the configured index) let
# scripts/gpu_check.sh make a separate virtualenv with a CUDA build of torch instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of pip arguments
"$VENV/bin/python" -m pip install --quiet ${TORCH_PIP_ARGS:-torch==2.13.0}
"$VENV/bin/python" -m pip install --quiet -e '.[test,docs]'
# The Slurm recipe's test (tests/deploy/test_slurm_recipe.py) runs a real single-host Slurm: Debian's slurm-wlm and
# munge, installed the same best-effort way (skipped with the reason where they are absent).
if ! command -v slurmctld >/dev/null 2>&1 && [ "${ELASTICD_NO_SLURM:-0}" != 1 ] && command -v apt-get >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 \
        || echo "setup: slurm-wlm not installed (apt-get failed); the Slurm recipe's test will be skipped" >&2
fi
# The status page's browser test (tests/elasticd/observe/test_observe.py) drives Debian's `chromium`; it is skipped with the
# reason where chromium is absent, so installing it is best effort (root with apt and a reachable mirror).
if ! command -v chromium >/dev/null 2>&1 && [ "${ELASTICD_NO_CHROMIUM:-0}" != 1 ] && command -v apt-get >/dev/null 2>&1 \
        && [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
        || echo "setup: chromium not installed (apt-get failed); the browser test will be skipped" >&2
fi
# A node daemon running as root runs jobs as this unprivileged user unless told otherwise (`elasticd start
# --jobs-as`, elasticd/daemon/job_user.py): the demo's daemon does. tests/elasticd/daemon/test_security_run_as.py uses it too.
if [ "$(id -u)" = 0 ] && ! id elasticd-job >/dev/null 2>&1 && command -v useradd >/dev/null 2>&1; then
    useradd --system --user-group --create-home --home-dir /var/lib/elasticd-job --shell /usr/sbin/nologin \
        elasticd-job || echo "setup: could not create the user elasticd-job; a root daemon needs --jobs-as USER" >&2
fi
# That user runs this Python and elasticd: a directory on their way that it may not pass through (an
# interpreter under /root) gets o+x, i.e. others may pass through it, not list it (the daemon checks, and
# refuses to start with the directory named otherwise).
if [ "$(id -u)" = 0 ] && id elasticd-job >/dev/null 2>&1; then
    "$VENV/bin/python" - <<'PY'
import os, stat
from elasticd.daemon import job_user
user = job_user.lookup(job_user.DEFAULT_JOB_USER)
for _what, path in job_user.runnable_paths():
    while (where := job_user.blocked_at(path, user)) is not None:
        os.chmod(where, stat.S_IMODE(os.stat(where).st_mode) | stat.S_IXOTH)
        print(f"setup: {where}: others may now pass through (o+x) to run {os.path.realpath(path)} as {user.name}")
PY
fi
