"""kvstore_connector.cuda_copy.device_pointer: the device address of registered host memory, on every cupy.

cupy 14 (cupy-cuda13x) has no runtime.hostGetDevicePointer, which the first GPU run on an H200 hit
(AttributeError at the first cudaHostRegister). These stand-ins are the two shapes of cupy's runtime module."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvstore_connector.cuda_copy import device_pointer


class _Cupy14Runtime:
    """cupy >= 14: pointerGetAttributes only."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def pointerGetAttributes(self, ptr: int) -> SimpleNamespace:  # noqa: N802 - cupy's name
        self.asked.append(ptr)
        return SimpleNamespace(devicePointer=ptr + 0x1000, hostPointer=ptr)


class _OldRuntime:
    """A runtime module with hostGetDevicePointer alone."""

    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def hostGetDevicePointer(self, ptr: int, flags: int) -> int:  # noqa: N802 - cupy's name
        self.asked.append((ptr, flags))
        return ptr + 0x2000


def test_uses_pointer_attributes_when_present() -> None:
    rt = _Cupy14Runtime()
    assert device_pointer(rt, 0x7F00_0000_0000) == 0x7F00_0000_1000
    assert rt.asked == [0x7F00_0000_0000]


def test_falls_back_to_host_get_device_pointer() -> None:
    rt = _OldRuntime()
    assert device_pointer(rt, 4096) == 4096 + 0x2000
    assert rt.asked == [(4096, 0)]


def test_a_runtime_with_neither_says_what_is_missing() -> None:
    with pytest.raises(AttributeError, match="hostGetDevicePointer"):
        device_pointer(object(), 4096)
