#!/usr/bin/env bash
# Run the demo (no server needed): a trained chat model (SmolLM2, built once from the GGUF set-up installs) answers
# ShareGPT conversations turn by turn, its KV reused through the embedded default topology; --synthetic: the toy
# engine's multi-turn workload, every reused block checked against recompute.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/tiercache demo "$@"
