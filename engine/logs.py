"""Request ids on log records, and `--log-format json` (python-json-logger).

The gateway binds each request's id (the `id` of the OpenAI response, e.g. `cmpl-…`) to the
context variable below when it creates it; every record logged while that request is being
served — by the gateway, the pipeline, the Conductor, uvicorn's access log — then carries
`request_id`. In JSON mode each record is one line:

    {"timestamp": "2026-01-01T12:00:00.123Z", "level": "INFO", "logger": "uvicorn.access",
     "message": "127.0.0.1:5000 - \"POST /v1/completions HTTP/1.1\" 200", "request_id": "cmpl-…"}

Records not about a request have no `request_id` key. Nothing here reads headers or config, so
API keys and the KV token never reach a record through it. Worker actors log the same way
(setup_worker_logging), passing the id of the request a record is about in `extra`.
"""

from __future__ import annotations

import logging
import os
import sys
from contextvars import ContextVar
from datetime import datetime, timezone

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

#: The id of the request the current task serves (None outside a request).
request_id_var: ContextVar[str | None] = ContextVar("pdcluster_request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_JSON_FIELDS = ("asctime", "levelname", "name", "message")
_RENAMES = {"asctime": "timestamp", "levelname": "level", "name": "logger"}
# uvicorn attaches an ANSI-coloured copy of each message; it has no place in JSON
_SKIPPED = [*RESERVED_ATTRS, "color_message"]


def bind_request_id(request_id: str) -> None:
    """Marks the current task (and tasks it creates from now on) as serving `request_id`."""
    request_id_var.set(request_id)


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to records logged while a request is bound (never overrides one a
    caller passed with `extra`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = request_id_var.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        return True


class _TextFormatter(logging.Formatter):
    """TEXT_FORMAT plus ` [request_id]` on records about a request."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        request_id = getattr(record, "request_id", None)
        return f"{text} [{request_id}]" if request_id else text


class _JsonFormatter(JsonFormatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        when = datetime.fromtimestamp(record.created, tz=timezone.utc)
        return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def json_formatter() -> logging.Formatter:
    """One JSON object per record: timestamp (ISO 8601, UTC, ms), level, logger, message,
    request_id when set, other `extra` fields, exc_info when present."""
    return _JsonFormatter(list(_JSON_FIELDS), rename_fields=_RENAMES, reserved_attrs=_SKIPPED)


def configure_logging(level: str = "info", fmt: str = "text") -> logging.Handler:
    """Replaces the root logger's handlers by one stderr handler in `fmt` ("text" | "json")
    with RequestIdFilter, at `level`. Returns the handler.

    Raises ValueError for an unknown format or level.
    """
    if fmt not in ("text", "json"):
        raise ValueError(f"unknown log format {fmt!r}; one of text, json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter() if fmt == "json" else _TextFormatter(TEXT_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


#: Environment of a worker actor (set by deploy.launcher through Ray's runtime_env): its log
#: level and format, read by setup_worker_logging when the actor starts.
WORKER_LOG_LEVEL_ENV = "PDCLUSTER_LOG_LEVEL"
WORKER_LOG_FORMAT_ENV = "PDCLUSTER_LOG_FORMAT"


def worker_env_vars(level: str, fmt: str) -> dict[str, str]:
    """Env vars (for a Ray actor's runtime_env) that make setup_worker_logging log at `level`
    in `fmt`."""
    return {WORKER_LOG_LEVEL_ENV: level, WORKER_LOG_FORMAT_ENV: fmt}


def setup_worker_logging() -> None:
    """Called first thing in a worker actor's __init__: configure_logging from the two env vars
    above (the process edge of a worker: deploy.launcher wrote them from the ServeConfig).
    Without them, leaves logging as it is. Worker records about a request carry `request_id`
    through logging's `extra`."""
    if WORKER_LOG_FORMAT_ENV in os.environ:
        configure_logging(os.environ.get(WORKER_LOG_LEVEL_ENV, "info"),
                          os.environ[WORKER_LOG_FORMAT_ENV])
