"""The process's UCX runtime: one event-loop thread and ucxx's context, shared by every UCX plane in it.

Why one per process: ucxx keeps a single context per process and ties its progress and its request futures to
the event loop that created it. A daemon runs one UCX plane; a process that starts several (the in-process
test rigs) must run them all on that same loop, or a request created on one loop is awaited on another.

Why Python futures (`enable_python_future=True`): without them ucxx awaits a posted request by yielding to
the loop until it completes, and the serving side always has a header receive posted on each open endpoint
(the next frame, up to idle_timeout_s away), so the loop thread ran at a full core on an idle daemon from its
first served frame on (measured: 1.0 core, against 0.02 with futures). With them a notifier thread completes
the futures and the loop sleeps in epoll.

    loop()    the running loop (started, with ucxx initialised on it, on first use; never stopped: its thread
              is a daemon thread, and planes close their own endpoints and listeners)
"""

from __future__ import annotations

import asyncio
import threading

__all__ = ["loop"]

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _init_ucx() -> None:
    import ucxx
    try:
        ucxx.init(enable_python_future=True)
    except RuntimeError:  # "UCX is already initiated": someone in this process did it first (on this loop)
        pass


def loop() -> asyncio.AbstractEventLoop:
    """The process's UCX loop, running; ucxx initialised on its thread before it is handed out."""
    global _loop
    with _lock:
        if _loop is None:
            lp = asyncio.new_event_loop()
            threading.Thread(target=lp.run_forever, name="kvstore-ucx", daemon=True).start()

            async def init() -> None:
                _init_ucx()

            asyncio.run_coroutine_threadsafe(init(), lp).result(30)
            _loop = lp
        return _loop
