"""Facts about the host shared by the daemon and its clients."""

from __future__ import annotations

import numpy as np

__all__ = ["boot_id", "byte_view"]


def boot_id() -> str:
    """Changes at every boot; with the hostname it tells a client whether it shares the daemon's memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def byte_view(buf: object) -> np.ndarray:
    """A flat uint8 view of any buffer-protocol object (bytes, bytearray, memoryview, numpy array)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]  # any buffer; 3.11 has no Buffer type
