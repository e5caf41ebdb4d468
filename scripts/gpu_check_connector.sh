#!/usr/bin/env bash
# The vLLM connector's GPU path, checked on a CUDA machine with torch alone (no vLLM, no xxhash, no network):
# benchmarks/gpu_connector.py. Every KV layout byte-equal both ways over real /dev/shm regions, with each copy's
# producer delayed and staging poisoned so a missing wait shows; a step's GB/s (jobs checked done first) judged
# against a contiguous pinned copy, compute overlap and synchronizing calls per step, pinned and through bounce
# buffers; two ranks over one region; two KV-cache groups with a job failing in one; a load ending while a long
# store still copies; a run of slots past 2 GiB; a refused registration, a failing copy, a region too big for its
# directory and a planted synchronizing call, each caught. Prints one table and a verdict per check, writes
# gpu_connector.json (and the engine's log) under $OUT, exits non-zero if a check failed. A few minutes on one
# H100/H200 (it gives up after 8).
# With --every-break: the check once as it is (it must pass), then once per guard broken on purpose
# (gpu_connector.py --break NAME --quick: each must fail), each run's files in $OUT/<name>; non-zero unless all
# held.
# Usage, from the repository root (or a copy of it): OUT=/some/dir bash scripts/gpu_check_connector.sh [--every-break]
set -uo pipefail
OUT=${OUT:-/tmp/tiercache-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
df -h /dev/shm | tail -1
cd benchmarks || exit 1
if [ "${1:-}" != "--every-break" ]; then
    timeout 480 python3 gpu_connector.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_connector.log"
    exit "${PIPESTATUS[0]}"
fi
shift
held=0
mkdir -p "$OUT/intact"
timeout 480 python3 gpu_connector.py --out "$OUT/intact" "$@" > "$OUT/intact/gpu_connector.log" 2>&1
code=$?
echo "intact: exit $code (must be 0)"
[ "$code" -eq 0 ] || held=1
for name in $(python3 -c "from gpu_connector_breaks import BREAKS; print(' '.join(BREAKS))"); do
    mkdir -p "$OUT/$name"
    timeout 480 python3 gpu_connector.py --out "$OUT/$name" --break "$name" --quick "$@" > "$OUT/$name/gpu_connector.log" 2>&1
    code=$?
    echo "--break $name: exit $code (must be 1); failed: $(grep '^FAIL ' "$OUT/$name/gpu_connector.log" | tr '\n' ';')"
    [ "$code" -eq 1 ] || held=1
done
exit "$held"
