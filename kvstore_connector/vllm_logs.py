"""The connector's and the client's log lines in vLLM's log: vLLM configures only its own `vllm` logger."""

from __future__ import annotations

import logging

__all__ = ["log_where_vllm_logs"]


def log_where_vllm_logs() -> None:
    """Send the connector's and the client's log lines (loggers `kvstore_connector.*`, `kvstore.*`) to vLLM's own
    handlers, at vLLM's level: vLLM configures only its `vllm` logger, and a line of another logger would
    otherwise reach its log only from WARNING up, as a bare message without level or time. Once, when the
    first connector is built (vLLM has configured its logging by then); a logger that has handlers of its
    own (the application configured it) is left alone."""
    ours = logging.getLogger("vllm")
    if not ours.handlers:
        return
    for name in ("kvstore_connector", "kvstore"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            for handler in ours.handlers:
                logger.addHandler(handler)
            logger.setLevel(ours.getEffectiveLevel())
            logger.propagate = False
