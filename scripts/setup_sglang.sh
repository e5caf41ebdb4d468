#!/usr/bin/env bash
# Idempotent set-up of the SGLang engine venv (.venv-sglang): the CPU build of torch, then SGLang 0.5.23
# and exactly the packages its HiCache storage and KV-pool modules import, all without their dependencies
# (SGLang's own requirements pull CUDA wheels and another torch; scripts/sglang-cpu.txt says why each is
# there), then tiercache (editable) with what its Redis tiers and the tests need. Its own venv: SGLang's
# pins conflict with other engines'.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh
VENV=.venv-sglang

bash scripts/setup.sh   # redis-server, openssl (the tests' servers)

if needs_setup "$VENV" pyproject.toml setup.py scripts/setup_sglang.sh scripts/venv.sh scripts/sglang-cpu.txt; then
    pip="$VENV/bin/python -m pip install -q"
    $pip --upgrade pip
    $pip "torch==$TORCH_VERSION"
    $pip --no-deps -r scripts/sglang-cpu.txt
    # tiercache itself, then its own requirements resolved as usual (those SGLang's set has are left as
    # they are), and the test runner.
    $pip --no-deps -e .
    tiercache_dependencies "$VENV" | xargs $pip "pytest>=8" "pytest-asyncio>=0.23"
    "$VENV/bin/python" -W ignore -c "import tiercache.integrations.sglang" >/dev/null
    setup_done "$VENV"
fi
