#!/usr/bin/env bash
# Run the multi-turn chat demo on the embedded default topology (no server needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tiercache demo "$@"
