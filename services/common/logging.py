"""One-line structured logs: ``time level service logger: message key=value ...`` or JSON lines.

    log = logging.getLogger(__name__)
    log.info("reserved", extra=kv(request_id=rid, blocks=12))
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from services.common.config import opt, require

_KV_ATTR = "pdserve_kv"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass
class LoggingConfig:
    """Logging."""

    log_level: str = opt("INFO", "Lowest level written.", choices=_LEVELS)
    log_format: str = opt("text", "text: one key=value line per record; json: one JSON object per line.",
                          choices=("text", "json"))

    def __post_init__(self) -> None:
        self.log_level = self.log_level.upper()
        require(self.log_level in _LEVELS, self, "log_level", f"must be one of {', '.join(_LEVELS)}")


def kv(**fields: Any) -> dict[str, Any]:
    """``extra=`` for a log call: structured fields rendered as key=value (or JSON keys)."""
    return {_KV_ATTR: fields}


def _fmt_value(v: Any) -> str:
    s = f"{v:.6g}" if isinstance(v, float) else str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' ="\n')) else s


class _Formatter(logging.Formatter):
    def __init__(self, service: str, as_json: bool) -> None:
        super().__init__()
        self.service = service
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = getattr(record, _KV_ATTR, {}) or {}
        msg = record.getMessage()
        exc = self.formatException(record.exc_info) if record.exc_info else ""
        if self.as_json:
            obj: dict[str, Any] = {
                "ts": round(record.created, 6), "level": record.levelname, "service": self.service,
                "logger": record.name, "msg": msg, **fields,
            }
            if exc:
                obj["exc"] = exc
            return json.dumps(obj, default=str)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        line = f"{ts} {record.levelname:<5} {self.service} {record.name}: {msg}"
        if fields:
            line += " " + " ".join(f"{k}={_fmt_value(v)}" for k, v in fields.items())
        if exc:
            # Keep one record per line: fold the traceback.
            line += " exc=" + json.dumps(exc)
        return line


_CURRENT: LoggingConfig | None = None


def current_config() -> LoggingConfig | None:
    """The config the last :func:`setup_logging` applied (a child process started by the service logs alike)."""
    return _CURRENT


def setup_logging(service: str, config: LoggingConfig | None = None) -> None:
    """Route the root logger to stderr with the pdserve format (stdout is kept for the ready line)."""
    global _CURRENT
    cfg = config or LoggingConfig()
    _CURRENT = cfg
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(service, cfg.log_format == "json"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(cfg.log_level)
    # grpc's own Python logger is chatty at DEBUG about polling; keep it at WARNING unless asked.
    logging.getLogger("grpc").setLevel(max(logging.WARNING, root.level))


def write_line(line: str) -> None:
    """One whole line on stdout in one write. Services run unbuffered under the launcher, where ``print``
    writes the text and its newline separately; a log line from another thread (or the engine-core process
    sharing the log file) could land between the two and the launcher would read it as part of this line."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
