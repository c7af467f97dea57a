"""Both sides: structured JSON logs that carry channel / bundle seq / bundle id."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from bridge.errors import ConfigError

__all__ = [
    "ensure_logging",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "check_log_level",
    "get_logger",
    "log_event",
    "Recurring",
    "operator_name",
    "setup_logging",
]

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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""Accepted by --log-level and $DIODE_LOG_LEVEL (any case)."""
LOG_FORMATS = ("json", "text")
"""Accepted by --log-format and $DIODE_LOG_FORMAT."""


def check_log_level(value: str, where: str) -> str:
    """``value`` as a level name; ConfigError naming ``where`` and the accepted values."""
    lvl = value.strip().upper()
    lvl = "WARNING" if lvl == "WARN" else lvl  # the alias logging itself accepts
    if lvl not in LOG_LEVELS:
        raise ConfigError(
            f"{where} = {value!r} is not a log level: use one of {', '.join(LOG_LEVELS)}"
        )
    return lvl


def ensure_logging() -> None:
    """Set up logging unless this process already did: a Spark Python worker (a source's
    reader, an executor) starts with none, and its records would print bare, without ids."""
    if not logging.getLogger("bridge").handlers:
        setup_logging()


def setup_logging(level: str | None = None, *, json_logs: bool | None = None) -> None:
    """Configure the root logger once (stderr). $DIODE_LOG_LEVEL, $DIODE_LOG_FORMAT=json|text.

    A level or format that is not one of the accepted values is a ConfigError naming the option
    or the variable, and the accepted values."""
    if level is not None:
        lvl = check_log_level(level, "--log-level")
    else:
        lvl = check_log_level(os.environ.get("DIODE_LOG_LEVEL", "INFO"), "DIODE_LOG_LEVEL")
    if json_logs is not None:
        use_json = json_logs
    else:
        fmt = os.environ.get("DIODE_LOG_FORMAT", "json")
        if fmt.strip().lower() not in LOG_FORMATS:
            raise ConfigError(
                f"DIODE_LOG_FORMAT = {fmt!r} is not a log format: use one of "
                f"{', '.join(LOG_FORMATS)}, or unset it (json)"
            )
        use_json = fmt.strip().lower() == "json"
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


def operator_name() -> str:
    """Who runs this command, for the audit (an approval, a write-off, a rewind): the login
    name, else ``uid N``."""
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


class Recurring:
    """A refusal warned of at most every ``every`` seconds while it lasts with the same reason
    (``due``), and once more when it is over (``over``)."""

    def __init__(self, every: float = 60.0) -> None:
        self.every = every
        self.why: str | None = None
        self._warned_at = 0.0

    def due(self, why: str) -> bool:
        """It happened (again), for reason ``why``: whether to warn now."""
        now = time.monotonic()
        if why == self.why and now - self._warned_at < self.every:
            return False
        self.why, self._warned_at = why, now
        return True

    def over(self) -> bool:
        """It did not happen this time: whether it had (then say that it is over)."""
        was, self.why = self.why is not None, None
        return was
