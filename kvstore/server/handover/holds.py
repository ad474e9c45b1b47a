"""Sync points for the hand-over's adversarial tests: hold one side at a named step until it is killed.

`KVSTORE_HANDOVER_HOLD=<side>:<step>` and `KVSTORE_HANDOVER_HOLD_FILE=<path>` make that side (`sender`: the
running daemon, `receiver`: its successor) write the step's name to the file when it reaches the step and then
wait there forever; the test sees the file, kills the process with SIGKILL and checks what serves afterwards
(tests/test_handover_kills.py). Unset (always, outside those tests), `stage` returns at once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

__all__ = ["stage_hook"]

log = logging.getLogger(__name__)


def stage_hook(side: str) -> Callable[[str], None]:
    want = os.environ.get("KVSTORE_HANDOVER_HOLD", "")
    path = os.environ.get("KVSTORE_HANDOVER_HOLD_FILE", "")
    if not want or not path:
        return lambda step: None
    held_side, _, held_step = want.partition(":")

    def stage(step: str) -> None:
        if held_side == side and held_step == step:
            log.warning("hand-over test hold: %s waits at %r until killed", side, step)
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(step)
            threading.Event().wait()
    return stage
