#!/usr/bin/env bash
# The GPU benchmark: `bash tests/gpu/bench.sh` on a machine with CUDA GPUs and torch installed (nothing is installed
# here). gradsync's DDP against torch's, eager and compiled, bf16: step time, backward's host time, peak memory.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" tests/gpu/bench.py "$@"
