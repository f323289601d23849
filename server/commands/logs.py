"""Log set-up: plain text or one JSON object per line (`--log-format json`)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

# Fields a record may carry through `extra=`; they become top-level keys in JSON mode.
EXTRA_FIELDS = ("request_id", "bucket", "prompt_tokens", "output_tokens", "ttft_s", "duration_s", "status",
                "graph", "seconds", "prompt")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in EXTRA_FIELDS:
            if hasattr(record, name):
                out[name] = getattr(record, name)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def configure_logging(fmt: str, level: int = logging.INFO) -> None:
    """Replace the root handlers once, at start-up. uvicorn is then run with log_config=None so its
    loggers propagate here too."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
