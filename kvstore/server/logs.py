"""Structured logging for the daemon: `key=value` text for people or one JSON object a line for collectors."""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging"]


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(level: str, fmt: str, node_id: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        formatter = logging.Formatter(
            f"%(asctime)s.%(msecs)03dZ level=%(levelname)s node={node_id} logger=%(name)s msg=%(message)s",
            "%Y-%m-%dT%H:%M:%S",
        )
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
