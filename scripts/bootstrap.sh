#!/usr/bin/env bash
# Sets up .venv with the pinned stack (torch stays the CPU wheel) and, unless --no-run, runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first and exactly pinned: a looser spec lets a dependency pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
if [ "${1:-}" != "--no-run" ]; then
  .venv/bin/batchrl run
fi
