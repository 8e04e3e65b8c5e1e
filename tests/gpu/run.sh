#!/usr/bin/env bash
# The prepared GPU check: `bash tests/gpu/run.sh` on a machine with a CUDA GPU and torch installed (nothing is
# installed here). One line per item, PASSED / FAILED / SKIPPED with the reason; under 6 minutes on one GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA GPUs:', torch.cuda.device_count())"
exec "$PY" -m pytest -p no:cacheprovider -o addopts="" -q -rA --timeout 300 tests/gpu "$@"
