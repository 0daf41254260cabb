#!/usr/bin/env bash
# Set up the environment on a fresh machine (torch first) and run the whole test suite on CPU.
#   bash scripts/run_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/common.sh
ensure_environment
python -m pip install -q -e ".[test]"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -q --timeout 900 "${@:-tests}"
