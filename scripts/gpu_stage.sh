#!/usr/bin/env bash
# Build a self-contained copy of this checkout for a GPU machine with no network, for
# scripts/gpu_check.sh: the tracked and untracked-not-ignored files, the wheels in .whl/
# (python 3.12 manylinux wheels of the test dependencies the machine lacks) as whl/, and
# this machine's redis-server, redis-cli and openssl with their shared libraries (but
# not glibc's or libstdc++'s) as redis/, each behind a wrapper that sets LD_LIBRARY_PATH.
# Usage: bash scripts/gpu_stage.sh DEST   (DEST is emptied first)
set -euo pipefail
DEST=${1:?usage: gpu_stage.sh DEST}
cd "$(dirname "$0")/.."
rm -rf "$DEST" && mkdir -p "$DEST/whl" "$DEST/redis/bin" "$DEST/redis/lib"
git ls-files -co --exclude-standard | grep -v '^\.venv/' | tar -cf - -T - | tar -C "$DEST" -xf -
if compgen -G ".whl/*.whl" >/dev/null; then cp .whl/*.whl "$DEST/whl/"; fi
for binary in redis-server redis-cli openssl; do
    path=$(command -v "$binary") || continue
    cp "$path" "$DEST/redis/bin/$binary.bin"
    printf '#!/bin/sh\nhere=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH="$here/../lib" exec "$here/%s.bin" "$@"\n' \
        "$binary" >"$DEST/redis/bin/$binary"
    chmod +x "$DEST/redis/bin/$binary"
    ldd "$path" | awk '/=>/ {print $3}' | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux)[.-]' \
        | xargs -r -I{} cp -L {} "$DEST/redis/lib/"
done
du -sh "$DEST"
