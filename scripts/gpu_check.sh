#!/usr/bin/env bash
# The GPU checks, on a CUDA machine with no network (the lent H100): install the carried
# wheels (whl/), put a carried redis-server (redis/bin) on PATH, then run the stages named
# on the command line (default: all) with logs and the benchmark JSON under $OUT:
#   probe    versions, mapped pinned memory, cuMemcpyBatchAsync       -> probe.log
#   swap     tests/movement/test_swap.py (every swap path)            -> swap_tests.log
#   bench    benchmarks/swap.py                                       -> bench.log, swap_cuda.json
#   manager  manager tests + end-to-end model test, GPU pool on cuda -> manager.log
#   suite    the whole suite with TEST_TIERCACHE_DEVICE=cuda          -> suite.log
# Run from the repository root (or a copy of it): bash scripts/gpu_check.sh [stage ...]
set -uo pipefail
OUT=${OUT:-/tmp/tiercache-gpu-out}
mkdir -p "$OUT"
STAGES=${*:-probe swap bench manager suite}
BENCH_ARGS=${BENCH_ARGS:-}
# libcachesim's wheel needs libglib-2.0, absent from the GPU image; the policy and MRC tests run on the CPU anyway.
SUITE_ARGS=${SUITE_ARGS:---ignore=tests/policies/test_policies.py --ignore=tests/telemetry/test_mrc.py}
export PYTHONUNBUFFERED=1
SOURCE=$(pwd)
if [ -d whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# The package as setuptools lays it out (tiers/, policies/, configs/ inside tiercache/), in a copy.
WORK=/tmp/tiercache-work
rm -rf "$WORK" && mkdir -p "$WORK"
tar -C "$SOURCE" --exclude=./whl --exclude=./redis -cf - . | tar -C "$WORK" -xf -
for part in tiers policies configs; do cp -r "$WORK/$part" "$WORK/tiercache/$part"; done
[ -d "$SOURCE/redis/bin" ] && export PATH="$SOURCE/redis/bin:$PATH"
cd "$WORK" || exit 1
export PYTHONPATH="$WORK:$PYTHONPATH"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
command -v redis-server && redis-server --version
for stage in $STAGES; do
    echo "=== $stage $(date -u +%T)"
    case $stage in
        probe) timeout 120 python3 scripts/gpu_probe.py 2>&1 | tee "$OUT/probe.log" ;;
        swap) timeout 240 python3 -m pytest tests/movement/test_swap.py -q -rs -p no:cacheprovider 2>&1 \
            | tee "$OUT/swap_tests.log" | tail -25 ;;
        bench) timeout 300 python3 benchmarks/swap.py --out "$OUT" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log" ;;
        manager) TEST_TIERCACHE_DEVICE=cuda timeout 240 python3 -m pytest tests/manager/test_manager.py \
            tests/end_to_end/test_model_e2e.py -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/manager.log" | tail -25 ;;
        suite) TEST_TIERCACHE_DEVICE=cuda timeout 300 python3 -m pytest -q -rs -p no:cacheprovider $SUITE_ARGS 2>&1 \
            | tee "$OUT/suite.log" | tail -25 ;;
        *) echo "unknown stage $stage" ;;
    esac
done
echo "=== end $(date -u +%T)"
