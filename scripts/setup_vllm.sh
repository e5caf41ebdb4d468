#!/usr/bin/env bash
# Idempotent set-up of the vLLM engine venv (.venv-vllm): the CPU build of torch, vLLM 0.33.0 and
# xgrammar without their dependencies (a plain 'pip install vllm' downgrades vLLM and pulls CUDA
# wheels), the pure-Python rest from scripts/vllm-0.33-cpu.txt, then tiercache (editable) with what
# its Redis tiers and the policy tests need. Its own venv: vLLM's pins conflict with other engines'.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-vllm
TORCH_VERSION=2.13.0
VLLM_VERSION=0.33.0
XGRAMMAR_VERSION=0.2.8

bash scripts/setup.sh   # redis-server, openssl (the tests' servers and certificates)

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.tiercache-setup"
want="$(cat pyproject.toml scripts/setup_vllm.sh scripts/vllm-0.33-cpu.txt | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    pip="$VENV/bin/python -m pip install -q"
    $pip --upgrade pip
    $pip "torch==$TORCH_VERSION"
    $pip --no-deps "vllm==$VLLM_VERSION" "xgrammar==$XGRAMMAR_VERSION"
    $pip --no-deps -r scripts/vllm-0.33-cpu.txt
    # tiercache itself, and only the dependencies vLLM's set lacks (resolved as usual: none pulls vLLM).
    $pip --no-deps -e .
    $pip "redis[hiredis]>=5.0" "lz4>=4.0" "xxhash>=3.0" "sortedcontainers>=2.4" "libcachesim>=0.3.5"
    "$VENV/bin/python" -c "import vllm.v1.kv_offload.tiering.spec, tiercache.integrations.vllm" >/dev/null
    echo "$want" > "$stamp"
fi
