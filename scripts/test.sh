#!/usr/bin/env bash
# Run the test suite (CPU; GPU-only tests skip). Sets up .venv first when it is missing.
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/python -c "import nosa, pytest, hypothesis" 2>/dev/null; then
    bash scripts/setup.sh
fi
exec .venv/bin/python -m pytest "$@"
