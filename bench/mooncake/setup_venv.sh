#!/usr/bin/env bash
# Build the Mooncake venv for bench.remote's comparison (bench only: never the main venv, never in CI):
#   bash bench/mooncake/setup_venv.sh [VENV]   (default .venv-mooncake; PYTHON=python3 picks the base)
# What it takes, checked on this 2-core CPU machine: mooncake-transfer-engine 0.3.13.post1 from PyPI with
# nvidia-cuda-runtime-cu12 (its engine links libcudart.so.12 and libcuda.so.1), Debian's libibverbs1 and
# ibverbs-providers (linked even for TCP), iproute2 (bench.remote runs Mooncake in a network namespace),
# and a stand-in libcuda.so.1 built here from bench/mooncake/cuda_stub.c (every driver call answers "no
# device"), which bench/mooncake/rig.py puts on LD_LIBRARY_PATH with the CUDA runtime.
# Idempotent: a finished venv carries $VENV/.installed-stamp and is left alone.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
VENV=${1:-.venv-mooncake}
PYTHON=${PYTHON:-python3}
PY=$VENV/bin/python
STAMP=$VENV/.installed-stamp

if [ -f "$STAMP" ]; then
    echo "$VENV is already set up ($STAMP); rm -rf $VENV to rebuild"
    exit 0
fi

missing=""
for pkg in libibverbs1 ibverbs-providers iproute2 gcc; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
    apt-get update -qq && apt-get install -y -qq $missing
fi

test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q mooncake-transfer-engine==0.3.13.post1 nvidia-cuda-runtime-cu12==12.9.79 numpy xxhash

mkdir -p "$VENV/cuda-stub"
gcc -shared -fPIC -O2 -Wall -o "$VENV/cuda-stub/libcuda.so.1" "$HERE/cuda_stub.c"

# Prove the store loads with the stub and the runtime, as rig.py will run it.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LD_LIBRARY_PATH="$VENV/cuda-stub:$SITE/nvidia/cuda_runtime/lib" "$PY" -c '
from mooncake.store import MooncakeDistributedStore
assert hasattr(MooncakeDistributedStore, "batch_get_into")
print("mooncake store loads")'
test -x "$VENV/bin/mooncake_master"
"$PY" -m pip freeze > "$VENV/pip-freeze.txt"
touch "$STAMP"
echo "done: $VENV"
