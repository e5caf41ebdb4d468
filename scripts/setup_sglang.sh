#!/usr/bin/env bash
# Idempotent set-up of the SGLang engine venv (.venv-sglang): the CPU build of torch, then SGLang 0.5.23
# and exactly the packages its HiCache storage and KV-pool modules import, all without their dependencies
# (SGLang's own requirements pull CUDA wheels and another torch; scripts/sglang-cpu.txt says why each is
# there), then tiercache (editable) with what its Redis tiers and the tests need. Its own venv: SGLang's
# pins conflict with other engines'.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-sglang
TORCH_VERSION=2.13.0

bash scripts/setup.sh   # redis-server, openssl (the tests' servers)

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.tiercache-setup"
want="$(cat pyproject.toml scripts/setup_sglang.sh scripts/sglang-cpu.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    pip="$VENV/bin/python -m pip install -q"
    $pip --upgrade pip
    $pip "torch==$TORCH_VERSION"
    $pip --no-deps -r scripts/sglang-cpu.txt
    $pip --no-deps -e .
    $pip "redis[hiredis]>=5.0" "lz4>=4.0" "xxhash>=3.0" "sortedcontainers>=2.4" "pytest>=8" "pytest-asyncio>=0.23"
    "$VENV/bin/python" -W ignore -c "import tiercache.integrations.sglang" >/dev/null
    echo "$want" > "$stamp"
fi
