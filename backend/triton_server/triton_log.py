"""The splitfuse loggers' records in Triton's log. Inside the Python backend's stub nothing
configures `logging`, so the engine's INFO lines (KV pool, backends, threads) went nowhere and its
warnings only to the stub's stderr; this handler hands each record to `pb_utils.Logger`, which
writes it into the server's log with Triton's own prefix and level."""

from __future__ import annotations

import logging

import triton_python_backend_utils as pb_utils

ROOT_LOGGER = "splitfuse"


class TritonLogHandler(logging.Handler):
    """Forwards records to pb_utils.Logger, each line led by the instance's name."""

    def __init__(self, instance: str, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.instance = instance

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{self.instance}: {self.format(record)}"
            if record.levelno >= logging.ERROR:
                pb_utils.Logger.log_error(text)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(text)
            else:
                pb_utils.Logger.log_info(text)
        except Exception:  # a log line must never break the engine
            self.handleError(record)


def install(instance: str) -> TritonLogHandler:
    """Route the splitfuse loggers' INFO and above into Triton's log; `uninstall` at finalize."""
    handler = TritonLogHandler(instance)
    logger = logging.getLogger(ROOT_LOGGER)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


def uninstall(handler: TritonLogHandler) -> None:
    logging.getLogger(ROOT_LOGGER).removeHandler(handler)
