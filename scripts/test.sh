#!/usr/bin/env bash
# Run the whole test suite (real redis-server processes are started by the fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -rs "$@"
