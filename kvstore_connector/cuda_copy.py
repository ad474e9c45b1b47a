"""GPU <-> arena copies: the arena as pinned, device-mapped host memory and one gather/scatter kernel.

Registration: per arena mapping, through kvstore_connector/pinning.py (whole for a shared arena, per slab and
re-checked against the slab's epoch for a tenant's sparse file).

Why a kernel and not cudaMemcpyAsync: one stored block is made of one piece per layer and K/V (64 pieces of
32 KiB for a Llama-8B block of 16 tokens), at arbitrary slot addresses. Issuing one memcpy per piece from
Python costs microseconds each (~130k calls for a 32K-token prompt). Instead the arena is registered once
with cudaHostRegister(Mapped|Portable), so under unified virtual addressing the GPU can read and write it by
its host address, and a single kernel launch per batch moves every (dst, src, length) triple of a `CopyPlan`,
16 bytes per thread per iteration when aligned. The copy runs on a dedicated stream; callers get a CUDA event.

Ordering with vLLM's compute: a save is launched from vLLM's thread after its current stream's work (the
forward that wrote the KV) via stream.wait_stream, and `fence()` makes the compute stream wait for the last
save before the next step's kernels can overwrite a block that was freed (by preemption) and reused. A load is
launched from the connector's loader thread, whose current stream is not vLLM's: it waits instead for an
event that start_load_kv recorded on vLLM's stream (`compute_marker`).

Only imported when the KV cache is on CUDA; bench/gpu_check.py exercises it on a GPU machine.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvstore_connector.layout import CopyPlan
from kvstore_connector.pinning import PinnedRanges
from kvstore.client.arena_map import ArenaMap

__all__ = ["CudaCopier", "compute_marker", "device_pointer"]

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


def device_pointer(runtime: Any, address: int) -> int:
    """The device address of registered host memory at `address`.

    cupy 14 (cupy-cuda13x, seen on an H200 image) has no `hostGetDevicePointer`; every cupy has
    `pointerGetAttributes`, whose `devicePointer` is what cudaHostGetDevicePointer returns. The older call is the
    fallback for a runtime module without it."""
    get_attrs = getattr(runtime, "pointerGetAttributes", None)
    if get_attrs is not None:
        return int(get_attrs(address).devicePointer)
    return int(runtime.hostGetDevicePointer(address, 0))


class CudaCopier:
    """Copies for one arena mapping (an ArenaMap): built when the worker first copies through a mapping and
    closed by that mapping's close hook, after the last copy that used it (kvstore/client/arena_map.py)."""

    def __init__(self, arena: ArenaMap, device: str) -> None:
        import cupy  # noqa: PLC0415 - GPU nodes only (cupy-cuda12x)
        import torch  # noqa: PLC0415

        self._cupy = cupy
        self._torch = torch
        self.device = torch.device(device)
        self._dev_index = self.device.index or 0
        self.pins = PinnedRanges(arena, self._host_register, self._host_unregister)
        self._kernel = cupy.RawKernel(_KERNEL, "kv_copy_segments")
        self.stream = torch.cuda.Stream(device=self.device)
        self._last: Any = None
        self._lock = threading.Lock()  # saves launch from vLLM's thread, loads from the connector's loader
        self._inflight: list[tuple[Any, Any]] = []

    def _host_register(self, address: int, nbytes: int) -> None:
        cupy = self._cupy
        with cupy.cuda.Device(self._dev_index):
            cupy.cuda.runtime.hostRegister(address, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
            dev_ptr = device_pointer(cupy.cuda.runtime, address)
        if dev_ptr != address:  # every CUDA GPU of this decade has unified virtual addressing
            cupy.cuda.runtime.hostUnregister(address)
            raise RuntimeError("the GPU maps pinned host memory at another address (no unified virtual "
                               "addressing): the kvstore connector's copy kernel needs UVA")

    def _host_unregister(self, address: int) -> None:
        with self._cupy.cuda.Device(self._dev_index):
            self._cupy.cuda.runtime.hostUnregister(address)

    def copy(self, plan: CopyPlan, after: Any = None) -> Any:
        """Launch the copy; returns a torch.cuda.Event. It runs after `after` (an event from `compute_marker`,
        recorded on vLLM's compute stream: loads launched from the loader thread) or, by default, after the
        calling thread's current stream (saves, launched from vLLM's own thread)."""
        with self._lock:
            return self._copy_locked(plan, after)

    def _copy_locked(self, plan: CopyPlan, after: Any) -> Any:
        torch, cupy = self._torch, self._cupy
        n = len(plan.lengths)
        if n:  # the caller holds slots in these slabs: they cannot move until the copy is done
            self.pins.ensure(np.concatenate([plan.dst, plan.src]))
        if after is not None:
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        ev = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            if n:
                with cupy.cuda.Device(self._dev_index), \
                        cupy.cuda.ExternalStream(self.stream.cuda_stream, self._dev_index):
                    # the index arrays travel on the same stream, so the kernel sees them complete
                    d, s, ln = (cupy.asarray(a) for a in (plan.dst, plan.src, plan.lengths))
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
        """The mapping's last copy is done: wait for the stream, then drop every registration."""
        try:
            self.stream.synchronize()
        finally:
            try:
                self.pins.close()
            except Exception:  # noqa: BLE001 - context gone at interpreter exit
                pass


def compute_marker(device: str) -> Any:
    """An event on the calling thread's current stream (vLLM's compute stream when called from start_load_kv):
    a load launched later from the loader thread waits for it, so it cannot overwrite blocks the GPU may
    still be using from earlier steps."""
    import torch  # noqa: PLC0415

    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(torch.device(device)))
    return ev
