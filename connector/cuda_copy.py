"""GPU <-> arena copies: the arena as pinned, device-mapped host memory and one gather/scatter kernel.

Why a kernel and not cudaMemcpyAsync: one stored block is made of one piece per layer and K/V (64 pieces of
32 KiB for a Llama-8B block of 16 tokens), at arbitrary slot addresses. Issuing one memcpy per piece from
Python costs microseconds each (~130k calls for a 32K-token prompt). Instead the arena is registered once
with cudaHostRegister(Mapped|Portable), so under unified virtual addressing the GPU can read and write it by
its host address, and a single kernel launch per batch moves every (dst, src, length) triple of a `CopyPlan`,
16 bytes per thread per iteration when aligned. The copy runs on a dedicated stream; callers get a CUDA event.

Ordering with vLLM's compute: a save is launched after the current stream's work (the forward that wrote the
KV) via stream.wait_stream, and `fence()` makes the compute stream wait for the last save before the next
step's kernels can overwrite a block that was freed (by preemption) and reused.

Only imported when the KV cache is on CUDA; bench/gpu_check.py exercises it on a GPU machine.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from connector.layout import CopyPlan

__all__ = ["CudaCopier"]

_KERNEL = r"""
extern "C" __global__ void kv_copy_segments(const unsigned long long* __restrict__ dst,
                                            const unsigned long long* __restrict__ src,
                                            const unsigned long long* __restrict__ len, long long n) {
  for (long long s = blockIdx.x; s < n; s += gridDim.x) {
    char* d = (char*)dst[s];
    const char* p = (const char*)src[s];
    unsigned long long L = len[s];
    if (((((unsigned long long)d) | ((unsigned long long)p) | L) & 15ULL) == 0ULL) {
      int4* d4 = (int4*)d;
      const int4* p4 = (const int4*)p;
      for (unsigned long long i = threadIdx.x; i < (L >> 4); i += blockDim.x) d4[i] = p4[i];
    } else {
      for (unsigned long long i = threadIdx.x; i < L; i += blockDim.x) d[i] = p[i];
    }
  }
}
"""

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2


class CudaCopier:
    def __init__(self, arena_span: tuple[int, int], device: str) -> None:
        import cupy  # noqa: PLC0415 - GPU nodes only (cupy-cuda12x)
        import torch  # noqa: PLC0415

        self._cupy = cupy
        self._torch = torch
        self.device = torch.device(device)
        base, size = arena_span
        with cupy.cuda.Device(self.device.index or 0):
            cupy.cuda.runtime.hostRegister(base, size, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
            dev_ptr = cupy.cuda.runtime.hostGetDevicePointer(base, 0)
        # With UVA the device pointer equals the host address; keep the offset in case it does not.
        self._shift = int(dev_ptr) - base
        self._base, self._size = base, size
        self._kernel = cupy.RawKernel(_KERNEL, "kv_copy_segments")
        self.stream = torch.cuda.Stream(device=self.device)
        self._last: Any = None
        self._lock = threading.Lock()  # saves launch from vLLM's thread, loads from the connector's loader
        self._inflight: list[tuple[Any, Any]] = []

    def _translate(self, plan: CopyPlan) -> tuple[np.ndarray, np.ndarray]:
        """Host arena addresses -> device-visible addresses (identity under UVA)."""
        if self._shift == 0:
            return plan.dst, plan.src
        lo, hi = self._base, self._base + self._size

        def shift(a: np.ndarray) -> np.ndarray:
            inside = (a >= lo) & (a < hi)
            return np.where(inside, a + np.uint64(self._shift), a).astype(np.uint64)

        return shift(plan.dst), shift(plan.src)

    def copy(self, plan: CopyPlan) -> Any:
        """Launch the copy after the current stream's work; returns a torch.cuda.Event."""
        with self._lock:
            return self._copy_locked(plan)

    def _copy_locked(self, plan: CopyPlan) -> Any:
        torch, cupy = self._torch, self._cupy
        n = len(plan.lengths)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        ev = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            if n:
                dst, src = self._translate(plan)
                with cupy.cuda.Device(self.device.index or 0), \
                        cupy.cuda.ExternalStream(self.stream.cuda_stream, self.device.index or 0):
                    # the index arrays travel on the same stream, so the kernel sees them complete
                    d, s, ln = (cupy.asarray(a) for a in (dst, src, plan.lengths))
                    self._kernel((min(n, 65535),), (256,), (d, s, ln, np.int64(n)))
            ev.record(self.stream)
            if n:
                # keep the index arrays alive until the kernel is done (cupy's pool would reuse them)
                self._inflight = [(e, a) for e, a in self._inflight if not e.query()] + [(ev, (d, s, ln))]
        self._last = ev
        return ev

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.synchronize()

    def fence(self) -> None:
        """Make the compute stream wait (on the GPU, not the CPU) for the last launched copy."""
        with self._lock:
            last = self._last
        if last is not None:
            self._torch.cuda.current_stream(self.device).wait_event(last)

    def close(self) -> None:
        self.stream.synchronize()
        try:
            self._cupy.cuda.runtime.hostUnregister(self._base)
        except Exception:  # noqa: BLE001 - already unregistered / context gone at interpreter exit
            pass
