#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a machine without network: install the carried wheels
# (.whl/, made by benchmarks/gpu_check_wheels.sh: jsonargparse for the CLI) into /tmp/site, then run.
#   benchmarks/gpu_check.sh --out "$OUT/gpu_check"          # arguments go to gpu_check.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "$@"
