"""bench.remote's comparison with Mooncake Store's remote get (bench only; none of Mooncake's code is here).

    setup_venv.sh   `make setup-mooncake`: the Mooncake venv (mooncake-transfer-engine from PyPI) and the stub
    cuda_stub.c     a stand-in libcuda.so.1 (every driver call: no device), so the CUDA-linked wheel loads
    rig.py          a network namespace with Mooncake's master and two store processes, driven from the bench
    peer.py         one store process (holder or getter), run by the Mooncake venv's Python inside the namespace
"""
