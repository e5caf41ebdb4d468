#!/usr/bin/env bash
# Idempotent set-up of the vLLM engine venv (.venv-vllm): the CPU build of torch, vLLM 0.33.0 and
# xgrammar without their dependencies (a plain 'pip install vllm' downgrades vLLM and pulls CUDA
# wheels), the pure-Python rest from scripts/vllm-0.33-cpu.txt, then tiercache (editable) with what
# its Redis tiers, the policy tests and the property tests need. Its own venv: vLLM's pins conflict with other engines'.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh
VENV=.venv-vllm
VLLM_VERSION=0.33.0
XGRAMMAR_VERSION=0.2.8

bash scripts/setup.sh   # redis-server, openssl (the tests' servers and certificates)

if needs_setup "$VENV" pyproject.toml setup.py scripts/setup_vllm.sh scripts/venv.sh scripts/vllm-0.33-cpu.txt; then
    pip="$VENV/bin/python -m pip install -q"
    $pip --upgrade pip
    $pip "torch==$TORCH_VERSION"
    $pip --no-deps "vllm==$VLLM_VERSION" "xgrammar==$XGRAMMAR_VERSION"
    $pip --no-deps -r scripts/vllm-0.33-cpu.txt
    # tiercache itself, then its own requirements resolved as usual (those vLLM's set has are left as they
    # are; none pulls vLLM), and libcachesim for the policy tests.
    $pip --no-deps -e .
    tiercache_dependencies "$VENV" | xargs $pip "libcachesim>=0.3.5" "hypothesis>=6.100"
    "$VENV/bin/python" -c "import vllm.v1.kv_offload.tiering.spec, tiercache.integrations.vllm" >/dev/null
    setup_done "$VENV"
fi
