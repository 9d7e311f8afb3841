#!/usr/bin/env bash
# Run the test suite (CPU; GPU-only tests skip). Sets up .venv first when it is missing.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import nosa, pytest, xdist, hypothesis" 2>/dev/null; then
    bash scripts/setup.sh
fi
# One thread per process unless asked otherwise: the tests' tensors are small and the SGLang servers
# they start run beside them on the same cores, where two threads per process spin against each other.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two workers, a group of tests each at a time (tests/conftest.py says how the groups are made):
# the servers the tests start are mostly idle while a test computes its reference, so a second
# worker uses the second core. `bash scripts/test.sh -n 0` runs everything in one process.
exec .venv/bin/python -m pytest -n 2 "$@"
