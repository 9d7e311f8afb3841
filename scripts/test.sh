#!/usr/bin/env bash
# Run the test suite (CPU; GPU-only tests skip). Sets up .venv first when it is missing.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import nosa, pytest, hypothesis" 2>/dev/null; then
    bash scripts/setup.sh
fi
# One thread per process unless asked otherwise: the tests' tensors are small and the SGLang servers
# they start run beside them on the same cores, where two threads per process spin against each other.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest "$@"
