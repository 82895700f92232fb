#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv in .venv with the CPU torch wheel first (a bare `torch`
# requirement would pull a multi-GB CUDA build), then elasticd itself with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e '.[test]'
