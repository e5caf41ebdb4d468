#!/usr/bin/env bash
# The vLLM connector's GPU path, checked on a CUDA machine with torch alone (no vLLM, no xxhash, no network):
# benchmarks/gpu_connector.py. Every KV layout byte-equal both ways over real /dev/shm regions; a step's GB/s
# (jobs checked done first) against a contiguous pinned copy, compute overlap and synchronizing calls per step,
# pinned and through bounce buffers; two ranks over one region; two KV-cache groups with a job failing in one;
# a refused registration, a failing copy, a region too big for its directory and a planted synchronizing call,
# each caught. Prints one table and a verdict per check, writes gpu_connector.json (and the engine's log) under
# $OUT, exits non-zero if a check failed. A few minutes on one H100/H200 (it gives up after 8).
# Usage, from the repository root (or a copy of it): OUT=/some/dir bash scripts/gpu_check_connector.sh
set -uo pipefail
OUT=${OUT:-/tmp/tiercache-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
df -h /dev/shm | tail -1
cd benchmarks || exit 1
timeout 480 python3 gpu_connector.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_connector.log"
exit "${PIPESTATUS[0]}"
