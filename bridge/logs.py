"""Both sides: structured JSON logs that carry channel / bundle seq / bundle id."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

__all__ = ["get_logger", "setup_logging", "log_event"]

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys()) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and every extra field (ids)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _RESERVED and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def setup_logging(level: str | None = None, *, json_logs: bool | None = None) -> None:
    """Configure the root logger once (stderr). $DIODE_LOG_LEVEL, $DIODE_LOG_FORMAT=json|text."""
    lvl = (level or os.environ.get("DIODE_LOG_LEVEL", "INFO")).upper()
    use_json = (
        json_logs if json_logs is not None else os.environ.get("DIODE_LOG_FORMAT", "json") == "json"
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if use_json
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    )
    root = logging.getLogger("bridge")
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    root.propagate = False
    for noisy in ("pika", "py4j", "gnupg"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``bridge`` tree."""
    return logging.getLogger(name if name.startswith("bridge") else f"bridge.{name}")


def log_event(logger: logging.Logger, level: int, msg: str, **ids: Any) -> None:
    """Log ``msg`` with ids (channel=, bundle_seq=, bundle_id=, ...) as structured fields."""
    logger.log(level, msg, extra=ids)
