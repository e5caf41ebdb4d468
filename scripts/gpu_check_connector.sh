#!/usr/bin/env bash
# The vLLM connector's transfer engine on a CUDA machine, torch only (no vLLM there): every KV layout
# byte-equal both ways, a step's batched H2D/D2H GB/s against a contiguous pinned copy, compute overlap and
# the count of synchronizing calls per step (benchmarks/gpu_connector.py). Under 8 minutes on one H100/H200.
# Wheels the machine lacks (xxhash, ...) are installed from whl/ or .whl/ when carried (scripts/gpu_stage.sh).
# Usage, from the repository root (or a copy of it): OUT=/some/dir bash scripts/gpu_check_connector.sh
set -uo pipefail
OUT=${OUT:-/tmp/tiercache-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for wheels in whl .whl; do
    if compgen -G "$wheels/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$wheels"/*.whl
    fi
done
export PYTHONPATH="$(pwd):/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
cd benchmarks || exit 1
timeout 460 python3 gpu_connector.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_connector.log"
exit "${PIPESTATUS[0]}"
