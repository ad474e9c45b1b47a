#!/usr/bin/env bash
# bench.gpu_check on a CUDA image that has torch, cupy and grpcio but no network and no kvstore install
# (e.g. a lent H200 whose python3 is 3.12 with torch 2.11 + cupy-cuda13x; seen December 2026).
#
#   bash bench/gpu_offline.sh prepare   # here, with network and `make setup` done: .gpu-offline/ gets cp312
#                                       # wheels of what the image lacks and the gRPC stubs built by make setup
#   bash bench/gpu_offline.sh run       # there, from a copy of the checkout that includes .gpu-offline/:
#                                       # installs the wheels into /tmp/kvstore-site, builds the native copy
#                                       # module with cc, runs python3 -m bench.gpu_check (log: $OUT or .gpu-offline)
#
# The stubs are generated here because grpcio-tools has no wheel for every grpcio; grpcio and protobuf travel
# at the versions the stubs were generated with, so the generated version checks pass.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.gpu-offline
case "${1:-}" in
prepare)
  py=.venv/bin/python
  stubs=$(ls -d build/cp3*/gen/kvstore/_proto | head -1)   # written by make setup's CMake build
  rm -rf "$DIR" && mkdir -p "$DIR/wheels" "$DIR/proto"
  cp "$stubs"/*.py "$DIR/proto/"
  for pkg in grpcio protobuf lmdb zstandard; do
    ver=$($py -c "import importlib.metadata as m; print(m.version('$pkg'))")
    $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DIR/wheels" "$pkg==$ver"
  done
  du -sh "$DIR" ;;
run)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvstore-site \
    "$DIR"/wheels/*.whl
  export PYTHONPATH=/tmp/kvstore-site:$PWD PYTHONUNBUFFERED=1
  mkdir -p kvstore/_proto && cp "$DIR"/proto/*.py kvstore/_proto/
  inc=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
  suffix=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  cc -O3 -Wall -shared -fPIC -pthread -I"$inc" kvstore/_native/copy.c -o "kvstore/_native/_copy$suffix"
  cc -O3 -Wall -shared -fPIC -I"$inc" kvstore/_native/key_index.c -o "kvstore/_native/_keyindex$suffix"
  python3 -m bench.gpu_check 2>&1 | tee "${OUT:-$DIR}/gpu_check.log" ;;
*)
  echo "usage: bash bench/gpu_offline.sh prepare|run (see the comment at the top)" >&2; exit 2 ;;
esac
